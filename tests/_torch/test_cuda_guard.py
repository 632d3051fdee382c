"""The fake CUDA guard of ``FakeTensorMode`` on a CUDA build without a GPU
(functional_pp/_torch/cuda_guard.py): up to torch 2.11 it is freed with the thread that
registered it, so a second compiled launch of simulated devices crashed. functional_pp pins it
to a thread that lives as long as the process; these run in child processes, since the failure
is a segmentation fault."""
import subprocess
import sys

import pytest
import torch

from functional_pp._torch import cuda_guard

# FakeTensorMode entered on device-like threads that end, then again (the crash on torch 2.11)
CHILD = """
import threading, torch
{import_}
from torch._subclasses.fake_tensor import FakeTensorMode

def trace():
    with FakeTensorMode():
        torch.ones(2, device="cuda" if torch.version.cuda else "cpu") * 2

def compiled():
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    assert f(torch.ones(3)).tolist() == [3.0] * 3

for target in (trace, trace, compiled, compiled):
    t = threading.Thread(target=target); t.start(); t.join()
trace()
print("ok")
"""

IMPORTS = {
    "main": "import functional_pp",
    "thread": ("t = threading.Thread(target=lambda: __import__('functional_pp')); t.start(); t.join()\n"
               "import functional_pp"),
}


@pytest.mark.parametrize("imported_on", list(IMPORTS))
def test_fake_tensor_modes_on_threads_that_end_do_not_crash(imported_on):
    out = subprocess.run([sys.executable, "-c", CHILD.format(import_=IMPORTS[imported_on])],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-3000:])


def test_the_capability_and_the_pin_on_this_torch():
    """Where no fake guard is registered (a CPU-only build, or GPUs present) nothing is pinned and
    the capability holds; on a CUDA build without a GPU the guard is pinned at import and the
    probe (a child process without functional_pp) says whether torch itself keeps it alive."""
    needed = cuda_guard.needs_fake_cuda_guard()
    assert needed == (torch.version.cuda is not None and torch.cuda.device_count() == 0)
    assert cuda_guard.pin_fake_cuda_guard() is needed
    outlives = cuda_guard.fake_cuda_guard_outlives_its_thread()
    assert isinstance(outlives, bool)
    if not needed:
        assert outlives
    print(f"torch {torch.__version__}: fake CUDA guard needed={needed}, outlives its thread={outlives}")
