"""The training step: loss -> gradients (torch.autograd) -> optimizer update, on every device.

``step = train_step(loss_fn, optimizer, mesh=mesh, rules=rules)``; inside a launched
function ``state = step.init(params)`` and ``state, metrics = step(state, batch)``. The
gradients of sharded parameters arrive reduced exactly once over every mesh axis where the
data varied (the named ops' transposes); optimizer state is sharded like the parameters."""
from __future__ import annotations

import functools
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from functional_pp import optim
from functional_pp._torch import compile_cache_limits, is_tracing, trace_backward
from functional_pp._torch.grad_leaves import differentiable, grad_seed
from functional_pp.compile.backend import step_backend
from functional_pp.compile.barrier import materialize
from functional_pp.compile.gate import CompileGate
from functional_pp.compile.layer_compile import compiled_layers, split_mode
from functional_pp.step.native_trace import NativeStep, call_natively, dynamo_traces_step, native_step, run_compiled
from functional_pp.compile.recompute import backward_region, recomputed_leaf, reset_region_ids
from functional_pp.core import step_values
from functional_pp.core.backward_thread import carry_to_backward
from functional_pp.core.layout import Layout, Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.policy import FIELDS as POLICY_FIELDS
from functional_pp.core.policy import Policy
from functional_pp.core.runtime import current_context, current_policy, new_per_thread, use_policy
from functional_pp.devices import mesh_view
from functional_pp.core.tree import leaves_with_paths, tree_flatten, tree_leaves, tree_unflatten
from functional_pp.ops import fake_quant
from functional_pp.ops.token_ids import checks_so_far, deferred_checks, failed_flag, raise_if_bad
from functional_pp.parallel import param_uses
from functional_pp.parallel.buckets import grad_buckets, resolve_pending
from functional_pp.parallel.collectives import psum as sum_over
from functional_pp.parallel.fsdp_order import UnitOrder
from functional_pp.parallel.fsdp_units import begin_forward
from functional_pp.parallel.fsdp_units import fsdp_units as layer_units
from functional_pp.parallel.grads import check_scalar_loss
from functional_pp.parallel.named import Named, make_named, env, settle, wrap
from functional_pp.parallel.shard_map import use_rules
from functional_pp.step import activation_offload, offload
from functional_pp.step.buffers import acc_dtype, as_dtype, master_copy, select_finite
from functional_pp.step.deferred_metrics import PendingSteps, StepMetrics
from functional_pp.step.io import check_batch, peak_memory, read_step_metrics, split_micro
from functional_pp.step.known_finite import KnownFinite, KnownPeaks
from functional_pp.step.nonfinite import NonFiniteError, keep_or_raise  # noqa: F401 (NonFiniteError: public here too)
from functional_pp.step.result import DeviceStepResult
from functional_pp.step.update import Updated, redo_held, update_phase


# the step without gradient buckets and FSDP units: one collective per weight, layer by layer
# (the planner's dry runs count collectives per layer; docs/communication.md)
class NoLayerWarning(UserWarning):
    """An FSDP model declared no ``functional_pp.layer``: each weight is gathered on its own."""


PER_WEIGHT = {"bucket_mb": None, "fsdp_units": False, "fsdp_keep_root": False}
# a step's policy unless told otherwise: it does not recompute (remat=False, whatever the ambient
# value); the other ambient fields inherit functional_pp.configure (docs/policy.md)
STEP_POLICY = Policy(remat=False)
DEFAULT_BATCH_DIMS = {"tokens": "batch seq", "labels": "batch seq", "positions": "seq"}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# every compiled TrainStep of a process adds graphs to the cache of the same function
# (_device_step): dynamo's default of 8 per function would refuse the ninth step built in a
# process (a sweep, a notebook, a test session); docs/compile.md "Many steps in one process"
COMPILED_STEPS_PER_PROCESS = 64
METRICS_MODES = ("per_step", "deferred")


@dataclass
class ParamSpec:
    """Static description of the parameter tree: dim names and layout of every leaf."""
    paths: list[str]
    dims: list[tuple[str, ...]]
    layouts: list[Layout]
    treespec: Any
    trainable: tuple[bool, ...] | None = None    # per leaf: trained (None: every leaf)
    _axes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def frozen(self) -> bool:
        """Whether some leaf is frozen (no gradient, no optimizer state, no gradient collective)."""
        return self.trainable is not None and not all(self.trainable)

    def trainable_tree(self, tree: Any) -> Any:
        """``tree`` (laid out like the parameters) with its frozen leaves left out (``None``, an
        empty subtree): what the optimizer sees; the tree itself when every leaf trains."""
        if not self.frozen:
            return tree
        leaves, spec = tree_flatten(tree)
        return tree_unflatten(spec, [x if t else None for x, t in zip(leaves, self.trainable)])

    def merged(self, leaves: list, treespec: Any, trained: Any) -> Any:
        """The full parameter tree (``treespec``, from this step's flatten) from all its old
        ``leaves`` and the new ``trained`` subtree."""
        if not self.frozen:
            return trained
        new = iter(tree_leaves(trained))
        return tree_unflatten(treespec, [next(new) if t else x for x, t in zip(leaves, self.trainable)])

    def named_types(self, mesh, shapes: tuple) -> list[tuple]:
        """Per leaf of local shape ``shapes[i]``: dims, split, vary, partial and global sizes of
        its named value (the fields :class:`Named` derives), once per mesh and shapes (eager)."""
        key = ("types", mesh, shapes)
        cached = self._axes.get(key)
        if cached is None:
            cached = []
            for shape, dims, layout in zip(shapes, self.dims, self.layouts):
                x = Named(torch.empty(shape, device="meta"), dims, layout)
                cached.append((x.dims, x.split, x.vary, x.partial, x._sizes))
            self._axes[key] = cached
        return cached

    def axis_groups(self, mesh) -> list[tuple[tuple[str, ...], list[int]]]:
        """The trainable leaves' indices (counted among the trainable leaves) grouped by the mesh
        axes (in mesh order) that split them (groups in order of their first leaf): what one
        reduction per group completes; derived once per mesh."""
        key = ("groups", mesh)
        cached = None if is_tracing() else self._axes.get(key)
        if cached is None:
            groups: dict[tuple[str, ...], list[int]] = {}
            layouts = [la for i, la in enumerate(self.layouts) if self.trainable is None or self.trainable[i]]
            for i, layout in enumerate(layouts):
                axes = tuple(a for a in mesh.axis_names if any(a in s for s in layout))
                groups.setdefault(axes, []).append(i)
            cached = list(groups.items())
            if not is_tracing():
                self._axes[key] = cached
        return cached


