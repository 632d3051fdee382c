"""The training step: loss -> gradients (torch.autograd) -> optimizer update, on every device.

``step = train_step(loss_fn, optimizer, mesh=mesh, rules=rules)``; inside a launched
function ``state = step.init(params)`` and ``state, metrics = step(state, batch)``. The
gradients of sharded parameters arrive reduced exactly once over every mesh axis where the
data varied (the named ops' transposes); optimizer state is sharded like the parameters."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from . import optim
from .barrier import materialize
from .buckets import DEFAULT_BUCKET_MB, check_bucket_mb, grad_buckets, resolve_pending
from .fsdp_order import UnitOrder
from .fsdp_units import begin_forward, fsdp_units as layer_units
from .collectives import psum
from .compile_gate import CompileGate
from .compiler import step_backend
from .grads import check_scalar_loss
from .recompute import backward_region, reset_region_ids
from .layer_compile import compiled_layers, split_mode
from .layout import Layout, Rules
from .mesh import Mesh
from .named import Named, _make, configure, env, settle, wrap
from .ops.token_ids import deferred_checks, raise_if_bad
from .runtime import Options, current_context
from .shard_map import use_rules
from .step_buffers import acc_dtype, as_dtype, keep_if, master_copy, own_buffers, write_into
from .step_io import check_batch, nonfinite_what, peak_memory, read_step_metrics, split_micro
from .torch_private import is_tracing, trace_backward
from .tree import leaves_with_paths, tree_leaves, tree_map

# the step without gradient buckets and FSDP units: one collective per weight, layer by layer
# (the planner's dry runs count collectives per layer; docs/communication.md)
PER_WEIGHT = {"bucket_mb": None, "fsdp_units": False, "fsdp_keep_root": False}
DEFAULT_BATCH_DIMS = {"tokens": "batch seq", "labels": "batch seq", "positions": "seq"}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParamSpec:
    """Static description of the parameter tree: dim names and layout of every leaf."""
    paths: list[str]
    dims: list[tuple[str, ...]]
    layouts: list[Layout]
    treespec: Any
    _axes: dict = field(default_factory=dict, repr=False, compare=False)

    def split_axes(self, mesh) -> list[tuple[str, ...]]:
        """Per leaf, the mesh axes (in mesh order) that split it; derived once per mesh."""
        cached = None if is_tracing() else self._axes.get(mesh)
        if cached is None:
            cached = [tuple(a for a in mesh.axis_names if any(a in s for s in layout)) for layout in self.layouts]
            if not is_tracing():
                self._axes[mesh] = cached
        return cached

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
        """The leaves' indices grouped by the mesh axes that split them (groups in order of their
        first leaf): what one reduction per group completes; derived once per mesh."""
        key = ("groups", mesh)
        cached = None if is_tracing() else self._axes.get(key)
        if cached is None:
            groups: dict[tuple[str, ...], list[int]] = {}
            for i, axes in enumerate(self.split_axes(mesh)):
                groups.setdefault(axes, []).append(i)
            cached = list(groups.items())
            if not is_tracing():
                self._axes[key] = cached
        return cached


class NonFiniteError(FloatingPointError):
    """A step's loss, gradient norm or update is not finite (``on_nonfinite="raise"``), or too
    many consecutive steps were skipped (``max_consecutive_skips``)."""


@dataclass
class TrainStep:
    """One training step of ``loss_fn`` (built by :func:`train_step`). The fields are its
    settings: numerics (``precision``, ``grad_accum``, ``on_nonfinite``), compilation, and the op
    policy (``remat``, ``keep_gathered``, ``cp_attention``, ``regather_activations``;
    docs/policy.md). Shared by every device thread: ``spec`` is set once by :meth:`init`."""

    loss_fn: Callable[[Any, dict], Named]
    optimizer: optim.GradientTransformation
    mesh: Mesh | None = None
    rules: Rules = field(default_factory=Rules)
    compile: bool | str = False           # False, True (inductor), a backend name ("aot_eager"), or
    #                                       "per_layer[:backend]": compile each @fpp.layer once
    grad_accum: int = 1
    precision: str = "fp32"               # fp32 | bf16 | fp16 (compute dtype; master weights fp32)
    remat: bool = False                   # activation checkpointing per layer
    # op policy of the step (docs/policy.md); None: the ambient default of functional_pp.configure
    keep_gathered: bool | None = None     # keep FSDP-gathered weights for backward (no re-gather)
    cp_attention: str | None = None       # "ring" | "allgather": attention over a cp-split sequence
    regather_activations: bool | None = None  # save gathered activations' shards, re-gather in backward
    on_nonfinite: str = "skip"            # skip | raise
    max_consecutive_skips: int | None = 10  # stop after this many skipped steps in a row (None: never)
    lr_schedule: Callable | None = None   # reported in the metrics
    batch_dims: dict = field(default_factory=lambda: dict(DEFAULT_BATCH_DIMS))
    flops_per_token: float | None = None
    peak_flops_per_device: float | None = None
    bucket_mb: float | None = DEFAULT_BUCKET_MB  # DP gradient all-reduce buckets (None: per gradient, synchronous)
    fsdp_units: bool = True               # FSDP: one flat all-gather / reduce-scatter per layer
    fsdp_keep_root: bool = True           # FSDP: weights outside the layers not re-gathered in backward
    fsdp_prefetch: bool = True            # FSDP: the next unit's gather launched before a unit computes
    donate_state: bool = False            # the caller gives up the state passed in: compiled steps
    #                                       write the new state into it (the old state may be overwritten;
    #                                       docs/memory.md "Donated state")

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {sorted(PRECISIONS)}")
        if self.on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite {self.on_nonfinite!r}: choose 'skip' or 'raise'")
        check_bucket_mb(self.bucket_mb)
        if self.cp_attention not in (None, "ring", "allgather"):
            raise ValueError(f"cp_attention {self.cp_attention!r}: choose 'ring' or 'allgather' (or None: "
                             f"the functional_pp.configure default)")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.max_consecutive_skips is not None and (
                isinstance(self.max_consecutive_skips, bool) or not isinstance(self.max_consecutive_skips, int)
                or self.max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be an integer >= 1 (or None: never stop), got "
                             f"{self.max_consecutive_skips!r}")
        self.spec: ParamSpec | None = None
        self._compiled = None
        self._compile_lock = threading.Lock()   # simulated devices share one compiled step
        self._unit_order = UnitOrder()          # FSDP units' forward order, for prefetch (fsdp_order.py)

    # -------------------------------------------------------------------- init
    def init(self, params: Any) -> dict:
        """Training state from a tree of named parameters (``functional_pp.init``): fp32
        master shards, optimizer state (sharded like the parameters), step counters."""
        import optree
        leaves, treespec = optree.tree_flatten(params, none_is_leaf=False)
        bad = [p for p, x in leaves_with_paths(params) if not isinstance(x, Named)]
        if bad:
            raise TypeError(f"step.init needs named parameters (from functional_pp.init); {bad[0]!r} is a "
                            f"{type(dict(leaves_with_paths(params))[bad[0]]).__name__}")
        paths = [p for p, _ in leaves_with_paths(params)]
        spec = ParamSpec(paths, [x.dims for x in leaves], [x.split for x in leaves], treespec)
        with self._compile_lock:     # set once, read by every device: never changed under a running step
            if self.spec is None:
                self.spec = spec
            elif (self.spec.paths, self.spec.dims, self.spec.layouts) != (spec.paths, spec.dims, spec.layouts):
                where = next((f"{p}: dims {a} layout {la} vs {b} {lb}" for p, a, la, b, lb in zip(
                    spec.paths, self.spec.dims, self.spec.layouts, spec.dims, spec.layouts) if (a, la) != (b, lb)),
                    f"parameter paths {self.spec.paths[:3]}... vs {spec.paths[:3]}...")
                raise ValueError(f"step.init: this step was initialised with other parameters ({where}); "
                                 f"every device must pass the same tree, and another model needs its own "
                                 f"train_step")
        master = optree.tree_unflatten(treespec, [master_copy(x.data) for x in leaves])
        return {"params": master, "opt_state": self.optimizer.init(master),
                "step": torch.zeros((), dtype=torch.int64), "skipped": torch.zeros((), dtype=torch.int64),
                "consecutive_skips": torch.zeros((), dtype=torch.int64)}

    # ------------------------------------------------------------- the step
    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
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
        if step_compile:
            with self._compile_lock:     # one wrapper (one backend) for every device thread
                if self._compiled is None:
                    self._compiled = CompileGate(   # simulated devices: one compiles, all reuse it
                        torch.compile(self._device_step, backend=step_backend(step_compile),
                                      fullgraph=True, dynamic=False),   # static shapes
                        type(self)._device_step.__code__)
            fn = self._compiled
            reset_region_ids()       # same guard state every call: no recompilation
        t0 = time.perf_counter()
        # thread-local settings are set outside the compiled region
        with use_rules(self.rules), trace_backward(bool(step_compile)), self.policy(), \
                compiled_layers(step_backend(layer_compile) if layer_compile else None), \
                layer_units(self.fsdp_units, keep_root=self.fsdp_keep_root and not self.compile,
                            prefetch=self.fsdp_prefetch, order=self._unit_order), \
                deferred_checks() as id_checks:     # token-id checks, raised after the step
            params, opt_state, step, skipped, m = fn(state["params"], state["opt_state"], state["step"],
                                                     state["skipped"], batch)
        if "consecutive_skips" in state:     # read with the metrics: one transfer
            m = {**m, "consecutive_skips": torch.as_tensor(state["consecutive_skips"])}
        metrics, bad_ids = read_step_metrics(m, step, id_checks)    # the step's one device-to-host read
        if bad_ids:
            raise_if_bad(id_checks)      # out-of-range token ids / labels (docs/bad_inputs.md §1)
        if not step_compile:     # eager: the state to keep, chosen after the one read (docs/eager_overhead.md)
            if metrics["skipped"]:      # the old state itself (never written)
                params, opt_state = state["params"], state["opt_state"]
            # donate_state: nothing to copy back, the new state already lives in the step's own
            # buffers (the donated gradients and the new moments; docs/memory.md "Donated state")
        seconds = time.perf_counter() - t0
        metrics["step_time_s"] = seconds
        metrics["tokens_per_s"] = metrics["tokens"] / seconds if seconds > 0 else float("nan")
        if self.flops_per_token and self.peak_flops_per_device:
            n = (self.mesh.size if self.mesh else 1)
            metrics["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (self.peak_flops_per_device * n)
        metrics["peak_memory_bytes"] = peak_memory()
        if metrics["skipped"] and self.on_nonfinite == "raise":
            raise NonFiniteError(f"step {int(state['step'])}: {nonfinite_what(metrics)} is not finite; "
                                 f"training stopped (set on_nonfinite='skip' to skip such steps)")
        run = int(metrics.get("consecutive_skips", 0)) + 1 if metrics["skipped"] else 0
        metrics["consecutive_skips"] = run
        if self.max_consecutive_skips is not None and run >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"step {int(state['step'])}: {run} consecutive steps were skipped because the "
                f"{nonfinite_what(metrics)} is not finite; training stopped (max_consecutive_skips="
                f"{self.max_consecutive_skips}). Lower the learning rate, check the data, or resume "
                f"from an earlier checkpoint")
        return {"params": params, "opt_state": opt_state, "step": step, "skipped": skipped,
                "consecutive_skips": torch.tensor(run, dtype=torch.int64)}, metrics

    def policy(self) -> ContextManager[Options]:
        """The step's op policy (remat, keep_gathered, cp_attention, regather_activations and the
        fp32 reduction of 16-bit gradients) in force for the ops it runs; the fields left None
        keep the ambient :func:`functional_pp.configure` values (docs/policy.md)."""
        explicit = {k: getattr(self, k) for k in ("keep_gathered", "cp_attention", "regather_activations")
                    if getattr(self, k) is not None}
        return configure(remat=self.remat, reduce_dtype=torch.float32 if PRECISIONS[self.precision] else None,
                         **explicit)

    def gradients(self, state: dict, batch: dict) -> tuple[torch.Tensor, Any]:
        """The loss and the reduced gradients (named, laid out like the parameters) this step
        would compute for ``batch``, without updating anything (functional_pp.value_and_grad)."""
        import optree
        from .grads import value_and_grad
        if self.spec is None:
            raise RuntimeError("call step.init(params) before step.gradients")
        leaves, treespec = optree.tree_flatten(state["params"], none_is_leaf=False)
        with use_rules(self.rules), self.policy():
            named_batch = {k: v if isinstance(v, Named) else wrap(v, self.batch_dims[k]) for k, v in batch.items()}
            return value_and_grad(self.loss_fn, self._named_params(leaves, treespec), named_batch)

    def named_params(self, params: Any) -> Any:
        """The training state's fp32 master ``params`` as the named values the loss sees (cast to
        the compute precision, laid out as at :meth:`init`)."""
        import optree
        leaves, treespec = optree.tree_flatten(params, none_is_leaf=False)
        return self._named_params(leaves, treespec)

    def _named_params(self, leaves: list[torch.Tensor], treespec) -> Any:
        import optree
        compute = PRECISIONS[self.precision]
        if compute is not None:
            leaves = [x.to(compute) if x.is_floating_point() else x for x in leaves]
        if is_tracing():
            named = [Named(x, dims, layout, is_param=True)
                     for x, dims, layout in zip(leaves, self.spec.dims, self.spec.layouts)]
        else:    # eager: the named types (frozensets, global sizes) are built once per mesh and shapes
            types = self.spec.named_types(env()[0], tuple(x.shape for x in leaves))
            named = [_make(x, *t, is_param=True) for x, t in zip(leaves, types)]
        return optree.tree_unflatten(treespec, named)

    def _device_step(self, params, opt_state, step, skipped, batch):
        import optree
        leaves, treespec = optree.tree_flatten(params, none_is_leaf=False)
        micro = split_micro(batch, self.grad_accum)
        weights, tokens = self._micro_weights(micro)
        grads = [torch.zeros_like(x) if len(micro) > 1 else x for x in leaves]   # (dtype template)
        acc = acc_dtype(leaves)
        total = torch.zeros((), dtype=acc)
        for mb, w in zip(micro, weights):
            xs = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
            named_batch = {k: wrap(v, self.batch_dims[k]) for k, v in mb.items()}
            named_params = self._named_params(xs, treespec)
            begin_forward(named_params)     # FSDP forward prefetch follows the last forward's units
            loss_named = settle(self.loss_fn(named_params, named_batch))
            named_params = None
            check_scalar_loss(loss_named, "train_step")
            loss = loss_named.data.to(acc) * w.to(acc)
            diff = [x for x in xs if x.requires_grad]
            with backward_region(), grad_buckets(self.bucket_mb) as buckets:   # docs/communication.md
                gs = torch.autograd.grad(loss, diff)
                gs = iter(buckets.finish(gs) if buckets is not None else resolve_pending(gs))
            if len(micro) == 1:          # no accumulation buffer needed
                grads = [as_dtype(next(gs), g.dtype) if x.requires_grad else g for g, x in zip(grads, xs)]
            else:
                grads = [g + next(gs).to(g.dtype) if x.requires_grad else g for g, x in zip(grads, xs)]
            gs = None                    # release the per-micro-batch gradients
            total = total + loss.detach()
        if is_tracing() and PRECISIONS[self.precision] is not None:
            grads = [materialize(g) for g in grads]   # keep 16-bit gradient math out of the update kernel
        # eager: the optimizer works in place on the step's own gradient buffers (docs/memory.md)
        donate = not is_tracing()
        grad_tree = optree.tree_unflatten(treespec, own_buffers(grads, leaves) if donate else grads)
        grads = None
        grad_norm = optim.global_norm(grad_tree, self._sq_reducer)
        finite = torch.isfinite(total) & torch.isfinite(grad_norm)
        updates, new_opt = optim.update_with(self.optimizer, grad_tree, opt_state, params,
                                             norm_reducer=self._sq_reducer, donate_updates=donate)
        grad_tree = None
        new_params = optim.apply_updates(params, updates,
                                         donate_updates=optim.returns_fresh(self.optimizer, donate))
        updates = None
        # a non-finite update (or one that overflows the parameters) is not applied either; with
        # donated buffers the update already sits in the new parameters, so check those
        update_ok = self._update_finite(new_params)
        nonfinite = {"nonfinite_loss": ~torch.isfinite(total), "nonfinite_grad": ~torch.isfinite(grad_norm),
                     "nonfinite_update": ~update_ok}
        finite = finite & update_ok
        if not donate:
            # compiled: a branch-free select per tensor (fused into the update's kernels). Eager
            # steps choose between the new and the old state on the host, after the step's one
            # read of its metrics (__call__, docs/eager_overhead.md)
            new_params = tree_map(lambda new, old: keep_if(finite, new, old), new_params, params)
            new_opt = tree_map(lambda new, old: keep_if(finite, new, old), new_opt, opt_state)
            if self.donate_state:        # the caller gave up the old state: update it in place
                new_params, new_opt = write_into(params, new_params), write_into(opt_state, new_opt)
        lr = self.lr_schedule(step) if self.lr_schedule is not None else torch.zeros(())
        metrics = {"loss": total, "grad_norm": grad_norm, "lr": torch.as_tensor(lr, dtype=torch.float32),
                   "tokens": tokens, "skipped": (~finite).to(torch.int64),
                   **{k: v.to(torch.int64) for k, v in nonfinite.items()}}
        return new_params, new_opt, step + 1, skipped + (~finite).to(torch.int64), metrics

    def _update_finite(self, new_params: Any) -> torch.Tensor:
        """Whether every element of the updated parameters is finite on every device: a NaN
        update (e.g. a zero second moment with eps=0) must not be applied either. ``(u * 0).sum()`` is NaN iff
        ``u`` holds a NaN or inf; the per-leaf values are combined like the gradient norm's
        (docs/bad_inputs.md §2). Eager steps use a leaf's 2-norm instead (also NaN or inf when
        the norm overflows fp32, beyond 1.8e19, as the gradient norm then does)."""
        leaves = tree_leaves(new_params)
        if is_tracing():
            return torch.isfinite(self._sq_reducer([(u * 0).sum() for u in leaves]))
        # eager: per group of leaves split over the same mesh axes, one foreach 2-norm (the
        # cheapest foreach reduction; NaN or inf iff a leaf holds one or its norm overflows, as
        # the gradient norm does), times 0, summed and completed over the group's axes
        acc = acc_dtype(leaves)
        total = None
        for axes, group in self.spec.axis_groups(env()[0]):
            full = [leaves[i] for i in group if leaves[i].numel()]
            value = (torch.stack(torch._foreach_norm(full, 2)).mul_(0).sum().to(acc) if full
                     else torch.zeros((), dtype=acc))
            value = psum(value, axes) if axes else value
            total = value if total is None else total + value
        return torch.isfinite(total) if total is not None else torch.ones((), dtype=torch.bool)

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
        from .collectives import psum as sum_over
        key = "labels" if "labels" in mb else next(iter(mb))
        x = wrap(mb[key], self.batch_dims[key])
        n = (torch.count_nonzero(x.data != -100) if key == "labels" else
             torch.full((), x.data.numel(), device=x.data.device)).to(torch.float64)
        axes = {a for s in x.split for a in s}
        return sum_over(n, tuple(a for a in env()[0].axis_names if a in axes)) if axes else n

    def _sq_reducer(self, sq_sums: Any) -> torch.Tensor:
        """Complete per-leaf sums of squares across the devices that split each leaf."""
        sq = tree_leaves(sq_sums)
        acc = acc_dtype(sq)
        total = None
        for axes, group in self.spec.axis_groups(env()[0]):
            values = [sq[i] for i in group]
            value = (torch.stack(values).sum() if len(values) > 1 else values[0]).to(acc)
            value = psum(value, axes) if axes else value
            total = value if total is None else total + value
        return total if total is not None else torch.zeros((), dtype=acc)


def train_step(loss_fn: Callable[[Any, dict], Named], optimizer: optim.GradientTransformation, *,
               mesh: Mesh | None = None, rules: Rules | None = None, **options) -> TrainStep:
    """Build a training step: see :class:`TrainStep` for the options (compile, grad_accum,
    precision, on_nonfinite, lr_schedule, batch_dims, flops_per_token, ..., and the op policy
    remat, keep_gathered, cp_attention, regather_activations: docs/policy.md)."""
    if rules is not None and mesh is not None:
        rules.check(mesh)
    return TrainStep(loss_fn, optimizer, mesh=mesh, rules=rules or Rules(), **options)
