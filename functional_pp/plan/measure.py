"""Measure a real step the way the dry-run estimates it: every device of a simulated mesh
trains one step on real CPU tensors while device ``rank``'s allocations, saved tensors and
collectives are recorded. The reference the estimates are tested against, and the input of
:func:`functional_pp.plan.timing.fit_cluster`."""
from __future__ import annotations

import time
from typing import Any, Callable

import optree
import torch

from functional_pp import optim
from functional_pp.core.comm import CommReport, comm_report
from functional_pp.core.layout import Rules, local_shape
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_rank
from functional_pp.core.tree import leaves_with_paths
from functional_pp.devices.launch import launch
from functional_pp.parallel.init import init
from functional_pp.parallel.named import configure
from functional_pp.parallel.shard_map import use_rules
from functional_pp.plan.dryrun import BatchSpec, Instrumented, batch_dims_of
from functional_pp.plan.tracker import DeviceRun, MemoryTracker
from functional_pp.step.train import PER_WEIGHT, train_step


def measure(loss_fn: Callable[[Any, dict], Any], decls: Any, mesh: Mesh, rules: Rules, batch: BatchSpec, *,
            options: dict | None = None, optimizer: optim.GradientTransformation | None = None,
            precision: str = "fp32", grad_accum: int = 1, remat: bool | str = False, repeated: str | None = "layers",
            rank: int = 0, seed: int = 0, trainable: Any = None,
            params: Callable[[], Any] | None = None) -> tuple[DeviceRun, CommReport, float]:
    """Run one real training step on simulated devices; returns device ``rank``'s recorded
    run, its communication report and the step's wall time in seconds. ``trainable``: the
    step's mask (frozen parameters); ``params()``: this device's named parameters (called on
    each simulated device; default: ``decls`` initialised from ``seed``), e.g. a quantized base."""
    options = dict(options or {})
    batch_dims = batch_dims_of(batch)                  # (a DPO step's pairs too)

    def device():
        loss = Instrumented(loss_fn, repeated)
        step = train_step(loss, optimizer or optim.adamw(1e-4), mesh=mesh, rules=rules, precision=precision,
                          grad_accum=grad_accum, remat=remat, trainable=trainable, batch_dims=batch_dims, **PER_WEIGHT)
        with use_rules(rules), configure(**options):
            state = step.init(params() if params is not None else init(lambda: decls, mesh=mesh, rules=rules, seed=seed))
            local = {}
            for key, (shape, dims, *dtype) in batch.items():
                dims = dims.split() if isinstance(dims, str) else list(dims)
                layout = rules.resolve(dims, shape, mesh, name=f"batch[{key!r}]")
                local[key] = torch.zeros(local_shape(shape, layout, mesh), dtype=(dtype or [torch.long])[0])
            me = current_rank() == rank
            masters = [x for _, x in leaves_with_paths(state["params"])]
            baseline = {"weights": sum(x.numel() * x.element_size() for x in masters),
                        "optimizer state": sum(x.numel() * x.element_size()
                                               for x in optree.tree_leaves(state["opt_state"], none_is_leaf=False)
                                               if isinstance(x, torch.Tensor))}
            tracker = MemoryTracker(baseline, masters, None, timeline=False) if me else None
            with comm_report() as rep:
                if tracker is not None:
                    loss.tracker = tracker
                    tracker._report = rep
                t0 = time.perf_counter()
                if tracker is not None:
                    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
                        step(state, local)
                else:
                    step(state, local)
                seconds = time.perf_counter() - t0
        return (tracker.run, rep, seconds) if me else None
    return launch(device, mesh)[rank]
