"""Fake CUDA on a CPU-only build: "cuda" tensors without a GPU, to check device placement.

torch's ``FakeTensorMode`` gives tensors their metadata only (shape, dtype, device) and runs
each op's meta kernel: ``torch.zeros(3, device="cuda")`` is a fake tensor on ``cuda:0``, and an
op mixing a fake cuda tensor with a CPU tensor (other than a 0-dim one, which CUDA accepts as
a scalar) raises :data:`DeviceMismatchError`, as a real GPU would. Two gaps of a CPU-only
build are filled here:

* ``Tensor.to("cuda")``, ``.cuda()``, ``.contiguous()``, ``.copy_()`` across devices, ``x[i]``
  and ``x[i] = v`` take a CUDA device guard in
  torch's Python binding, before dispatch, and fail ("not linked with support for cuda
  devices"); a torch-function mode sends them, for fake tensors, to the aten ops they
  dispatch to (``_to_copy``; ``select`` / ``slice`` / ``unsqueeze`` / ``index`` /
  ``index_put_``, ``clone``, ``copy_``).
* the ``torch.cuda`` queries the framework makes to choose by device (``is_available``,
  ``get_device_capability``, ``get_device_name``, memory statistics) answer as an H100
  would while :func:`fake_cuda` is active.

Used by tests/devices/test_fake_cuda.py; the touch points are tested in
tests/_torch/test_touch_points.py.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FakeCuda", "fake_cuda", "is_fake", "DeviceMismatchError"]


def _device_mismatch_error() -> type[Exception]:
    """What an op mixing devices raises under ``FakeTensorMode``: ``FakeTensorDeviceMismatchError``
    where torch has it (2.13 on), a plain ``RuntimeError`` ("Unhandled FakeTensor Device
    Propagation ... found two different devices") on torch 2.11."""
    from torch._subclasses import fake_tensor
    return getattr(fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError)


DeviceMismatchError = _device_mismatch_error()

DEVICE_NAME = "NVIDIA H100 80GB HBM3 (fake)"
CAPABILITY = (9, 0)


def is_fake(x: Any) -> bool:
    """Whether ``x`` is a fake tensor (metadata only)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(x, FakeTensor)


def _basic_view(x: torch.Tensor, index: Any) -> tuple[torch.Tensor, list]:
    """``x`` indexed by the integers, slices, ``None`` and ``...`` of ``index``, and the
    tensor (advanced) indices left to apply to that view's dimensions (None: the whole dim)."""
    index = list(index) if isinstance(index, tuple) else [index]
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index[at:at + 1] = [slice(None)] * (x.dim() - consumed)
    out, dim, advanced = x, 0, []
    for i in index:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
            advanced.append(None)
        elif isinstance(i, bool):
            raise NotImplementedError("fake_cuda: a bool index")
        elif isinstance(i, (int, torch.SymInt)):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, 1 if i.step is None else i.step)
            dim += 1
            advanced.append(None)
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=x.device)
            dim += t.dim() if t.dtype == torch.bool else 1
            advanced.append(t)
    return out, advanced


def _trimmed(advanced: list) -> list:
    while advanced and advanced[-1] is None:
        advanced = advanced[:-1]
    return advanced


def _getitem(x: torch.Tensor, index: Any) -> torch.Tensor:
    out, advanced = _basic_view(x, index)
    advanced = _trimmed(advanced)
    return torch.ops.aten.index.Tensor(out, advanced) if advanced else out


def _setitem(x: torch.Tensor, index: Any, value: Any) -> None:
    out, advanced = _basic_view(x, index)
    advanced = _trimmed(advanced)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype, device=x.device)
    if advanced:
        torch.ops.aten.index_put_.default(out, advanced, value.to(dtype=x.dtype))
    else:
        torch.ops.aten.copy_.default(out, value)


