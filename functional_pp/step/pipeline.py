"""The training step with pipeline parallelism: the model's repeated layers split over the
``pp`` mesh axis by the rule ``layers="pp"``, micro-batches (``grad_accum``) run by a schedule
(docs/pipelines.md).

``step = pipeline_step(loss_fn, optimizer, mesh=Mesh(pp=4, dp_shard=2), rules=Rules(...,
layers="pp"), grad_accum=8, schedule="1f1b")`` is a :class:`~functional_pp.step.train.TrainStep`
whose device function is a :class:`PipelineSchedule` (step/device_step.py): each device holds the layers of its stages (the other
layers' parameters are empty in its state). The parameters outside the layers named in
``first_stage`` (the embedding) only the first stage holds, those in ``last_stage`` (final norm,
head) only the last; the others, and those named in both (a tied embedding), every stage holds,
their gradients summed over ``pp``. The schedule's timeline, checked
on paper first (:func:`~functional_pp.parallel.pipeline.timing.simulate`), is run in lock
step: at each time every device runs the action the timeline gives it, then the activations
and gradients finished at that time move to the next and previous stage (one ``ppermute`` over
``pp`` per direction, only the pairs that send). Each micro-batch's loss is weighted by its
share of the global token count before its backward; the gradient norm covers every stage.
Under FSDP a stage's units are gathered once per step by default (``fsdp_gather``,
:mod:`~functional_pp.parallel.fsdp.gather_once`); with ``compile`` each virtual stage's
forward is one compiled graph."""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from functional_pp._torch import compile_cache_limits
from functional_pp.parallel.step_backend import step_backend
from functional_pp.compile.gate import CompileGate
from functional_pp.compile.layer_compile import split_mode
from functional_pp.compile.recompute import backward_region
from functional_pp.core import step_values
from functional_pp.core.runtime import current_rank
from functional_pp.core.tree import leaves_with_paths, tree_flatten, tree_leaves, tree_unflatten
from functional_pp.devices import mesh_view
from functional_pp.ops.token_ids import checks_apart
from functional_pp.optim.base import state_like_params
from functional_pp.parallel.buckets.pending import resolve_pending
from functional_pp.parallel.fsdp.units import gathered_stand_in
from functional_pp.parallel.grads import check_scalar_loss
from functional_pp.parallel.named import env, settle, wrap
from functional_pp.parallel.fsdp.gather_once import GATHER_POLICIES, GatheredOnce
from functional_pp.parallel.pipeline.schedule import build, check_sizes
from functional_pp.parallel.pipeline.stage import StageOutput, StageRun, running_stage
from functional_pp.parallel.pipeline.timing import Timeline, simulate
from functional_pp.parallel.raw_collectives import axis_index, raw_all_reduce, raw_permute
from functional_pp.step.buffers import acc_dtype
from functional_pp.step.device_step import call_loss, finish_update, micro_weights, throughput_tokens
from functional_pp.step.io import split_micro
from functional_pp.step.train import COMPILED_STEPS_PER_PROCESS, PRECISIONS, TrainStep, step_options
from functional_pp.step.result import DeviceStepResult
from functional_pp.step.update import UpdateStrategy

PP = "pp"


class FewMicroBatchesWarning(UserWarning):
    """Fewer micro-batches than pipeline stages: most of the step is bubble."""


