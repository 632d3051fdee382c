"""Kernels launched per compiled step, ours against plain torch's, counted on the CPU (the GPU
proxy of docs/gpu.md "Kernels of the compiled step, without a GPU").

    python benchmarks/kernel_count.py                          # tiny Llama, 1 and 2 layers, bf16
    python benchmarks/kernel_count.py --layers 2 --precision fp32 --kernels

Sides, as ``benchmarks/gpu.py`` runs them on a GPU: ``functional`` is ``fpp.train_step(
compile=True)`` (the whole step, inductor, donated state, AdamW); ``plain`` the ``nn.Module`` of
``benchmarks/single_device.py`` with ``torch.compile`` (inductor) of forward + loss, autocast
for bf16, and ``torch.optim.AdamW(fused=True)`` (one op; one fused kernel on a GPU).

One step of each side, after two, runs under ``torch.profiler`` with inductor's
``cpp.enable_kernel_profile`` (every generated C++ kernel is an event). A *launch* is an
inductor kernel or an op (``aten::``, or a custom op such as ``fpp::materialize``) that no
counted op encloses, less the ops that make no kernel on a GPU (allocations, views, no-op
conversions). Each launch is ``graph`` (inside a compiled region) or ``eager``. A *host read*
is an op that returns a tensor's value to Python (``item``, ``_local_scalar_dense``,
``is_nonzero``; ``tolist`` shows as its ``resolve_conj``).

Inductor's C++ kernels are not Triton's: on a GPU the counts differ (foreach ops become combo
kernels of bounded size, reductions may split), but an op or kernel here that plain torch
does not have is work a GPU step does too.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from single_device import OPT, PlainLlama, load_from_functional, make_batch, plain_loss  # noqa: E402

import functional_pp as fpp  # noqa: E402
from functional_pp.models import llama  # noqa: E402

# ops that allocate, view or convert nothing: no kernel on a GPU
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view",
    "detach", "detach_", "alias", "lift_fresh", "resize_", "set_", "t", "transpose", "permute", "expand", "select",
    "slice", "unsqueeze", "squeeze", "split", "chunk", "unbind", "result_type", "resolve_conj", "resolve_neg",
    "_reinterpret_tensor", "size", "stride", "numel", "dim", "is_same_size", "record_stream"))
# wrappers whose work (if any) is the ops they call, counted in their place
TRANSPARENT = frozenset(f"aten::{n}" for n in ("to", "contiguous", "matmul", "linear", "flatten", "type_as"))
# a value read to Python (``tolist`` shows as its resolve_conj when not inside a counted op)
HOST_READS = frozenset(("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::resolve_conj"))
COMPILED_REGION = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph")
GRAPH_CALL = "## Call CompiledFxGraph"          # one call of one compiled graph


def _is_kernel(name: str) -> bool:
    return bool(re.match(r"(graph_\d+_)?cpp_", name))


def _counts(name: str) -> bool:
    """An op or kernel that is a launch unless an enclosing one is counted."""
    if _is_kernel(name):
        return True
    return bool(re.fullmatch(r"\w+::\w+(\.\w+)?", name)) and name not in NO_KERNEL and name not in TRANSPARENT \
        and name.split("::")[0] not in ("autograd", "profiler", "cuda")


@dataclasses.dataclass
class Launches:
    """One step's launches: ``kernels[(where, name)]``, ``where`` "graph" or "eager"."""
    kernels: collections.Counter
    graph_calls: int                 # calls of compiled graphs (a graph break makes two)
    host_reads: collections.Counter  # (where, op): "graph" inside a compiled region (a graph break's)

    @property
    def total(self) -> int:
        return sum(self.kernels.values())

    def of(self, where: str | None = None, match=None) -> int:
        """Launches ``where`` (None: anywhere) whose name ``match`` accepts (None: all)."""
        return sum(n for (w, name), n in self.kernels.items()
                   if (where is None or w == where) and (match is None or match(name)))

    def reads(self, where: str | None = None) -> int:
        return sum(n for (w, _), n in self.host_reads.items() if where is None or w == where)

    def table(self) -> list[str]:
        return [f"{n:5d}  {w:5s}  {name[:150]}" for (w, name), n in sorted(self.kernels.items())]


def count_launches(fn) -> Launches:
    """The launches and host reads of one call of ``fn`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kernels, reads, regions = collections.Counter(), collections.Counter(), 0
    for e in prof.events():
        name = e.name
        ancestors = []
        p = e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        in_graph = any(any(r in a for r in COMPILED_REGION) for a in ancestors)
        if name.startswith(GRAPH_CALL):
            regions += 1
        where = "graph" if in_graph else "eager"
        if name in HOST_READS:
            if not any(a in HOST_READS or _counts(a) for a in ancestors):
                reads[where, name] += 1
            continue
        if not _counts(name) or any(_counts(a) for a in ancestors):
            continue
        kernels[where, name] += 1
    return Launches(kernels, regions, reads)


@contextlib.contextmanager
def kernel_events():
    """Inductor's generated C++ kernels record a profiler event each (for code compiled inside)."""
    import torch._inductor.config as icfg
    with icfg.patch({"cpp.enable_kernel_profile": True}):
        yield


