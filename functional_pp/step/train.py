"""The training step: loss -> gradients (torch.autograd) -> optimizer update, on every device.

``step = train_step(loss_fn, optimizer, mesh=mesh, rules=rules)``; inside a launched
function ``state = step.init(params)`` and ``state, metrics = step(state, batch)``. The
gradients of sharded parameters arrive reduced exactly once over every mesh axis where the
data varied (the named ops' transposes); optimizer state is sharded like the parameters."""
from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from functional_pp import optim
from functional_pp._torch import compile_cache_limits, is_tracing, trace_backward
from functional_pp._torch.grad_leaves import grad_seed
from functional_pp.parallel.step_backend import step_backend
from functional_pp.compile.layer_compile import compiled_layers, split_mode
from functional_pp.compile.recompute import reset_region_ids
from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh, require_mesh
from functional_pp.core.policy import Policy
from functional_pp.core.runtime import current_context, current_policy, new_per_thread, use_policy
from functional_pp.core.tree import leaves_with_paths, tree_leaves, tree_unflatten
from functional_pp.devices import mesh_view
from functional_pp.ops.token_ids import deferred_checks
from functional_pp.parallel.fsdp.role import role as param_role
from functional_pp.parallel.named import Named, make_named, env, wrap
from functional_pp.parallel.shard_map import use_rules
from functional_pp.step import offload
from functional_pp.step.buffers import device_of, master_copy
from functional_pp.step.compiled_step import COMPILED_STEPS_PER_PROCESS, CompiledStep
from functional_pp.step.deferred_metrics import StepMetrics
from functional_pp.step.device_step import DeviceFunction, PlainDeviceStep
from functional_pp.step.io import check_batch, unwrap_batch
from functional_pp.step.known_finite import DonatedBound
from functional_pp.step.layering import LayerUse, NoLayerWarning
from functional_pp.step.metrics_modes import HostView, metrics_mode
from functional_pp.step.precision_cast import cast_floating
from functional_pp.step.nonfinite import NonFiniteError  # noqa: F401 (public here too)
from functional_pp.step.result import DeviceStepResult
from functional_pp.step.state_check import state_mismatch, state_signature
from functional_pp.step.settings import (DEFAULT_BATCH_DIMS, METRICS_MODES, PER_WEIGHT, PRECISIONS, STEP_POLICY,
                                         ParamSpec, StepSettings, step_options, trainable_flags)
from functional_pp.step.update import UpdateStrategy, choose_update

# (imported from here by the planner, the pipeline step and the tests)
__all__ = ["TrainStep", "train_step", "NoLayerWarning", "NonFiniteError", "ParamSpec", "StepSettings",
           "DEFAULT_BATCH_DIMS", "METRICS_MODES", "PER_WEIGHT", "PRECISIONS", "STEP_POLICY",
           "COMPILED_STEPS_PER_PROCESS", "step_options", "trainable_flags"]


