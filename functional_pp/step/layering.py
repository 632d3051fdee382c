"""What a training step learns about the model's layers under FSDP units: whether its forward
calls ``functional_pp.layer`` (the units and the root kept gathered follow from it), the
units' forward order for prefetch, and the one warning for a model without layers.

Until a forward has shown whether the model calls ``fpp.layer``, the root is kept only from
the first layer call on: a model without layers is ZeRO-3 from its first step
(docs/memory.md, parallel/fsdp/units.py).
"""
from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Iterator

from functional_pp.core.policy import Policy
from functional_pp.parallel.fsdp.order import UnitOrder
from functional_pp.parallel.fsdp.units import fsdp_units

__all__ = ["NoLayerWarning", "LayerUse"]


class NoLayerWarning(UserWarning):
    """An FSDP model declared no ``functional_pp.layer``: each weight is gathered on its own."""


class LayerUse:
    """Per step (shared by its device threads): whether a forward called ``fpp.layer``
    (``layered``) or ran under FSDP units without any (``no_layers``: said once with a
    :class:`NoLayerWarning`), and the units' forward order (parallel/fsdp/order.py)."""

    def __init__(self) -> None:
        self.order = UnitOrder()        # FSDP units' forward order, for prefetch
        self.no_layers = False          # a forward called no fpp.layer: no root kept
        self.layered = False            # a forward called fpp.layer: the root is kept from the start
        self._lock = threading.Lock()

    @contextmanager
    def units(self, policy: Policy, layer_compile: object, data_dims: tuple[str, ...],
              stacklevel: int) -> Iterator[None]:
        """FSDP units for a step's block under ``policy`` (compile="per_layer" gathers inside each
        compiled layer, per weight: nothing is root there), learning from what the block's
        forward called. ``stacklevel``: the warning's (``warnings.warn``'s, from the warning's frame)."""
        keep_root = policy.fsdp_keep_root and not layer_compile and not self.no_layers
        with fsdp_units(policy.fsdp_units, keep_root=keep_root, prefetch=policy.fsdp_prefetch,
                        order=self.order, provisional_root=not self.layered,
                        data_dims=data_dims, in_flight=policy.collectives_in_flight) as seen:
            yield
        if seen.layered:
            self.layered = True
        elif seen.root_without_layers and policy.fsdp_units:
            self._root_had_no_layers(stacklevel)

    def _root_had_no_layers(self, stacklevel: int) -> None:
        """The forward called no ``fpp.layer`` under FSDP: every weight is a root weight. Say so
        once; every step (the first included) re-gathers each weight in backward (ZeRO-3 per
        weight)."""
        with self._lock:
            if self.no_layers:
                return
            self.no_layers = True
        warnings.warn(
            "train_step: the model calls no functional_pp.layer, so under FSDP every sharded weight is "
            "all-gathered per weight by the op that uses it and all-gathered again in backward (ZeRO-3, "
            "from the first step on): correct, with ZeRO-3's memory, but in many small collectives that "
            "cannot be prefetched. Wrap the model's repeated block in functional_pp.layer to gather each "
            "layer's weights as one unit (one flat all-gather, prefetched while the layer before computes).",
            NoLayerWarning, stacklevel=stacklevel)
