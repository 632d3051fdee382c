"""The dry-run: one training step of one representative device on meta tensors, exactly as
``functional_pp.train_step`` runs it (same precision, reductions, optimizer, accumulation),
with repeated layers run once and twice and extrapolated (docs/planning.md)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Callable, Sequence

import optree
import torch

from functional_pp import optim
from functional_pp._torch import trace_backward
from functional_pp.core.comm import CommEvent, CommReport, comm_report
from functional_pp.compile.selective import is_selective
from functional_pp.core.policy import check_remat
from functional_pp.core.layout import Rules, local_shape
from functional_pp.core.mesh import Mesh
from functional_pp.core.tree import leaves_with_paths, map_with_path
from functional_pp.ops.token_ids import deferred_checks
from functional_pp.parallel.named import Named, wrap
from functional_pp.parallel.fsdp.gather_once import GATHER_POLICIES
from functional_pp.parallel.pipeline.stage import StageOutput, StageRun, running_stage
from functional_pp.parallel.shard_map import use_rules
from functional_pp.plan import fsdp2
from functional_pp.plan.device import representative_device
from functional_pp.plan.pipeline import PP, pipeline_plan, split_pipeline
from functional_pp.plan.tracker import DeviceRun, MemoryTracker
from functional_pp.step.train import DEFAULT_BATCH_DIMS, PER_WEIGHT, PRECISIONS, train_step

#: a step's inputs: key -> (global shape, dims) or (global shape, dims, dtype) (default int64 ids;
#: a float column such as KTO's ``desirable`` names torch.float32)
BatchSpec = dict[str, tuple]


@dataclass
class LayoutEstimate:
    """One layout's step on one device: communication (exact), memory at the peak by
    category, FLOPs; ``time`` is filled by a cost model (:mod:`functional_pp.plan.timing`)."""
    mesh: Mesh
    rules: Rules
    comm: CommReport
    param_bytes: int                 # weights held (fp32 master shards)
    state_bytes: int                 # weights + gradients + optimizer state
    activation_bytes: int            # tensors saved for backward (parameters excluded)
    peak_bytes: int                  # highest live memory during the step
    memory: dict[str, int]           # the peak by category
    flops: float                     # FLOPs of this device's matrix products in one step
    layers: int                      # repeated layers in the model (1 when none)
    runs: tuple[DeviceRun, ...]      # the measured runs (1 or 2 layers, or the whole model; see layer_runs)
    settings: dict = field(default_factory=dict)
    comm_time_s: float = 0.0
    time: Any = None                 # a timing.StepTime once costed
    notes: list[str] = field(default_factory=list)
    rank: int = 0                    # the device that ran (the busiest when work is uneven)
    pipeline: Any = None             # a plan.pipeline.PipelinePlan when the mesh has pp > 1 (runs: one micro-batch)
    micro_steps: tuple | None = None  # (G, 2, 3): runs of 2 and 3 micro-steps stand for G (see MICRO_RUNS)
    host_bytes: int = 0              # host memory per device at its peak (offload_params, activation_offloading)
    # what the caching allocator reserves beyond the peak: that of the run with the most layers
    # (its cached blocks are reused layer after layer, so it does not grow with them; plan/allocator.py)
    reserved_overhead: int = 0
    # layers whose parameters differ in shape (Gemma 4's full layers, DeepSeek's dense ones): the
    # first layer_runs[i] layers ran, and f(L) = sum_i layer_weights[i] f(run i) (None: 1 and 2
    # identical layers, f(1) + (L-1)(f(2) - f(1)); docs/planning.md, "Layers that differ")
    layer_runs: tuple[int, ...] | None = None
    layer_weights: tuple[Fraction, ...] | None = None
    # an online run's rollout (a plan.generation.GenerationEstimate) held over the same state
    # before each step: the peak is the larger (app/rollout_memory.py)
    rollout: Any = None

    @property
    def comm_bytes(self) -> int:
        return self.comm.total_bytes

    @property
    def memory_bytes(self) -> int:
        return self.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """The caching allocator's peak reserved bytes (``torch.cuda.max_memory_reserved``):
        the peak plus the blocks' rounding and the cached free blocks too small or too
        scattered to reuse (plan/allocator.py; docs/planning.md, "Reserved memory")."""
        return self.peak_bytes + self.reserved_overhead

    def extrapolate(self, fn: Callable[[DeviceRun], float]) -> float:
        """An additive quantity of the whole model from the runs: f(1) + (L-1)(f(2) - f(1))
        (and likewise over micro-steps)."""
        return extrapolate([fn(r) for r in self.runs], self.layers, self.micro_steps, self.layer_weights)

    def extrapolate_values(self, values) -> float:
        """f(L) (and f(G) micro-steps) from f's values on the runs."""
        return extrapolate(list(values), self.layers, self.micro_steps, self.layer_weights)

    def describe(self) -> str:
        """Mesh sizes (only axes > 1) and the settings that differ from the defaults."""
        mesh = "x".join(f"{a}={s}" for a, s in self.mesh.shape.items() if s > 1) or "1 device"
        extra = [k if v is True else f"{k}={v}" for k, v in self.settings.items()
                 if k not in ("label", "fits", "precision") and (v is True or v not in (None, False, 1))]
        label = self.settings.get("label")
        return " ".join([mesh] + ([label] if label else []) + extra)

    def row(self) -> dict:
        """The numbers of one table row (JSON-ready)."""
        row = {"layout": self.describe(), "mesh": dict(self.mesh.shape), "rules": _rules_dict(self.rules),
               "settings": {k: v for k, v in self.settings.items()}, "comm_GB": self.comm_bytes / 1e9,
               "peak_GB": self.peak_bytes / 1e9, "host_GB": self.host_bytes / 1e9, "state_GB": self.state_bytes / 1e9,
               "activations_GB": self.activation_bytes / 1e9,
               "memory_GB": {k: v / 1e9 for k, v in self.memory.items()}, "tflops": self.flops / 1e12,
               "comm_s": self.comm_time_s}
        if self.time is not None:
            row.update(self.time.row())
        return row


