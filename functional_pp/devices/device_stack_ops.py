"""The ops on ``DeviceStack`` values that do not simply go through functorch's batching rules
(docs/simulation.md, "Batched simulation"): view ops taken directly on the stacked blocks,
the CPU flash attention with the devices folded into its batch, ``out=`` ops, ``_foreach_*``
ops, fused optimizer kernels, and in-place or ``out=`` writes into ordinary tensors (written
once, with the value every device agrees on). :func:`route` dispatches every op.

Mechanism: Devices (batched simulator: ops beyond functorch's rules).
"""
from __future__ import annotations

import torch

from functional_pp.devices.device_stack import (DeviceStack, as_device_stack, batched_call, n_devices,
                                                same_on_all_devices, set_route)


def route(func, args, kwargs):
    """Run ``func`` on arguments among which are ``DeviceStack`` values, for every device."""
    out = kwargs.get("out")
    if out is not None and type(out) is not DeviceStack and not isinstance(out, (list, tuple)):
        return _into_plain(func, args, kwargs)
    name = func.__name__
    if name.startswith("_foreach_"):
        return _foreach_call(func, args, kwargs)
    if name.startswith("_fused_"):
        return _fused_call(func, args, kwargs)
    if out is not None:
        return _out_call(func, args, kwargs)
    if args and type(args[0]) is not DeviceStack and isinstance(args[0], torch.Tensor) and _writes_self(func):
        return _in_place_into_plain(func, args, kwargs)
    view = _VIEWS.get(func)
    if view is not None and type(args[0]) is DeviceStack and args[0].ndim > 0:
        try:
            return _wrap_views(view(args[0].stacked, args[0].ndim, *args[1:], **kwargs))
        except (RuntimeError, IndexError):
            pass                      # functorch's rule runs it (and raises the op's own error)
    rule = _FOLDED.get(func)
    if rule is not None and all(type(a) is DeviceStack for a in args[:rule]) and kwargs.get("attn_mask") is None:
        return _folded_call(func, rule, args, kwargs)
    return batched_call(func, args, kwargs)


_aten = torch.ops.aten


def _d(dim: int, ndim: int) -> int:
    """A device's dimension ``dim`` (of ``ndim``) as a dimension of the stacked blocks."""
    return (dim + ndim if dim < 0 else dim) + 1


def _expand(s, ndim, size, implicit=False):
    extra = len(size) - ndim
    if extra:
        s = s.view(s.shape[0], *[1] * extra, *s.shape[1:])
    return s.expand(s.shape[0], *size)


# the view ops (half of a step's ops), taken directly on the stacked blocks: the device
# dimension stays the leading one, the device's dimensions move one up (what functorch's rules
# do for them, without entering a vmap level)
_VIEWS = {
    _aten.view.default: lambda s, nd, size: s.view(s.shape[0], *size),
    _aten._unsafe_view.default: lambda s, nd, size: _aten._unsafe_view.default(s, [s.shape[0], *size]),
    _aten.expand.default: _expand,
    _aten.t.default: lambda s, nd: s.transpose(1, 2) if nd == 2 else _aten.alias.default(s),
    _aten.transpose.int: lambda s, nd, d0, d1: s.transpose(_d(d0, nd), _d(d1, nd)),
    _aten.permute.default: lambda s, nd, dims: s.permute(0, *[_d(d, nd) for d in dims]),
    _aten.unsqueeze.default: lambda s, nd, d: s.unsqueeze(_d(d, nd + 1)),
    _aten.squeeze.dim: lambda s, nd, d: s.squeeze(_d(d, nd)),
    _aten.select.int: lambda s, nd, d, i: s.select(_d(d, nd), i),
    _aten.slice.Tensor: lambda s, nd, d=0, start=None, end=None, step=1:
        _aten.slice.Tensor(s, _d(d, nd), start, end, step),
    _aten.split.Tensor: lambda s, nd, size, d=0: _aten.split.Tensor(s, size, _d(d, nd)),
    _aten.detach.default: lambda s, nd: _aten.detach.default(s),
    _aten.alias.default: lambda s, nd: _aten.alias.default(s),
}


def _wrap_views(out):
    if isinstance(out, torch.Tensor):
        return DeviceStack(out)
    return [DeviceStack(o) for o in out]
# ops that treat their leading (batch) dimension independently: the devices are folded into it
# (one kernel call instead of functorch's per-device fallback); value: how many leading
# arguments are batched tensors
_FOLDED = {_aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
           _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 6}


def _folded_call(func, n_batched, args, kwargs):
    n = args[0].stacked.shape[0]
    folded = [a.stacked.reshape(-1, *a.stacked.shape[2:]) for a in args[:n_batched]]
    result = func(*folded, *args[n_batched:], **kwargs)
    return tuple(DeviceStack(r.reshape(n, -1, *r.shape[1:])) for r in result)


_FUNCTIONAL: dict = {}
_WRITES_SELF: dict = {}


