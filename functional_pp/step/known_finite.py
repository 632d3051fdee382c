"""What a training step knows about the state it returned, carried to the next step without
reading that state again (docs/optim.md "Bound before the update", "Peaks carried instead of
read"): whether the parameters are finite, and a bound of each leaf's first-moment peak.

AdamW's pre-update bound holds only for finite parameters. A step that writes into its state
writes finite parameters only (that is what the bound shows), so once a state's parameters
are known finite, the parameters the step returns are too. Likewise the bound needs each
first moment's largest magnitude, which the step advances analytically from the gradients'
norms. Each value is remembered, per device thread, with the tensors it is about (by identity
and version counter); a step given exactly those tensors, unchanged since, uses it; any other
state (the first step, a loaded checkpoint, a state built or changed by hand, the new buffers of
a held step made again) is read once on the device (no host read) and its value carried on.
:class:`DonatedBound` is the part a step is built with: the bound and both caches.

Mechanism: Optimizer update (what a donated step carries for the bound: finite parameters, first-moment peaks).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from functional_pp._torch import version_counter
from functional_pp.core.runtime import new_per_thread
from functional_pp.optim.bounds import UpdateBound, params_finite, term_peaks


class Remembered:
    """A value about some tensors, remembered per device thread with their identities and
    version counters (an in-place change of one, or another tensor, makes it unknown)."""

    def __init__(self) -> None:
        self._local = new_per_thread()

    def get(self, leaves: list[torch.Tensor], read: Callable[[list[torch.Tensor]], Any]) -> Any:
        """The value remembered for ``leaves`` if they are the tensors remembered, unchanged;
        else ``read(leaves)``."""
        known = getattr(self._local, "known", None)
        if known is not None:
            refs, versions, value = known
            if len(refs) == len(leaves) and all(
                    r() is x and version_counter(x) == v for r, v, x in zip(refs, versions, leaves)):
                return value
        return read(leaves)

    def remember(self, leaves: list[torch.Tensor], value: Any) -> None:
        """``value`` is about ``leaves`` as they are now. None: forget."""
        if value is None:
            self._local.known = None
            return
        self._local.known = ([weakref.ref(x) for x in leaves], [version_counter(x) for x in leaves], value)


class KnownFinite(Remembered):
    """The parameters last returned on each device thread and a 0-dim bool: whether they are
    all finite (on every device, each for its own shards)."""

    def flag(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        """Whether ``leaves`` (a state's parameters) are finite: the remembered flag if they are
        the tensors remembered, unchanged; else read from them."""
        return self.get(leaves, lambda xs: params_finite(xs))

    def remember(self, leaves: list[torch.Tensor], flag: Optional[torch.Tensor]) -> None:
        """After a step given parameters with ``flag``: ``leaves``, the parameters it returns,
        have the same flag (finite ones stay finite; a state with non-finite parameters is never
        written, only skipped). ``flag`` None: forget."""
        super().remember(leaves, flag)


class KnownPeaks(Remembered):
    """Per device thread, the bound terms (e.g. AdamW's first moments) a step last returned and,
    per parameter leaf, an upper bound of their largest magnitude on this device."""

    def peaks(self, bound: UpdateBound, opt_state: Any, params: Any) -> list[torch.Tensor]:
        """The carried peaks of ``bound``'s terms in this state if a step returned these very
        terms, unchanged since; else read from them (``optim.bounds.term_peaks``: exact)."""
        return self.get(_terms(bound, opt_state, params), lambda _: term_peaks(bound, opt_state, params))

    def remember_peaks(self, bound: UpdateBound, opt_state: Any, params: Any,
                       peaks: Optional[list[torch.Tensor]]) -> None:
        """``peaks`` bound the terms of this (returned) state; None: forget."""
        self.remember(_terms(bound, opt_state, params), peaks)


def _terms(bound: UpdateBound, opt_state: Any, params: Any) -> list[torch.Tensor]:
    return [t for ts in bound.terms(opt_state, params) for t in ts]


class DonatedBound:
    """A step's pre-update bound (``optim.update_bound``; only for a donated step) and what the
    step carries for it from one call to the next: whether the parameters are finite
    (:class:`KnownFinite`, where the bound needs finite parameters) and, for a compiled donated
    step, its terms' peaks (:class:`KnownPeaks`, where the bound carries them). Built once
    with the step; shared by its device threads (what it remembers is per thread)."""

    def __init__(self, optimizer: Any, donate_state: bool):
        from functional_pp import optim
        # the bound a donated step writes under (docs/optim.md "Bound before the update"), looked up once
        self.bound: UpdateBound | None = optim.update_bound(optimizer) if donate_state else None
        self.known_finite = KnownFinite()
        self.known_peaks = KnownPeaks()

    def params_finite(self, param_leaves: list[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where the bound needs finite parameters: whether ``param_leaves`` are (0-dim bool, read
        only for a state no step returned; docs/optim.md "Bound before the update"); else None."""
        if getattr(self.bound, "needs_finite_params", False):
            return self.known_finite.flag(param_leaves)
        return None

    def carried_peaks(self, opt_state: Any, trained_params: Any) -> tuple[Any, Optional[list[torch.Tensor]]]:
        """Where the bound carries its terms' peaks (AdamW's first moments) and ``opt_state``
        holds them: the bound and the peaks (remembered, or read on the device for a state no step
        returned; docs/optim.md "Peaks carried instead of read"); else (None, None)."""
        carried = getattr(self.bound, "carried", None)
        if carried is None or not carried.applies(opt_state):
            return None, None
        return self.bound, self.known_peaks.peaks(self.bound, opt_state, trained_params)

    def remember(self, param_leaves: list[torch.Tensor], finite: Optional[torch.Tensor], bound: Any,
                 opt_state: Any, trained_params: Any, peaks: Optional[list[torch.Tensor]]) -> None:
        """After a step: the parameters it returns (``param_leaves``) have the flag ``finite`` of
        those it was given; with a carrying ``bound`` (from :meth:`carried_peaks`), the returned
        ``opt_state``'s terms have ``peaks``."""
        self.known_finite.remember(param_leaves, finite)
        if bound is not None:
            self.known_peaks.remember_peaks(bound, opt_state, trained_params, peaks)