def _device_of(tree: Any) -> torch.device | None:
    """The device of the first tensor of ``tree`` (None: no tensor)."""
    leaf = next((x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)), None)
    return None if leaf is None else leaf.device


def _run_tensor(run: int, previous: Any, old: Any, device: torch.device) -> torch.Tensor:
    """The state's ``consecutive_skips`` after a per-step read: the old tensor where the run did
    not change (every step of a run without skips: no host-to-device copy), else a new one on
    ``device``."""
    if run == previous and isinstance(old, torch.Tensor) and old.device == device:
        return old
    return torch.tensor(run, dtype=torch.int64, device=device)


@dataclass
class TrainStep:
    """One training step of ``loss_fn`` (built by :func:`train_step`). The fields are its
    settings: numerics (``precision``, ``grad_accum``, ``on_nonfinite``), compilation, and its
    execution ``policy`` (a :class:`~functional_pp.core.policy.Policy`: remat, keep_gathered,
    cp_attention, regather_activations, gradient buckets, FSDP units; docs/policy.md). Shared
    by every device thread: ``spec`` is set once by :meth:`init`."""

    loss_fn: Callable[[Any, dict], Named]
    optimizer: optim.GradientTransformation
    mesh: Mesh | None = None
    rules: Rules = field(default_factory=Rules)
    compile: bool | str = False           # False, True (inductor), a backend name ("aot_eager"), or
    #                                       "per_layer[:backend]": compile each @fpp.layer once
    grad_accum: int = 1
    precision: str = "fp32"               # fp32 | bf16 | fp16 (compute dtype; master weights fp32)
    policy: Policy = STEP_POLICY          # how the ops and collectives execute (docs/policy.md); its
    #                                       fields left None take the ambient functional_pp.configure values
    on_nonfinite: str = "skip"            # skip | raise
    max_consecutive_skips: int | None = 10  # stop after this many skipped steps in a row (None: never)
    lr_schedule: Callable | None = None   # reported in the metrics
    batch_dims: dict = field(default_factory=lambda: dict(DEFAULT_BATCH_DIMS))
    flops_per_token: float | None = None
    peak_flops_per_device: float | None = None
    donate_state: bool = False            # the caller gives up the state passed in: compiled steps
    #                                       write the new state into it (the old state may be overwritten;
    #                                       docs/memory.md "Donated state")
    trainable: Any = None                 # which parameters train: a tree of bools like the parameters,
    #                                       a callable(params) returning one (optim.mask_by_path), or
    #                                       None (all); frozen ones get no gradient, optimizer state or
    #                                       gradient collective (docs/adapters.md "Frozen parameters")
    metrics: str = "per_step"             # per_step: each call reads its metrics (one transfer) | deferred:
    #                                       none does; StepMetrics read at step.read() or first use
    #                                       (docs/eager_overhead.md "Host synchronisation")
    offload_params: bool = False          # master shards, gradients and optimizer state on the host between
    #                                       steps, the update there (FSDP2's CPUOffloadPolicy; step/offload.py)
    activation_offloading: bool = False   # saved activations to pinned host memory in forward, back in
    #                                       backward (CUDA; step/activation_offload.py)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {sorted(PRECISIONS)}")
        if self.on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite {self.on_nonfinite!r}: choose 'skip' or 'raise'")
        if self.metrics not in METRICS_MODES:
            raise ValueError(f"metrics {self.metrics!r}: choose 'per_step' (read after every step) or 'deferred' "
                             f"(read at step.read() or when a value is used)")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"TrainStep(policy=...) needs a functional_pp.Policy, got {type(self.policy).__name__}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        for lever in ("offload_params", "activation_offloading"):
            if getattr(self, lever) and split_mode(self.compile)[0]:
                raise ValueError(f"train_step({lever}=True, compile={self.compile!r}): a compiled step cannot "
                                 f"offload yet; use compile=False or compile='per_layer' (each layer compiled, "
                                 f"the step eager; docs/memory.md)")
        if self.max_consecutive_skips is not None and (
                isinstance(self.max_consecutive_skips, bool) or not isinstance(self.max_consecutive_skips, int)
                or self.max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be an integer >= 1 (or None: never stop), got "
                             f"{self.max_consecutive_skips!r}")
        self.spec: ParamSpec | None = None
        self._compiled = None
        self._compiled_new_buffers = None       # a held compiled donated step's redo (_redo_without_donation)
        self._natives: dict = {}                # natively traced step functions by settings (_native_step)
        self._compile_lock = threading.Lock()   # simulated devices share one compiled step
        self._unit_order = UnitOrder()          # FSDP units' forward order, for prefetch (parallel/fsdp_order.py)
        self._no_layers = False                 # a forward called no fpp.layer: no root kept (_root_had_no_layers)
        self._layered = False                   # a forward called fpp.layer: the root is kept from the start
        self._shared = new_per_thread()         # per device: parameters its first forward gathered twice (tied)
        self._compute = new_per_thread()        # offload_params: per device, where the step computes (step.init)
        self._said_not_offloaded: list = []     # activation_offloading off CUDA: said once (step/activation_offload.py)
        self._unread = new_per_thread()        # metrics="deferred": each device thread's PendingSteps
        self._known_finite = KnownFinite()      # donated state: whether its parameters are finite (step/known_finite.py)
        self._known_peaks = KnownPeaks()        # compiled donated state: its first moments' peaks (same)
        # the bound a donated step writes under (docs/optim.md "Bound before the update"), looked up once
        self._donated_bound = optim.update_bound(self.optimizer) if self.donate_state else None

    # -------------------------------------------------------------------- init
    def init(self, params: Any) -> dict:
        """Training state from a tree of named parameters (``functional_pp.init``): fp32
        master shards of the trained parameters (frozen ones keep their dtype), optimizer state
        (sharded like the parameters), step counters."""
        import optree
        leaves, treespec = optree.tree_flatten(params, none_is_leaf=False)
        bad = [p for p, x in leaves_with_paths(params) if not isinstance(x, Named)]
        if bad:
            raise TypeError(f"step.init needs named parameters (from functional_pp.init); {bad[0]!r} is a "
                            f"{type(dict(leaves_with_paths(params))[bad[0]]).__name__}")
        paths = [p for p, _ in leaves_with_paths(params)]
        spec = ParamSpec(paths, [x.dims for x in leaves], [x.split for x in leaves], treespec,
                         trainable_flags(self.trainable, params, leaves))
        with self._compile_lock:     # set once, read by every device: never changed under a running step
            if self.spec is None:
                self.spec = spec
            elif (self.spec.paths, self.spec.dims, self.spec.layouts, self.spec.trainable) != (
                    spec.paths, spec.dims, spec.layouts, spec.trainable):
                where = next((f"{p}: dims {a} layout {la} vs {b} {lb}" for p, a, la, b, lb in zip(
                    spec.paths, self.spec.dims, self.spec.layouts, spec.dims, spec.layouts) if (a, la) != (b, lb)),
                    f"parameter paths {self.spec.paths[:3]}... vs {spec.paths[:3]}...")
                raise ValueError(f"step.init: this step was initialised with other parameters ({where}); "
                                 f"every device must pass the same tree, and another model needs its own "
                                 f"train_step")
        flags = self.spec.trainable or (True,) * len(leaves)
        # frozen parameters keep their dtype (a bf16 base stays bf16): only trained ones need fp32 masters
        copies = [master_copy(x.data) if t else x.data.detach().contiguous() for x, t in zip(leaves, flags)]
        if self.offload_params:     # the state on the host; the step computes where the parameters were
            compute = self._compute.device = copies[0].device
            copies = [offload.to_host(x, compute) for x in copies]
        master = optree.tree_unflatten(treespec, copies)
        # the counters live with the parameters: a step adds to them there (no host copy)
        device = _device_of(master)
        return {"params": master, "opt_state": self.optimizer.init(self.spec.trainable_tree(master)),
                "step": torch.zeros((), dtype=torch.int64, device=device),
                "skipped": torch.zeros((), dtype=torch.int64, device=device),
                "consecutive_skips": torch.zeros((), dtype=torch.int64, device=device)}

    # ------------------------------------------------------------- the step
    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict | StepMetrics]:
        """One step: ``(new state, metrics)``. With ``metrics="per_step"`` the metrics are Python
        numbers, read after the step (one transfer) and the host checks done; with
        ``metrics="deferred"`` a :class:`StepMetrics` read later with every unread step
        (:meth:`read`), skipped steps chosen on the device (docs/eager_overhead.md)."""
        if self.spec is None:
            raise RuntimeError("call step.init(params) before the first step")
        if self.mesh is not None and current_context(required=False) is not None:
            mesh = current_context().mesh
            if mesh != self.mesh:
                raise ValueError(f"train_step was built for {self.mesh} but runs on {mesh}")
        batch = {k: (v.data if isinstance(v, Named) else v) for k, v in batch.items()}
        check_batch(batch)
        unknown = [k for k in batch if k not in self.batch_dims]
        if unknown:
            raise ValueError(f"batch key {unknown[0]!r} has no dimension names; pass batch_dims="
                             f"{{{unknown[0]!r}: 'batch seq', ...}} to train_step")
        fn = self._device_step
        step_compile, layer_compile = split_mode(self.compile)   # compile="per_layer": layers only
        if step_compile or layer_compile:
            mesh_view.refuse_batched(ValueError(
                f"train_step(compile={self.compile!r}) cannot run in a batched simulation (it runs eager ops over "
                f"a device dimension; docs/simulation.md): use compile=False there, or launch(simulate=True) to "
                f"simulate the compiled step"))
        if step_compile:
            with self._compile_lock:     # one wrapper (one backend) for every device thread
                if self._compiled is None:
                    self._compiled = self._compile(self._device_step)
            fn = self._compiled
            reset_region_ids()       # same guard state every call: no recompilation
        t0 = time.perf_counter()
        finite = self._params_finite(state["params"])
        bound, peaks = self._carried_peaks(state) if step_compile else (None, None)
        with self._settings(step_compile, layer_compile), \
                deferred_checks() as id_checks:     # token-id checks, raised after the step
            out: DeviceStepResult = fn(
                state["params"], state["opt_state"], state["step"], state["skipped"], batch, finite, peaks,
                grad_seed(_device_of(state["params"]), bool(step_compile)))
        params, opt_state, step, skipped, m = out.params, out.opt_state, out.step, out.skipped, out.metrics
        written, retry, peaks = out.written, out.retry, out.peaks
        out = None
        if self.metrics == "deferred":
            self._known_finite.remember(tree_leaves(params), finite)
            if bound is not None:
                self._known_peaks.remember_peaks(bound, opt_state, self.spec.trainable_tree(params), peaks)
            return self._defer(state, params, opt_state, step, skipped, m, written, id_checks, t0)
        if "consecutive_skips" in state:     # read with the metrics: one transfer
            m = {**m, "consecutive_skips": torch.as_tensor(state["consecutive_skips"])}
        metrics, bad_ids = read_step_metrics(m, step, id_checks)    # the step's one device-to-host read
        if bad_ids:
            raise_if_bad(id_checks)      # out-of-range token ids / labels (docs/bad_inputs.md §1)
        if metrics.pop("update_held", 0):     # rare: nothing written in place; update in new buffers
            if retry is None:    # a compiled step: run again without donation (docs/compile.md)
                retry = functools.partial(self._redo_without_donation, state, batch)
            params, opt_state, skipped, metrics = redo_held(retry, state["skipped"], metrics)
            written, peaks = False, None     # (new buffers, or the old state: read at the next step)
        # the state to return, or a NonFiniteError: chosen after the one read (step/nonfinite.py)
        params, opt_state, run = keep_or_raise(metrics, state, params, opt_state, written=written,
                                               on_nonfinite=self.on_nonfinite,
                                               max_consecutive_skips=self.max_consecutive_skips)
        self._known_finite.remember(tree_leaves(params), finite)
        if bound is not None:
            self._known_peaks.remember_peaks(bound, opt_state, self.spec.trainable_tree(params), peaks)
        self._host_values(metrics, time.perf_counter() - t0)
        metrics["peak_memory_bytes"] = peak_memory(self._offloaded_to() or _device_of(params))
        previous = metrics.get("consecutive_skips")
        metrics["consecutive_skips"] = run
        return {"params": params, "opt_state": opt_state, "step": step, "skipped": skipped,
                "consecutive_skips": _run_tensor(run, previous, state.get("consecutive_skips"), step.device)}, metrics

    def trace(self, state: dict, batch: dict) -> DeviceStepResult:
        """The step's device function run once on ``state`` and this device's ``batch`` (tensors
        or named values), eager and without the host's part: nothing compiled, no metrics read,
        no skip chosen, no counters kept. The hook the planner measures a step with (on meta
        tensors, plan/dryrun.py); run it under :meth:`apply_policy` and the step's rules."""
        if self.spec is None:
            raise RuntimeError("call step.init(params) before step.trace")
        return self._device_step(state["params"], state["opt_state"], state["step"], state["skipped"], batch)

    def _params_finite(self, params: Any) -> torch.Tensor | None:
        """A donated step whose optimizer's bound needs finite parameters: whether ``params`` are
        (0-dim bool, read only for a state no step returned; docs/optim.md "Bound before the
        update"); else None."""
        bound = self._donated_bound
        return self._known_finite.flag(tree_leaves(params)) if getattr(bound, "needs_finite_params", False) else None

    def _carried_peaks(self, state: dict) -> tuple[Any, list[torch.Tensor] | None]:
        """A compiled donated step whose optimizer's bound carries its terms' peaks (AdamW's first
        moments): the bound and the peaks of ``state`` (remembered, or read on the device for a
        state no step returned; docs/optim.md "Peaks carried instead of read"); else (None, None)."""
        bound = self._donated_bound
        carried = getattr(bound, "carried", None)
        if carried is None or not carried.applies(state["opt_state"]):
            return None, None
        return bound, self._known_peaks.peaks(bound, state["opt_state"], self.spec.trainable_tree(state["params"]))

    def _host_values(self, metrics: dict, seconds: float, window_steps: int = 1) -> None:
        """The host's figures of a step that took ``seconds``: step_time_avg_s, tokens_per_s_avg, mfu_avg;
        ``window_steps``: how many steps that time is the average of (deferred metrics read a
        window of steps at once), recorded with them."""
        metrics["step_time_avg_s"] = seconds
        metrics["window_steps"] = window_steps
        metrics["tokens_per_s_avg"] = metrics["tokens"] / seconds if seconds > 0 else float("nan")
        if self.flops_per_token and self.peak_flops_per_device:
            n = (self.mesh.size if self.mesh else 1)
            metrics["mfu_avg"] = metrics["tokens_per_s_avg"] * self.flops_per_token / (self.peak_flops_per_device * n)

    def _defer(self, state, params, opt_state, step, skipped, m, written, id_checks, t0) -> tuple[dict, StepMetrics]:
        """metrics="deferred": the new state (a skipped step's already chosen on the device) and
        the step's metrics kept unread; the run of skipped steps counted on the device."""
        run = state.get("consecutive_skips")
        skip = m["skipped"]
        run = skip if run is None else (torch.as_tensor(run) + skip) * skip    # +1, or 0 after a taken step
        window = getattr(self._unread, "steps", None)
        if window is None:
            window = self._unread.steps = PendingSteps(self._host_values, on_nonfinite=self.on_nonfinite,
                                                       max_consecutive_skips=self.max_consecutive_skips)
        metrics = window.add(m, step, run, id_checks, written=written, started=t0)
        return {"params": params, "opt_state": opt_state, "step": step, "skipped": skipped,
                "consecutive_skips": run}, metrics

    def read(self) -> list[StepMetrics]:
        """metrics="deferred": read this device's unread steps in one transfer and run their host
        checks in order (raising for the first failing step: NonFiniteError, TokenIdError);
        returns their metrics. Nothing to do (an empty list) in the per-step mode."""
        window = getattr(self._unread, "steps", None)
        return window.read() if window is not None else []

    def _compile(self, fn: Callable[..., Any]) -> CompileGate:
        """``fn`` (a device step) compiled, called with ``fn``'s arguments: simulated devices
        share one compilation (compile/gate.py); dynamo sees one opaque call traced natively
        (step/native_trace.py) unless ``FPP_STEP_TRACE=dynamo``; static shapes."""
        backend = step_backend(split_mode(self.compile)[0], self.policy.bucket_mb, self.policy.overlap,
                               self.policy.collectives_in_flight)
        if dynamo_traces_step():
            return CompileGate(torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), fn.__code__)
        return CompileGate(torch.compile(call_natively, backend=backend, fullgraph=True, dynamic=False),
                           call_natively.__code__,
                           call=lambda compiled, *args: run_compiled(compiled, self._native_step(fn, args), args))

    def _native_step(self, fn: Callable[..., Any], args: tuple) -> NativeStep:
        """``fn`` with the structure of ``args`` and what its native trace reads beyond them:
        the mesh, the kind of device, the policy in force, and the device's rank where the
        trace read it (step/native_trace.py)."""
        ctx = current_context(required=False)
        settings = (getattr(ctx, "mesh", None), type(getattr(ctx, "backend", None)).__name__, self.resolved_policy(),
                    fake_quant.enabled())          # (QAT's switch, read by the traced loss: a graph per value)
        step = native_step(fn, settings, args)
        with self._compile_lock:
            step = self._natives.setdefault(step.key, step)
            if step.read_rank is not None and step.read_rank != ctx.rank:    # a graph per device
                step = native_step(fn, (*settings, ctx.rank), args)
                step = self._natives.setdefault(step.key, step)
        return step

    @contextmanager
    def _settings(self, step_compile: Any, layer_compile: Any) -> Iterator[None]:
        """The step's thread-local settings, set outside the compiled region."""
        compiling = bool(step_compile or layer_compile)
        # (compile="per_layer" gathers inside each compiled layer, per weight: nothing is root there)
        policy = self.policy
        keep_root = policy.fsdp_keep_root and not layer_compile and not self._no_layers
        # until a forward has shown whether the model calls fpp.layer, the root is kept only from
        # the first layer call on: a model without layers is ZeRO-3 from its first step
        with use_rules(self.rules), trace_backward(bool(step_compile)), self.apply_policy(), \
                compile_cache_limits(COMPILED_STEPS_PER_PROCESS) if compiling else nullcontext(), \
                compiled_layers(step_backend(layer_compile) if layer_compile else None), \
                layer_units(policy.fsdp_units, keep_root=keep_root, prefetch=policy.fsdp_prefetch,
                            order=self._unit_order, provisional_root=not self._layered,
                            data_dims=self._batch_dim_names(), in_flight=policy.collectives_in_flight) as seen:
            yield
        if seen.layered:
            self._layered = True
        elif seen.root_without_layers and policy.fsdp_units:
            self._root_had_no_layers()

    def _batch_dim_names(self) -> tuple[str, ...]:
        """The dimension names of the step's batch (``batch_dims``), in order, once each: the
        rules' axes for them are the data-parallel axes (FSDP units, parallel/fsdp_units.py)."""
        names = [d for dims in self.batch_dims.values() for d in (dims.split() if isinstance(dims, str) else dims)]
        return tuple(dict.fromkeys(names))

    def _root_had_no_layers(self) -> None:
        """The forward called no ``fpp.layer`` under FSDP: every weight is a root weight. Say so
        once; every step (the first included) re-gathers each weight in backward (ZeRO-3 per
        weight)."""
        with self._compile_lock:
            if self._no_layers:
                return
            self._no_layers = True
        warnings.warn(
            "train_step: the model calls no functional_pp.layer, so under FSDP every sharded weight is "
            "all-gathered per weight by the op that uses it and all-gathered again in backward (ZeRO-3, "
            "from the first step on): correct, with ZeRO-3's memory, but in many small collectives that "
            "cannot be prefetched. Wrap the model's repeated block in functional_pp.layer to gather each "
            "layer's weights as one unit (one flat all-gather, prefetched while the layer before computes).",
            NoLayerWarning, stacklevel=4)

    def _redo_without_donation(self, state: dict, batch: dict) -> Updated:
        """A held compiled donated step (its state passed in untouched: nothing was written) made
        again by the compiled step without donation (a second graph, compiled at the first held
        step): the update in new buffers, checked as such a step checks it."""
        step_compile, layer_compile = split_mode(self.compile)
        with self._compile_lock:
            if self._compiled_new_buffers is None:
                self._compiled_new_buffers = self._compile(self._device_step_new_buffers)
        reset_region_ids()
        with self._settings(step_compile, layer_compile), deferred_checks():   # (ids checked by the step)
            out = self._compiled_new_buffers(
                state["params"], state["opt_state"], state["step"], state["skipped"], batch,
                grad_seed(_device_of(state["params"]), True))
        m = out.metrics
        return Updated(out.params, out.opt_state, m["grad_norm"], {"nonfinite_update": m["nonfinite_update"]},
                       m["skipped"] == 0, False)

    def _device_step_new_buffers(self, params, opt_state, step, skipped, batch, seed=None):
        return self._device_step(params, opt_state, step, skipped, batch, seed=seed, donate_state=False)

    def resolved_policy(self) -> Policy:
        """The policy the step's ops run under: its ``policy`` (16-bit ``precision`` summing
        16-bit values in fp32 unless the policy names a ``reduce_dtype``), the fields left None
        taken from the ambient :func:`functional_pp.configure` values (docs/policy.md)."""
        policy = self.policy
        if policy.reduce_dtype is None and PRECISIONS[self.precision] is not None:
            policy = policy.replace(reduce_dtype=torch.float32)
        return policy.over(current_policy())

    def apply_policy(self) -> ContextManager[Policy]:
        """Put :meth:`resolved_policy` in force for the block: around the step, ``step.gradients``,
        ``app.evaluate.evaluate`` and the planner's dry runs, so the loss computes the same way
        in all of them."""
        return use_policy(self.resolved_policy())

    def gradients(self, state: dict, batch: dict) -> tuple[torch.Tensor, Any]:
        """The loss and the reduced gradients (named, laid out like the parameters) this step
        would compute for ``batch``, without updating anything (functional_pp.value_and_grad)."""
        import optree

        from functional_pp.parallel.grads import value_and_grad
        if self.spec is None:
            raise RuntimeError("call step.init(params) before step.gradients")
        leaves, treespec = optree.tree_flatten(state["params"], none_is_leaf=False)
        with use_rules(self.rules), self.apply_policy():
            named_batch = {k: v if isinstance(v, Named) else wrap(v, self.batch_dims[k]) for k, v in batch.items()}
            return value_and_grad(self.loss_fn, self._named_params(leaves, treespec), named_batch)

    def named_params(self, params: Any) -> Any:
        """The training state's fp32 master ``params`` as the named values the loss sees (cast to
        the compute precision, laid out as at :meth:`init`)."""
        import optree
        leaves, treespec = optree.tree_flatten(params, none_is_leaf=False)
        return self._named_params(leaves, treespec)

    def _named_params(self, leaves: list[torch.Tensor], treespec) -> Any:
        return tree_unflatten(treespec, self._named_leaves(leaves))

    def _named_leaves(self, leaves: list[torch.Tensor], cast: bool = True) -> list[Named]:
        """The parameters as the named values the loss sees, cast to the compute precision
        (``cast``) or not."""
        compute = PRECISIONS[self.precision] if cast else None
        device = self._offloaded_to()
        if device is not None:      # offload: host shards (evaluation, step.gradients) to the compute device
            leaves = [x.to(device) if x.device != device else x for x in leaves]
        if compute is not None:
            leaves = [x.to(compute) if x.is_floating_point() else x for x in leaves]
        elif cast:      # fp32 compute: a frozen 16-bit parameter (kept in its dtype by init) is upcast
            leaves = [x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x for x in leaves]
        if is_tracing():
            named = [Named(x, dims, layout, is_param=True)
                     for x, dims, layout in zip(leaves, self.spec.dims, self.spec.layouts)]
        else:    # eager: the named types (frozensets, global sizes) are built once per mesh and shapes
            # parameters an earlier forward gathered at several sites are tied (parallel/param_uses.py)
            tied = getattr(self._shared, "tied", None) or ()
            types = self.spec.named_types(env()[0], tuple(x.shape for x in leaves))
            named = [make_named(x, *t, is_param=True, tied=i in tied) for i, (x, t) in enumerate(zip(leaves, types))]
        return named

    def _offloaded_to(self) -> torch.device | None:
        """offload_params: the device this thread's step computes on (set by :meth:`init`); else None."""
        if not self.offload_params:
            return None
        device = getattr(self._compute, "device", None)
        if device is None:
            raise RuntimeError("train_step(offload_params=True): call step.init(params) on this device first "
                               "(it moves the state to the host and remembers the compute device)")
        return device

    def _device_step(self, params, opt_state, step, skipped, batch, params_finite=None, peaks=None,
                     seed=None, donate_state: bool | None = None) -> DeviceStepResult:
        # seed: what the parameters are made differentiable with in a compiled step on a
        # torch whose dynamo cannot (_torch/grad_leaves.py); None otherwise
        leaves, treespec = tree_flatten(params)
        trains = self.spec.trainable or (True,) * len(leaves)
        micro = split_micro(batch, self.grad_accum)
        weights, tokens = self._micro_weights(micro)
        compute_device, work = self._offloaded_to(), leaves
        if compute_device is not None:   # offload: the shards on the device for this step, in the compute precision
            compute = PRECISIONS[self.precision]
            work = [offload.to_compute(x, compute_device, compute if t else None) for x, t in zip(leaves, trains)]
        grads = [torch.zeros_like(x, device=w.device) if len(micro) > 1 else w
                 for x, w, t in zip(leaves, work, trains) if t]   # (dtype template)
        acc = acc_dtype(leaves)
        total = torch.zeros((), dtype=acc, device=work[0].device)
        reported = []                    # the values the loss reports (core/step_values.py), per micro-batch
        for mb, w in zip(micro, weights):
            # frozen leaves enter without requires_grad: autograd computes no gradient for them, so
            # no transpose runs (no DP all-reduce, no FSDP reduce-scatter; docs/adapters.md)
            xs = [_differentiable(x, seed, x.is_floating_point() and t) for x, t in zip(work, trains)]
            named_batch = {k: wrap(v, self.batch_dims[k]) for k, v in mb.items()}
            named_params = self._named_params(xs, treespec)
            begin_forward(named_params)     # FSDP forward prefetch follows the last forward's units
            checked = checks_so_far()
            learning = not is_tracing() and getattr(self._shared, "tied", None) is None   # (eager steps)
            acts = (activation_offload.offloading(_device_of(work), self._said_not_offloaded)
                    if self.activation_offloading else nullcontext())
            with step_values.collecting() as found, param_uses.counting(learning) as uses, acts:
                loss_named = settle(self.loss_fn(named_params, named_batch))
            if learning:                    # parameters gathered at several sites: tied from now on
                self._shared.tied = param_uses.gathered_more_than_once(
                    uses, [x.data for x in tree_leaves(named_params)])
            reported.append(found)
            named_params = None
            check_scalar_loss(loss_named, "train_step")
            loss = loss_named.data.to(acc) * w.to(acc)
            if self.metrics == "deferred":
                loss = self._non_finite_if_bad_ids(loss, checked)
            diff = [x for x in xs if x.requires_grad]
            with backward_region(), grad_buckets(self.policy.bucket_mb) as buckets:   # docs/communication.md
                # (CUDA runs backward on autograd's own thread: it gets this thread's state)
                gs = torch.autograd.grad(carry_to_backward(loss), diff)
                gs = iter(buckets.finish(gs) if buckets is not None else resolve_pending(gs))
            xs = [x for x, t in zip(xs, trains) if t]
            if len(micro) == 1:          # no accumulation buffer needed
                grads = [as_dtype(next(gs), g.dtype) if x.requires_grad else g for g, x in zip(grads, xs)]
            else:
                grads = [g + next(gs).to(g.dtype) if x.requires_grad else g for g, x in zip(grads, xs)]
            gs = None                    # release the per-micro-batch gradients
            total = total + loss.detach()
        if is_tracing() and PRECISIONS[self.precision] is not None:
            grads = [materialize(g) for g in grads]   # keep 16-bit gradient math out of the update kernel
        if compute_device is not None:   # offload: the gradients and the update on the host
            work = xs = None
            masters = [x for x, t in zip(leaves, trains) if t]
            grads = [offload.grad_to_host(g, x.dtype) for g, x in zip(grads, masters)]
            total = total.to(offload.HOST)
        # norm, optimizer and the device side of the non-finite guard (step/update.py)
        trained = self.spec.trainable_tree(params)      # the optimizer's tree: the trainable leaves
        up = update_phase(self.optimizer, grads, tree_flatten(trained)[1], trained, opt_state, total,
                          self.spec.axis_groups(env()[0]),
                          donate_state=self.donate_state if donate_state is None else donate_state,
                          params_finite=params_finite, peaks=peaks, reduce_on=compute_device)
        if self.metrics == "deferred" and not up.written:     # the skip chosen on the device
            up.params, up.opt_state = self._keep_old_if_skipped(up, tree_leaves(trained), opt_state)
        up.params = self.spec.merged(leaves, treespec, up.params)     # the frozen leaves as they were
        lr = self.lr_schedule(step) if self.lr_schedule is not None else torch.zeros((), device=total.device)
        skip = (~up.finite).to(torch.int64)
        metrics = {"loss": total, "grad_norm": up.grad_norm,
                   "lr": torch.as_tensor(lr, dtype=torch.float32, device=total.device),
                   "tokens": tokens, "skipped": skip, **{k: v.to(torch.int64) for k, v in up.flags.items()},
                   **step_values.combine(reported)}
        return DeviceStepResult(up.params, up.opt_state, step + 1, skipped + skip, metrics, up.written, up.retry,
                                up.peaks)

    @staticmethod
    def _keep_old_if_skipped(up, old_params: list, old_opt_state: Any) -> tuple[Any, Any]:
        """metrics="deferred", a state made in new buffers: the new parameters and optimizer
        state of ``up`` where the step is finite, else the old ones, selected on the device
        (``up``'s references are dropped first, so each new buffer is freed once its select is
        made; docs/eager_overhead.md "Host synchronisation")."""
        new_params, params_spec = tree_flatten(up.params)
        new_state, state_spec = tree_flatten(up.opt_state)
        new = [*new_params, *new_state]
        up.params = up.opt_state = new_params = new_state = None
        new = select_finite(up.finite, new, [*old_params, *tree_leaves(old_opt_state)])
        n = len(old_params)
        return tree_unflatten(params_spec, new[:n]), tree_unflatten(state_spec, new[n:])

    @staticmethod
    def _non_finite_if_bad_ids(loss: torch.Tensor, since: int) -> torch.Tensor:
        """metrics="deferred": the loss divided by 0 where a token-id check of this micro-batch
        failed (by 1 otherwise), so its gradient is not finite and reaches every device through
        the gradient reductions: the non-finite guard skips the step everywhere (the error is
        raised at the read; docs/bad_inputs.md §1)."""
        bad = failed_flag(since)
        return loss if bad is None else loss / ~bad

    def _micro_weights(self, micro: list[dict]):
        """Weight of each micro-batch: its share of the (global) non-ignored labels, so that
        accumulation equals one large batch. Also returns the global token count."""
        counts = [self._token_count(mb) for mb in micro]
        if len(counts) == 1:
            # c / max(c, 1) in one op: 1, or 0 when every label is ignored (docs/eager_overhead.md)
            return [counts[0].clamp_max(1)], counts[0]
        total = sum(counts[1:], counts[0])
        # every label ignored: a zero-weight step (loss 0, no gradient), not 0/0
        return [c / total.clamp_min(1) for c in counts], total

    def _token_count(self, mb: dict) -> torch.Tensor:
        """The global number (float64) of non-ignored labels of a micro-batch (of elements of its
        first entry without labels): counted here, summed over the mesh axes splitting it."""
        key = "labels" if "labels" in mb else next(iter(mb))
        x = wrap(mb[key], self.batch_dims[key])
        n = (torch.count_nonzero(x.data != -100) if key == "labels" else
             torch.full((), x.data.numel(), device=x.data.device)).to(torch.float64)
        axes = {a for s in x.split for a in s}
        return sum_over(n, tuple(a for a in env()[0].axis_names if a in axes)) if axes else n


