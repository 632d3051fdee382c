"""Activation offloading (``train_step(activation_offloading=True)``, Axolotl's
``activation_offloading: true``; docs/memory.md "Activation offloading").

Inside a step's forward every tensor autograd saves for backward on a CUDA device (of at least
:data:`MIN_BYTES`) is copied to pinned host memory on a side stream, so the copy overlaps the
forward's compute and the device memory is reused once the copy is done; backward copies it
back when it needs it (on the compute stream, after the side stream's copy). The FSDP
re-gathering hooks hand the tensors they do not replace to this packer (core/saved_hooks.py),
so activations inside FSDP layers are offloaded too. Where the step does not compute on CUDA
(the CPU: host memory is its memory) it is a no-op, said once. Not offloaded: what a
checkpointed layer keeps (``remat``: torch's checkpoint hooks are innermost there) and tensors
smaller than :data:`MIN_BYTES` (a copy costs more than it saves)."""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

import torch

from functional_pp.core.saved_hooks import Packed, packing

MIN_BYTES = 1 << 20                 # smaller saved tensors stay on the device


class NotOffloadedWarning(UserWarning):
    """``activation_offloading`` asked where the step does not compute on CUDA: nothing moves."""


class _OnHost(Packed):
    """A saved tensor's pinned host copy: its copy finishes at ``done`` (an event of the side
    stream), and :meth:`restore` puts it back on ``device``."""

    __slots__ = ("host", "device", "done")

    def __init__(self, host: torch.Tensor, device: torch.device, done):
        self.host, self.device, self.done = host, device, done

    def restore(self) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return self.host.to(self.device, non_blocking=True)


class CudaMover:
    """Moves saved tensors of a CUDA device to pinned host memory on a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __call__(self, t: torch.Tensor) -> Packed:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))   # t is computed
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = self.stream.record_event()
        t.record_stream(self.stream)        # its memory is reused only after the copy
        return _OnHost(host, t.device, done)


@functools.lru_cache(maxsize=None)
def _cuda_mover(device: torch.device) -> CudaMover:
    return CudaMover(device)         # one side stream per device, for every step


def mover_for(device: torch.device) -> Callable[[torch.Tensor], Packed] | None:
    """The mover for saved tensors of a step computing on ``device``; None where there is
    nothing to offload (not CUDA)."""
    return _cuda_mover(device) if device.type == "cuda" else None


def _offloadable(t: torch.Tensor, device: torch.device) -> bool:
    return (t.device == device and t.is_contiguous() and t.layout == torch.strided
            and t.numel() * t.element_size() >= MIN_BYTES)


@contextmanager
def _offloaded(device: torch.device, move: Callable[[torch.Tensor], Packed]) -> Iterator[None]:
    def pack(t: torch.Tensor):
        return move(t) if _offloadable(t, device) else t
    with packing(pack):
        yield


def offloading(device: torch.device | None, said: list) -> ContextManager[None]:
    """The context of a step's forward that computes on ``device``: saved tensors offloaded
    where it is CUDA; elsewhere a no-op that warns once (``said``: the step's record that it did)."""
    move = mover_for(device) if device is not None else None
    if move is None:
        if not said:
            said.append(True)
            warnings.warn(f"train_step(activation_offloading=True): the step computes on {device}, whose saved "
                          f"activations are already in host memory; nothing is offloaded (it moves them off a "
                          f"CUDA device only)", NotOffloadedWarning, stacklevel=5)
        return nullcontext()
    return _offloaded(device, move)