def _writes_self(func) -> bool:
    """Whether ``func`` writes its first argument in place (``add_``, ``copy_``, ...)."""
    found = _WRITES_SELF.get(func)
    if found is None:
        arguments = func._schema.arguments
        alias = arguments[0].alias_info if arguments else None
        found = _WRITES_SELF[func] = bool(alias is not None and alias.is_write)
    return found


def _in_place_into_plain(func, args, kwargs):
    """An in-place op on an ordinary tensor with per-device arguments (a step counter advanced by
    a per-device flag): computed for every device, then written once, if every device agrees."""
    target = args[0]
    every = as_device_stack(target, n_devices(list(args) + list(kwargs.values())))
    batched_call(func, (every, *args[1:]), kwargs)
    return target.copy_(same_on_all_devices(every.stacked, f"{func} into an ordinary tensor"))


def _functional_overload(func):
    """The overload of ``func``'s op without ``out=`` taking the same other arguments."""
    found = _FUNCTIONAL.get(func)
    if found is None:
        want = [a.name for a in func._schema.arguments if not a.is_out]
        packet = func.overloadpacket
        for name in packet.overloads():
            op = getattr(packet, name)
            if [a.name for a in op._schema.arguments] == want and not any(a.is_out for a in op._schema.arguments):
                found = _FUNCTIONAL[func] = op
                break
        else:
            raise RuntimeError(f"batched simulation: {func} (an out= op) has no functional overload to run")
    return found


def _out_call(func, args, kwargs):
    """An ``out=`` op (functorch has no batching for these): the functional op, then copied into
    ``out`` (of the result's shape, as the ops here use it)."""
    out = kwargs["out"]
    result = batched_call(_functional_overload(func), args, {k: v for k, v in kwargs.items() if k != "out"})
    if result.shape != out.shape:
        raise RuntimeError(f"batched simulation: {func} writes a result of shape {tuple(result.shape)} into "
                           f"out= of shape {tuple(out.shape)} (resizing out= is not simulated)")
    return out.copy_(result)


def _foreach_call(func, args, kwargs):
    """A ``_foreach_*`` op (no batching rule in functorch): a pointwise one applied once to the
    stacked blocks where only its lists hold ``DeviceStack`` values (same result per device),
    else one op per list element (``_foreach_norm`` always: it reduces each element)."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    others = [a for a in list(args) + list(kwargs.values()) if not isinstance(a, (list, tuple))]
    pointwise = not func.__name__.startswith("_foreach_norm")
    if pointwise and all(type(x) is DeviceStack for li in lists for x in li) \
            and not any(type(a) is DeviceStack for a in others):
        phys = [[x.stacked for x in a] if isinstance(a, (list, tuple)) else a for a in args]
        result = func(*phys, **kwargs)
        return None if result is None else [DeviceStack(r) for r in result]
    return _unrolled_foreach(func, args, kwargs)


def _fused_call(func, args, kwargs):
    """A fused optimizer kernel (``_fused_adamw_``): elementwise over its tensor lists, so run
    once on the stacked blocks; its per-step scalars (step counts, ``lr``, ``found_inf``,
    ``grad_scale``) must agree on every device, as they do in a data-parallel step."""
    def plain(a, what):
        return same_on_all_devices(a.stacked, f"{func} ({what})") if type(a) is DeviceStack else a
    n_lists = sum(isinstance(a, (list, tuple)) for a in args)
    phys = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)) and i == n_lists - 1 and a and func.__name__.startswith("_fused_adam"):
            phys.append([plain(x, "step") for x in a])          # state_steps: one scalar per tensor
        elif isinstance(a, (list, tuple)):
            if not all(type(x) is DeviceStack for x in a):
                raise RuntimeError(f"batched simulation: {func} on tensors that are not all per-device values")
            phys.append([x.stacked for x in a])
        else:
            phys.append(plain(a, "argument"))
    return func(*phys, **{k: plain(v, k) for k, v in kwargs.items()})


def _unrolled_foreach(func, args, kwargs):
    name = func.__name__.split(".")[0][len("_foreach_"):]
    n = len(next(a for a in args if isinstance(a, (list, tuple))))
    if name == "norm":
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
        return [torch.linalg.vector_norm(x, ord_, dtype=dtype) for x in args[0]]
    single = getattr(torch.ops.aten, name)
    out = []
    for i in range(n):
        one = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
        out.append(single(*one, **kwargs))
    return None if name.endswith("_") else out


def _into_plain(func, args, kwargs):
    """An ``out=`` op whose output is an ordinary tensor: computed for all devices, then written
    once, if every device computed the same."""
    out = kwargs["out"]
    result = batched_call(_functional_overload(func), args, {k: v for k, v in kwargs.items() if k != "out"})
    if type(result) is DeviceStack:
        result = same_on_all_devices(result.stacked, f"{func} into an ordinary tensor")
    return out.copy_(result)


set_route(route)
