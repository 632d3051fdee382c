"""Private PyTorch APIs: every internal functional_pp relies on, in this one folder, so a torch
upgrade breaks here and nowhere else (each touch point is tested in tests/_torch/)."""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

from functional_pp._torch.version import check_torch_version

check_torch_version()    # before the first private import: say which torch is unsupported, not fail in it

from torch._C._functorch import (_add_batch_dim, _remove_batch_dim, _vmap_decrement_nesting,  # noqa: E402
                                 _vmap_increment_nesting)

from functional_pp._torch.dynamo_settings import dynamo_settings_are_thread_local, patch_dynamo  # noqa: E402,F401


def is_tracing() -> bool:
    """Whether this thread is being traced by torch.compile (or runs code of its compilation).

    ``torch.compiler.is_compiling()`` reads one process-wide flag that dynamo holds True for
    the whole compilation: while one simulated device thread compiles, every other device
    thread's eager code would take its traced branch (run a compiled layer's function eagerly,
    skip FSDP units or gradient buckets) and issue other collectives than its peers
    (docs/compile.md, "Per-layer compilation"). Dynamo compiles under its global compile
    lock, so the flag counts for the thread that holds that lock; inside dynamo's trace both
    calls below fold to True."""
    if not torch.compiler.is_compiling():
        # (the thread's own dict: ``getattr(_native, "tracing", False)`` raised and caught an
        # AttributeError on every eager call outside traced_natively, 0.8 of its 1.0 us, about
        # 90 calls a step of the tiny Llama; docs/eager_overhead.md)
        return _native.__dict__.get("tracing", False)
    return torch.compiler.is_dynamo_compiling() or _compile_lock_owned()


_native = threading.local()


@contextlib.contextmanager
def traced_natively():
    """Inside the block this thread's code is traced (:func:`is_tracing`): a step that AOT
    autograd traces by running it (step/native_trace.py), where torch 2.11 does not hold
    ``torch.compiler.is_compiling()``."""
    previous = _native.__dict__.get("tracing", False)
    _native.tracing = True
    try:
        yield
    finally:
        _native.tracing = previous


def compiled_calls_ignore_fx_tracing() -> bool:
    """Capability: whether a compiled function called on one thread runs compiled while another
    thread's compilation FX-traces (AOT autograd's trace sets ``torch.fx``'s process-wide
    tracing flag). torch.compile runs the function as written, or raises "Detected that you
    are using FX to symbolically trace a dynamo-optimized function", while that flag is set
    and ``torch.compiler.is_compiling()`` is not: torch 2.13 on holds the latter True for the
    whole compilation (:func:`compile_flag_is_process_wide`), torch 2.11 does not, and there
    simulated devices calling a compiled layer or step while a peer compiled failed
    (tests/_torch/test_fx_tracing_flag.py checks the two agree)."""
    return compile_flag_is_process_wide()


def compile_despite_peers_fx_tracing():
    """On this thread, compiled functions run compiled even while another thread's compilation
    FX-traces (on a torch where that would not hold by itself: :func:`compiled_calls_ignore_fx_tracing`).
    For threads that never call a compiled function from inside their own FX trace: simulated
    devices (a device thread that traces a step runs its layers as written, layer_compile.py).
    Each device thread enters it (:func:`patch_dynamo`)."""
    if compiled_calls_ignore_fx_tracing():
        return contextlib.nullcontext()
    return patch_dynamo(force_compile_during_fx_trace=True)


def compile_flag_is_process_wide() -> bool:
    """Capability: whether ``torch.compiler.is_compiling()`` is held True for the whole of a
    dynamo compilation, on every thread (torch 2.13 on: dynamo enters
    ``torch.compiler._compile_session_context`` around it). On torch 2.11 dynamo sets no such
    flag (it is True only inside its trace), so no other thread can see it: :func:`is_tracing`
    is right either way, this only tells which. Detected by the session's presence, without
    compiling (a probe compilation inside ``fake_cuda`` would save a CUDA random state);
    tests/_torch/test_compile_flag.py checks it against what another thread sees."""
    return callable(getattr(torch.compiler, "_compile_session_context", None))