@dataclass
class TrainStep(StepSettings):
    """One training step of ``loss_fn`` (built by :func:`train_step`): its settings
    (:class:`~functional_pp.step.settings.StepSettings`, checked when built) and the parts built
    from them once, when the step is built:

    - the device function (``device``, step/device_step.py: :class:`~functional_pp.step.device_step.PlainDeviceStep`,
      or the pipeline's schedule that ``pipeline_step`` gives it), run eager, or compiled by a
      :class:`~functional_pp.step.compiled_step.CompiledStep`;
    - the metrics mode (step/metrics_modes.py): read every step, or the deferred wrapper;
    - what a donated step carries for its optimizer's bound (:class:`~functional_pp.step.known_finite.DonatedBound`);
    - what a forward showed of the model's layers under FSDP units, and the one warning for a
      model without any (:class:`~functional_pp.step.layering.LayerUse`).

    Shared by every device thread: ``spec`` is set once by :meth:`init`."""

    device: DeviceFunction | None = field(default=None, repr=False, compare=False)   # None: PlainDeviceStep()

    def __post_init__(self):
        super().__post_init__()
        self.device = self.device if self.device is not None else PlainDeviceStep()
        self.device.bind(self)      # (first: it may refuse a setting by name; step/pipeline.py)
        self.spec: ParamSpec | None = None
        self._rules_checked = False      # Rules.check_used after the first step
        self._compile_lock = threading.Lock()   # simulated devices share one spec (and a pipeline's stages)
        self._compiled = CompiledStep(lambda: split_mode(self.compile)[0], lambda: self.policy, self.resolved_policy)
        self._layers = LayerUse()               # fpp.layer calls seen, FSDP units' order (step/layering.py)
        self._shared = new_per_thread()         # per device: parameters its first forward gathered twice (tied)
        self._init_state = new_per_thread()     # per device: the shapes step.init made (step/state_check.py)
        self._compute = new_per_thread()        # offload_params: per device, where the step computes (step.init)
        self._said_not_offloaded: list = []     # activation_offloading off CUDA: said once (step/activation_offload.py)
        self._bound = DonatedBound(self.optimizer, self.donate_state)   # donated state: step/known_finite.py
        # in place, in new buffers or written under a guard (step/update.py), chosen once
        self._update = choose_update(self.optimizer, donate_state=self.donate_state,
                                     compiled=bool(split_mode(self.compile)[0]), bound=self._bound.bound)
        self._metrics = metrics_mode(self.metrics, HostView(
            on_nonfinite=self.on_nonfinite, max_consecutive_skips=self.max_consecutive_skips,
            host_values=self._host_values, compute_device=self._offloaded_to,
            redo=functools.partial(self._update.redo, self)))

    # -------------------------------------------------------------------- init
    def init(self, params: Any) -> dict:
        """Training state from a tree of named parameters (``functional_pp.init``): fp32
        master shards of the trained parameters (frozen ones keep their dtype), optimizer state
        (sharded like the parameters), step counters; under a pipeline, this device's stages'
        (its device function's ``init``)."""
        state = self.device.init(params)
        if getattr(self._init_state, "signature", None) is None:    # the first: a failing step's diagnosis
            self._init_state.signature = state_signature(state)
        return state

    def logical_state(self, state: dict) -> dict:
        """The whole training state, as one device (``train_step`` without ``pp``) holds it: the
        state itself, or under a pipeline every stage's layers gathered (step/pipeline.py)."""
        return self.device.logical_state(state)

    def logical_params(self, params: Any) -> Any:
        """The whole parameter tree (:meth:`logical_state`'s parameters): what a forward of the
        whole model needs (GRPO's sampling)."""
        return self.device.logical_params(params)

    def stage_state(self, state: dict) -> dict:
        """This device's part of a whole training state (:meth:`logical_state`): the state
        itself, or under a pipeline the other stages' layers left empty."""
        return self.device.stage_state(state)

    def initial_state(self, params: Any) -> dict:
        """:meth:`init`'s state with every parameter held (what a device function starts from)."""
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
        device = device_of(master)
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
        batch = unwrap_batch(batch, self.batch_dims)
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
            fn = self._compiled.donated(self._device_step)     # one wrapper (one backend) for every device
            reset_region_ids()       # same guard state every call: no recompilation
        t0 = time.perf_counter()
        param_leaves = tree_leaves(state["params"])
        finite = self._bound.params_finite(param_leaves)
        bound, peaks = self._carried_peaks(state) if step_compile else (None, None)
        try:
            with self._settings(step_compile, layer_compile), \
                    deferred_checks() as id_checks:     # token-id checks, raised after the step
                out: DeviceStepResult = fn(
                    state["params"], state["opt_state"], state["step"], state["skipped"], batch, finite, peaks,
                    grad_seed(device_of(state["params"]), True) if step_compile else None)   # (eager: none)
        except Exception as exc:
            self._refuse_foreign_state(state, exc)
            raise
        if not self._rules_checked:      # once the names the step uses are known: a misspelt rule
            self.rules.check_used([*(d for dims in self.spec.dims for d in dims), *self._batch_dim_names()])
            self._rules_checked = True
        # read every step, or kept unread (metrics="deferred"): step/metrics_modes.py
        new, metrics, peaks = self._metrics.finish(state, batch, out, id_checks, t0)
        out = None
        # (a state written in place, or a skipped step's, returns the very tree given: flattened once)
        new_leaves = param_leaves if new["params"] is state["params"] else tree_leaves(new["params"])
        self._bound.remember(new_leaves, finite, bound, new["opt_state"],
                             self.spec.trainable_tree(new["params"]), peaks)
        return new, metrics

    def _refuse_foreign_state(self, state: dict, exc: Exception) -> None:
        """Raise a ValueError naming the leaves when the failed step's ``state`` is not of the
        shapes this device's :meth:`init` made (step/state_check.py)."""
        recorded = getattr(self._init_state, "signature", None)
        why = state_mismatch(recorded, state) if recorded is not None else None
        if why is not None:
            raise ValueError(why) from exc

    def trace(self, state: dict, batch: dict) -> DeviceStepResult:
        """The step's device function run once on ``state`` and this device's ``batch`` (tensors
        or named values), eager and without the host's part: nothing compiled, no metrics read,
        no skip chosen, no counters kept. The hook the planner measures a step with (on meta
        tensors, plan/dryrun.py); run it under :meth:`apply_policy` and the step's rules."""
        if self.spec is None:
            raise RuntimeError("call step.init(params) before step.trace")
        return self._device_step(state["params"], state["opt_state"], state["step"], state["skipped"], batch,
                                 update=self._update.eager)

    def _carried_peaks(self, state: dict) -> tuple[Any, list[torch.Tensor] | None]:
        """A compiled donated step whose optimizer's bound carries its terms' peaks (AdamW's first
        moments): the bound and the peaks of ``state``; else (None, None) (step/known_finite.py)."""
        return self._bound.carried_peaks(state["opt_state"], self.spec.trainable_tree(state["params"]))

    @property
    def _known_peaks(self):      # (the tests' view of what the step remembers)
        return self._bound.known_peaks

    @property
    def _natives(self) -> dict:  # (the tests' view of the compiled step's native graphs)
        return self._compiled.natives

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

    def read(self) -> list[StepMetrics]:
        """metrics="deferred": read this device's unread steps in one transfer and run their host
        checks in order (raising for the first failing step: NonFiniteError, TokenIdError);
        returns their metrics. Nothing to do (an empty list) in the per-step mode."""
        return self._metrics.read()

    @contextmanager
    def _settings(self, step_compile: Any, layer_compile: Any) -> Iterator[None]:
        """The step's thread-local settings, set outside the compiled region."""
        compiling = bool(step_compile or layer_compile)
        # (the no-layer warning points at the step's caller: step/layering.py)
        with use_rules(self.rules), trace_backward(bool(step_compile)), self.apply_policy(), \
                compile_cache_limits(COMPILED_STEPS_PER_PROCESS) if compiling else nullcontext(), \
                compiled_layers(step_backend(layer_compile) if layer_compile else None), \
                self._layers.units(self.policy, layer_compile, self._batch_dim_names(), stacklevel=6):
            yield

    def _batch_dim_names(self) -> tuple[str, ...]:
        """The dimension names of the step's batch (``batch_dims``), in order, once each: the
        rules' axes for them are the data-parallel axes (FSDP units, parallel/fsdp/units.py)."""
        names = [d for dims in self.batch_dims.values() for d in (dims.split() if isinstance(dims, str) else dims)]
        return tuple(dict.fromkeys(names))

    def run_without_donation(self, state: dict, batch: dict) -> DeviceStepResult:
        """The step without donation (updating as the step's strategy does without donation) run
        on ``state``: compiled where the step is (a second graph, compiled at its first use), else
        eager. How a held donated step is made again (``UpdateStrategy.redo``, step/update.py)."""
        step_compile, layer_compile = split_mode(self.compile)
        fn = self._device_step_new_buffers
        if step_compile:
            fn = self._compiled.new_buffers(fn)
            reset_region_ids()
        with self._settings(step_compile, layer_compile), deferred_checks():   # (ids checked by the step)
            return fn(state["params"], state["opt_state"], state["step"], state["skipped"], batch,
                      grad_seed(device_of(state["params"]), bool(step_compile)))

    def _device_step_new_buffers(self, params, opt_state, count, skipped, batch, seed=None):
        return self._device_step(params, opt_state, count, skipped, batch, seed=seed,
                                 update=self._update.without_donation)

    def resolved_policy(self) -> Policy:
        """The policy the step's ops run under: its ``policy`` (16-bit ``precision`` summing
        16-bit values in fp32 unless the policy names a ``reduce_dtype``), the fields left None
        taken from the ambient :func:`functional_pp.configure` values (docs/policy.md)."""
        policy, ambient, precision = self.policy, current_policy(), self.precision
        memo = self.__dict__.get("_resolved_memo")      # (every step asks: derived once per policy objects)
        if memo is not None and memo[0] is policy and memo[1] is ambient and memo[2] == precision:
            return memo[3]
        resolved = policy
        if resolved.reduce_dtype is None and PRECISIONS[precision] is not None:
            resolved = resolved.replace(reduce_dtype=torch.float32)
        resolved = resolved.over(ambient)
        self._resolved_memo = (policy, ambient, precision, resolved)
        return resolved

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
        if compute is not None:      # (eager: one op each way for all the leaves; step/precision_cast.py)
            leaves = cast_floating(leaves, compute)
        elif cast:      # fp32 compute: a frozen 16-bit parameter (kept in its dtype by init) is upcast
            leaves = [x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x for x in leaves]
        if is_tracing():
            named = [Named(x, dims, layout, is_param=True)
                     for x, dims, layout in zip(leaves, self.spec.dims, self.spec.layouts)]
        else:    # eager: the named types (frozensets, global sizes) are built once per mesh and shapes
            # parameters an earlier forward gathered at several sites are tied (parallel/fsdp/param_uses.py)
            tied = getattr(self._shared, "tied", None) or ()
            types = self.spec.named_types(env()[0], tuple(x.shape for x in leaves))
            named = [make_named(x, *t, role=param_role(True, i in tied)) for i, (x, t) in enumerate(zip(leaves, types))]
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

    def _device_step(self, params, opt_state, count, skipped, batch, params_finite=None, peaks=None,
                     seed=None, update: UpdateStrategy | None = None) -> DeviceStepResult:
        """The device function (step/device_step.py) the step was built with, run on this device
        with the step's update strategy (or ``update``): the one function every compiled step
        compiles (docs/compile.md)."""
        return self.device(params, opt_state, count, skipped, batch, params_finite, peaks, seed,
                           update if update is not None else self._update)


