"""The private torch APIs we depend on still behave as we use them."""
import contextlib
import threading

import pytest
import torch

from functional_pp import _torch as torch_private


def test_in_backward_only_inside_a_backward_function():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(torch_private.in_backward())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(torch_private.in_backward())
            return g

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [False, True] and not torch_private.in_backward()


def test_dynamo_settings_are_set_for_the_block_and_restored():
    """Thread-local from torch 2.13 on, process-wide on 2.11 (tests/_torch/test_dynamo_settings.py)."""
    import torch._dynamo.config as dcfg
    before = dcfg.trace_autograd_ops
    other = []
    with torch_private.trace_backward(), torch_private.compile_cache_limits(1000):
        assert dcfg.trace_autograd_ops and dcfg.recompile_limit >= 1000
        t = threading.Thread(target=lambda: other.append(dcfg.trace_autograd_ops))
        t.start()
        t.join()
    local = torch_private.dynamo_settings_are_thread_local()
    assert other == [before if local else True] and dcfg.trace_autograd_ops == before


def test_apply_function_equals_function_apply_with_gradients():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(x, k):
            return x * k

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.k = inputs[1]

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None

    x = torch.arange(3.0, requires_grad=True)
    y = torch_private.apply_function(Scale, x, 3.0)
    assert type(y.grad_fn).__name__ == "ScaleBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, x * 3) and torch.equal(g, torch.full((3,), 3.0))
    compiled = torch.compile(lambda t: torch_private.apply_function(Scale, t, 2.0), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 2)


def test_is_tracing_belongs_to_the_compiling_thread():
    """torch.compiler.is_compiling() is one process-wide flag, True for every thread while any
    thread compiles; is_tracing() is True only on the thread that compiles (and inside
    dynamo's trace), so the other simulated devices keep running their eager code
    (docs/compile.md, "Per-layer compilation")."""
    from torch._dynamo.convert_frame import compile_lock

    from functional_pp.compile.layer_compile import compiled_layers, layer_backend

    compiling, release, seen = threading.Event(), threading.Event(), {}

    process_wide = torch_private.compile_flag_is_process_wide()   # False on torch 2.11

    def compiler_thread():          # what dynamo does while it compiles a frame
        session = torch.compiler._compile_session_context() if process_wide else contextlib.nullcontext()
        with compile_lock, session:
            seen["compiler"] = torch_private.is_tracing()
            compiling.set()
            release.wait(60)

    t = threading.Thread(target=compiler_thread)
    t.start()
    try:
        assert compiling.wait(60)
        assert torch.compiler.is_compiling() is process_wide     # torch's flag leaks into this thread
        assert not torch_private.is_tracing()
        assert torch_private.runs_eagerly(torch.ones(1))
        with compiled_layers("aot_eager"):
            assert layer_backend() == "aot_eager"       # layers still run compiled here
    finally:
        release.set()
        t.join(60)
    assert seen["compiler"] is process_wide      # 2.11: nothing marks the compiling thread outside the trace
    assert not torch.compiler.is_compiling() and not torch_private.is_tracing()

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        return x + 1 if torch_private.is_tracing() else x - 1
    assert traced(torch.zeros(1)).item() == 1.0           # inside dynamo's trace: True


def test_the_package_asks_is_tracing_not_the_process_wide_flag():
    """Every "am I traced?" test of the package goes through torch_private.is_tracing (see
    above); a direct torch.compiler.is_compiling() would misfire on simulated devices."""
    import pathlib
    root = pathlib.Path(torch_private.__file__).parents[1]
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.relative_to(root).as_posix() != "_torch/__init__.py" and "torch.compiler.is_compiling(" in p.read_text()]
    assert not offenders, f"use functional_pp._torch.is_tracing() in {offenders}"


def test_mt19937_state_reproduces_manual_seed_and_keeps_every_word():
    """``mt19937_state`` writes the generator layout this torch reads: the words of a
    ``manual_seed`` state give the same draws, and changing one word changes them."""
    import numpy as np

    from functional_pp._torch import check_mt19937_state_layout, mt19937_state

    check_mt19937_state_layout()
    seeded = torch.Generator().manual_seed(77)
    words = np.frombuffer(seeded.get_state().numpy().tobytes(), dtype=np.uint64, count=624, offset=24).copy()
    ours = torch.Generator()
    ours.set_state(mt19937_state(words, 77))
    for shape in [(5,), (1000,)]:               # torch's scalar and vectorised normal paths
        assert torch.equal(torch.randn(shape, generator=ours), torch.randn(shape, generator=seeded))
    words[600] ^= 1
    ours.set_state(mt19937_state(words, 77))
    assert not torch.equal(torch.randn(1000, generator=ours),
                           torch.randn(1000, generator=torch.Generator().manual_seed(77)))
    with pytest.raises(ValueError, match="624 words"):
        mt19937_state(words[:10])


def test_vmap_level_batches_an_op_from_inside_a_torch_dispatch():
    """The batched simulation enters a vmap level inside ``__torch_dispatch__`` (where torch
    switches off functorch's keys): an op on the batched tensor runs once over the batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.arange(6.0).reshape(3, 2)
    seen = []

    class Once(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.sum.default and not seen:
                with torch_private.vmap_level(3) as level:
                    seen.append(torch_private.remove_batch_dim(func(torch_private.add_batch_dim(args[0], level)),
                                                               level, 3))
            return func(*args, **(kwargs or {}))

    with Once():
        x.sum()
    assert torch.equal(seen[0], x.sum(1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_joint_pass_marks_nodes_that_the_partitioner_recomputes(backend):
    """``compile_backend(joint_pass=)`` runs on AOT autograd's joint graph before the partition;
    a forward node marked by ``recompute_in_backward`` is computed again in backward instead of
    saved (sin(x @ w): the forward keeps only x and w, not the product, which either partitioner
    saves unmarked: a matmul is never recomputed on its own)."""
    from functional_pp._torch import compile_backend, joint_forward_nodes, recompute_in_backward

    def mark(graph):
        forward = joint_forward_nodes(graph)
        assert not any(n.name.startswith("tangents") for n in forward)
        for n in forward:
            if n.op == "call_function" and "mm" in str(n.target):
                recompute_in_backward(n)

    def only_inputs_saved(joint_pass) -> bool:
        torch._dynamo.reset()
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        fn = torch.compile(lambda a, b: torch.sin(a @ b), backend=compile_backend(backend, lambda g: None, joint_pass),
                           fullgraph=True)
        out = fn(x, w)
        kept = out.grad_fn.saved_tensors
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.cos(x.detach() @ w.detach()) @ w.detach().T)
        return all(t.data_ptr() in (x.data_ptr(), w.data_ptr()) for t in kept)
    assert only_inputs_saved(mark)
    assert not only_inputs_saved(None)
    torch._dynamo.reset()