# --------------------------------------------------------------------------- the two sides
def tiny_config(layers: int, tie: bool = False) -> llama.Config:
    return llama.Config.tiny(layers=layers, tie_embeddings=tie)


class Functional:
    """``fpp.train_step(compile=True)``: the whole step compiled with inductor, donated state."""
    name = "functional"

    def __init__(self, cfg, precision: str, batch):
        opt = fpp.optim.adamw(OPT["lr"], b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"], weight_decay=OPT["weight_decay"])
        self.step_fn = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, precision=precision,
                                      compile=True, donate_state=True)
        self.state = self.step_fn.init(fpp.init(llama.init, cfg, seed=0))
        self.batch = batch

    def step(self) -> float:
        self.state, m = self.step_fn(self.state, self.batch)
        return m["loss"]

    def params(self) -> dict:
        return self.state["params"]


class Plain:
    """``torch.compile`` of forward + loss, autocast for bf16, ``AdamW(fused=True)``."""
    name = "plain"

    def __init__(self, cfg, precision: str, batch):
        self.model = PlainLlama(cfg, max_seq=batch["tokens"].shape[1])
        load_from_functional(self.model, fpp.init(llama.init, cfg, seed=0), cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]),
                                     eps=OPT["eps"], weight_decay=OPT["weight_decay"], fused=True)
        self.loss_fn = torch.compile(functools.partial(plain_loss, self.model))
        self.bf16 = precision == "bf16"
        self.batch = batch

    def step(self) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.batch["tokens"], self.batch["labels"])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def measure(side_cls, cfg, precision: str, batch, warmup: int = 2) -> tuple[Launches, list[float]]:
    """Builds a side, runs ``warmup`` steps (the first compiles, with kernel events) and
    counts the launches of the next."""
    side = side_cls(cfg, precision, batch)
    with kernel_events():
        losses = [side.step() for _ in range(warmup)]
        counted = count_launches(side.step)
    return counted, losses


# --------------------------------------------------------------------------- phases
def is_update(name: str) -> bool:
    """An update launch: plain torch's optimizer ops, or a compiled kernel fusing foreach ops
    (ours traces the optimizer as foreach ops; its gradient-norm sums fuse where they fit) other
    than the parameters' casts to the compute precision (``_foreach_copy_``, fused into the
    layers' kernels; step/precision_cast.py)."""
    return "foreach" in name.replace("_foreach_copy", "") or "fused_adam" in name


def phases(few: Launches, many: Launches, layers: tuple[int, int]) -> dict:
    """Per layer (the difference of two depths), the update, and the rest (embedding, loss,
    rotary tables, the host's part) at the smaller depth."""
    per_layer = (many.total - few.total) / (layers[1] - layers[0])
    update = few.of(match=is_update)
    return {"per_layer": per_layer, "update": update, "update_per_layer": (many.of(match=is_update) - update)
            / (layers[1] - layers[0]), "outside_layers": few.total - layers[0] * per_layer - update,
            "total": many.total}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="1,2", help="depths to count (two give the per-layer count)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--kernels", action="store_true", help="also list every launch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    depths = [int(x) for x in args.layers.split(",")]
    out: dict = {"precision": args.precision, "torch": torch.__version__, "depths": {}}
    counted = {}
    for layers in depths:
        cfg = tiny_config(layers)
        batch = make_batch(cfg, 2, 32, "cpu")
        for side in (Functional, Plain):
            c, losses = measure(side, cfg, args.precision, batch)
            counted[side.name, layers] = c
            out["depths"].setdefault(layers, {})[side.name] = {
                "launches": c.total, "graph": c.of("graph"), "eager": c.of("eager"), "graph_calls": c.graph_calls,
                "host_reads": dict(collections.Counter({f"{w} {n}": k for (w, n), k in c.host_reads.items()})),
                "losses": losses}
            print(f"{layers} layer(s) {side.name:10s}: {c.total} launches ({c.of('graph')} in compiled graphs, "
                  f"{c.of('eager')} eager), {c.graph_calls} graph calls, host reads {dict(c.host_reads)}")
            if args.kernels:
                print("\n".join("    " + line for line in c.table()))
    if len(depths) >= 2:
        for name in ("functional", "plain"):
            out[name] = phases(counted[name, depths[0]], counted[name, depths[1]], (depths[0], depths[1]))
            print(f"{name:10s} " + ", ".join(f"{k} {v:g}" for k, v in out[name].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
