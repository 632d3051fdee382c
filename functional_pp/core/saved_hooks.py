"""Saved-tensor hooks that compose. torch applies only the innermost ``saved_tensors_hooks``
block; the package's own hooks (FSDP re-gathering: parallel/fsdp/regather.py, parallel/fsdp/units.py)
replace the tensors they know and hand every other one to the enclosing :func:`packing` block
(activation offloading, step/activation_offload.py) with :func:`pack_other`. What a packer
returns carries its own way back (a :class:`Packed`), so any unpack hook restores it with
:func:`unpack_other`, on whatever thread backward runs."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from functional_pp.core.runtime import per_thread

_local = per_thread("core.saved_hooks")


class Packed:
    """A saved tensor kept elsewhere; :meth:`restore` gives it back for backward."""

    def restore(self) -> torch.Tensor:
        raise NotImplementedError


def pack_other(t: torch.Tensor) -> Any:
    """``t`` packed by the enclosing :func:`packing` block of this thread (``t`` itself outside one)."""
    pack = getattr(_local, "pack", None)
    return t if pack is None else pack(t)


def unpack_other(p: Any) -> Any:
    """A saved value back: a :class:`Packed` restored, anything else as it is."""
    return p.restore() if isinstance(p, Packed) else p


@contextmanager
def packing(pack: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """Save tensors for backward through ``pack`` (returning the tensor or a :class:`Packed`)
    inside the block, also those the package's inner hooks do not replace."""
    previous = getattr(_local, "pack", None)
    _local.pack = pack
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack_other):
            yield
    finally:
        _local.pack = previous