def trainable_flags(trainable: Any, params: Any, leaves: list[Named]) -> tuple[bool, ...] | None:
    """Per parameter leaf whether it trains (``TrainStep.trainable`` resolved against the named
    ``params``: a tree of bools or a callable returning one); None where all do. A
    non-floating leaf never trains."""
    if trainable is None:
        return None
    flags = tuple(tree_leaves(optim.resolve_mask(trainable, params)))
    flags = tuple(f and x.data.is_floating_point() for f, x in zip(flags, leaves))
    if not any(flags):
        raise ValueError("train_step(trainable=...): no parameter is trainable; mark at least one leaf True "
                         "(or pass trainable=None to train them all)")
    return flags


def step_options(options: dict, where: str = "train_step") -> dict:
    """A step builder's keyword ``options`` with the policy settings among them (``remat=``,
    ``keep_gathered=``, ``bucket_mb=``, ...: the fields of :class:`Policy`) gathered into one
    ``policy`` (on top of ``policy=`` if given, else of the step's default)."""
    settings = {k: options.pop(k) for k in list(options) if k in POLICY_FIELDS}
    base = options.pop("policy", STEP_POLICY)
    if not isinstance(base, Policy):
        raise TypeError(f"{where}(policy=...) needs a functional_pp.Policy, got {type(base).__name__}")
    return {**options, "policy": base.replace(**settings) if settings else base}


