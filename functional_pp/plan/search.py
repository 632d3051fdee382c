"""Search layouts: meshes x axis orders x rule sets x step options, pruned, costed, ranked,
with the Pareto front of (step time, memory) (docs/planning.md, "Search").

A strategy is a function ``(candidates, evaluate) -> results``: :func:`exhaustive` evaluates
all of them; :func:`beam` first ranks meshes with default options and expands only the best."""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from functional_pp.core.layout import Rules, balanced, inherit
from functional_pp.core.mesh import DEFAULT_AXES, Mesh
from functional_pp.plan.cluster import Cluster
from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.dryrun import BatchSpec, LayoutEstimate, estimate
from functional_pp.plan.timing import cost
from functional_pp.plan.workers import Pool


@dataclass(frozen=True)
class Candidate:
    """One layout to try: a mesh (its order places axes on nodes), rules and step options."""
    mesh: Mesh
    rules: Rules
    label: str = ""
    options: tuple = ()          # ((name, value), ...): keep_gathered, cp_attention
    precision: str = "bf16"
    grad_accum: int = 1
    remat: bool | str = False    # False, True, "selective" or "selective_alternate"
    schedule: str = "1f1b"       # pipeline schedule (pp > 1); grad_accum is its micro-batches
    virtual: int = 1             # model chunks per device (interleaved_1f1b)
    loss_chunks: int | None = None   # the LM head and loss over this many token chunks (None: whole logits)

    def __hash__(self):
        return hash((tuple(self.mesh.shape.items()), repr(self.rules), self.options, self.precision,
                     self.grad_accum, self.remat, self.schedule, self.virtual, self.loss_chunks))


@dataclass
class Space:
    """What to search. ``fsdp``: which axis groups to shard parameters over (names from
    ``("dp_shard",)``, ``("dp_shard", "cp")``, ``()`` = no FSDP); ``orders``: "default"
    (``dp_replicate, dp_shard, cp, tp``: tp innermost) or "all" (every order that places the
    axes on nodes differently). ``pp``: pipeline sizes, each with ``schedules`` (interleaved
    with each of ``virtual_stages``) and ``micro_batches``; ``ep``: expert-parallel sizes.
    ``loss_chunks``: the LM head and cross-entropy over that many chunks of each device's tokens
    (None: the whole logits), a memory lever like ``remat``; :func:`search` needs ``loss_for``
    for a value other than None."""
    axes: Sequence[str] = DEFAULT_AXES
    fsdp: Sequence[tuple[str, ...]] = (("dp_shard", "cp"), ("dp_shard",), ())
    sequence_parallel: Sequence[bool] = (True, False)
    regather_activations: Sequence[bool] = (False, True)   # with SP: Megatron's re-gather in backward
    cp_attention: Sequence[str] = ("ring", "allgather")
    remat: Sequence[bool | str] = (False, True)   # add "selective", "selective_alternate" to rank them too
    loss_chunks: Sequence[int | None] = (None,)   # e.g. (None, 8): the head and loss over 8 token chunks too
    keep_gathered: Sequence[bool] = (False, True)
    grad_accum: Sequence[int] = (1,)
    orders: str = "default"
    precision: str = "bf16"
    max_axis: dict = field(default_factory=dict)     # e.g. {"tp": 8}: largest size per axis
    pp: Sequence[int] = (1,)                         # pipeline sizes (an outermost pp axis, layers="pp")
    schedules: Sequence[str] = ("1f1b", "interleaved_1f1b")
    virtual_stages: Sequence[int] = (2,)             # model chunks per device of interleaved_1f1b
    micro_batches: Sequence[int] | None = None       # per pipeline step; None: as many as stages (torchtitan's default)
    ep: Sequence[int] = (1,)                         # expert-parallel sizes (an ep axis, experts="ep"; MoE models)
    offload_params: Sequence[bool] = (False,)        # parameters, gradients, optimizer state on the host (FSDP)
    activation_offloading: Sequence[bool] = (False,)  # saved activations on the host
    micro_batch_sizes: Sequence[int] | str | None = None   # sequences per data-parallel rank per micro-step at the
    # global batch searched (gradient accumulation makes up the rest; a pipeline's micro-batches); "all": every
    # size that divides a layout's local batch; None: ``grad_accum`` (and ``micro_batches``) as given