def _rules_dict(rules: Rules) -> dict:
    return {k: list(v) if isinstance(v, (tuple, list)) else v for k, v in getattr(rules, "table", {}).items()}


#: gradient accumulation of more micro-steps than the last of these is run with these many and
#: extrapolated: every micro-step after the first does the same (same collectives, FLOPs, saved
#: tensors; the accumulated gradients already exist), so f(G) = f(2) + (G - 2)(f(3) - f(2)), the
#: peak too (it grows by the few bytes each micro-step keeps to the end, its loss and token count;
#: docs/planning.md, "Repeated micro-steps")
MICRO_RUNS = (2, 3)
#: from this many micro-steps on, the four runs (1 and 2 layers at 2 and 3 micro-steps) are cheaper
#: than the two of all G
EXTRAPOLATE_FROM = 7


def extrapolate(values: Sequence[float], layers: int, micro_steps: tuple | None = None,
                weights: Sequence[Fraction] | None = None) -> float:
    """f(L) from f(1) and f(2) (exact for quantities additive over identical layers), or with
    ``weights`` (layers of several kinds, :func:`layer_plan`) sum_i weights[i] f(run i); with
    ``micro_steps`` = (G, g0, g1) the values are those runs at g0 then at g1 micro-steps, and
    f(L, G) = f(L, g0) + (G - g0)(f(L, g1) - f(L, g0)) (additive over identical micro-steps)."""
    if micro_steps is not None:
        g, g0, g1 = micro_steps
        half = len(values) // 2
        at0, at1 = extrapolate(values[:half], layers, None, weights), extrapolate(values[half:], layers, None, weights)
        return at0 + (g - g0) * (at1 - at0) / (g1 - g0)
    if weights is not None:
        total = sum((w * v for w, v in zip(weights, values, strict=True)), Fraction(0))
        return int(total) if isinstance(total, Fraction) and total.denominator == 1 else float(total)
    if len(values) == 1:
        return values[0]
    one, two = values
    return one + (layers - 1) * (two - one)



def layer_kinds(layers: Sequence[Any]) -> list[int]:
    """Each layer's kind: layers whose parameter declarations (paths, shapes, dims, dtypes) are
    the same are of one kind, numbered in order of first appearance."""
    seen: dict[tuple, int] = {}
    out = []
    for layer in layers:
        sig = tuple((path, tuple(d.shape), tuple(d.dims), str(d.dtype)) for path, d in leaves_with_paths(layer))
        out.append(seen.setdefault(sig, len(seen)))
    return out


def layer_plan(kinds: Sequence[int]) -> tuple[tuple[int, ...], tuple[Fraction, ...] | None]:
    """Which first-n-layers runs stand for the whole model of layers of ``kinds``, and with
    which weights: each run's quantities are modelled as a constant (the model outside the
    layers) plus one term per layer of each kind, one per kind present (what a kind makes once
    and its layers share: a mask, a collective of the MoE layers' sums) and one for the kind of
    its last layer (what is live while the last layer's backward runs); the shortest runs whose terms span the whole
    model's are taken, and f(L) = sum_i weights[i] f(run i), exact in rationals; the whole model
    (no weights) when those runs hold as many layers. Identical layers: runs of 1 and 2 and no
    weights (f(1) + (L-1)(f(2) - f(1)))."""
    n = len(kinds)
    if len(set(kinds)) == 1:
        return (1, 2), None
    k = max(kinds) + 1
    last = kinds[-1]

    def features(m: int) -> list[Fraction]:
        counts = [Fraction(kinds[:m].count(j)) for j in range(k)]
        return ([Fraction(1)] + counts + [Fraction(c > 0) for c in counts[1:]]
                + [Fraction(kinds[m - 1] == j) for j in range(k) if j != last])
    target = features(n)
    basis: list[tuple[list[Fraction], int]] = []      # reduced rows (pivot column) and their runs
    runs: list[int] = []
    rows: list[list[Fraction]] = []
    for m in range(1, n + 1):
        row = _reduce(features(m), basis)
        if any(row):
            pivot = next(i for i, x in enumerate(row) if x)
            basis.append(([x / row[pivot] for x in row], pivot))
            runs.append(m)
            rows.append(features(m))
        if not any(_reduce(target, basis)):
            break
    if sum(runs) >= n:                  # no shorter than the model: run it all
        return (n,), None
    return tuple(runs), _solve(rows, target)


def _reduce(row: list[Fraction], basis) -> list[Fraction]:
    row = list(row)
    for b, pivot in basis:
        if row[pivot]:
            f = row[pivot]
            row = [x - f * y for x, y in zip(row, b)]
    return row


def _solve(rows: list[list[Fraction]], target: list[Fraction]) -> tuple[Fraction, ...]:
    """w with sum_i w[i] rows[i] = target (the rows independent, target in their span)."""
    m, cols = len(rows), len(target)
    # Gaussian elimination on the transposed system: columns of rows are unknown weights
    aug = [[rows[i][c] for i in range(m)] + [target[c]] for c in range(cols)]
    pivots, r = [], 0
    for c in range(m):
        p = next((i for i in range(r, cols) if aug[i][c]), None)
        if p is None:
            continue
        aug[r], aug[p] = aug[p], aug[r]
        aug[r] = [x / aug[r][c] for x in aug[r]]
        for i in range(cols):
            if i != r and aug[i][c]:
                f = aug[i][c]
                aug[i] = [x - f * y for x, y in zip(aug[i], aug[r])]
        pivots.append(c)
        r += 1
    w = [Fraction(0)] * m
    for i, c in enumerate(pivots):
        w[c] = aug[i][m]
    return tuple(w)