def train_step(loss_fn: Callable[[Any, dict], Named], optimizer: optim.GradientTransformation, *,
               mesh: Mesh | None = None, rules: Rules | None = None, **options) -> TrainStep:
    """Build a training step: see :class:`TrainStep` for the options (compile, grad_accum,
    precision, on_nonfinite, lr_schedule, batch_dims, flops_per_token, ...). Its execution
    policy is ``policy=`` (a :class:`Policy`) and/or its fields as keywords (remat,
    keep_gathered, cp_attention, regather_activations, check_rep, bucket_mb, fsdp_units,
    fsdp_keep_root, fsdp_prefetch, collectives_in_flight, overlap), which change that policy
    (docs/policy.md)."""
    if rules is not None and mesh is not None:
        rules.check(mesh)
    return TrainStep(loss_fn, optimizer, mesh=mesh, rules=rules or Rules(), **step_options(dict(options)))


def _differentiable(x, seed, requires):
    """A leaf to differentiate against (_torch/grad_leaves.py). Where it is ``x + seed`` (a new
    tensor in the traced graph, not the parameter's own storage), its backward uses read a copy
    made again in backward, so the step does not keep a second copy of every parameter until
    then (compile/recompute.py)."""
    if seed is None or not requires:
        return differentiable(x, seed, requires)
    with recomputed_leaf():
        return differentiable(x, seed, requires)
