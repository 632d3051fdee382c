"""Real-process parity: one launch per layout runs every check of that layout (eager and
compiled training steps) and returns losses, every gradient and the updated parameters, so
the same function can run on simulated devices and on real gloo processes and be compared.
See docs/real_processes.md."""
from __future__ import annotations

import functools

import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.optim.transform import GradientTransformation, chain

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
DTYPE = torch.float64            # as the equivalence suite: differences are routing, not rounding
STEPS = 2
DATA = [make_batch(CFG, batch=8, seq=16, seed=i) for i in range(STEPS)]
R = fpp.Rules
BATCH_AXES = ("dp_replicate", "dp_shard")

# name: (mesh sizes, rules, op options)
LAYOUTS = {
    "dp": (dict(dp_replicate=2), R(batch=BATCH_AXES), {}),
    "fsdp": (dict(dp_shard=2), R(batch=BATCH_AXES, hidden="dp_shard"), {}),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), R(batch=BATCH_AXES, hidden="dp_shard"), {}),
    "tp": (dict(tp=2), llama.default_rules(fsdp=False), {}),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True), {}),
    "cp_ring": (dict(cp=4), R(batch=BATCH_AXES, seq="cp"), {"cp_attention": "ring"}),
    "cp_ring_2": (dict(cp=2), R(batch=BATCH_AXES, seq="cp"), {"cp_attention": "ring"}),   # compiled only
    "cp_allgather": (dict(cp=2), R(batch=BATCH_AXES, seq="cp"), {"cp_attention": "allgather"}),
    "fsdp_tp_cp": (dict(dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True), {}),
    "2x2x2x2": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules(), {}),
}


def capture_gradients() -> GradientTransformation:
    """An optimizer stage that keeps the gradients it receives in its state (so a compiled
    step returns them) and passes them on unchanged."""
    def init(params):
        return tree.tree_map(torch.zeros_like, params)

    def update(grads, state, params=None):
        return grads, grads
    return GradientTransformation(init, update)


def optimizer():
    return chain(capture_gradients(), fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0))


def train(layout: str, compile_mode) -> dict:
    """``STEPS`` training steps of ``layout`` on this device: per-step loss and full gradients,
    final full parameters (as float64 numpy arrays)."""
    mesh_kw, rules, opts = LAYOUTS[layout]
    mesh = fpp.Mesh(**mesh_kw)
    decls = llama.init(CFG, DTYPE)
    step = fpp.train_step(LOSS, optimizer(), mesh=mesh, rules=rules, compile=compile_mode or False)
    out = {"loss": [], "grads": []}
    with fpp.configure(**opts):
        state = step.init(fpp.init(llama.init, CFG, DTYPE, mesh=mesh, rules=rules, seed=0))
        for b in DATA:
            with fpp.use_rules(rules):
                local = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            state, metrics = step(state, local)
            out["loss"].append(metrics["loss"])
            with fpp.use_rules(rules):
                grads = fpp.gather_tree(state["opt_state"][0], decls, rules)
            out["grads"].append({p: g.numpy() for p, g in fpp.leaves_with_paths(grads)})
        with fpp.use_rules(rules):
            params = fpp.gather_tree(state["params"], decls, rules)
    out["params"] = {p: x.numpy() for p, x in fpp.leaves_with_paths(params)}
    return out


def run_modes(layout: str, modes: tuple) -> dict:
    """Every mode of one layout in one launch (one process group, one fork)."""
    return {mode: train(layout, mode) for mode in modes}


def launch(layout: str, modes: tuple, processes: bool, timeout: float = 600):
    mesh = fpp.Mesh(**LAYOUTS[layout][0])
    return fpp.launch(functools.partial(run_modes, layout, modes), mesh, processes=processes,
                      timeout=timeout)