def estimate(loss_fn: Callable[[Any, dict], Any], decls: Any, mesh: Mesh, rules: Rules,
             batch: BatchSpec, *, options: dict | None = None, optimizer: optim.GradientTransformation | None = None,
             precision: str = "fp32", grad_accum: int = 1, remat: bool | str = False, repeated: str | None = "layers",
             bandwidth: dict[str, float] | float | None = None, rank: int | None = None, timeline: bool = True,
             label: str | None = None, trainable: Any = None, schedule: str = "1f1b",
             virtual_stages: int = 1, pp_fsdp_gather: str = "step",
             extrapolate_micro_steps: bool = True, compiled: bool = False,
             fsdp2_streams: bool = False, expandable_segments: bool = False, float8: bool = False,
             float8_all_gather: bool = False, _pipeline_stage: bool = False) -> LayoutEstimate:
    """Communication, memory and FLOPs per device of one training step of ``loss_fn`` under
    ``mesh`` and ``rules``, without running it: one representative device (``rank``) runs
    ``train_step``'s step on meta tensors: rank 0, or the busiest device when an op announces
    that its work depends on the device (contiguous causal context parallelism, noted in
    ``notes``); ``rank=`` picks one.

    ``batch`` gives each input's GLOBAL shape and dimension names, e.g.
    ``{"tokens": ((8, 4096), "batch seq"), "labels": ((8, 4096), "batch seq")}`` (int64 ids; a third
    element names another dtype, e.g. ``((8, 4096), "batch seq", torch.float32)`` for a float column).
    ``precision``, ``grad_accum``, ``remat`` (False, True, ``"selective"`` or ``"selective_alternate"``:
    the step runs its selective checkpointing, the kept matmul and attention results counted as activations and
    the recomputed ops in backward) and ``optimizer`` (default AdamW) are the training step's; ``options`` the ops' (``keep_gathered``, ``cp_attention``).
    ``repeated`` names the list of identical layers in ``decls``: with L > 2 layers the
    model is run with 1 and 2 of them and the rest extrapolated (exact to the byte).
    ``bandwidth`` (bytes/s, per mesh axis or one number) sets ``comm_time_s``; the full time
    model is :func:`functional_pp.plan.cost`. ``trainable``: the step's (a callable(params)
    such as ``optim.mask_by_path(...)``, since the model is run with 1 and 2 layers): frozen
    parameters hold no gradient and no optimizer state and are never reduced.

    With ``pp`` > 1 in the mesh (rules ``layers="pp"``), ``grad_accum`` is the number of
    micro-batches, run by ``schedule`` with ``virtual_stages`` model chunks per device
    (docs/planning.md, "Pipelines"): one device's stage runs one micro-batch, and the schedule
    sets the step's length, the activations held and the stage-to-stage transfers.
    ``pp_fsdp_gather`` is ``pipeline_step``'s ``fsdp_gather``: "step" (the default) gathers the
    stage's FSDP units once per step, in their master dtype, holds them and their unsharded
    gradients for the whole step and reduce-scatters once; "micro" gathers and reduce-scatters
    per micro-batch as a step without pipeline does.

    ``extrapolate_micro_steps``: 7 or more micro-steps (``grad_accum`` without pp) are run as
    2 and 3 and extrapolated (exact: every micro-step after the first is the same); False runs
    them all.

    ``compiled``: each layer compiled on its own (``torch.compile`` of the block, as torchtitan
    and ``train_step(compile="per_layer")`` do): AOTAutograd's min-cut partitioner chooses what a
    layer's forward saves for backward, recomputing cheap pointwise ops (norms, SiLU products,
    rotary, casts) from what it keeps; the peak, its split and ``activation_bytes`` follow it
    (plan/partition.py; docs/planning.md, "Compiled layers"). Same flag as ``cost(..., compiled=True)``.

    ``fsdp2_streams``: reserved memory as torch's FSDP2 (``fully_shard``, torchtitan's) allocates
    its collectives' buffers: each unit's flat all-gather buffer on its all-gather stream, the
    reduce-scatter outputs on its reduce-scatter stream, each stream with pools of its own
    (plan/allocator.py; docs/planning.md, "Reserved memory"), the latter holding the step's
    sharded gradients until the next step; and, with FSDP over ``dp_shard`` outside a pipeline,
    the parameters as FSDP2 holds them under torchtitan's policy: the root unit and the last
    layer gathered from their forward to the end of their backward, no 16-bit shard copies
    (plan/fsdp2.py). Off: every buffer on the compute stream, as this framework's own step
    allocates them. ``expandable_segments``: reserved memory
    under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (each pool one segment growing at
    its end; torchtitan's launcher sets it) instead of CUDA's default.

    ``float8``: the layers' matmuls run as torchao's Float8 linear layers (dynamic tensorwise
    scaling, torchtitan's ``float8`` converter): each product's operands are cast to fp8 copies
    that live while it runs (docs/planning.md, "Float8's memory"); ``float8_all_gather`` (with
    ``float8``): the layers' matrix weights are gathered in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``), 1 byte per element. Same flags as :func:`cost`'s."""
    if float8_all_gather and not float8:
        raise ValueError("estimate: float8_all_gather=True gathers the Float8 linear layers' weights in fp8; it "
                         "needs float8=True")
    rules.check(mesh)
    if mesh.shape.get(PP, 1) > 1:
        return _estimate_pipeline(loss_fn, decls, mesh, rules, batch, dict(
            options=options, optimizer=optimizer, precision=precision, remat=remat, bandwidth=bandwidth,
            rank=rank, timeline=timeline, label=label, trainable=trainable, compiled=compiled,
            fsdp2_streams=fsdp2_streams, expandable_segments=expandable_segments, float8=float8,
            float8_all_gather=float8_all_gather),
            grad_accum, repeated, schedule, virtual_stages, pp_fsdp_gather)
    options = dict(options or {})
    remat = options.pop("remat", remat)
    remat = remat if is_selective(remat) else bool(remat)
    check_remat(remat)
    offload = (bool(options.pop("offload_params", False)), bool(options.pop("activation_offloading", False)))
    options.pop("reduce_dtype", None)          # the training step decides, as in a real run
    unknown = sorted(set(options) - {"keep_gathered", "cp_attention", "regather_activations"})
    if unknown:
        raise ValueError(f"estimate: options {unknown} are not settings of the step's op policy; use "
                         f"keep_gathered, cp_attention, regather_activations or remat (docs/policy.md)")
    settings = dict(precision=precision, grad_accum=grad_accum, remat=remat,
                    keep_gathered=bool(options.get("keep_gathered", False)),
                    regather_activations=bool(options.get("regather_activations", False)),
                    cp_attention=options.get("cp_attention", "ring") if mesh.shape.get("cp", 1) > 1 else None,
                    offload_params=offload[0], activation_offloading=offload[1], label=label,
                    compiled_layers=bool(compiled), float8=bool(float8), float8_all_gather=bool(float8_all_gather))
    layers_list = decls.get(repeated) if isinstance(decls, dict) and repeated else None
    n_layers = len(layers_list) if isinstance(layers_list, list) else 1
    lengths, layer_w = layer_plan(layer_kinds(layers_list)) if n_layers > 2 else ((n_layers,), None)
    if layer_w is not None and remat is True:
        # recomputing whole layers, the peak is in the backward of the last layer of the kind that
        # recomputes the most, which need not be the last layer: not a sum over the layers
        lengths, layer_w = (n_layers,), None
        notes_kinds = [f"layers of {len(set(layer_kinds(layers_list)))} kinds (parameter shapes) recomputed whole "
                       f"(remat=True): all {n_layers} layers ran"]
    else:
        notes_kinds = []
    if len(lengths) > 1:
        variants = [{**decls, repeated: layers_list[:m]} for m in lengths]
    else:
        variants, n_layers, lengths, layer_w = [decls], 1, None, None
    micro = _micro_runs(batch, grad_accum) if extrapolate_micro_steps else None
    steps = [(g, {k: ((shape[0] // grad_accum * g, *shape[1:]), *rest) for k, (shape, *rest) in batch.items()})
             for g in MICRO_RUNS] if micro else [(grad_accum, batch)]

    itemsize = (PRECISIONS[precision] or torch.float32).itemsize

    def held(d):                     # what FSDP2 keeps gathered (plan/fsdp2.py held_unsharded)
        if not fsdp2_streams or _pipeline_stage or mesh.shape.get("dp_shard", 1) == 1:
            return None
        root, last = fsdp2.held_unsharded(d, repeated, mesh, rules, float8_all_gather, itemsize)
        return root, fsdp2.layer_count(d, repeated) - 1, last

    def run_on(device: int) -> list:
        return [_run_device(loss_fn, d, mesh, rules, b, options, optimizer, precision, g, remat,
                            repeated, device, timeline, trainable, compiled, fsdp2_streams, expandable_segments,
                            (float8, float8_all_gather),
                            _learn_needed(loss_fn, d, mesh, rules, b, options, optimizer, precision, g, repeated,
                                          device, trainable) if compiled and is_selective(remat) else None,
                            offload=any(offload), fsdp2_held=held(d))
                for g, b in steps for d in variants]
    device = 0 if rank is None else rank
    results = run_on(device)
    uneven = {what: busiest for r in results for what, busiest in r[0].uneven.items()}
    if uneven and rank is None:      # the step waits for the busiest device: estimate that one
        busiest = {a: i for coords in uneven.values() for a, i in coords.items()}
        if mesh.rank_of(busiest) != device:
            device = mesh.rank_of(busiest)
            results = run_on(device)
    notes = [f"uneven work: {what}; estimated device {device}" for what in uneven] + notes_kinds
    runs = tuple(r[0] for r in results)
    if settings["cp_attention"] == "ring":       # each query meets the keys of all cp chunks, one call each
        for r in runs:
            r.attention_by_keys = {n * mesh.shape["cp"]: f for n, f in r.attention_by_keys.items()}
    comm = _extrapolate_report([r[1] for r in results], n_layers, micro, layer_w)
    ext = lambda f: int(round(extrapolate([f(r) for r in results], n_layers, micro, layer_w)))  # noqa: E731
    weights = ext(lambda r: r[0].baseline["weights"])
    opt_state = ext(lambda r: r[0].baseline["optimizer state"])
    grads = ext(lambda r: r[2])                  # frozen parameters have none
    split = (lambda r: r.compiled_breakdown) if compiled else (lambda r: r.peak_breakdown)
    memory = {}
    for cat in set().union(*(split(r) for r in runs)):
        v = extrapolate([split(r).get(cat, 0) for r in runs], n_layers, micro, layer_w)
        if v:
            memory[cat] = int(round(v))
    peak = (lambda r: r.compiled_peak_bytes) if compiled else (lambda r: r.peak_bytes)
    gradients = fsdp2.sharded_gradients(decls, repeated, mesh, rules, trainable) if fsdp2_streams else []
    est = LayoutEstimate(
        mesh, rules, comm, param_bytes=weights, state_bytes=weights + grads + opt_state,
        activation_bytes=ext(lambda r: r[0].saved_bytes + (r[0].compiled_saved_delta if compiled else 0)),
        peak_bytes=ext(lambda r: peak(r[0])),
        memory=memory, flops=extrapolate([sum(r.flops.values()) for r in runs], n_layers, micro, layer_w),
        layers=n_layers, runs=runs, settings=settings, notes=notes, rank=device, micro_steps=micro,
        reserved_overhead=max(0, _reserved(runs[-1], steps[-1][0], gradients, expandable_segments)
                              - runs[-1].peak_bytes),
        layer_runs=tuple(lengths) if layer_w is not None else None, layer_weights=layer_w)
    if layer_w is not None:
        est.notes.append(f"layers of {len(set(layer_kinds(layers_list)))} kinds (parameter shapes): ran the first "
                         f"{', '.join(map(str, lengths))} of {n_layers} layers and solved for each kind's share")
    if any(offload):
        _offloaded(est, offload, weights if precision == "fp32" else 0, ext)
    est.comm_time_s = _bandwidth_time(comm, bandwidth)
    return est


def _reserved(run: DeviceRun, micro_steps: int, units: list[int], expandable_segments: bool) -> int:
    """The reserved bytes of the whole model's step from the run with the most layers: its own (the
    cached blocks are reused layer after layer), but for FSDP2's reduce-scatter stream
    (``fsdp2_streams``), whose pool holds every unit's sharded gradients until the next step:
    the run's pool (its own outputs, freed per weight) is replaced by the whole model's
    gradients ``units`` (plan/fsdp2.py ``sharded_gradients``) replayed on it (plan/fsdp2.py ``held_gradients``)."""
    if not run.gradient_shards:
        return run.peak_reserved
    return (run.peak_reserved - run.reserved_by_stream.get(fsdp2.REDUCE_SCATTER_STREAM, 0)
            + fsdp2.held_gradients(units, micro_steps, expandable_segments))


def _offloaded(est: LayoutEstimate, levers: tuple[bool, bool], shard_copies: int, ext) -> None:
    """The device's and the host's peaks of a step with ``levers`` (offload_params,
    activation_offloading) pulled, from the same run (plan/tracker.py ``split``): with
    ``offload_params`` the master shards, optimizer state, update and gradients (once backward is
    done) are on the host, and the step's device copies of the shards added (``shard_copies``:
    fp32 steps copy them as they are; a 16-bit step's cast copies are already counted);
    with ``activation_offloading`` the saved activations are on the host, but those of the layer
    computing (made in forward, brought back in backward; docs/memory.md)."""
    device = ext(lambda r: r[0].offload_peaks[levers][0]) + (shard_copies if levers[0] else 0)
    host = ext(lambda r: r[0].offload_peaks[levers][1])
    est.peak_bytes, est.host_bytes = device, host
    moved = (("weights", "optimizer state", "update temporaries") if levers[0] else ()) + \
        (("activations",) if levers[1] else ())
    est.memory = {k: v for k, v in est.memory.items() if k not in moved}
    est.notes.append("offloaded to the host: " + ", ".join(
        n for n, on in zip(("parameters, gradients and optimizer state (offload_params)",
                            "saved activations (activation_offloading)"), levers) if on))


def _stage_copies(decls: dict, repeated: str, n_layers: int, per_device: int) -> dict:
    """Whole copies of the model in the tree (a preference run's frozen reference under
    ``reference``, with its own ``repeated`` list of as many layers), each cut to the stage's
    layers as ``pipeline_step`` splits them (its ``layers`` paths: app/loop.py ``_build_step``)."""
    return {k: {**v, repeated: v[repeated][:per_device]} for k, v in decls.items()
            if k != repeated and isinstance(v, dict) and isinstance(v.get(repeated), list)
            and len(v[repeated]) == n_layers}


def _estimate_pipeline(loss_fn, decls, mesh: Mesh, rules: Rules, batch: BatchSpec, kw: dict, micro: int,
                       repeated: str | None, schedule: str, virtual: int, fsdp_gather: str) -> LayoutEstimate:
    """A pipeline layout: the dry-run of one device's L / pp layers on one micro-batch on the
    mesh without pp, and the schedule's timeline (plan/pipeline.py)."""
    if fsdp_gather not in GATHER_POLICIES:
        raise ValueError(f"plan.estimate(pp_fsdp_gather={fsdp_gather!r}): choose one of "
                         f"{', '.join(map(repr, GATHER_POLICIES))} (docs/pipelines.md)")
    layers_list = decls.get(repeated) if isinstance(decls, dict) and repeated else None
    if not isinstance(layers_list, list):
        raise ValueError(f"plan.estimate: a pipeline (pp={mesh.shape[PP]}) splits the list of layers at "
                         f"{repeated!r}, which the parameter tree does not have (pass repeated='path')")
    n_layers = len(layers_list)
    inner, inner_rules, timeline = split_pipeline(mesh, rules, n_layers, micro, schedule, virtual)
    for key, (shape, *_) in batch.items():
        if shape[0] % micro:
            raise ValueError(f"plan.estimate: batch[{key!r}] has {shape[0]} sequences, not divisible into "
                             f"grad_accum={micro} micro-batches")
    micro_batch = {k: ((shape[0] // micro, *shape[1:]), *rest) for k, (shape, *rest) in batch.items()}
    p = mesh.shape[PP]
    per_device = n_layers // p
    stage = {**decls, repeated: layers_list[:per_device], **_stage_copies(decls, repeated, n_layers, per_device)}
    est = estimate(loss_fn, stage, inner, inner_rules, micro_batch, grad_accum=1, repeated=repeated, **kw,
                   _pipeline_stage=True)   # (its units are held for the step: plan/pipeline.py, not FSDP2's rule)
    if kw.get("float8_all_gather") and fsdp_gather == "step":
        est.notes.append("float8_all_gather: the stage's FSDP units held for the step are counted in 16 bits "
                         "(not halved)")
    x_shape, x_dtype = _boundary(loss_fn, stage, inner, inner_rules, micro_batch, kw["precision"])
    boundary_bytes = int(torch.Size(x_shape).numel()) * x_dtype.itemsize
    plan = pipeline_plan(timeline, n_layers, boundary_bytes, fsdp_gather)
    last = est.runs[-1]
    layer = max((s.layer for s in last.saved if s.layer is not None), default=None)
    per_layer = sum(s.nbytes for s in last.saved if s.layer == layer and s.category in ("activations", "logits"))
    extra = int(max(0, plan.in_flight - virtual) * per_layer * per_device // virtual)
    est.activation_bytes += extra
    if extra:
        est.memory["activations"] = est.memory.get("activations", 0) + extra
    held_grads = 0
    comm = CommReport()
    if fsdp_gather == "micro":
        comm.events = est.comm.events * micro
    else:           # the stage's FSDP units gathered (uncast) and reduce-scattered once per step
        fsdp = _fsdp_events(est, stage, inner, inner_rules, kw["trainable"])
        once = [fsdp[i] for i in sorted(fsdp)]
        comm.events = once + [e for i, e in enumerate(est.comm.events) if i not in fsdp] * micro
        once = [e for e in once if e is not None]
        comm.events = [e for e in comm.events if e is not None]
        held = sum(e.bytes_sent for e in once)      # the gathered units (n-1)/n and the unsharded gradients' (n-1)/n
        gathers = [(est.comm.events[i].bytes_sent, e.bytes_sent) for i, e in fsdp.items()
                   if e is not None and e.kind == "all_gather"]
        if gathers:
            plan = replace(plan, gather_scale=sum(b for _, b in gathers) / max(1, sum(a for a, _ in gathers)))
        held_grads = sum(e.bytes_sent for e in once if e.kind == "reduce_scatter")
        est.peak_bytes += held - held_grads
        est.memory["weights in flight"] = est.memory.get("weights in flight", 0) + held
    # the in-flight activations and each model chunk's unsharded gradients, over the timeline
    chunk = per_layer * per_device / virtual
    held_peak = max(timeline.held_peak(d, chunk, held_grads / virtual) for d in range(p))
    est.peak_bytes += int(held_peak - virtual * chunk)
    if held_grads + extra > held_peak - virtual * chunk:     # a chunk's gradients freed before another's exist
        est.memory["weights in flight"] = est.memory.get("weights in flight", 0) - int(held_grads + extra - (held_peak - virtual * chunk))
    for i in range(plan.sends):        # activations forward, their gradients backward
        comm.events.append(CommEvent("permute", (PP,), p, boundary_bytes, tuple(x_shape),
                                     str(x_dtype).replace("torch.", ""), i % 2 == 1))
    est.comm, est.mesh, est.rules, est.pipeline = comm, mesh, rules, plan
    est.flops *= micro
    est.settings.update(grad_accum=micro, pp_schedule=schedule, virtual_stages=virtual,
                        pp_fsdp_gather=fsdp_gather if fsdp_gather != "step" else None)
    est.notes.append(f"pipeline: one device of {p} stages ({per_device} layers) on one micro-batch of {micro}; the "
                     f"parameters outside the layers are all counted on it (the last stage holds the head)")
    est.comm_time_s = _bandwidth_time(comm, kw["bandwidth"])
    return est


def _fsdp_events(est: LayoutEstimate, decls, mesh: Mesh, rules: Rules, trainable) -> dict[int, CommEvent | None]:
    """Under ``fsdp_gather="step"``: the indices of the micro-batch's FSDP collectives in
    ``est.comm.events`` and what each becomes once per step: a forward gather of a weight in
    its master dtype (fp32 when trained, its own when frozen), a gradient reduce-scatter as it
    is, a backward re-gather nothing (None)."""
    weight = {(e.kind, e.axes, e.shape, e.phase == "backward") for r in est.runs for e in r.events
              if e.weight_traffic and e.kind in ("all_gather", "reduce_scatter")}
    flags = dict(leaves_with_paths(trainable(decls))) if trainable is not None else {}
    master: dict[tuple, int] = {}
    for path, d in leaves_with_paths(decls):
        shape = tuple(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, path), mesh))
        size = 4 if flags.get(path, True) and d.dtype.is_floating_point else d.dtype.itemsize
        master[shape] = max(master.get(shape, 0), size)
    out: dict[int, CommEvent | None] = {}
    for i, e in enumerate(est.comm.events):
        if (e.kind, e.axes, e.shape, e.backward) not in weight:
            continue
        if e.kind == "reduce_scatter":
            out[i] = e
        elif e.backward:
            out[i] = None
        else:
            size, itemsize = master.get(e.shape), getattr(torch, e.dtype).itemsize
            size = size or itemsize
            out[i] = replace(e, bytes_sent=e.bytes_sent * size // itemsize,
                             dtype=e.dtype if size == itemsize else {4: "float32", 2: "bfloat16", 1: "uint8"}[size])
    return out


def _boundary(loss_fn, decls, mesh: Mesh, rules: Rules, batch: BatchSpec, precision: str):
    """Shape and dtype of the residual stream at a stage boundary: the model run on meta
    tensors up to its first layer."""
    with representative_device(mesh, 0), use_rules(rules):
        params = map_with_path(lambda p, d: _meta_param(d, rules, mesh, p), decls)
        named = _meta_named_batch(batch, rules, mesh)
        try:
            with running_stage(StageRun(0, -1, None, cut=True)), torch.no_grad():
                loss_fn(params, named)
        except StageOutput as first:
            dtype = PRECISIONS[precision] or first.value.data.dtype
            return tuple(first.value.data.shape), dtype
    raise ValueError("plan.estimate: the model called no functional_pp.layer; a pipeline cuts the model at its "
                     "layers")


def _learn_needed(loss_fn, decls, mesh, rules, batch, options, optimizer, precision, grad_accum, repeated, rank,
                  trainable) -> dict:
    """What backward reads of each layer's forward values (by position) when nothing is checkpointed:
    what a compiled, selectively checkpointed layer must keep or recompute (plan/partition.py)."""
    run = _run_device(loss_fn, decls, mesh, rules, batch, options, optimizer, precision, grad_accum, False,
                      repeated, rank, False, trainable, True)[0]
    return run.needed_positions


def batch_dims_of(batch: BatchSpec) -> dict:
    """``train_step``'s ``batch_dims`` of a batch spec: its keys' dimension names (over the
    step's defaults), so a batch of other keys (a DPO step's pairs) is laid out as given."""
    return {**DEFAULT_BATCH_DIMS, **{k: dims for k, (_, dims, *_) in batch.items()}}


def _run_device(loss_fn, decls, mesh, rules, batch, options, optimizer, precision, grad_accum, remat,
                repeated, rank, timeline, trainable=None, compiled=False, fsdp2_streams=False,
                expandable_segments=False, float8=(False, False), needed=None, offload=True, fsdp2_held=None):
    loss = Instrumented(loss_fn, repeated)
    step = train_step(loss, optimizer or optim.adamw(1e-4), mesh=mesh, rules=rules, precision=precision,
                      grad_accum=grad_accum, remat=remat, trainable=trainable, **options,
                      batch_dims=batch_dims_of(batch), **PER_WEIGHT)   # policy: docs/policy.md
    with representative_device(mesh, rank), use_rules(rules), step.apply_policy():
        params = map_with_path(lambda p, d: _meta_param(d, rules, mesh, p), decls)
        named_batch = _meta_batch(batch, rules, mesh)
        state = step.init(params)
        masters = [x for _, x in leaves_with_paths(state["params"])]
        trained = _nbytes(optree.tree_leaves(step.spec.trainable_tree(state["params"]), none_is_leaf=False))
        baseline = {"weights": _nbytes(masters),
                    "optimizer state": _nbytes(optree.tree_leaves(state["opt_state"], none_is_leaf=False))}
        with comm_report() as rep:
            held = masters + optree.tree_leaves(state["opt_state"], none_is_leaf=False)
            sizes = [t.untyped_storage().nbytes() for t in held if isinstance(t, torch.Tensor)]
            tracker = MemoryTracker(baseline, masters, rep, timeline, baseline_sizes=sizes, compiled=compiled,
                                    fsdp2_streams=fsdp2_streams, expandable_segments=expandable_segments,
                                    needed=needed, selective=remat if is_selective(remat) else "selective",
                                    float8=float8[0], float8_all_gather=float8[1], offload=offload,
                                    fsdp2_held=fsdp2_held)
            loss.tracker = tracker
            with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), \
                    trace_backward(False), deferred_checks():
                out = step.trace(state, named_batch)
            del out
    return tracker.run, rep, trained     # (trained: the bytes of the gradients the update sees)


class Instrumented:
    """``loss_fn`` telling its ``tracker``, once one is attached, that forward runs and (through
    the ``repeated`` list of layers) which layer; without a tracker, ``loss_fn`` itself."""

    def __init__(self, loss_fn: Callable[[Any, dict], Any], repeated: str | None):
        self.loss_fn, self.repeated, self.tracker = loss_fn, repeated, None

    def __call__(self, params: Any, batch: dict) -> Any:
        tracker = self.tracker
        if tracker is None:
            return self.loss_fn(params, batch)
        tracker.begin_forward()
        if self.repeated and isinstance(params, dict) and isinstance(params.get(self.repeated), list):
            params = {**params, self.repeated: _Layers(params[self.repeated], tracker)}
        out = self.loss_fn(params, batch)
        tracker.layer = None
        return out


class _Layers(list):
    """The repeated layers; iterating tells the tracker which layer runs."""

    def __init__(self, items, tracker: MemoryTracker):
        super().__init__(items)
        self._tracker = tracker

    def __iter__(self):
        for i in range(len(self)):
            self._tracker.layer = i
            yield list.__getitem__(self, i)
        self._tracker.layer = None

    def __getitem__(self, i):
        if isinstance(i, int):
            self._tracker.layer = i % len(self)
        return list.__getitem__(self, i)


def _meta_param(d, rules: Rules, mesh: Mesh, path: str) -> Named:
    layout = rules.resolve(d.dims, d.shape, mesh, path)
    x = Named(torch.empty(local_shape(d.shape, layout, mesh), dtype=d.dtype, device="meta"), d.dims, layout)
    return x


def _meta_batch(batch: BatchSpec, rules: Rules, mesh: Mesh) -> dict:
    return {k: v.data for k, v in _meta_named_batch(batch, rules, mesh).items()}


def _meta_named_batch(batch: BatchSpec, rules: Rules, mesh: Mesh) -> dict:
    out = {}
    for key, (shape, dims, *dtype) in batch.items():
        dims = dims.split() if isinstance(dims, str) else list(dims)
        layout = rules.resolve(dims, shape, mesh, name=f"batch[{key!r}]")
        out[key] = wrap(torch.zeros(local_shape(shape, layout, mesh), dtype=(dtype or [torch.long])[0], device="meta"),
                        dims, layout)
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _micro_runs(batch: BatchSpec, grad_accum: int) -> tuple | None:
    """(G, 2, 3) when ``grad_accum`` = G micro-steps are better run as 2 and 3 and extrapolated."""
    if grad_accum < EXTRAPOLATE_FROM or any(shape[0] % grad_accum for shape, *_ in batch.values()):
        return None
    return (grad_accum, *MICRO_RUNS)


def _extrapolate_report(reports: list[CommReport], layers: int, micro_steps: tuple | None = None,
                        weights: Sequence[Fraction] | None = None) -> CommReport:
    """The whole model's collectives: the 1-layer run's plus (L-1) times what a second layer adds
    (with ``weights``: each collective counted sum_i weights[i] times its count in run i, in
    the order of the longest run); with ``micro_steps`` (G, g0, g1), the g0 runs' plus
    (G - g0) / (g1 - g0) times what g1 adds."""
    if micro_steps is not None:
        g, g0, g1 = micro_steps
        half = len(reports) // 2
        at0 = _extrapolate_report(reports[:half], layers, None, weights)
        at1 = _extrapolate_report(reports[half:], layers, None, weights)
        out = CommReport()
        out.events = list(at0.events)
        extra = list((Counter(at1.events) - Counter(at0.events)).elements())
        for _ in range((g - g0) // (g1 - g0)):
            out.events.extend(extra)
        return out
    out = CommReport()
    if weights is not None:
        return _weighted_report(reports, weights)
    out.events = list(reports[0].events)
    if len(reports) == 2:
        extra = Counter(reports[1].events) - Counter(reports[0].events)
        if Counter(reports[0].events) - Counter(reports[1].events):    # one collective grows with the layers
            return _weighted_report(reports, (Fraction(2 - layers), Fraction(layers - 1)))
        for _ in range(layers - 1):
            out.events.extend(extra.elements())
    return out


def _weighted_report(reports: list[CommReport], weights: Sequence[Fraction]) -> CommReport:
    """Each collective counted sum_i weights[i] times its count in run i, in the longest run's
    order. A collective whose size grows with the layers (the MoE layers' routing counts summed
    in one all-reduce of one row per layer) is one per run of a size that differs: those issued
    as often in every run, alike but in their first dimension, get that dimension and their
    bytes extrapolated."""
    counts = [Counter(r.events) for r in reports]
    total = {e: sum((w * c[e] for w, c in zip(weights, counts)), Fraction(0)) for e in set().union(*counts)}
    bad = {e for e, n in total.items() if n < 0 or n.denominator != 1}
    grown: list[CommEvent] = []
    if bad:
        def key(e):
            return e.kind, e.axes, e.group_size, e.dtype, e.backward, len(e.shape), e.shape[1:]
        groups: dict[tuple, list[list[CommEvent]]] = {}
        for e in bad:
            groups.setdefault(key(e), [[] for _ in reports])
        for i, r in enumerate(reports):
            for e in r.events:
                if key(e) in groups:
                    groups[key(e)][i].append(e)
        for k, per_run in groups.items():
            c = max(len(evs) for evs in per_run)
            for evs in per_run:         # runs without the layers that issue it: of size 0
                if not evs:
                    evs.extend(replace(e, shape=(0, *e.shape[1:]), bytes_sent=0)
                               for e in next(v for v in per_run if v))
            if len({len(evs) for evs in per_run}) != 1 or not c or not k[5]:
                raise RuntimeError(f"plan: the collectives of the runs of {len(reports)} layer counts are not a sum "
                                   f"over the layers ({k[0]} over {k[1]} of shapes "
                                   f"{[[e.shape for e in evs] for evs in per_run]}); pass repeated=None to run "
                                   f"every layer")
            for j in range(len(per_run[0])):
                evs = [evs[j] for evs in per_run]
                first = sum((w * e.shape[0] for w, e in zip(weights, evs)), Fraction(0))
                nbytes = sum((w * e.bytes_sent for w, e in zip(weights, evs)), Fraction(0))
                if first < 0 or first.denominator != 1 or nbytes < 0 or nbytes.denominator != 1:
                    raise RuntimeError(f"plan: the {k[0]} over {k[1]} of shapes {[e.shape for e in evs]} in the runs "
                                       f"does not grow by whole layers; pass repeated=None to run every layer")
                if first:
                    grown.append(replace(evs[-1], shape=(int(first), *evs[-1].shape[1:]), bytes_sent=int(nbytes)))
            for evs in per_run:
                for e in evs:
                    total.pop(e, None)
    left = {e: int(n) for e, n in total.items()}
    out = CommReport()
    for e in reports[-1].events:
        if left.get(e, 0) > 0:
            out.events.append(e)
            left[e] -= 1
        elif grown and e in bad:
            out.events.append(grown.pop(0))
    for e, n in left.items():
        out.events.extend([e] * n)
    out.events.extend(grown)
    return out


def _bandwidth_time(rep: CommReport, bandwidth) -> float:
    if bandwidth is None:
        return 0.0
    total = 0.0
    for e in rep.events:
        bw = bandwidth if isinstance(bandwidth, (int, float)) else min(bandwidth.get(a, float("inf")) for a in e.axes)
        total += e.bytes_sent / bw
    return total