def _compile_lock_owned() -> bool:
    from torch._dynamo.convert_frame import compile_lock
    return compile_lock._is_owned()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward function on this thread."""
    return torch._C._current_autograd_node() is not None


def compile_cache_limits(n_graphs: int):
    """Let torch.compile keep ``n_graphs`` graphs per function (call it on the thread that
    compiles: :func:`patch_dynamo`)."""
    import torch._dynamo.config as dcfg

    limits = {name: max(getattr(dcfg, name), n_graphs)
              for name in ("recompile_limit", "cache_size_limit") if hasattr(dcfg, name)}
    limits["accumulated_cache_size_limit"] = max(dcfg.accumulated_cache_size_limit, 8 * n_graphs)
    return patch_dynamo(**limits)


def trace_backward(enabled: bool = True):
    """Let dynamo trace ``torch.autograd.grad`` inside a compiled function (on this thread:
    :func:`patch_dynamo`)."""
    if not enabled:
        return contextlib.nullcontext()
    return patch_dynamo(trace_autograd_ops=True)


def annotate(meta: dict):
    """Attach ``meta`` to every graph node traced inside the block (``node.meta["custom"]``)."""
    import torch.fx.traceback as fx_traceback
    return fx_traceback.annotate(meta)


def is_backward_node(node) -> bool:
    """Whether a node of a traced step was produced by ``torch.autograd.grad``'s backward (as
    dynamo marks it: see :func:`dynamo_marks_backward_nodes`)."""
    return bool(node.meta.get("autograd_backward"))


@functools.cache
def dynamo_marks_backward_nodes() -> bool:
    """Capability: whether the nodes dynamo traces from ``torch.autograd.grad`` carry
    ``node.meta["autograd_backward"]`` (torch 2.12 on; torch 2.11's do not, and the compile
    passes then find the backward by the tag the step sets around its ``autograd.grad``,
    compile/recompute.py ``is_backward``). Probed once by compiling a small gradient."""
    found = []

    def capture(graph):
        found.extend(bool(n.meta.get("autograd_backward")) for n in graph.nodes)

    def probe(x, seed):
        y = x + seed
        return torch.autograd.grad((y * y).sum(), [y])[0]

    from torch._dynamo.utils import counters
    stats = dict(counters["stats"])      # the probe's graph is not the caller's: its counts are undone
    try:
        with trace_backward():
            torch.compile(probe, backend=compile_backend("aot_eager", capture), fullgraph=True)(
                torch.ones(2), torch.zeros((), requires_grad=True))
    finally:
        counters["stats"].clear()
        counters["stats"].update(stats)
    return any(found)


def compile_backend(name: str, graph_pass, joint_pass=None):
    """A ``torch.compile`` backend: ``name`` ("inductor" or an AOT-eager-like backend) with
    ``graph_pass(graph)`` run on the ATen graph that will execute. ``graph_pass`` may return a
    function ``wrap(compiled) -> compiled`` applied to the compiled callable. ``joint_pass(graph)``,
    when given, runs on a differentiated function's joint forward-backward graph before AOT
    autograd's partitioner splits it (where :func:`recompute_in_backward` marks take effect)."""
    from torch._dynamo.backends.common import aot_autograd

    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import CustomGraphPass

        from functional_pp._torch.buffer_reuse import reuse_past_ordering_deps
        from functional_pp._torch.kernel_order import inductor_patches

        def backend(gm, example_inputs):
            box = {}

            class Pass(CustomGraphPass):
                def __call__(self, graph):
                    box["wrap"] = graph_pass(graph)

                def uuid(self):
                    return None          # never reuse a cached graph: the pass must see it

            class JointPass(CustomGraphPass):
                def __call__(self, graph):
                    joint_pass(graph)

                def uuid(self):
                    return None

            # kernels in graph order: weight gradients not sunk to the optimizer (docs/compile.md)
            patches = {"post_grad_custom_pre_pass": Pass(), **inductor_patches()}
            if joint_pass is not None:
                patches["joint_custom_pre_pass"] = JointPass()
            # matmul outputs overwritten in place past the donated update (docs/compile.md)
            with reuse_past_ordering_deps():
                compiled = compile_fx(gm, example_inputs, config_patches=patches)
            wrap = box.get("wrap")
            return wrap(compiled) if wrap else compiled
        return backend
    if name not in ("aot_eager", "eager_with_passes"):
        return None
    from functorch.compile import default_partition, make_boxed_func

    def fw(gm, example_inputs):
        wrap = graph_pass(gm.graph)
        gm.recompile()
        return make_boxed_func(wrap(gm) if wrap is not None else gm)

    def partition(joint, joint_inputs, **kwargs):
        joint_pass(joint.graph)
        joint.recompile()
        return default_partition(joint, joint_inputs, **kwargs)
    if joint_pass is None:
        return aot_autograd(fw_compiler=fw, inference_compiler=fw)
    return aot_autograd(fw_compiler=fw, inference_compiler=fw, partition_fn=partition)


