"""The private torch names functional_pp/_torch re-exports still are what the package uses them
as (the planner's dispatch mode, DP buckets' and the batched simulator's wrapper tensors, the
graph passes' operator type, the config's backend list, the process backend's functional
collectives). A torch upgrade that moves or changes one fails here, by name."""
import ast
import pathlib

import torch

from functional_pp import _torch as T
from functional_pp._torch.distributed import funcol

ROOT = pathlib.Path(__file__).resolve().parents[2] / "functional_pp"


def test_op_overload_is_the_type_of_a_graph_node_target():
    assert isinstance(torch.ops.aten.add.Tensor, T.OpOverload)
    assert not isinstance(torch.add, T.OpOverload)


def test_dispatch_mode_sees_every_aten_call():
    seen = []

    class Mode(T.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2) * 3
    assert torch.ops.aten.mul.Tensor in seen


def test_pytree_helpers_flatten_and_map_nested_containers():
    tree = {"a": [torch.ones(1), (torch.zeros(2),)], "b": torch.ones(3)}
    leaves, _ = T.tree_flatten(tree)
    assert [x.numel() for x in leaves] == [1, 2, 3]
    doubled = T.tree_map(lambda x: x * 2, tree)
    assert doubled["a"][1][0].shape == (2,) and float(doubled["b"].sum()) == 6.0


def test_wrapper_subclass_has_the_shape_and_no_storage_of_its_own():
    class Wrapper(torch.Tensor):
        __torch_function__ = T.DISABLED_TORCH_FUNCTION

        @staticmethod
        def __new__(cls, inner):
            out = T.make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
            out.inner = inner
            return out

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda x: x.inner if isinstance(x, Wrapper) else x  # noqa: E731
            return func(*T.tree_map(unwrap, args), **T.tree_map(unwrap, kwargs or {}))

    w = Wrapper(torch.arange(6.0).view(2, 3))
    assert type(w) is Wrapper and w.shape == (2, 3) and w.dtype == torch.float32
    assert torch.equal(w + 1, torch.arange(6.0).view(2, 3) + 1)


def test_compile_backend_names_include_the_ones_configs_name():
    names = T.compile_backend_names()
    assert {"inductor", "aot_eager", "eager"} <= set(names)


def test_the_functional_collectives_the_process_backend_calls_exist():
    source = (ROOT / "devices" / "dist.py").read_text()
    used = {n.attr for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "funcol"}
    assert used, "devices/dist.py no longer calls funcol: update this test"
    missing = sorted(n for n in used if not callable(getattr(funcol, n, None)))
    assert not missing, f"torch.distributed._functional_collectives lacks {missing}"


def test_fake_cuda_tensors_index_move_and_refuse_device_mixes():
    """functional_pp/_torch/fake_cuda.py: fake "cuda" tensors on this build, the Python-binding
    methods it routes to aten (indexing, .to, .contiguous, copies), the device check."""
    import pytest
    from functional_pp._torch.fake_cuda import DeviceMismatchError, fake_cuda, is_fake
    with fake_cuda() as fc, fc.device():
        x = torch.empty(4, 6, device="cuda")
        assert is_fake(x) and x.device == torch.device("cuda", 0)
        assert x[1:, ::2].shape == (3, 3) and x[None, ..., 0].shape == (1, 4) and x[1].shape == (6,)
        assert x[torch.zeros(2, dtype=torch.long, device="cuda")].shape == (2, 6)
        x[:, 0] = 1.0
        x[:, 1:3] = torch.empty(4, 2, device="cuda")
        assert x.t().contiguous().is_contiguous() and x.cuda() is x
        host = fc.mode.from_tensor(torch.ones(4, 6))
        assert host.to("cuda").device.type == "cuda" and x.copy_(host).device.type == "cuda"
        assert fc.to_cuda({"w": torch.ones(2)})["w"].device.type == "cuda"
        with pytest.raises(DeviceMismatchError, match="devices"):
            x + host
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_fake_cuda_backward_still_fails_without_a_gpu():
    """The autograd engine asks for the CUDA accelerator: a CPU-only build lacks it and the process
    aborts (torch 2.13.0+cpu); a CUDA build on a machine without a GPU raises instead (torch
    2.14.1+cu130: "hasPrimaryContext expects a valid device index"). Why
    tests/devices/test_fake_cuda.py runs forwards and optimizer updates only. When this starts
    passing (a torch that fakes the accelerator), run whole steps there."""
    import subprocess
    import sys
    if torch.cuda.is_available():
        return
    code = ("import torch\nfrom functional_pp._torch.fake_cuda import FakeCuda\nfc = FakeCuda()\n"
            "with fc.device():\n    x = torch.empty(2, device='cuda', requires_grad=True)\n"
            "    (x * 2).sum().backward()\nprint('ran')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT.parent)})
    assert run.returncode != 0 and "ran" not in run.stdout, run.stdout
    if torch.version.cuda is None:  # CPU-only build: the engine aborts the process
        assert "not linked with support for cuda" in run.stderr or "accelerator" in run.stderr, run.stderr[-500:]
    else:  # CUDA build, no GPU: the engine raises when it looks for device 0's context
        assert "RuntimeError" in run.stderr and "valid device index" in run.stderr, run.stderr[-500:]


def test_a_forked_child_runs_autograd_after_the_parent_compiled_a_backward():
    """On a CUDA build without a GPU, FakeTensorMode (every torch.compile) registers a dummy CUDA
    guard reporting one device; a first backward after it starts an autograd CUDA thread and a
    forked child (launch(processes=True)) then refuses autograd (torch 2.14.1+cu130). Importing
    functional_pp runs the first backward before that (_torch.start_autograd_on_the_devices_present)."""
    import subprocess
    import sys
    code = ("import os, torch\nimport functional_pp\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n    torch.ones(2)\n"
            "f = torch.compile(lambda x: (x * 2).sum(), backend='aot_eager')\n"
            "f(torch.ones(3, requires_grad=True)).backward()\n"
            "pid = os.fork()\nif pid == 0:\n    y = torch.ones(3, requires_grad=True)\n"
            "    (y * 2).sum().backward()\n    os._exit(0 if torch.equal(y.grad, torch.full((3,), 2.0)) else 3)\n"
            "_, status = os.waitpid(pid, 0)\nprint('child exit', os.waitstatus_to_exitcode(status))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT.parent)})
    assert run.returncode == 0 and "child exit 0" in run.stdout, run.stdout + run.stderr[-1000:]
