"""Export what a dry-run saw (docs/planning.md, "Trace"): every collective with its op,
phase, layer, mesh axes, group size and bytes; every tensor saved for backward with its op
and layer; the memory timeline. Runs with repeated layers hold layers 0 and 1 only: layer 1
stands for each of layers 1..L-1."""
from __future__ import annotations

import json
from dataclasses import asdict

from functional_pp.plan.dryrun import LayoutEstimate


def trace(est: LayoutEstimate) -> dict:
    """The trace of ``est``'s most complete run as plain data (JSON-ready)."""
    run = est.runs[-1]
    return {
        "mesh": dict(est.mesh.shape), "rules": repr(est.rules), "settings": dict(est.settings),
        "device": est.rank, "notes": list(est.notes),
        "layers_in_model": est.layers,
        "layers_in_run": (est.layer_runs[-1] if est.layer_runs else 2 if len(est.runs) == 2 else est.layers),
        "repeats": ("the first n layers for n in %s, weighted" % (est.layer_runs,) if est.layer_runs else
                    "layer 1 stands for layers 1..L-1" if len(est.runs) == 2 else "whole model"),
        "collectives": [asdict(e) for e in run.events],
        "saved": [asdict(s) for s in run.saved],
        "memory_timeline": [{"op_index": i, "op": op, "phase": ph, "layer": layer, "live_bytes": live}
                            for i, op, ph, layer, live in run.timeline],
        "peak": {"bytes": run.peak_bytes, "at": run.peak_at, "by_category": run.peak_breakdown},
        "flops": dict(run.flops),
    }


def write_trace(est: LayoutEstimate, path: str) -> None:
    """Write :func:`trace` as JSON."""
    with open(path, "w") as f:
        json.dump(trace(est), f, indent=1, default=str)
