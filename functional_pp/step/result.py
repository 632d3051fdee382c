"""What a training step's device function returns, by name (eager, compiled or traced alike)."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


class DeviceStepResult(NamedTuple):
    """The device function's result: the new state, the metrics still on the device, and what
    the host needs to finish the step (docs/architecture.md, "The step"). A named tuple, so a
    compiled or natively traced step returns it as it returns a tuple."""

    params: Any
    """The new master parameters (the tensors passed in when ``written``)."""
    opt_state: Any
    """The new optimizer state."""
    step: torch.Tensor
    """The step counter after this step."""
    skipped: torch.Tensor
    """The count of skipped (non-finite) steps after this step."""
    metrics: dict
    """Loss, gradient norm, learning rate, tokens and flags, as device tensors."""
    written: bool
    """The update was written into the state passed in (a donated state)."""
    peaks: list | None
    """A compiled donated step's carried peaks of the update bound's terms."""