def joint_forward_nodes(graph) -> list:
    """The nodes of AOT autograd's joint graph that its forward computes: those that read no
    incoming gradient (``tangents_*`` placeholders), directly or through other nodes."""
    backward: set = set()
    out = []
    for node in graph.nodes:
        if node.op == "output":
            continue
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
        elif node.op != "placeholder":
            out.append(node)
    return out


def recompute_in_backward(node) -> None:
    """Mark a node of a joint graph for AOT autograd's partitioner: backward computes it again
    instead of the forward saving its result, collectives included (what
    ``torch.utils.checkpoint``'s selective policy ``CheckpointPolicy.MUST_RECOMPUTE`` sets;
    SimpleFSDP's way of re-gathering FSDP weights in backward)."""
    from torch.utils.checkpoint import CheckpointPolicy
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def runs_eagerly(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs as plain eager code: not traced by torch.compile, no
    dispatch mode active (FakeTensorMode, ...), ``x`` a real tensor (not fake, not wrapped by
    functorch). Where this is False an opaque custom op must be used instead of Python."""
    return (not is_tracing()
            and torch._C._len_torch_dispatch_stack() == 0
            and type(x) in (torch.Tensor, torch.nn.Parameter)
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]


def apply_function(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)`` without ``Function.apply``'s per-call ``inspect.signature`` binding
    (tens of microseconds, paid by every collective on every simulated device). Only for
    functions whose ``forward`` takes exactly ``args``, positionally, with no defaults. Under
    torch.compile or functorch transforms: ``fn.apply`` itself."""
    if is_tracing() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return _FUNCTION_APPLY.__get__(None, fn)(*args)


def cached_graph_count(code) -> int:
    """How many compiled graphs dynamo's cache holds for the code object ``code``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(code))


def start_autograd_on_the_devices_present() -> None:
    """Run one CPU backward now, on a CUDA build without a GPU, so that forked children
    (``launch(processes=True)``) can still run autograd. The engine starts its per-device
    threads once, at the first backward, for as many devices as the registered device guards
    report, and a process forked after it started any refuses autograd ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"). On a CUDA build
    without devices, ``FakeTensorMode`` (so every ``torch.compile``) registers a dummy CUDA
    guard that reports one device (``torch._C._ensureCUDADeviceGuardSet``): a first backward
    after it would start a CUDA thread. Seen on torch 2.14.1+cu130 on a CPU machine; a
    CPU-only build registers no such guard, and with real GPUs the threads start anyway."""
    if torch.version.cuda is None or torch.cuda.device_count() > 0:
        return
    x = torch.zeros((), requires_grad=True)
    (x * 1.0).backward()


def reset_compile_workers_after_fork() -> None:
    """Forget inductor's compile thread pool in a forked child. The pool is cached per process
    and a child inherits the cache but not its threads, so the child's first compilation would
    wait forever for a worker (torch resets its process pool after a fork, not this one)."""
    module = sys.modules.get("torch._inductor.async_compile")
    if module is not None:
        module.AsyncCompile.pool.cache_clear()


# Byte layout of torch's CPU generator state (``CPUGeneratorImplState`` in
# aten/src/ATen/CPUGeneratorImpl.cpp): u64 initial seed, i32 left, i32 seeded, u64 next,
# u64 state[624], 3 doubles and an i32 for the cached double normal, then the cached float
# normal (f32) and its valid flag (bool), padded to 5056 bytes.
_MT_STATE_BYTES = 5056
_MT_WORDS_OFFSET = 24
_MT_WORDS = 624
_MT_DOUBLE_NORMAL_VALID = _MT_WORDS_OFFSET + 8 * _MT_WORDS + 24
_MT_FLOAT_NORMAL_VALID = _MT_DOUBLE_NORMAL_VALID + 8


def mt19937_state(words, initial_seed: int = 0) -> torch.Tensor:
    """A CPU ``torch.Generator`` state whose mt19937 holds the 624 32-bit ``words`` (a numpy
    uint32/uint64 array, not all zero), ready to twist on its first draw and with no cached
    normal sample: ``gen.set_state(mt19937_state(words))`` seeds a generator with 19968 bits
    where ``manual_seed`` takes 32 (docs/init.md)."""
    import numpy as np

    words = np.asarray(words, dtype=np.uint64)
    if words.shape != (_MT_WORDS,):
        raise ValueError(f"mt19937_state: need {_MT_WORDS} words, got shape {words.shape}")
    buf = np.zeros(_MT_STATE_BYTES, dtype=np.uint8)
    np.frombuffer(buf, dtype=np.uint64, count=1)[0] = initial_seed & ((1 << 64) - 1)
    np.frombuffer(buf, dtype=np.int32, count=2, offset=8)[:] = (1, 1)   # left = 1: twist first
    np.frombuffer(buf, dtype=np.uint64, count=_MT_WORDS, offset=_MT_WORDS_OFFSET)[:] = \
        words & np.uint64(0xFFFFFFFF)
    return torch.from_numpy(buf)


@functools.cache
def check_mt19937_state_layout() -> None:
    """Raise if this torch's CPU generator state is not the layout ``mt19937_state`` writes
    (checked against a ``manual_seed`` state, whose first word is the seed itself)."""
    import numpy as np

    gen = torch.Generator().manual_seed(12345)
    state = gen.get_state().numpy()
    ok = (state.size == _MT_STATE_BYTES
          and np.frombuffer(state, dtype=np.uint64, count=1, offset=_MT_WORDS_OFFSET)[0] == 12345
          and tuple(np.frombuffer(state, dtype=np.int32, count=2, offset=8)) == (1, 1))
    if not ok:
        raise RuntimeError(
            f"torch {torch.__version__}'s CPU generator state is not the layout functional_pp's "
            "init writes (functional_pp._torch.mt19937_state): update that function for this torch")


def version_counter(x: torch.Tensor) -> int:
    """The tensor's version counter: advanced by every in-place operation on it (or a view of it)
    made through torch's ops (``Tensor._version``)."""
    return x._version


def _functorch_keys():
    """The dispatch keys torch excludes while a ``__torch_dispatch__`` runs that functorch's
    batching needs back."""
    return _FUNCTORCH_KEYS


_K = torch._C.DispatchKey
_FUNCTORCH_KEYS = torch._C.DispatchKeySet(_K.FuncTorchDynamicLayerBackMode)
for _key in (_K.FuncTorchBatched, _K.FuncTorchVmapMode, _K.FuncTorchDynamicLayerFrontMode,
             _K.FuncTorchGradWrapper, _K.ADInplaceOrView):
    _FUNCTORCH_KEYS = _FUNCTORCH_KEYS.add(_key)


@contextlib.contextmanager
def vmap_level(batch_size: int, randomness: str = "error"):
    """Enter one functorch vmap level of ``batch_size`` (also from inside a
    ``__torch_dispatch__``, where torch switches off the keys vmap needs); yields the level for
    :func:`add_batch_dim` / :func:`remove_batch_dim`. The batched simulation runs each op this
    way (devices/device_stack.py, docs/simulation.md)."""
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set() - _functorch_keys()):
        level = _vmap_increment_nesting(batch_size, randomness)
        try:
            yield level
        finally:
            _vmap_decrement_nesting()


