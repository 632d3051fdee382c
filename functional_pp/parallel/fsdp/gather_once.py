"""FSDP under a pipeline with the weights gathered once per step (``fsdp_gather="step"``,
docs/pipelines.md): a device's stages gather their FSDP units (one per layer, one for the held
parameters outside the layers) when the step starts, keep them gathered across every
micro-batch, accumulate the gradients unsharded, and reduce-scatter each unit once when the
schedule is done. The gathers and reduce-scatters are the units' own (``units.py``), so each
element is gathered and summed as in a step without pipeline; only their number changes: one
of each per unit and step instead of two gathers and one reduce-scatter per unit and
micro-batch (``fsdp_gather="micro"``).

Mechanism: FSDP (under a pipeline: weights gathered once per step; eager).
"""
from __future__ import annotations

import torch

from functional_pp.compile.recompute import backward_region
from functional_pp.parallel.buckets.pending import resolve_pending
from functional_pp.parallel.fsdp.units import gather_unit
from functional_pp.parallel.named import Named, configure

GATHER_POLICIES = ("step", "micro")


class GatheredOnce:
    """The gathered parameters of one step: ``full[i]`` for parameter ``i`` (a unit member),
    their accumulated gradients, and the units in gather order."""

    def __init__(self, named: list[Named], units: list[list[int]]):
        self.full: dict[int, Named] = {}
        self.units: list[list[int]] = []
        self._shards: dict[int, torch.Tensor] = {}
        self._grads: dict[int, torch.Tensor] = {}
        with configure(keep_gathered=True):        # held by this object, not re-gathered in backward
            for idx in units:
                (out,), _ = gather_unit((tuple(named[i] for i in idx),))
                members = [i for i, y in zip(idx, out) if y.data is not named[i].data]
                for i, y in zip(idx, out):
                    if i in members:
                        self.full[i], self._shards[i] = y, named[i].data
                if members:
                    self.units.append(members)

    def named(self, i: int, compute: torch.dtype | None) -> Named:
        """Parameter ``i`` gathered, cast to the compute precision."""
        y = self.full[i]
        return y.replace(data=y.data.to(compute)) if compute is not None and y.data.is_floating_point() else y

    def target(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's backward differentiates for parameter ``i``: its gathered value,
        or the shard itself when it is not gathered here."""
        return self.full[i].data if i in self.full else shard

    def accumulate(self, i: int, grad: torch.Tensor) -> bool:
        """Add a micro-batch's gradient of gathered parameter ``i`` (unsharded); False when ``i``
        is not gathered here (the caller accumulates it)."""
        if i not in self.full:
            return False
        self._grads[i] = grad if i not in self._grads else self._grads[i] + grad
        return True

    def reduce(self) -> dict[int, torch.Tensor]:
        """The shards' gradients: one reduce-scatter per unit (in gather order, alike on every
        device of the unit's group), from the gradients accumulated over the micro-batches."""
        out: dict[int, torch.Tensor] = {}
        for members in self.units:
            trains = [i for i in members if self.full[i].data.requires_grad]
            if not trains:
                continue
            fulls = [self.full[i].data for i in trains]
            sent = [self._grads.get(i, torch.zeros_like(f)) for i, f in zip(trains, fulls)]
            with backward_region():
                gs = resolve_pending(torch.autograd.grad(fulls, [self._shards[i] for i in trains], sent,
                                                         allow_unused=True))
            out.update({i: g for i, g in zip(trains, gs) if g is not None})
        self.full, self._grads = {}, {}
        return out