@dataclass
class PipelineSchedule:
    """A step's device function (step/device_step.py) whose micro-batches run through pipeline
    stages over ``pp``: its settings, checked when ``pipeline_step`` builds the step
    (:meth:`bind`), the stages' layout of the parameters and the schedule's rounds."""

    schedule: str = "1f1b"           # gpipe | 1f1b | interleaved_1f1b | zb_h1
    virtual_stages: int = 1          # model chunks per device (interleaved_1f1b)
    layers: str | tuple[str, ...] = "layers"   # the list of repeated layers in the parameter tree; several
    #                                  lists of one length (a frozen reference copy's) are split alike
    first_stage: tuple[str, ...] = ()   # parameters (path prefixes) only the first stage holds (embedding)
    last_stage: tuple[str, ...] = ()    # ... only the last stage holds (final norm, head); the others,
    #                                     and those named in both (a tied embedding), every stage holds
    fsdp_gather: str = "step"        # FSDP: "step" gathers a stage's units once per step and reduce-scatters
    #                                  them once; "micro" gathers (and re-gathers) them in every micro-batch
    stage_compile: bool | str = False   # each virtual stage's forward compiled with this (the step's
    #                                     ``compile``, taken by pipeline_step: :func:`pipeline_settings`)

    def bind(self, step: TrainStep) -> None:
        """Take the step's settings, checked (the rules split the layers over pp, the schedule's
        sizes, the settings a pipeline runs with: :func:`pipeline_settings`); nothing of the
        step is changed."""
        self.step = step
        for lever in ("offload_params", "activation_offloading"):
            if getattr(step, lever):
                raise ValueError(f"pipeline_step({lever}=True): a pipeline step cannot offload yet; use train_step "
                                 f"(no pp axis) to offload, or remove {lever} (docs/memory.md)")
        given = {"compile": split_mode(step.compile)[0], "fsdp_prefetch": step.policy.fsdp_prefetch,
                 "bucket_mb": step.policy.bucket_mb}
        unfit = {k: v for k, v in given.items() if v not in (False, None)}
        if unfit:
            raise ValueError(f"PipelineSchedule: a pipeline step runs without {', '.join(unfit)} (given "
                             f"{unfit}); build it with pipeline_step, which compiles each virtual stage's forward "
                             f"instead of the step and turns FSDP prefetch and gradient buckets off")
        self._compiled_stages: dict[int, CompileGate] = {}
        if self.fsdp_gather not in GATHER_POLICIES:
            raise ValueError(f"pipeline_step(fsdp_gather={self.fsdp_gather!r}): choose one of "
                             f"{', '.join(map(repr, GATHER_POLICIES))} (docs/pipelines.md, FSDP)")
        p = self.stages
        self.layer_lists = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
        if p > 1 and self.step.rules[self.layer_lists[0]] != (PP,):
            raise ValueError(f"pipeline_step: the mesh has pp={p} but the rules do not split the layers over it; "
                             f"add the rule {self.layer_lists[0]}='pp' (Rules(..., {self.layer_lists[0]}='pp'))")
        check_sizes(self.schedule, p, self.virtual_stages, self.step.grad_accum)
        if self.step.grad_accum < p:
            warnings.warn(f"pipeline_step: {self.step.grad_accum} micro-batches on {p} stages: raise grad_accum "
                          f"(gradient_accumulation_steps) to at least {p}, or most of each step is bubble",
                          FewMicroBatchesWarning, stacklevel=4)
        self.timeline: Timeline = simulate(build(self.schedule, p, self.step.grad_accum, self.virtual_stages))
        self._rounds = self._lock_step()
        self._stage_of: list[int | None] | None = None
        self._layer_of: list[tuple[int, int] | None] | None = None   # (layer list, layer) of each leaf
        self._shapes: list[tuple] | None = None
        self._per = 0                # layers per virtual stage
        self._probes: dict[tuple, Probe] = {}     # per device and micro-batch shapes: passes and metrics

    @property
    def stages(self) -> int:
        return self.step.mesh.shape.get(PP, 1) if self.step.mesh is not None else 1

    # ----------------------------------------------------------- the state
    def init(self, params: Any) -> dict:
        """As ``TrainStep.initial_state``, with the parameters of other devices' layers left empty."""
        _refuse_batched()
        paths = [p for p, _ in leaves_with_paths(params)]
        n_layers = self._count_layers(params)
        check_sizes(self.schedule, self.stages, self.virtual_stages, self.step.grad_accum, layers=n_layers)
        per = n_layers // (self.stages * self.virtual_stages)
        layer_of = [self._layer_at(p) for p in paths]
        stage_of = [n[1] // per if n is not None else self._end_stage(p) for n, p in zip(layer_of, paths)]
        for name in (*self.first_stage, *self.last_stage):
            if not any(_under(p, name) for p in paths):
                raise ValueError(f"pipeline_step: no parameter at {name!r} (first_stage / last_stage name path "
                                 f"prefixes of the parameter tree, e.g. {paths[0]!r})")
        shapes = [tuple(x.data.shape) for x in tree_flatten(params)[0]]
        state = self.step.initial_state(params)
        with self.step._compile_lock:
            if self._stage_of is None:
                self._stage_of, self._layer_of, self._shapes, self._per = stage_of, layer_of, shapes, per
        me = axis_index(PP) if self.stages > 1 else 0
        leaves, spec = tree_flatten(state["params"])
        leaves = [x if self._held(i, me) else x.new_empty(0) for i, x in enumerate(leaves)]
        state["params"] = tree_unflatten(spec, leaves)
        state["opt_state"] = self.step.optimizer.init(self.step.spec.trainable_tree(state["params"]))
        return state

    def _layer_at(self, path: str) -> tuple[int, int] | None:
        return layer_at(path, self.layer_lists)

    def logical_state(self, state: dict) -> dict:
        """The whole training state on every stage, as one device (or ``train_step`` on the same
        mesh without ``pp``) would hold it: each layer's parameters and optimizer state gathered
        from the stage that holds them (a sum over ``pp`` with zeros elsewhere: exact). A layer
        keeps its name, so this state resumes on any pp size (:meth:`stage_state`) or without a
        pipeline."""
        return self._map_param_leaves(state, self._whole_leaf())

    def logical_params(self, params: Any) -> Any:
        """The whole parameter tree on every stage (:meth:`logical_state`'s parameters, without
        the optimizer state): what a forward of the whole model needs (GRPO's sampling)."""
        whole = self._whole_leaf()
        leaves, spec = tree_flatten(params)
        return tree_unflatten(spec, [whole(i, x) for i, x in enumerate(leaves)])

    def _whole_leaf(self):
        """``fn(i, leaf)``: parameter ``i`` (or a leaf mirroring it) whole, from the stage holding it."""
        me = axis_index(PP) if self.stages > 1 else 0

        def whole(i: int, x: torch.Tensor) -> torch.Tensor:
            if self._stage_of[i] is None or self.stages == 1:
                return x
            mine = x if self._held(i, me) else torch.zeros(self._shapes[i], dtype=x.dtype, device=x.device)
            return raw_all_reduce(mine, PP, "sum")
        return whole

    def stage_state(self, state: dict) -> dict:
        """This device's part of a whole training state (:meth:`logical_state` of a pipeline of
        any size, or a one-device state): the other stages' layers left empty. Call
        :meth:`init` first (it records the parameters' layout)."""
        if self._stage_of is None:
            raise RuntimeError("call step.init(params) before step.stage_state(state)")
        me = axis_index(PP) if self.stages > 1 else 0
        return self._map_param_leaves(state, lambda i, x: x if self._held(i, me) else x.new_empty(0))

    def _map_param_leaves(self, state: dict, fn) -> dict:
        """``state`` with ``fn(i, leaf)`` applied to parameter ``i`` and to the optimizer state's
        leaves that mirror it (Adam's moments of the trained parameters; ``optim.state_like_params``)."""
        leaves, spec = tree_flatten(state["params"])
        params = tree_unflatten(spec, [fn(i, x) for i, x in enumerate(leaves)])
        opt_leaves, opt_spec = tree_flatten(state["opt_state"])
        like = tree_leaves(state_like_params(state["opt_state"]))
        trained = [i for i, t in enumerate(self._trains(len(leaves))) if t]
        out, seen = [], 0
        for x, mirrors in zip(opt_leaves, like):
            out.append(fn(trained[seen % len(trained)], x) if mirrors else x)
            seen += bool(mirrors)
        return {**state, "params": params, "opt_state": tree_unflatten(opt_spec, out)}

    def _trains(self, n: int) -> tuple[bool, ...]:
        return self.step.spec.trainable or (True,) * n

    def _count_layers(self, params: Any) -> int:
        counts = []
        for name in self.layer_lists:
            node = params
            for key in name.split("."):
                node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, (list, tuple)) or not node:
                raise ValueError(f"pipeline_step: the parameter tree has no list of layers at {name!r} "
                                 f"(pass layers='path.to.list' naming the repeated layers)")
            counts.append(len(node))
        if len(set(counts)) > 1:
            raise ValueError(f"pipeline_step: the layer lists {', '.join(map(repr, self.layer_lists))} hold "
                             f"{', '.join(map(str, counts))} layers; lists split alike need one length")
        return counts[0]

    def _end_stage(self, path: str) -> int | None:
        return end_stage(path, self.first_stage, self.last_stage, self.stages * self.virtual_stages)

    def _held(self, i: int, device: int) -> bool:
        k = self._stage_of[i]
        return k is None or k % self.stages == device

    # ------------------------------------------------------------- the step
    def __call__(self, params, opt_state, count, skipped, batch, params_finite, peaks, seed,
                 update: UpdateStrategy) -> DeviceStepResult:
        _refuse_batched()      # (seed: None, no pipeline step is compiled whole)
        mesh = env()[0]
        p, v = self.stages, self.virtual_stages
        last = p * v - 1
        me = axis_index(PP) if p > 1 else 0
        leaves, treespec = tree_flatten(params)
        held = [self._held(i, me) for i in range(len(leaves))]
        # frozen leaves enter without requires_grad: no gradient, no optimizer state (as train_step)
        trains = self._trains(len(leaves))
        xs = [x.detach().requires_grad_(x.is_floating_point() and t) if h else
              torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)
              for x, h, t, shape in zip(leaves, held, trains, self._shapes)]
        micro = split_micro(batch, self.step.grad_accum)
        weights, tokens = micro_weights(micro, self.step.batch_dims, self.step.micro_weighting)
        tokens = throughput_tokens(micro, self.step.batch_dims, self.step.throughput_tokens, tokens)
        acc = acc_dtype([x for x, h in zip(leaves, held) if h])
        grads = [torch.zeros_like(x) for x in leaves]
        total = torch.zeros((), dtype=acc, device=leaves[0].device)
        wrt_of = {k: [i for i in range(len(leaves)) if held[i] and xs[i].requires_grad and
                      (self._stage_of[i] == k or (self._stage_of[i] is None and k in (0, last)))]
                  for k in range(me, p * v, p)}
        saved: dict[tuple[int, int], tuple] = {}
        inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        once = self._gather_once(xs, held) if self.fsdp_gather == "step" else None
        compute = PRECISIONS[self.step.precision]

        def stage_params(held=held):
            """The parameters a forward sees: those gathered once per step (fsdp_gather="step")
            in place of their shards, and for the parameters this device does not hold zero
            stand-ins as gathered (no communication)."""
            named = self.step._named_leaves(xs)
            if once is not None:
                named = [once.named(i, compute) if i in once.full else x for i, x in enumerate(named)]
            return tree_unflatten(treespec, [x if h else gathered_stand_in(x) for x, h in zip(named, held)])
        # shapes only: every parameter a stand-in, made apart from the forwards' values (the probe
        # runs without gradients: what it derives from a value, e.g. a pvary, must not reach them)
        probe = self._probe(tree_unflatten(treespec, [gathered_stand_in(x) for x in self.step._named_leaves(xs)]),
                            micro[0]) if p > 1 else None
        boundary = probe.boundary if p > 1 else None
        reported = []            # the values the last stage's loss reports (core/step_values.py), per micro-batch

        def forward(k: int, j: int) -> None:
            nonlocal total
            x_in = inbox.pop(("act", k - 1, j)).detach().requires_grad_() if k > 0 else None
            named_batch = {key: wrap(val, self.step.batch_dims[key]) for key, val in micro[j].items()}
            passes = probe.split(x_in) if x_in is not None else None
            with step_values.collecting() as found:
                y, cut = self._stage(k)(stage_params(), passes, named_batch,     # per micro-batch, as train_step
                                        probe.passes if probe is not None else 1)
            if cut:
                outbox[("act", k, j)] = y.detach()
            else:
                reported.append(found)
                y = y.to(acc) * weights[j].to(acc)
                total = total + y.detach()
            saved[(k, j)] = (x_in, y, None)

        def backward(k: int, j: int, part: str) -> None:
            x_in, y, g = saved[(k, j)]
            if g is None and k < last:
                g = inbox.pop(("grad", k + 1, j))
            wrt = wrt_of[k]
            want = ([x_in] if x_in is not None and part != "BW" else []) + \
                   ([once.target(i, xs[i]) if once else xs[i] for i in wrt] if part != "BI" else [])
            if want and y.requires_grad:
                with backward_region():
                    gs = resolve_pending(torch.autograd.grad(y, want, grad_outputs=g, allow_unused=True,
                                                             retain_graph=part == "BI"))
                if x_in is not None and part != "BW":
                    outbox[("grad", k, j)] = gs[0]
                    gs = gs[1:]
                for i, gi in zip(wrt if part != "BI" else [], gs):
                    if gi is not None and not (once and once.accumulate(i, gi)):
                        grads[i] = grads[i] + gi.to(grads[i].dtype)
            if part == "BI":
                saved[(k, j)] = (x_in, y, g)
            else:
                del saved[(k, j)]

        for messages, actions in self._rounds:
            self._exchange(messages, outbox, inbox, boundary, me)
            for a in actions.get(me, ()):
                if a.kind == "F":
                    forward(a.stage, a.micro)
                else:
                    backward(a.stage, a.micro, a.kind)
        if once is not None:     # one reduce-scatter per unit, of the gradients of every micro-batch
            for i, g in once.reduce().items():
                grads[i] = grads[i] + g.to(grads[i].dtype)
        values = step_values.combine(reported)
        if p > 1:       # the parameters outside the layers: their gradients come from the first and last stage
            grads = [raw_all_reduce(g, PP, "sum") if k is None and x.is_floating_point() and t else g
                     for g, k, x, t in zip(grads, self._stage_of, leaves, trains)]
            total = raw_all_reduce(total, PP, "sum")
            # the loss's reported values come from the last stage: every stage gets them
            values = {name: raw_all_reduce(values[name] if name in values else
                                           torch.zeros(shape, dtype=dtype, device=total.device), PP, "sum")
                      for name, (shape, dtype) in probe.reported.items()}
        return finish_update(self.step, update, params, leaves, treespec, opt_state,
                             [g for g, t in zip(grads, trains) if t], total, tokens, count, skipped, values,
                             self._norm_groups(mesh), params_finite=params_finite, peaks=peaks)

    def _stage(self, k: int):
        """Virtual stage ``k``'s forward: ``(params, x_in, batch) -> (value, cut)``, the
        activation to send on (``cut``) or the settled loss; with ``compile``, one graph per
        virtual stage (``k`` a constant of the trace), shared by the devices that run it."""
        if not self.stage_compile:
            return functools.partial(self._stage_forward, k)
        with self.step._compile_lock:
            gate = self._compiled_stages.get(k)
            if gate is None:
                backend = step_backend(self.stage_compile, overlap=self.step.policy.overlap,
                                       in_flight=self.step.policy.collectives_in_flight)
                fn = torch.compile(self._stage_forward, backend=backend, fullgraph=True, dynamic=False)
                gate = self._compiled_stages[k] = CompileGate(fn, PipelineSchedule._stage_forward.__code__)

        def run(*args):
            # a graph per stage and step object (docs/compile.md "Many steps in one process");
            # the token-id checks' list empty in every call
            with compile_cache_limits(COMPILED_STEPS_PER_PROCESS * self.stages * self.virtual_stages), \
                    checks_apart():
                return gate(k, *args)
        return run

    def _stage_forward(self, k: int, params, x_in: tuple[torch.Tensor, ...] | None, named_batch: dict,
                       passes: int = 1):
        last, per = self.stages * self.virtual_stages - 1, self._per
        try:
            with running_stage(StageRun(k * per, (k + 1) * per - 1, x_in, cut=k < last, layers=per * (last + 1),
                                        passes=passes)):
                out = call_loss(self.step.loss_fn, params, named_batch, "pipeline_step")
        except StageOutput as done:
            if not isinstance(done.value, tuple):
                return done.value.data, True
            return torch.cat([x.data.reshape(-1) for x in done.value]), True     # every pass's, one message
        if k < last:
            raise ValueError(f"pipeline_step: the model called fewer than {(k + 1) * per} layers but "
                             f"{self.layer_lists[0]!r} lists {per * (last + 1)}; call every layer once per forward")
        out = settle(out)
        check_scalar_loss(out, "pipeline_step")
        return out.data, False

    def _gather_once(self, xs: list[torch.Tensor], held: list[bool]) -> GatheredOnce:
        """This device's FSDP units gathered for the whole step: one per held layer, one for
        the held parameters outside the layers (uncast: the gradients accumulate in fp32)."""
        units: dict[tuple[int, int] | None, list[int]] = {}
        for i, h in enumerate(held):
            if h and xs[i].is_floating_point():
                units.setdefault(self._layer_of[i], []).append(i)
        return GatheredOnce(self.step._named_leaves(xs, cast=False), list(units.values()))

    def _norm_groups(self, mesh) -> list:
        """The step's leaf groups for the gradient norm, the layers' completed over ``pp`` too
        (each stage holds its own layers; the parameters outside them are alike on every stage)."""
        if self.stages == 1:
            return self.step.spec.axis_groups(mesh)
        out = []
        trained = [i for i, t in enumerate(self._trains(len(self._stage_of))) if t]   # (indices among them)
        for axes, idx in self.step.spec.axis_groups(mesh):
            layer = [i for i in idx if self._stage_of[trained[i]] is not None]
            other = [i for i in idx if self._stage_of[trained[i]] is None]
            if layer:
                out.append((tuple(a for a in mesh.axis_names if a in axes or a == PP), layer))
            if other:
                out.append((axes, other))
        return out

    def _lock_step(self) -> list[tuple[list[tuple], dict[int, list]]]:
        """The timeline as rounds, one per time at which something starts or ends: the messages
        (kind, stage, micro, from device, to device) finished then, and {device: actions
        starting then}."""
        s, last = self.timeline.schedule, self.stages * self.virtual_stages - 1
        starts: dict[int, dict[int, list]] = {}
        ends: dict[int, list[tuple]] = {}
        for d, dev in enumerate(self.timeline.slots):
            for start, end, a in dev:
                starts.setdefault(start, {}).setdefault(d, []).append(a)
                msgs = ends.setdefault(end, [])
                if a.kind == "F" and a.stage < last:
                    msgs.append(("act", a.stage, a.micro, d, s.device_of(a.stage + 1)))
                elif a.kind in ("B", "BI") and a.stage > 0:
                    msgs.append(("grad", a.stage, a.micro, d, s.device_of(a.stage - 1)))
        return [(ends.get(t, []), starts.get(t, {})) for t in sorted(set(starts) | set(ends))]

    def _exchange(self, messages: list[tuple], outbox: dict, inbox: dict, boundary, me: int) -> None:
        """Move the activations and gradients of ``messages`` to the devices that need them: one
        permute over pp per direction, only the pairs that send."""
        for kind in ("act", "grad"):
            msgs = [m for m in messages if m[0] == kind]
            if not msgs:
                continue
            if self.stages == 1:
                for m in msgs:
                    inbox[m[:3]] = outbox.pop(m[:3])
                continue
            mine = next((m for m in msgs if m[3] == me), None)
            buf = outbox.pop(mine[:3]) if mine is not None else torch.zeros(boundary[0], dtype=boundary[1])
            got = raw_permute(buf.contiguous(), PP, [(m[3], m[4]) for m in msgs])
            for m in msgs:
                if m[4] == me:
                    inbox[m[:3]] = got

    def _probe(self, named_params, mb: dict) -> "Probe":
        """What the stages exchange for micro-batches shaped like ``mb`` (cached per shapes): the
        loss run once without layers on the parameters' stand-ins, no gradient, recording each
        layer call's residual stream (each pass's shape) and the values the loss reports."""
        # per device: a device that found another's probe would skip the collectives its group runs
        key = (current_rank(), tuple((name, tuple(v.shape), v.dtype) for name, v in mb.items()))
        found = self._probes.get(key)
        if found is not None:
            return found
        named_batch = {name: wrap(val, self.step.batch_dims[name]) for name, val in mb.items()}
        seen: list = []
        with torch.no_grad(), step_values.collecting() as reported, \
                running_stage(StageRun(0, -1, None, cut=False, seen=seen)):
            self.step.loss_fn(named_params, named_batch)
        layers = self._per * self.stages * self.virtual_stages
        if not seen:
            raise ValueError("pipeline_step: the model called no functional_pp.layer; a pipeline cuts the model "
                             "at its layers")
        if len(seen) % layers:
            raise ValueError(f"pipeline_step: the loss called {len(seen)} layers, not a multiple of the {layers} "
                             f"listed at {self.layer_lists[0]!r}; each forward of the model must call every layer once")
        firsts = [x.data for x in seen[::layers]]
        if len({x.dtype for x in firsts}) > 1:
            raise ValueError(f"pipeline_step: the loss's forwards carry residual streams of dtypes "
                             f"{', '.join(str(x.dtype) for x in firsts)}; the stages send them in one message, "
                             f"of one dtype")
        found = Probe([tuple(x.shape) for x in firsts], firsts[0].dtype,
                      {name: (tuple(v.shape), v.dtype) for name, (v, _) in sorted(reported.items())})
        with self.step._compile_lock:
            self._probes[key] = found
        return found


