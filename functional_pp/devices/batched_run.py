"""Batched simulation: ``launch(fn, mesh, simulate="batched")`` runs ``fn`` once for every
device of the mesh, each tensor holding all devices' blocks (devices/device_stack.py), the
collectives computed over the device dimension (devices/batched.py); docs/simulation.md,
"Batched simulation". ``mesh_view.per_device`` builds per-device inputs (data, parameters)
through :meth:`RunBackend.per_device`.

Values that wrap a device's block (named arrays) are stacked and split through
``devices/mesh_view.register_block_type``, which their module calls (this layer does not
import it). The layers above reach this module only through ``devices/mesh_view.py``.

Mechanism: Devices (batched simulator: one run over a device dimension).
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import DeviceContext, current_context, thread_context
from functional_pp.devices import \
    device_stack_ops  # noqa: F401 (installs the dispatch of the ops with rules of their own)
from functional_pp.devices.batched import BatchedBackend, BatchedRank
from functional_pp.devices.device_stack import DeviceStack, stack_blocks
from functional_pp.devices.mesh_view import block_type

__all__ = ["launch_batched", "stack_per_device", "as_device"]


class RunBackend(BatchedBackend):
    """A batched run's backend: the collectives over the device dimension (devices/batched.py)
    and the per-device calls ``devices/mesh_view.py`` asks it for."""

    def per_device(self, fn: Callable[[], Any]) -> Any:
        return stack_per_device(fn)

    def as_device(self, rank: int, fn: Callable[[], Any]) -> Any:
        return as_device(rank, fn)


class _OneDeviceOnly:
    """Backend of :func:`per_device`'s per-device calls: they run one device at a time."""

    name = "per_device"

    def __getattr__(self, name: str):
        raise RuntimeError(f"functional_pp.per_device: the function called a collective ({name}); it runs "
                           f"one device at a time and cannot communicate: build each device's own "
                           f"values there (data, parameter blocks) and communicate outside it")


def launch_batched(fn: Callable[[], Any], mesh: Mesh) -> list:
    """Run ``fn()`` once for all devices of ``mesh``; its result, per device, in rank order."""
    if current_context(required=False) is not None:
        raise RuntimeError("functional_pp.launch cannot be nested inside another launch")
    ctx = DeviceContext(mesh, BatchedRank(), RunBackend(mesh), simulated=True, batched=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as the threaded simulator: one intra-op thread
    try:
        with thread_context(ctx):
            result = fn()
    finally:
        torch.set_num_threads(threads)
    return [_block_of(result, r) for r in range(mesh.size)]


def stack_per_device(fn: Callable[[], Any]) -> Any:
    """``fn()`` called once per device of the running batched simulation (``mesh_view.per_device``),
    the results stacked into one value for all devices."""
    return _stack([as_device(rank, fn) for rank in range(current_context().mesh.size)])


def as_device(rank: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` as device ``rank`` of the running batched simulation: that device's integer rank
    and ``axis_index`` values, no collectives (one device's share of ``per_device``)."""
    ctx = current_context()
    one = DeviceContext(ctx.mesh, rank, _OneDeviceOnly(), simulated=True,
                        extras=ctx.extras.setdefault(("per_device", rank), {}))
    with thread_context(one):
        return fn()


def _is_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or block_type(type(x)) is not None


def _stack(results: list) -> Any:
    flat = [optree.tree_flatten(r, is_leaf=_is_leaf, none_is_leaf=True) for r in results]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat):
        if s != spec:
            raise ValueError(f"functional_pp.per_device: device {i} returned a value of another structure "
                             f"({s}) than device 0 ({spec})")
    out = []
    for j, first in enumerate(flat[0][0]):
        column = [leaves[j] for leaves, _ in flat]
        kind = block_type(type(first))
        if kind is not None:
            out.append(kind[1](first, _stacked([kind[0](x) for x in column])))
        elif isinstance(first, torch.Tensor):
            out.append(_stacked(column))
        else:
            if any(x != first for x in column[1:]):
                raise ValueError(f"functional_pp.per_device: devices returned different values {column[:4]} "
                                 f"for a leaf that is neither a tensor nor a named array; a batched run "
                                 f"holds only tensors per device")
            out.append(first)
    return optree.tree_unflatten(spec, out)


def _stacked(blocks: list[torch.Tensor]) -> DeviceStack:
    """The devices' ``blocks`` stacked; their device becomes the run's (``BatchedBackend.device``:
    where values made without an input, such as ``axis_index``, are made)."""
    current_context().backend.device = blocks[0].device
    return stack_blocks(blocks)


def _block_of(tree: Any, rank: int) -> Any:
    """Device ``rank``'s view of a batched run's result."""
    def one(x):
        kind = block_type(type(x))
        if kind is not None and type(kind[0](x)) is DeviceStack:
            return kind[1](x, kind[0](x).stacked[rank].clone())
        if type(x) is DeviceStack:
            return x.stacked[rank].clone()
        return x
    return optree.tree_map(one, tree, is_leaf=_is_leaf, none_is_leaf=True)