def add_batch_dim(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` (leading dimension the batch) as a batched tensor of vmap level ``level``."""
    return _add_batch_dim(t, 0, level)


def remove_batch_dim(t: torch.Tensor, level: int, batch_size: int) -> torch.Tensor:
    """A batched tensor of vmap level ``level`` as a plain tensor, the batch leading."""
    return _remove_batch_dim(t, level, batch_size, 0)


# --- tensor subclasses, dispatch modes and pytrees (the planner's tracker, DP buckets, the batched simulator)
from torch._ops import OpOverload  # noqa: E402  (the type of an ATen operator overload: node.target)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode never run under ``torch.compile`` (the planner's tracker): its
    ``__torch_dispatch__`` is called as it is, without the wrapper that keeps Dynamo out of it
    (a Python frame around every op, about 5% of a dry-run)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

#: ``__torch_function__`` of a tensor subclass that only intercepts ``__torch_dispatch__``
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, shape, **kwargs) -> torch.Tensor:
    """A tensor of subclass ``cls`` with ``shape`` and no storage of its own (a wrapper)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def compile_backend_names() -> list[str]:
    """Every backend name ``torch.compile`` accepts here, debug backends included."""
    import torch._dynamo
    return torch._dynamo.list_backends(exclude_tags=())


start_autograd_on_the_devices_present()    # at import: before any FakeTensorMode registers a dummy guard
from functional_pp._torch.cuda_guard import pin_fake_cuda_guard  # noqa: E402

pin_fake_cuda_guard()    # then the fake CUDA guard, owned by a thread no simulated device outlives (cuda_guard.py)
from functional_pp._torch.cpu_attention_meta import correct_cpu_flash_attention_meta  # noqa: E402

correct_cpu_flash_attention_meta()    # float64 CPU attention compiled by inductor (torch 2.11: cpu_attention_meta.py)


def opaque_to_dynamo(fn):
    """``fn`` as one opaque call in dynamo's graph: dynamo does not interpret its bytecode;
    AOT autograd traces it by running it natively on fake tensors (``nonstrict_trace``). Its
    inputs and outputs must be tensors, Python primitives, containers of them, or classes
    registered with :func:`register_pytree_constant`."""
    return torch._dynamo.nonstrict_trace(fn)


def register_pytree_constant(cls: type) -> type:
    """Let instances of ``cls`` (hashable, compared with ``==``; built outside the compiled
    region) be passed to an :func:`opaque_to_dynamo` function as constants."""
    import torch.utils._pytree as pytree
    pytree.register_constant(cls)
    return cls


@contextlib.contextmanager
def counting_interpreted_instructions():
    """Count (in the list's one entry) the bytecode instructions dynamo interprets inside the
    block, on every thread: the measure of its tracing work (docs/compile.md, "Tracing time")."""
    from torch._dynamo import symbolic_convert
    cls = symbolic_convert.InstructionTranslatorBase
    original, counts = cls.step, [0]

    def step(self):
        counts[0] += 1
        return original(self)
    cls.step = step
    try:
        yield counts
    finally:
        cls.step = original
