"""Whether a training state's parameters are finite, known without reading them (docs/optim.md
"Bound before the update").

AdamW's pre-update bound holds only for finite parameters. A step that writes into its state
writes finite parameters only (that is what the bound shows), so once a state's parameters
are known finite, the parameters the step returns are too. This remembers, per device thread,
the parameters a step returned (by identity and version counter) with their flag; a step given
exactly those tensors, unchanged since, uses the flag; any other state (the first step, a
loaded checkpoint, a state built or changed by hand) is read once (:func:`params_finite`, on
the device, no host read) and its flag carried on from there."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from .optim.bounds import params_finite
from .torch_private import version_counter


class KnownFinite:
    """The parameters last returned on each device thread and a 0-dim bool: whether they are
    all finite (on every device, each for its own shards)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def flag(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        """Whether ``leaves`` (a state's parameters) are finite: the remembered flag if they are
        the tensors remembered, unchanged; else read from them."""
        known = getattr(self._local, "known", None)
        if known is not None:
            refs, versions, flag = known
            if len(refs) == len(leaves) and all(
                    r() is x and version_counter(x) == v for r, v, x in zip(refs, versions, leaves)):
                return flag
        return params_finite(leaves)

    def remember(self, leaves: list[torch.Tensor], flag: Optional[torch.Tensor]) -> None:
        """After a step given parameters with ``flag``: ``leaves``, the parameters it returns,
        have the same flag (finite ones stay finite; a state with non-finite parameters is never
        written, only skipped). ``flag`` None: forget."""
        if flag is None:
            self._local.known = None
            return
        self._local.known = ([weakref.ref(x) for x in leaves], [version_counter(x) for x in leaves], flag)
