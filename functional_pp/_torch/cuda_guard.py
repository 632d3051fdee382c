"""The CUDA device guard that ``FakeTensorMode`` installs on a CUDA build without a GPU.

Every ``FakeTensorMode.__enter__`` (so every ``torch.compile`` trace) calls
``torch._C._ensureCUDADeviceGuardSet()``: where the registered CUDA guard reports no device,
it registers a fake one (``c10::impl::FakeGuardImpl``, one device) in the process-wide
device-guard registry. Up to torch 2.11 the fake guard is owned by a ``thread_local``
``unique_ptr`` of the thread that entered the mode first, while the registry keeps a raw
pointer to it: when that thread exits, the guard is freed and the registry dangles; the next
``FakeTensorMode`` on any thread calls a virtual method of the freed guard and the process
dies ("Fatal Python error: Segmentation fault" in ``fake_tensor.py`` ``__enter__``). Simulated
devices are threads that end with their launch, so the second compiled launch of a process
crashed (tests/compile on torch 2.11.0+cu130 on a CPU machine). From torch 2.12 on (checked
in the 2.12.1, 2.14.1 and 2.15.0 wheels' libc10) the fake guard is a static that lives until
the process ends.

:func:`pin_fake_cuda_guard` has the fake guard registered by a thread that lives as long as the
process (the main thread, else a parked daemon thread), at import, so no device thread ever
owns it: on a torch where it is thread-local that is the fix, on the others it only registers
earlier what the first trace would. The capability itself (:func:`fake_cuda_guard_outlives_its_thread`)
can only be observed by crashing, so it is probed in a child process, by the tests only
(tests/_torch/test_cuda_guard.py)."""
from __future__ import annotations

import functools
import subprocess
import sys
import threading

import torch

_parked: threading.Event | None = None


def needs_fake_cuda_guard() -> bool:
    """Whether ``FakeTensorMode`` registers a fake CUDA guard here: a CUDA build without a GPU
    (a CPU-only build registers no CUDA guard at all; with a GPU the real one stays)."""
    return torch.version.cuda is not None and torch.cuda.device_count() == 0


def pin_fake_cuda_guard() -> bool:
    """Register the fake CUDA guard from a thread that outlives every simulated device (call it
    after the first backward: the autograd engine starts a thread per device the guards report,
    see ``start_autograd_on_the_devices_present``). Returns whether a guard was pinned."""
    global _parked
    if not needs_fake_cuda_guard():
        return False
    if threading.current_thread() is threading.main_thread():
        torch._C._ensureCUDADeviceGuardSet()
        return True
    if _parked is None:                 # imported on another thread: one that never ends
        done, _parked = threading.Event(), threading.Event()

        def park():
            torch._C._ensureCUDADeviceGuardSet()
            done.set()
            _parked.wait()

        threading.Thread(target=park, name="functional_pp-cuda-guard", daemon=True).start()
        done.wait()
    return True


_PROBE = """
import threading, torch
from torch._subclasses.fake_tensor import FakeTensorMode
def enter():
    with FakeTensorMode():
        pass
t = threading.Thread(target=enter); t.start(); t.join()
enter()          # the guard registered by the thread that ended: freed where it was thread-local
print("ok")
"""


@functools.cache
def fake_cuda_guard_outlives_its_thread() -> bool:
    """Capability: whether the fake CUDA guard registered by ``FakeTensorMode`` on one thread
    stays valid after that thread exits (False on torch 2.11's CUDA builds, True from 2.12; True
    where no fake guard is registered). Probed in a child process, without functional_pp, since
    the failure is a segmentation fault (a few seconds: for tests, not at import)."""
    if not needs_fake_cuda_guard():
        return True
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    return out.returncode == 0 and out.stdout.strip().endswith("ok")