@dataclass(frozen=True)
class Probe:
    """The residual stream each forward (pass) of a micro-batch sends between stages, and the
    metrics its loss reports (name -> shape, dtype)."""
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    reported: dict[str, tuple[tuple[int, ...], torch.dtype]]

    @property
    def passes(self) -> int:
        return len(self.shapes)

    @property
    def boundary(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of one stage-to-stage message: one pass's stream, or every pass's flat."""
        if self.passes == 1:
            return self.shapes[0], self.dtype
        return (sum(math.prod(s) for s in self.shapes),), self.dtype

    def split(self, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each pass's stream from a received message (views: gradients flow back to it)."""
        if self.passes == 1:
            return (received,)
        sizes = [math.prod(s) for s in self.shapes]
        return tuple(x.view(s) for x, s in zip(received.split(sizes), self.shapes))


def layer_at(path: str, layer_lists: tuple[str, ...]) -> tuple[int, int] | None:
    """(which layer list, which layer) of a parameter path, or None outside the layers."""
    for n, name in enumerate(layer_lists):
        if path.startswith(name + "."):
            return n, int(path[len(name) + 1:].split(".")[0])
    return None


def end_stage(path: str, first_stage: tuple[str, ...], last_stage: tuple[str, ...], stages: int) -> int | None:
    """The virtual stage (of ``stages``) that alone holds a parameter outside the layers, or None
    (all do: named in neither or in both of ``first_stage`` and ``last_stage``)."""
    first = any(_under(path, n) for n in first_stage)
    last = any(_under(path, n) for n in last_stage)
    return 0 if first and not last else stages - 1 if last and not first else None


def held_by_one_stage(path: str, layer_lists: tuple[str, ...], first_stage: tuple[str, ...] = (),
                      last_stage: tuple[str, ...] = ()) -> bool:
    """Whether one stage alone holds a parameter (a layer's, or a first- or last-stage one):
    :meth:`PipelineSchedule.logical_params` then gathers a whole copy of it on every stage."""
    return layer_at(path, layer_lists) is not None or end_stage(path, first_stage, last_stage, 2) is not None


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _refuse_batched() -> None:
    mesh_view.refuse_batched(ValueError("pipeline_step cannot run in a batched simulation (each stage runs its own "
                                        "actions): use launch's threads (the default) or processes=True"))


def pipeline_step(loss_fn, optimizer, *, mesh=None, rules=None, schedule: str = "1f1b", virtual_stages: int = 1,
                  layers: str = "layers", first_stage: tuple[str, ...] = (), last_stage: tuple[str, ...] = (),
                  fsdp_gather: str = "step", **options) -> TrainStep:
    """Build a :class:`~functional_pp.step.train.TrainStep` whose device function is a
    :class:`PipelineSchedule` (the options of :func:`~functional_pp.step.train.train_step`,
    ``grad_accum`` the number of micro-batches)."""
    from functional_pp.core.layout import Rules
    from functional_pp.step.train import check_step_arguments
    check_step_arguments(optimizer, mesh, rules, "pipeline_step")
    if rules is not None and mesh is not None:
        rules.check(mesh)
        rules.check_mesh_axes(mesh, "pipeline_step")
    options, stage_compile = pipeline_settings(step_options(dict(options), "pipeline_step"))
    schedule_fn = PipelineSchedule(schedule=schedule, virtual_stages=virtual_stages, layers=layers,
                                   first_stage=tuple(first_stage), last_stage=tuple(last_stage),
                                   fsdp_gather=fsdp_gather, stage_compile=stage_compile)
    return TrainStep(loss_fn, optimizer, mesh=mesh, rules=rules or Rules(), device=schedule_fn, **options)


def pipeline_settings(options: dict) -> tuple[dict, bool | str]:
    """A pipeline step's options (``step_options``'s) as the pipeline runs them, and the compile
    of its stages: ``compile`` compiles each virtual stage's forward (one torch.compile graph,
    its backward through AOT autograd; the schedule and the stage-to-stage permutes eager), not
    the step ("per_layer" as train_step); no FSDP prefetch (it follows the previous forward's
    units: not a stage's); no gradient buckets (gradients reduced as each backward makes them)."""
    stage_compile, _ = split_mode(options.get("compile", False))
    policy = options["policy"].replace(fsdp_prefetch=False, bucket_mb=None)
    return {**options, "policy": policy, **({"compile": False} if stage_compile else {})}, stage_compile