def factorizations(n_devices: int, axes: Sequence[str] = DEFAULT_AXES) -> Iterable[Mesh]:
    """Every mesh of ``n_devices`` over ``axes`` (sizes are divisors, product is n)."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    for combo in itertools.product(divisors, repeat=len(axes)):
        p = 1
        for c in combo:
            p *= c
        if p == n_devices:
            yield Mesh.from_axes(list(zip(axes, combo)))


def standard_rules(fsdp: Sequence[str] = ("dp_shard", "cp"), sequence_parallel: bool = False, pp: bool = False,
                   ep: bool = False) -> Rules:
    """Accelerate-style rules for models named like ``models/llama.py``: batch over
    dp_replicate x dp_shard, seq over cp in load-balanced order (every device does the same
    causal-attention work, so the representative device stands for all: docs/planning.md),
    heads/kv_heads/mlp/vocab over tp, parameters split along ``hidden`` over ``fsdp``, the
    residual stream's sequence like seq and further over tp with SP; with ``pp`` the layers
    over pp, with ``ep`` the experts over ep (and batch and hidden over it too, as the
    ``ep_size`` config key does)."""
    rules = dict(batch=("dp_replicate", "dp_shard"), seq=balanced("cp"), res_seq=inherit("seq"),
                 heads="tp", kv_heads="tp", mlp="tp", vocab="tp")
    if fsdp:
        rules["hidden"] = tuple(fsdp)
    if sequence_parallel:
        rules["res_seq"] = inherit("seq", "tp")
    if pp:
        rules["layers"] = "pp"
    if ep:
        rules.update(batch=(*rules["batch"], "ep"), experts="ep", hidden=(*rules.get("hidden", ()), "ep"))
    return Rules(rules).as_defaults()


def _meshes(n_devices: int, space: Space) -> Iterable[Mesh]:
    """Every mesh of ``space``: factorizations over its axes, with each pipeline size outermost
    and each expert-parallel size innermost."""
    for pp in space.pp:
        for ep in space.ep:
            if n_devices % (pp * ep):
                continue
            for mesh in factorizations(n_devices // (pp * ep), space.axes):
                yield Mesh.from_axes(([("pp", pp)] if pp > 1 else []) + list(mesh.shape.items())
                                     + ([("ep", ep)] if ep > 1 else []))


def _pipelines(mesh: Mesh, space: Space) -> list[tuple[str, int]]:
    """(schedule, virtual stages) of a mesh: one no-pipeline entry without pp."""
    if mesh.shape.get("pp", 1) == 1:
        return [("1f1b", 1)]
    return [(s, v) for s in space.schedules for v in (space.virtual_stages if s == "interleaved_1f1b" else (1,))]


def _accumulations(mesh: Mesh, space: Space, rows: int | None) -> list[int]:
    """The micro-steps per optimizer step of a mesh (a pipeline's micro-batches): from
    ``space.micro_batch_sizes`` at ``rows`` sequences per step (the sizes that divide the
    mesh's local batch), else ``space.micro_batches`` (default: as many as stages) under
    ``pp``, else ``space.grad_accum``."""
    p = mesh.shape.get("pp", 1)
    if space.micro_batch_sizes is None or rows is None:
        return list(space.micro_batches or (p,)) if p > 1 else list(space.grad_accum)
    dp = math.prod(mesh.shape.get(a, 1) for a in ("dp_replicate", "dp_shard", "ep"))
    local = rows // dp if rows % dp == 0 else 0
    sizes = range(1, local + 1) if space.micro_batch_sizes == "all" else space.micro_batch_sizes
    return [local // b for b in sizes if local and local % b == 0] or [1]   # [1]: rejected with the reason


def _orders(mesh: Mesh, how: str, cl: Cluster) -> list[Mesh]:
    if how == "default":
        return [mesh]
    big = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a != "pp"]
    first = [("pp", mesh.shape["pp"])] if mesh.shape.get("pp", 1) > 1 else []    # pp stays outermost
    seen, out = set(), []
    for perm in itertools.permutations(big):
        m = Mesh.from_axes(first + [(a, mesh.shape[a]) for a in perm] +
                           [(a, 1) for a in mesh.axis_names if mesh.shape[a] == 1 and a != "pp"])
        key = tuple(sorted(cl.placement(m).items()))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def candidates(n_devices: int, space: Space, cl: Cluster, rows: int | None = None) -> list[Candidate]:
    """Every candidate of ``space`` on ``n_devices`` (``rows``: sequences per step, for
    ``space.micro_batch_sizes``), without duplicates that differ only in names (a dp_shard axis
    without FSDP is dp_replicate) or in options that do nothing there (SP without tp, CP modes
    without cp, keep_gathered without FSDP)."""
    out, seen = [], set()
    for mesh in _meshes(n_devices, space):
        s = mesh.shape
        if any(s.get(a, 1) > m for a, m in space.max_axis.items()):
            continue
        tp, cp = s.get("tp", 1) > 1, s.get("cp", 1) > 1
        for fsdp in space.fsdp:
            fsdp = tuple(a for a in fsdp if s.get(a, 1) > 1)
            if s.get("dp_shard", 1) > 1 and "dp_shard" not in fsdp:
                continue                                   # plain DP: use dp_replicate
            choices = itertools.product(space.sequence_parallel if tp else (False,), space.regather_activations,
                                        space.cp_attention if cp else ("ring",),
                                        space.keep_gathered if fsdp else (False,), space.remat, space.loss_chunks,
                                        _accumulations(mesh, space, rows), _orders(mesh, space.orders, cl),
                                        _pipelines(mesh, space), space.offload_params, space.activation_offloading)
            for sp, regather, cpa, keep, remat, chunks, ga, ordered, (schedule, virtual), off, act_off in choices:
                if regather and not sp:
                    continue
                label = (f"fsdp={'+'.join(fsdp)}" if fsdp else "no-fsdp") + (" sp" if sp else "")
                opts = ((("cp_attention", cpa),) if cp else ()) + ((("keep_gathered", True),) if keep else ()) \
                    + ((("regather_activations", True),) if regather else ()) \
                    + ((("offload_params", True),) if off else ()) + ((("activation_offloading", True),) if act_off else ())
                rules = standard_rules(fsdp, sp, pp=s.get("pp", 1) > 1, ep=s.get("ep", 1) > 1)
                c = Candidate(ordered, rules, label, opts, space.precision, ga, remat, schedule, virtual, chunks)
                if hash(c) not in seen:
                    seen.add(hash(c))
                    out.append(c)
    return out


Evaluate = Callable[[Candidate], "LayoutEstimate | None"]


class Evaluator:
    """The strategies' ``evaluate``: ``evaluate(c)`` estimates one candidate, ``evaluate.many(cs)``
    several at once (on the pool's workers), in order; a layout that cannot be estimated is None,
    its reason kept in ``rejected`` in the order the candidates were given."""

    def __init__(self, pool: Pool, total: int, rejected: list, progress=None) -> None:
        self.pool, self.total, self.rejected, self.progress = pool, total, rejected, progress
        self.jobs = pool.jobs
        self._count = 0

    def __call__(self, c: Candidate) -> LayoutEstimate | None:
        return self.many([c])[0]

    def many(self, cands: Sequence[Candidate]) -> list[LayoutEstimate | None]:
        def done(i: int, result) -> None:
            if self.progress is not None:
                self.progress(self._count, self.total, _name(cands[i]))
            self._count += 1
        out = []
        for e, why in self.pool.map(cands, done):
            if why is not None:
                self.rejected.append(why)
            out.append(e)
        return out


def _many(evaluate: Evaluate) -> Callable[[Sequence[Candidate]], list]:
    """``evaluate.many``, or one candidate after another for a plain function."""
    return getattr(evaluate, "many", None) or (lambda cs: [evaluate(c) for c in cs])


def exhaustive(cands: Sequence[Candidate], evaluate: Evaluate) -> list[LayoutEstimate]:
    """Evaluate every candidate."""
    return [e for e in _many(evaluate)(cands) if e is not None]


def leanest(cands: Sequence[Candidate]) -> Candidate:
    """The candidate of a group that holds the least memory: every memory lever pulled (whole-layer
    recomputation, then the selective policies (every second matmul recomputed, then none); the most micro-steps, i.e. the smallest micro-batch; the
    most loss chunks; the widest FSDP; sequence parallelism; Megatron's re-gather; weights re-gathered in backward)."""
    def key(c: Candidate):
        opts = dict(c.options)
        return (-_REMAT_SAVING_ORDER[c.remat], -c.grad_accum, -_chunking(c), -len(c.rules.table.get("hidden") or ()),
                "tp" not in c.rules["res_seq"], not opts.get("regather_activations", False),
                bool(opts.get("keep_gathered", False)), opts.get("cp_attention", "ring") != "ring")
    return min(cands, key=key)


def beam(width: int = 4) -> Callable[[Sequence[Candidate], Evaluate], list[LayoutEstimate]]:
    """Group the candidates (one mesh shape and order, one pipeline schedule), probe each group
    with its first candidate (default options: no recomputation, the largest micro-batch; about
    the group's fastest), then visit the groups fastest probe first: a group whose probe does
    not fit is probed with its :func:`leanest` candidate, and dropped only when that does not fit
    either (then none of it fits). The visit stops once ``width`` groups have a layout that fits
    no slower than the next group's probe; the options of those groups are evaluated
    (:func:`_expand`). So the beam keeps a layout that fits whenever the space has one.

    With an :class:`Evaluator` of several workers the probes run together, the visit's lean
    probes a few ahead (those the visit does not reach are dropped: the result is the same for
    any number of workers), and the expansion one variant of every option set at a time."""
    def strategy(cands: Sequence[Candidate], evaluate: Evaluate) -> list[LayoutEstimate]:
        many = _many(evaluate)
        ahead = max(1, getattr(evaluate, "jobs", 1))
        groups: dict = {}
        for c in cands:
            groups.setdefault((tuple(c.mesh.shape.items()), c.schedule, c.virtual), []).append(c)
        lean_of = {k: leanest(g) for k, g in groups.items()}
        results, probed, evaluated = [], {}, []

        def keep(k, c, e) -> LayoutEstimate | None:
            probed.setdefault(k, []).append(c)
            evaluated.append((c, e))
            if e is not None:
                results.append(e)
            return e
        keys = list(groups)
        first = [keep(k, groups[k][0], e) for k, e in zip(keys, many([groups[k][0] for k in keys]))]
        again = [k for k, e in zip(keys, first) if e is None and lean_of[k] is not groups[k][0]]
        lean = {k: keep(k, lean_of[k], e) for k, e in zip(again, many([lean_of[k] for k in again]))}
        order = []
        for k, e in zip(keys, first):
            e = e or lean.get(k)
            if e is not None:
                order.append((_time(e), k, e))
        order.sort(key=lambda r: r[0])

        def needs_lean(k, e) -> bool:
            return not e.settings.get("fits", True) and all(lean_of[k] is not p for p in probed[k])
        ranked: list = []
        ready: dict = {}                # group -> its lean probe, evaluated ahead of the visit
        for i, (bound, k, e) in enumerate(order):
            if len(ranked) >= width and sorted(ranked, key=lambda r: r[0])[width - 1][0] <= bound:
                break
            if not e.settings.get("fits", True):
                if needs_lean(k, e):
                    if k not in ready:
                        batch = [kk for _, kk, ee in order[i:] if kk not in ready and needs_lean(kk, ee)][:ahead]
                        ready.update(zip(batch, many([lean_of[kk] for kk in batch])))
                    e = keep(k, lean_of[k], ready.pop(k))
                else:
                    e = None
            if e is not None and e.settings.get("fits", True):
                ranked.append((_time(e), k))
        done = {id(c): e for c, e in evaluated}
        chosen = [groups[k] for _, k in sorted(ranked, key=lambda r: r[0])[:width]]
        results.extend(_expand(chosen, many, done))
        return results
    return strategy


def _expand(groups: Sequence[Sequence[Candidate]], many, done: dict) -> list[LayoutEstimate]:
    """Every option of the groups, except a memory lever's slower variants where a faster one
    already fits: for the same other options, more recomputation (none, selective, selective with
    every second matmul recomputed, whole layer), more micro-steps and more loss chunks (the head's
    fp32 gradient accumulator read and written once per chunk) only add time, so a variant is
    skipped when one with no more of any of them fits. ``done``: candidates already evaluated (id -> estimate). The option sets advance
    together, one variant each per call of ``many``."""
    bases: dict = {}
    for group in groups:
        for c in group:
            bases.setdefault(_without_levers(c), []).append(c)
    queues = [sorted(v, key=lambda c: (_REMAT_SAVING_ORDER[c.remat], c.grad_accum, _chunking(c)))
              for v in bases.values()]
    fitting: list[list[Candidate]] = [[] for _ in queues]
    at = [0] * len(queues)
    out = []

    def dominated(i: int, c: Candidate) -> bool:
        return any(_REMAT_SAVING_ORDER[f.remat] <= _REMAT_SAVING_ORDER[c.remat] and f.grad_accum <= c.grad_accum
                   and _chunking(f) <= _chunking(c) for f in fitting[i])

    def settle(i: int, c: Candidate, e) -> None:
        if e is not None and e.settings.get("fits", True):
            fitting[i].append(c)
    while True:
        batch = []
        for i, q in enumerate(queues):
            while at[i] < len(q) and (dominated(i, q[at[i]]) or id(q[at[i]]) in done):
                c = q[at[i]]
                if not dominated(i, c):
                    settle(i, c, done[id(c)])
                at[i] += 1
            if at[i] < len(q):
                batch.append(i)
        if not batch:
            return out
        for i, e in zip(batch, many([queues[i][at[i]] for i in batch])):
            if e is not None:
                out.append(e)
            settle(i, queues[i][at[i]], e)
            at[i] += 1


# recomputation: none, selective (every matmul kept), selective with every second matmul recomputed, whole layer
_REMAT_SAVING_ORDER = {False: 0, "selective": 1, "selective_alternate": 2, True: 3}


def _chunking(c: Candidate) -> int:
    """How far the loss-chunking lever is pulled: 0 for the whole logits, else the chunk count."""
    return c.loss_chunks or 0


def _without_levers(c: Candidate) -> tuple:
    return (tuple(c.mesh.shape.items()), repr(c.rules), c.options, c.precision, c.schedule, c.virtual)


class Ranking(list):
    """Ranked estimates (those within the memory limit first, fastest first), the rejected
    candidates with the reason, and the Pareto front."""

    def __init__(self, items, rejected, limit, cluster_name, tokens_per_step: int = 0, devices: int = 1):
        super().__init__(items)
        self.rejected: list[tuple[str, str]] = rejected
        self.memory_limit_bytes = limit
        self.cluster = cluster_name
        self.tokens_per_step = tokens_per_step
        self.devices = devices

    def tokens_per_s_per_device(self, e: LayoutEstimate) -> float:
        """Predicted training throughput of ``e``: tokens per second per device."""
        return self.tokens_per_step / (_time(e) * self.devices) if e.time is not None and _time(e) > 0 else 0.0

    def fitting(self) -> list[LayoutEstimate]:
        """The layouts within the memory limit, best first."""
        return [e for e in self if _fits(e, self.memory_limit_bytes)]

    def pareto(self) -> list[LayoutEstimate]:
        """Layouts no other layout beats on both step time and peak memory."""
        front, best_mem = [], float("inf")
        for e in sorted(self, key=lambda e: (_time(e), e.peak_bytes)):
            if e.peak_bytes < best_mem:
                front.append(e)
                best_mem = e.peak_bytes
        return front

    def table(self, top: int | None = 20) -> str:
        return table(self[:top] if top else list(self), self.memory_limit_bytes, set(map(id, self.pareto())),
                     self.tokens_per_step, self.devices)

    def to_json(self) -> str:
        """The ranking, the Pareto front and the rejected candidates as JSON."""
        pareto = set(map(id, self.pareto()))
        rows = [dict(e.row(), rank=i + 1, fits=_fits(e, self.memory_limit_bytes), pareto=id(e) in pareto,
                     tokens_per_s_per_device=self.tokens_per_s_per_device(e)) for i, e in enumerate(self)]
        return json.dumps({"cluster": self.cluster, "memory_limit_GB": (self.memory_limit_bytes or 0) / 1e9,
                           "memory_limit_GiB": (self.memory_limit_bytes or 0) / GIB,
                           "layouts": rows, "rejected": [{"layout": m, "why": w} for m, w in self.rejected]},
                          indent=1, default=str)


def _time(e: LayoutEstimate) -> float:
    return e.time.step_s if e.time is not None else e.comm_time_s or e.comm_bytes


def _fits(e: LayoutEstimate, limit) -> bool:
    """Within the device's memory: what the caching allocator reserves (the peak and its
    rounding and cached blocks, plan/allocator.py), which is what runs out."""
    return limit is None or e.reserved_bytes <= limit


def search(loss_fn: Callable, decls: Any, n_devices: int, batch: BatchSpec, *,
           cluster: "Cluster | str | None" = "h100x8", space: Space | None = None,
           rules_for: Callable[[Mesh], Rules] | None = None, meshes: Iterable[Mesh] | None = None,
           memory_limit_bytes: float | None = None, strategy=None, cost_model=cost,
           bandwidth=None, options: dict | None = None, precision: str | None = None,
           progress: Callable[[int, int, str], None] | None = None, trainable: Any = None,
           pp_fsdp_gather: str = "step", optimizer: Any = None, compiled: bool = False,
           amend: Callable[[LayoutEstimate], None] | None = None, tokens_per_step: int | None = None,
           float8: bool = False, jobs: int | None = 1,
           loss_for: Callable[[int], Callable] | None = None) -> Ranking:
    """Estimate and cost candidate layouts of ``n_devices`` and rank them: those within the
    memory limit (default: the cluster's device memory) first, by step time, then memory.

    Candidates come from ``space`` (meshes x orders x FSDP axes x SP x CP mode x remat x
    keep_gathered x grad accumulation), or, with ``rules_for``, the meshes (``meshes`` or all
    factorizations) under ``rules_for(mesh)``. Layouts that cannot divide the model or the
    batch are rejected with the reason (``Ranking.rejected``). ``strategy``: ``exhaustive``
    (default up to 400 candidates) or ``beam(width)``; ``cost_model(estimate, cluster)``
    returns a StepTime. ``progress(i, n, layout)`` is called as each estimate is done. ``trainable``:
    the step's mask (:func:`estimate`'s; adapters, frozen or quantized bases), for every layout;
    ``pp_fsdp_gather``: FSDP under a pipeline gathers once per "step" or per "micro"-batch;
    ``optimizer``: the step's (default AdamW), whose state is part of the memory; ``compiled``:
    each layer compiled on its own (``estimate(compiled=True)``: what a compiled layer saves);
    ``amend(estimate)``: adds what the run holds beyond its step (an online run's rollout:
    app/report.py ``add_rollout``) before the layout is costed and fitted; ``tokens_per_step``:
    the tokens a step computes, for tokens/s (default: the first input's elements; a pair
    objective passes its chosen and rejected rows: app/row_tokens.py ``step_tokens``). ``float8``:
    each layout's memory with Float8 linear layers' buffers (``estimate(float8=True)``; the
    ``cost_model`` costs their time, e.g. ``functools.partial(cost, float8=True)``); ``jobs``:
    worker processes that run the dry-runs (None: one per core; plan/workers.py), the ranking the
    same for any number. ``loss_for(chunks)``: the loss with the LM head and cross-entropy over
    ``chunks`` token chunks (the model config's ``loss_chunks`` set), for the chunk counts of
    ``space.loss_chunks`` (a candidate without chunking runs ``loss_fn``); without it the lever is
    not searched (``space.loss_chunks`` must then be ``(None,)``)."""
    cl = as_cluster(cluster) if cluster is not None else None
    limit = memory_limit_bytes if memory_limit_bytes is not None else (cl.memory_bytes if cl else None)
    space = space or Space(precision=precision or "bf16")
    if rules_for is not None:
        cands = [Candidate(m, rules_for(m), "", tuple(sorted((options or {}).items())), precision or "fp32")
                 for m in (meshes if meshes is not None else _meshes(n_devices, space))]
    else:
        cands = candidates(n_devices, space, cl or as_cluster("h100x8"), rows=_rows(batch))
    losses = _chunked_losses(loss_fn, loss_for, {c.loss_chunks for c in cands})
    rejected: list[tuple[str, str]] = []

    def one(c: Candidate) -> tuple[LayoutEstimate | None, tuple[str, str] | None]:
        try:
            e = estimate(losses[c.loss_chunks], decls, c.mesh, c.rules, batch, options=dict(c.options), precision=c.precision,
                         grad_accum=c.grad_accum, remat=c.remat, bandwidth=bandwidth, timeline=False,
                         label=c.label, schedule=c.schedule, virtual_stages=c.virtual, trainable=trainable,
                         pp_fsdp_gather=pp_fsdp_gather, optimizer=optimizer, compiled=compiled, float8=float8)
        except Exception as exc:   # noqa: BLE001 - an impossible layout is a result, not a failure
            cause = getattr(exc, "original", exc)
            return None, (_name(c), f"{type(cause).__name__}: {cause}".splitlines()[0])
        if c.loss_chunks is not None:
            e.settings["loss_chunks"] = c.loss_chunks
        if amend is not None:
            amend(e)
        if cl is not None:
            e.time = cost_model(e, cl)
        e.settings["fits"] = _fits(e, limit)
        return e, None
    with _fewer_collections(), Pool(one, jobs) as pool:
        evaluate = Evaluator(pool, len(cands), rejected, progress)
        strategy = strategy or (exhaustive if len(cands) <= 400 else beam(4))
        results = strategy(cands, evaluate)
    results.sort(key=lambda e: (not _fits(e, limit), _time(e), e.peak_bytes))
    if results:
        results[0].notes.extend(f"skipped {m}: {why}" for m, why in rejected)
    tokens = (tokens_per_step if tokens_per_step is not None
              else math.prod(next(iter(batch.values()))[0]) if batch else 0)
    return Ranking(results, rejected, limit, cl.name if cl else None, tokens_per_step=tokens, devices=n_devices)


def _chunked_losses(loss_fn: Callable, loss_for, chunk_counts) -> dict:
    """chunk count -> the loss a candidate with it runs (None: ``loss_fn``), each built once."""
    wanted = sorted(k for k in chunk_counts if k is not None)
    bad = [k for k in wanted if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if bad:
        raise ValueError(f"plan.search: Space.loss_chunks holds {bad}: give token chunk counts >= 1, or None "
                         f"for the whole logits")
    if wanted and loss_for is None:
        raise ValueError(f"plan.search: Space.loss_chunks searches {wanted} token chunks of the LM head and loss, "
                         f"but no loss_for(chunks) was given to build that loss: pass loss_for (e.g. "
                         f"lambda n: functools.partial(llama.loss, cfg=dataclasses.replace(cfg, loss_chunks=n))) "
                         f"or leave Space.loss_chunks at (None,)")
    return {None: loss_fn, **{k: loss_for(k) for k in wanted}}


@contextlib.contextmanager
def _fewer_collections(young: int = 50_000):
    """Python's cyclic collector less often while dry-runs make their millions of small objects
    (each op's records, meta tensors, references): the youngest generation collected every
    ``young`` allocations instead of 700, the older ones less often too (about a fifth of the
    64-GPU plan's time; docs/planning.md "Speed"; the workers inherit it)."""
    before = gc.get_threshold()
    gc.set_threshold(max(young, before[0]), max(20, before[1]), max(100, before[2]))
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _rows(batch: BatchSpec) -> int | None:
    """Sequences per step: the size of the inputs' ``batch`` dimension."""
    for shape, dims, *_ in batch.values():
        dims = dims.split() if isinstance(dims, str) else list(dims)
        if "batch" in dims:
            return shape[dims.index("batch")]
    return None


def _remat_label(remat: bool | str) -> list[str]:
    return {True: ["remat"]}.get(remat, [f"remat={remat}"] if isinstance(remat, str) else [])


def _name(c: Candidate) -> str:
    mesh = "x".join(f"{a}={s}" for a, s in c.mesh.shape.items() if s > 1) or "1 device"
    pipe = ([c.schedule] + ([f"v={c.virtual}"] if c.virtual > 1 else [])) if c.mesh.shape.get("pp", 1) > 1 else []
    return " ".join([mesh, c.label] + pipe + [f"{k}={v}" for k, v in c.options] + _remat_label(c.remat)
                    + ([f"grad_accum={c.grad_accum}"] if c.grad_accum > 1 else [])
                    + ([f"loss_chunks={c.loss_chunks}"] if c.loss_chunks else []))


GIB = 2 ** 30


def gib(n: float) -> str:
    """Bytes in GiB as ``validate`` prints them (two decimals)."""
    return f"{n / GIB:,.2f}"


def table(estimates: Sequence[LayoutEstimate], memory_limit_bytes: float | None = None,
          pareto: set | None = None, tokens_per_step: int = 0, devices: int = 1, width: int = 64) -> str:
    """A readable ranking: step time, tokens/s per device, MFU, exposed communication, peak
    memory and what the caching allocator reserves (what must fit), the activations held at the peak and the state in GiB, then the full layout name
    (wrapped at ``width`` characters)."""
    if not estimates:
        return "(no layout could be estimated)"
    head = (f"{'#':>3} {'step s':>8} {'tok/s/dev':>9} {'MFU':>5} {'exposed s':>9} {'peak GiB':>8} {'resv GiB':>8} "
            f"{'act GiB':>7} {'state GiB':>9}  layout")     # resv: reserved by the allocator; act: activations at the peak
    lines = [head, "-" * (len(head) + width - len("layout"))]
    indent = " " * (head.index("layout"))
    for i, e in enumerate(estimates):
        t = e.time
        note = []
        if not _fits(e, memory_limit_bytes):
            note.append("OVER MEMORY")
        if pareto and id(e) in pareto:
            note.append("pareto")
        if any(n.startswith("uneven work") for n in e.notes):
            note.append(f"uneven work: device {e.rank} estimated")
        tokens = tokens_per_step / (_time(e) * devices) if t is not None and _time(e) > 0 else 0.0
        name = textwrap.wrap(e.describe() + (f" ({', '.join(note)})" if note else ""), width,
                             break_on_hyphens=False) or [""]
        lines.append(f"{i + 1:>3} {_time(e):8.4g} {tokens:9,.0f} {(t.mfu if t else 0):5.2f} "
                     f"{(t.exposed_comm_s if t else 0):9.3g} {gib(e.peak_bytes):>8} {gib(e.reserved_bytes):>8} "
                     f"{gib(e.memory.get('activations', 0)):>7} "
                     f"{gib(e.state_bytes):>9}  {name[0]}")
        lines.extend(indent + rest for rest in name[1:])
    return "\n".join(lines)
