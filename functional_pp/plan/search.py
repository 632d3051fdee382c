"""Search layouts: meshes x axis orders x rule sets x step options, pruned, costed, ranked,
with the Pareto front of (step time, memory) (docs/planning.md, "Search").

A strategy is a function ``(candidates, evaluate) -> results``: :func:`exhaustive` evaluates
all of them; :func:`beam` first ranks meshes with default options and expands only the best."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from functional_pp.core.layout import Rules, balanced, inherit
from functional_pp.core.mesh import DEFAULT_AXES, Mesh
from functional_pp.plan.cluster import Cluster
from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.dryrun import BatchSpec, LayoutEstimate, estimate
from functional_pp.plan.timing import cost


@dataclass(frozen=True)
class Candidate:
    """One layout to try: a mesh (its order places axes on nodes), rules and step options."""
    mesh: Mesh
    rules: Rules
    label: str = ""
    options: tuple = ()          # ((name, value), ...): keep_gathered, cp_attention
    precision: str = "bf16"
    grad_accum: int = 1
    remat: bool | str = False    # False, True or "selective"
    schedule: str = "1f1b"       # pipeline schedule (pp > 1); grad_accum is its micro-batches
    virtual: int = 1             # model chunks per device (interleaved_1f1b)

    def __hash__(self):
        return hash((tuple(self.mesh.shape.items()), repr(self.rules), self.options, self.precision,
                     self.grad_accum, self.remat, self.schedule, self.virtual))


@dataclass
class Space:
    """What to search. ``fsdp``: which axis groups to shard parameters over (names from
    ``("dp_shard",)``, ``("dp_shard", "cp")``, ``()`` = no FSDP); ``orders``: "default"
    (``dp_replicate, dp_shard, cp, tp``: tp innermost) or "all" (every order that places the
    axes on nodes differently). ``pp``: pipeline sizes, each with ``schedules`` (interleaved
    with each of ``virtual_stages``) and ``micro_batches``; ``ep``: expert-parallel sizes."""
    axes: Sequence[str] = DEFAULT_AXES
    fsdp: Sequence[tuple[str, ...]] = (("dp_shard", "cp"), ("dp_shard",), ())
    sequence_parallel: Sequence[bool] = (True, False)
    regather_activations: Sequence[bool] = (False, True)   # with SP: Megatron's re-gather in backward
    cp_attention: Sequence[str] = ("ring", "allgather")
    remat: Sequence[bool | str] = (False, True)   # add "selective" to rank selective checkpointing too
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
    return Rules(rules)


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


def _pipelines(mesh: Mesh, space: Space) -> list[tuple[str, int, int | None]]:
    """(schedule, virtual stages, micro-batches) of a mesh: one no-pipeline entry without pp."""
    p = mesh.shape.get("pp", 1)
    if p == 1:
        return [("1f1b", 1, None)]
    micro = space.micro_batches or (p,)
    return [(s, v, m) for s in space.schedules for v in (space.virtual_stages if s == "interleaved_1f1b" else (1,))
            for m in micro]


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


def candidates(n_devices: int, space: Space, cl: Cluster) -> list[Candidate]:
    """Every candidate of ``space`` on ``n_devices``, without duplicates that differ only in
    names (a dp_shard axis without FSDP is dp_replicate) or in options that do nothing there
    (SP without tp, CP modes without cp, keep_gathered without FSDP)."""
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
                                        space.keep_gathered if fsdp else (False,), space.remat, space.grad_accum,
                                        _orders(mesh, space.orders, cl), _pipelines(mesh, space))
            for sp, regather, cpa, keep, remat, ga, ordered, (schedule, virtual, micro) in choices:
                if regather and not sp:
                    continue
                label = (f"fsdp={'+'.join(fsdp)}" if fsdp else "no-fsdp") + (" sp" if sp else "")
                opts = ((("cp_attention", cpa),) if cp else ()) + ((("keep_gathered", True),) if keep else ()) \
                    + ((("regather_activations", True),) if regather else ())
                rules = standard_rules(fsdp, sp, pp=s.get("pp", 1) > 1, ep=s.get("ep", 1) > 1)
                c = Candidate(ordered, rules, label, opts, space.precision, micro or ga, remat, schedule, virtual)
                if hash(c) not in seen:
                    seen.add(hash(c))
                    out.append(c)
    return out


Evaluate = Callable[[Candidate], "LayoutEstimate | None"]


def exhaustive(cands: Sequence[Candidate], evaluate: Evaluate) -> list[LayoutEstimate]:
    """Evaluate every candidate."""
    return [e for e in map(evaluate, cands) if e is not None]


def beam(width: int = 4) -> Callable[[Sequence[Candidate], Evaluate], list[LayoutEstimate]]:
    """Rank the meshes (shape and order) with each one's first candidate (default options),
    then evaluate every option of the ``width`` best meshes."""
    def strategy(cands: Sequence[Candidate], evaluate: Evaluate) -> list[LayoutEstimate]:
        groups: dict = {}
        for c in cands:
            groups.setdefault(tuple(c.mesh.shape.items()), []).append(c)
        first = [(k, evaluate(g[0])) for k, g in groups.items()]
        ok = sorted((e.time.step_s if e.time else e.comm_bytes, k) for k, e in first
                    if e is not None and e.settings.get("fits", True))
        results = [e for _, e in first if e is not None]
        for _, k in ok[:width]:
            results.extend(e for e in map(evaluate, groups[k][1:]) if e is not None)
        return results
    return strategy


class Ranking(list):
    """Ranked estimates (those within the memory limit first, fastest first), the rejected
    candidates with the reason, and the Pareto front."""

    def __init__(self, items, rejected, limit, cluster_name):
        super().__init__(items)
        self.rejected: list[tuple[str, str]] = rejected
        self.memory_limit_bytes = limit
        self.cluster = cluster_name

    def pareto(self) -> list[LayoutEstimate]:
        """Layouts no other layout beats on both step time and peak memory."""
        front, best_mem = [], float("inf")
        for e in sorted(self, key=lambda e: (_time(e), e.peak_bytes)):
            if e.peak_bytes < best_mem:
                front.append(e)
                best_mem = e.peak_bytes
        return front

    def table(self, top: int | None = 20) -> str:
        return table(self[:top] if top else list(self), self.memory_limit_bytes, set(map(id, self.pareto())))

    def to_json(self) -> str:
        """The ranking, the Pareto front and the rejected candidates as JSON."""
        pareto = set(map(id, self.pareto()))
        rows = [dict(e.row(), rank=i + 1, fits=_fits(e, self.memory_limit_bytes), pareto=id(e) in pareto)
                for i, e in enumerate(self)]
        return json.dumps({"cluster": self.cluster, "memory_limit_GB": (self.memory_limit_bytes or 0) / 1e9,
                           "layouts": rows, "rejected": [{"layout": m, "why": w} for m, w in self.rejected]},
                          indent=1, default=str)


def _time(e: LayoutEstimate) -> float:
    return e.time.step_s if e.time is not None else e.comm_time_s or e.comm_bytes


def _fits(e: LayoutEstimate, limit) -> bool:
    return limit is None or e.peak_bytes <= limit


def search(loss_fn: Callable, decls: Any, n_devices: int, batch: BatchSpec, *,
           cluster: "Cluster | str | None" = "h100x8", space: Space | None = None,
           rules_for: Callable[[Mesh], Rules] | None = None, meshes: Iterable[Mesh] | None = None,
           memory_limit_bytes: float | None = None, strategy=None, cost_model=cost,
           bandwidth=None, options: dict | None = None, precision: str | None = None,
           progress: Callable[[int, int, str], None] | None = None, trainable: Any = None,
           pp_fsdp_gather: str = "step") -> Ranking:
    """Estimate and cost candidate layouts of ``n_devices`` and rank them: those within the
    memory limit (default: the cluster's device memory) first, by step time, then memory.

    Candidates come from ``space`` (meshes x orders x FSDP axes x SP x CP mode x remat x
    keep_gathered x grad accumulation), or, with ``rules_for``, the meshes (``meshes`` or all
    factorizations) under ``rules_for(mesh)``. Layouts that cannot divide the model or the
    batch are rejected with the reason (``Ranking.rejected``). ``strategy``: ``exhaustive``
    (default up to 400 candidates) or ``beam(width)``; ``cost_model(estimate, cluster)``
    returns a StepTime. ``progress(i, n, layout)`` is called before each estimate. ``trainable``:
    the step's mask (:func:`estimate`'s; adapters, frozen or quantized bases), for every layout;
    ``pp_fsdp_gather``: FSDP under a pipeline gathers once per "step" or per "micro"-batch."""
    cl = as_cluster(cluster) if cluster is not None else None
    limit = memory_limit_bytes if memory_limit_bytes is not None else (cl.memory_bytes if cl else None)
    space = space or Space(precision=precision or "bf16")
    if rules_for is not None:
        cands = [Candidate(m, rules_for(m), "", tuple(sorted((options or {}).items())), precision or "fp32")
                 for m in (meshes if meshes is not None else _meshes(n_devices, space))]
    else:
        cands = candidates(n_devices, space, cl or as_cluster("h100x8"))
    rejected: list[tuple[str, str]] = []
    counter = itertools.count()

    def evaluate(c: Candidate) -> LayoutEstimate | None:
        name = _name(c)
        if progress is not None:
            progress(next(counter), len(cands), name)
        try:
            e = estimate(loss_fn, decls, c.mesh, c.rules, batch, options=dict(c.options), precision=c.precision,
                         grad_accum=c.grad_accum, remat=c.remat, bandwidth=bandwidth, timeline=False,
                         label=c.label, schedule=c.schedule, virtual_stages=c.virtual, trainable=trainable,
                         pp_fsdp_gather=pp_fsdp_gather)
        except Exception as exc:   # noqa: BLE001 - an impossible layout is a result, not a failure
            cause = getattr(exc, "original", exc)
            rejected.append((name, f"{type(cause).__name__}: {cause}".splitlines()[0]))
            return None
        if cl is not None:
            e.time = cost_model(e, cl)
        e.settings["fits"] = _fits(e, limit)
        return e
    strategy = strategy or (exhaustive if len(cands) <= 400 else beam(4))
    results = strategy(cands, evaluate)
    results.sort(key=lambda e: (not _fits(e, limit), _time(e), e.peak_bytes))
    if results:
        results[0].notes.extend(f"skipped {m}: {why}" for m, why in rejected)
    return Ranking(results, rejected, limit, cl.name if cl else None)


def _remat_label(remat: bool | str) -> list[str]:
    return {True: ["remat"], "selective": ["remat=selective"]}.get(remat, [])


def _name(c: Candidate) -> str:
    mesh = "x".join(f"{a}={s}" for a, s in c.mesh.shape.items() if s > 1) or "1 device"
    pipe = ([c.schedule] + ([f"v={c.virtual}"] if c.virtual > 1 else [])) if c.mesh.shape.get("pp", 1) > 1 else []
    return " ".join([mesh, c.label] + pipe + [f"{k}={v}" for k, v in c.options] + _remat_label(c.remat)
                    + ([f"grad_accum={c.grad_accum}"] if c.grad_accum > 1 else []))


def table(estimates: Sequence[LayoutEstimate], memory_limit_bytes: float | None = None,
          pareto: set | None = None) -> str:
    """A readable ranking: step time, MFU, exposed communication, peak memory and its parts."""
    if not estimates:
        return "(no layout fits)"
    head = (f"{'#':>3} {'layout':<66} {'step s':>8} {'MFU':>5} {'exposed s':>9} {'comm GB':>8} "
            f"{'peak GB':>8} {'act GB':>7} {'state GB':>8}  note")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates):
        t = e.time
        note = []
        if memory_limit_bytes is not None and e.peak_bytes > memory_limit_bytes:
            note.append("over memory")
        if pareto and id(e) in pareto:
            note.append("pareto")
        if any(n.startswith("uneven work") for n in e.notes):
            note.append(f"uneven work: device {e.rank} estimated")
        step = f"{t.step_s:8.4g}" if t else f"{e.comm_time_s:8.4g}"
        lines.append(f"{i + 1:>3} {e.describe()[:66]:<66} {step} {(t.mfu if t else 0):5.2f} "
                     f"{(t.exposed_comm_s if t else 0):9.3g} {e.comm_bytes / 1e9:8.4g} {e.peak_bytes / 1e9:8.4g} "
                     f"{e.activation_bytes / 1e9:7.3g} {e.state_bytes / 1e9:8.4g}  {', '.join(note)}")
    return "\n".join(lines)