def check_step_arguments(optimizer: Any, mesh: Any, rules: Any, where: str) -> None:
    """Refuse an optimizer that is not an ``(init, update)`` pair, a mesh that is not a
    :class:`Mesh` or rules that are not :class:`Rules`, naming what to pass instead (a plain dict
    of rules, or ``"adamw"``, used to fail inside the first step)."""
    if not (isinstance(optimizer, tuple) and len(optimizer) == 2 and all(callable(f) for f in optimizer)):
        raise TypeError(f"{where}: optimizer must be an (init, update) pair such as functional_pp.optim.adamw(3e-4) "
                        f"(a GradientTransformation), got {type(optimizer).__name__} {optimizer!r}"[:400])
    if mesh is not None:
        require_mesh(mesh, where)
    if rules is not None and not isinstance(rules, Rules):
        hint = f"fpp.Rules({dict(rules)!r})" if isinstance(rules, dict) else "fpp.Rules(mlp='tp', ...)"
        raise TypeError(f"{where}: rules must be a functional_pp.Rules, got {type(rules).__name__} {rules!r}; "
                        f"wrap it: {hint}")


def train_step(loss_fn: Callable[[Any, dict], Named], optimizer: optim.GradientTransformation, *,
               mesh: Mesh | None = None, rules: Rules | None = None, **options) -> TrainStep:
    """Build a training step: see :class:`TrainStep` for the options (compile, grad_accum,
    precision, on_nonfinite, lr_schedule, batch_dims, flops_per_token, ...). Its execution
    policy is ``policy=`` (a :class:`Policy`) and/or its fields as keywords (remat,
    keep_gathered, cp_attention, regather_activations, check_rep, bucket_mb, fsdp_units,
    fsdp_keep_root, fsdp_prefetch, collectives_in_flight, overlap), which change that policy
    (docs/policy.md)."""
    check_step_arguments(optimizer, mesh, rules, "train_step")
    if rules is not None and mesh is not None:
        rules.check(mesh)
        rules.check_mesh_axes(mesh, "train_step")
    return TrainStep(loss_fn, optimizer, mesh=mesh, rules=rules or Rules(), **step_options(dict(options)))

