"""``DeviceStack``: one tensor per simulated device, held as one stacked tensor, so that every
op runs once for all devices (docs/simulation.md, "Batched simulation").

A ``DeviceStack`` looks like one device's tensor (its shape, dtype and strides are those of a
device's block); it holds the blocks of all N devices stacked along a leading dimension. Each
aten op on it runs as one op over that device dimension through functorch's batching rules
(the machinery of ``torch.vmap``), below autograd: autograd, custom autograd functions and
hooks see ordinary tensors and run once for all devices.

Ops functorch has no rule for (``out=``, ``_foreach_*``, fused optimizer kernels) and the
ones run directly on the stacked blocks (views, the CPU flash attention) are routed by
devices/device_stack_ops.py. What a batched run cannot do is refused with a clear error: reading a value to the host
(``.item()``, ``.tolist()``, ``bool(t)``) where the devices hold different values, random ops,
and writing per-device values into a tensor that is not a ``DeviceStack``.

Mechanism: Devices (batched simulator: the stacked per-device value).
"""
from __future__ import annotations

from typing import Any

import torch

from functional_pp._torch import (DISABLED_TORCH_FUNCTION, add_batch_dim, make_wrapper_subclass, remove_batch_dim,
                                  vmap_level)

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
               torch.ops.aten.is_nonzero.default}


def set_route(route) -> None:
    """Install ``route(func, args, kwargs)``, which runs every op on a ``DeviceStack`` (the host
    reads excepted); it ends in :func:`batched_call` for ops without a rule of their own."""
    global _route
    _route = route


class DevicesDisagree(RuntimeError):
    """A batched simulation read to the host a value that differs between devices."""


class DeviceStack(torch.Tensor):
    """The blocks of every simulated device as one tensor: ``stacked[r]`` is device r's block."""

    __slots__ = ("stacked",)
    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(cls, stacked: torch.Tensor, requires_grad: bool = False) -> "DeviceStack":
        out = make_wrapper_subclass(
            cls, stacked.shape[1:], strides=stacked.stride()[1:], dtype=stacked.dtype,
            device=stacked.device, layout=stacked.layout, requires_grad=requires_grad)
        out.stacked = stacked
        return out

    def __repr__(self) -> str:          # noqa: D105
        return f"DeviceStack({len(self.stacked)} devices, block shape {tuple(self.shape)}, {self.dtype})"

    def tolist(self):
        """The value as a Python list, if every device holds the same value."""
        return same_on_all_devices(self.stacked, "tolist()").tolist()

    def numpy(self, *args, **kwargs):
        """The value as a numpy array, if every device holds the same value."""
        return same_on_all_devices(self.stacked, "numpy()").numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            return _host_read(func, args, kwargs)
        return _route(func, args, kwargs)


def n_devices(args) -> int:
    for a in args:
        if type(a) is DeviceStack:
            return a.stacked.shape[0]
        if isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is DeviceStack:
                    return b.stacked.shape[0]
    raise AssertionError("no DeviceStack among the arguments")


def batched_call(func, args, kwargs):
    """``func`` run once for all devices by functorch's batching rule (the stacked blocks enter
    a vmap level as batched tensors, the op runs, its results leave it as ``DeviceStack``s)."""
    n = n_devices(list(args) + list(kwargs.values()))
    with vmap_level(n, "error") as level:
        inputs: dict[int, DeviceStack] = {}

        def unwrap(a):
            if type(a) is DeviceStack:
                b = add_batch_dim(a.stacked, level)
                inputs[id(b)] = (b, a)
                return b
            if isinstance(a, (list, tuple)) and a and any(type(x) is DeviceStack for x in a):
                return type(a)(unwrap(x) for x in a)
            return a

        b_args = tuple(unwrap(a) for a in args)
        b_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        try:
            result = func(*b_args, **b_kwargs)
        except RuntimeError as exc:
            if "called random operation while in randomness error mode" in str(exc):
                raise RuntimeError(f"batched simulation: {func} draws random numbers, which a batched "
                                   f"run does not simulate per device; use launch(simulate=True)") from exc
            raise

        def wrap(o):
            if isinstance(o, torch.Tensor):
                same = inputs.get(id(o))
                if same is not None and same[0] is o:
                    return same[1]          # an in-place op: the very tensor written
                return DeviceStack(remove_batch_dim(o, level, n))
            if isinstance(o, (list, tuple)):
                return type(o)(wrap(x) for x in o)
            return o
        return wrap(result)


def same_on_all_devices(stacked: torch.Tensor, what: str) -> torch.Tensor:
    """Device 0's block of ``stacked``, after checking every device holds the same (else a
    :class:`DevicesDisagree` naming ``what``)."""
    first = stacked[0]
    if stacked.shape[0] > 1 and not torch.equal(stacked, first.expand_as(stacked)):
        same = stacked == first
        if stacked.is_floating_point() or stacked.is_complex():    # NaN where device 0 has NaN: the same
            same |= stacked.isnan() & first.isnan()
        differ = (~same).reshape(stacked.shape[0], -1).any(1)
        if differ.any():
            diff = differ.nonzero().flatten().tolist()
            raise DevicesDisagree(
                f"batched simulation: {what} reads a value to the host that differs between devices "
                f"(devices {diff[:8]} differ from device 0); a batched run runs the host code once for "
                f"all devices, so it can only read values every device agrees on. Run it with "
                f"launch(simulate=True) (one thread per device) instead")
    return first


def _host_read(func, args, kwargs):
    if func is torch.ops.aten.equal.default:       # each device's answer; they must agree
        n = n_devices(args)
        blocks = [[a.stacked[r] if type(a) is DeviceStack else a for a in args] for r in range(n)]
        answers = [func(*b) for b in blocks]
        if len(set(answers)) > 1:
            raise DevicesDisagree(f"batched simulation: torch.equal answers {answers[:8]} on the devices; a "
                                  f"batched run runs the host code once, so it can only read what every "
                                  f"device agrees on. Run it with launch(simulate=True) instead")
        return answers[0]
    plain = [same_on_all_devices(a.stacked, f"{func.__name__}") if type(a) is DeviceStack else a
             for a in args]
    return func(*plain, **kwargs)


def stack_blocks(blocks: list[torch.Tensor]) -> DeviceStack:
    """One ``DeviceStack`` from the blocks of devices 0..N-1 (same shape and dtype)."""
    return DeviceStack(torch.stack([b.detach() for b in blocks]))


def as_device_stack(x: Any, n: int) -> DeviceStack:
    """``x`` itself if it is a ``DeviceStack``, else the same tensor on every one of ``n`` devices."""
    if type(x) is DeviceStack:
        return x
    return DeviceStack(x.detach().unsqueeze(0).expand(n, *x.shape).clone())


def physical(x: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``x``'s memory: the stacked blocks of a ``DeviceStack``, else ``x``
    (for code that inspects storage: buffer reuse, overlap checks)."""
    return x.stacked if type(x) is DeviceStack else x


_route = batched_call    # until devices/device_stack_ops.py installs the dispatch of its ops