class _FakeDeviceMoves(TorchFunctionMode):
    """``Tensor.to(<cuda>)``, ``.cuda()``, ``[]``, ``[] =``, ``.contiguous()``, ``.copy_(<other
    device>)`` and ``.new_tensor`` of fake tensors as the aten ops they dispatch to."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and is_fake(args[0]) and args[0].device.type == "cuda":
            return _getitem(args[0], args[1])
        if func is torch.Tensor.__setitem__ and is_fake(args[0]) and args[0].device.type == "cuda":
            return _setitem(*args)
        if func is torch.Tensor.contiguous and is_fake(args[0]) and args[0].device.type == "cuda":
            x, fmt = args[0], kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            return x if x.is_contiguous(memory_format=fmt) else torch.ops.aten.clone.default(x, memory_format=fmt)
        if (func is torch.Tensor.copy_ and is_fake(args[0]) and args[0].device.type == "cuda"
                and isinstance(args[1], torch.Tensor) and args[1].device != args[0].device):
            src = torch.ops.aten._to_copy.default(args[1], device=args[0].device)
            return torch.ops.aten.copy_.default(args[0], src)
        if func is torch.Tensor.new_tensor and is_fake(args[0]) and args[0].device.type == "cuda":
            kwargs.setdefault("dtype", args[0].dtype)
            kwargs.setdefault("device", args[0].device)
            return torch.tensor(args[1], **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args and is_fake(args[0]):
            x = args[0]
            if func is torch.Tensor.cuda:
                device, dtype, non_blocking = torch.device("cuda", 0), None, kwargs.get("non_blocking", False)
            else:
                device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cuda":
                device = torch.device("cuda", 0 if device.index is None else device.index)
                if device != x.device or (dtype is not None and dtype != x.dtype):
                    return torch.ops.aten._to_copy.default(x, dtype=dtype or x.dtype, device=device,
                                                           non_blocking=non_blocking)
                return x
        return func(*args, **kwargs)


class FakeCuda:
    """Fake tensors for the simulated devices of a launch: enter :meth:`device` on every
    device thread; tensors made there, or brought in with :meth:`to_cuda`, are fake. Each
    thread has a fake mode of its own (a mode's kernel-invocation state is not thread-safe,
    and dispatch modes are per thread anyway), so a device's tensors stay on its thread."""

    def __init__(self):
        self._local = threading.local()

    @property
    def mode(self):
        """This thread's ``FakeTensorMode`` (made on first use)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = getattr(self._local, "mode", None)
        if mode is None:
            mode = self._local.mode = FakeTensorMode(allow_non_fake_inputs=False)
        return mode

    @contextlib.contextmanager
    def device(self) -> Iterator[None]:
        """Run the block with fake tensors (on this thread)."""
        torch._C._ensureCUDADeviceGuardSet()    # a no-op CUDA device guard for this thread
        with self.mode, _FakeDeviceMoves():
            yield

    def to_cuda(self, tree: Any, namespace: str = "functional_pp") -> Any:
        """Every tensor of ``tree`` (real, or fake on the CPU) as a fake tensor on ``cuda:0`` (inside
        :meth:`device`)."""
        import optree

        def move(x):
            if not isinstance(x, torch.Tensor) or x.device.type == "cuda":
                return x
            with torch.no_grad():
                fake = torch.ops.aten._to_copy.default(x if is_fake(x) else self.mode.from_tensor(x),
                                                       device=torch.device("cuda", 0))
            return fake.requires_grad_() if x.requires_grad else fake
        return optree.tree_map(move, tree, namespace=namespace)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """``torch.cuda`` answering as one H100 (available, capability 9.0, bf16, memory
    statistics 0) and a :class:`FakeCuda` to run devices in."""
    with contextlib.ExitStack() as stack:
        for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                            ("is_bf16_supported", lambda *a, **k: True),
                            ("get_device_capability", lambda *a, **k: CAPABILITY),
                            ("get_device_name", lambda *a, **k: DEVICE_NAME),
                            ("current_device", lambda: 0), ("synchronize", lambda *a, **k: None),
                            ("max_memory_allocated", lambda *a, **k: 0),
                            ("reset_peak_memory_stats", lambda *a, **k: None),
                            ("is_initialized", lambda: False)):
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        # a fake tensor on "cuda" first makes a real one where torch.cuda.is_available() says
        # so (torch 2.11; 2.13 on asks the accelerator): nothing to initialise here
        from torch._subclasses import fake_tensor
        stack.enter_context(mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None))
        yield FakeCuda()
