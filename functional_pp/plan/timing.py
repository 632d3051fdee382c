"""The time model: compute from the dry-run's FLOPs, every collective by alpha-beta on the
links it crosses, overlap of weight traffic with compute (docs/planning.md, "Time model").

A cost model is any function ``(LayoutEstimate, Cluster) -> StepTime``; :func:`cost` is the
default one, and :func:`fit_cluster` fits a cluster's constants to measured step times."""
from __future__ import annotations

from dataclasses import dataclass, field

from functional_pp.core.mesh import Mesh
from functional_pp.plan.cluster import Cluster
from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.tracker import DeviceRun, TaggedEvent


@dataclass
class StepTime:
    """Seconds of one step on one device, and how they add up."""
    step_s: float
    compute_s: float
    exposed_comm_s: float       # collectives on the critical path + weight traffic not hidden
    hidden_comm_s: float        # weight traffic hidden under compute
    update_s: float             # optimizer: memory-bound pass over the state
    mfu: float
    by_collective: dict[str, float] = field(default_factory=dict)   # "tp all_gather (intra)" -> seconds
    per_layer: dict[str, float] = field(default_factory=dict)       # one repeated layer: compute, critical, weight
    placement: dict[str, str] = field(default_factory=dict)

    def row(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "hidden_comm_s": self.hidden_comm_s, "update_s": self.update_s, "mfu": self.mfu,
                "by_collective": dict(self.by_collective), "per_layer": dict(self.per_layer),
                "placement": dict(self.placement)}


def event_seconds(e: TaggedEvent, mesh: Mesh, cl: Cluster) -> tuple[float, str]:
    link = cl.link(mesh, e.axes)
    return cl.collective_seconds(e.kind, e.bytes_sent, e.group_size, link), link[0]


def run_components(run: DeviceRun, mesh: Mesh, cl: Cluster, layer: int | None = "all") -> dict[str, float]:
    """Additive seconds of one run (so they extrapolate over layers): compute and
    communication per phase, split into critical-path and weight traffic, per collective."""
    rate = cl.peak_flops * cl.compute_efficiency
    out: dict[str, float] = {}

    def add(k, v):
        out[k] = out.get(k, 0.0) + v
    if layer == "all":
        for phase, f in run.flops.items():
            add(f"compute {phase}", f / rate)
        add("forward flops", run.flops.get("forward", 0.0))
    else:
        add("compute", run.flops_by_layer.get(layer, 0.0) / rate)
    for e in run.events:
        if layer != "all" and (e.layer != layer or e.phase == "update"):
            continue
        s, where = event_seconds(e, mesh, cl)
        kind = "weight" if e.weight_traffic else "critical"
        add(f"{kind} {e.phase}" if layer == "all" else kind, s)
        add(f"{'+'.join(e.axes)} {e.kind} ({where})", s)
    return out


def cost(est, cl: "Cluster | str") -> "StepTime":
    """Step time, MFU and breakdown of ``est`` (a LayoutEstimate) on cluster ``cl``:
    compute = FLOPs / (peak x efficiency); weight traffic (FSDP gathers, gradient
    reductions) hides under the compute of its phase; the other collectives (TP/SP/CP
    activations, loss sums) add to it; the update is a memory-bound pass over the state."""
    cl = as_cluster(cl)
    comps = [run_components(r, est.mesh, cl) for r in est.runs]
    keys = set().union(*comps)
    total = {k: est.extrapolate_values([c.get(k, 0.0) for c in comps]) for k in keys}
    compute = sum(v for k, v in total.items() if k.startswith("compute "))
    exposed = hidden = 0.0
    for phase in ("forward", "backward"):
        w = total.get(f"weight {phase}", 0.0)
        c = total.get(f"compute {phase}", 0.0)
        exposed += total.get(f"critical {phase}", 0.0) + max(0.0, w - c)
        hidden += min(w, c)
    exposed += total.get("critical update", 0.0) + total.get("weight update", 0.0)
    update = 3 * est.state_bytes / cl.memory_bandwidth        # read state and gradients, write state
    step = compute + exposed + update
    mfu = 3 * total.get("forward flops", 0.0) / (step * cl.peak_flops) if step > 0 else 0.0
    by_coll = {k: v for k, v in total.items() if "(" in k}
    per_layer = {}
    if est.layers > 1:
        last = est.runs[-1]
        layer = max((e for e in last.flops_by_layer if e is not None), default=None)
        if layer is not None:
            per_layer = run_components(last, est.mesh, cl, layer)
    return StepTime(step, compute, exposed, hidden, update, mfu, by_coll, per_layer, cl.placement(est.mesh))


def fit_cluster(base: "Cluster | str", samples: list[tuple[object, float]]) -> Cluster:
    """Fit ``base``'s compute efficiency and intra/inter-node bandwidths to measured step
    times: ``samples`` are (LayoutEstimate, measured seconds). Least squares on
    seconds = flops / (peak x eff) + intra bytes / intra_bw + inter bytes / inter_bw
    (latency and update terms kept from ``base``); a term no sample exercises keeps its
    value."""
    import torch
    cl = as_cluster(base)
    rows, ys = [], []
    for est, seconds in samples:
        parts = []
        for r in est.runs:
            a = b = c = 0.0
            for e in r.events:
                where, _, lat = cl.link(est.mesh, e.axes)
                fixed_e = cl.collective_seconds(e.kind, 0, e.group_size, (where, 1.0, lat))
                if where == "intra":
                    a += e.bytes_sent
                else:
                    b += e.bytes_sent
                c += fixed_e
            parts.append((sum(r.flops.values()), a, b, c))
        flops, intra, inter, fixed = (est.extrapolate_values([p[i] for p in parts]) for i in range(4))
        fixed += 3 * est.state_bytes / cl.memory_bandwidth
        rows.append([flops, intra, inter])
        ys.append(seconds - fixed)
    A = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    used = [j for j in range(3) if A[:, j].abs().sum() > 0]
    sol = torch.linalg.lstsq(A[:, used], y.unsqueeze(1)).solution.squeeze(1)
    coef = dict(zip(used, sol.tolist()))
    kw = {}
    if 0 in coef and coef[0] > 0:
        kw["compute_efficiency"] = 1.0 / (coef[0] * cl.peak_flops)
    if 1 in coef and coef[1] > 0:
        kw["intra_bandwidth"] = 1.0 / coef[1]
    if 2 in coef and coef[2] > 0:
        kw["inter_bandwidth"] = 1.0 / coef[2]
    return cl.with_(name=f"{cl.name} (fitted)", **kw)
