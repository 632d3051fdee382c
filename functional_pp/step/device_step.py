"""A training step's device function: the part of a step that runs on every device (forward,
backward, the update phase), chosen when the step is built and given the step whose settings
and parts it uses (docs/architecture.md, "The step").

:class:`DeviceFunction` is what a :class:`~functional_pp.step.train.TrainStep` asks of it;
:class:`PlainDeviceStep` is ``train_step``'s (micro-batches in turn on every device), and
``step/pipeline.py``'s ``PipelineSchedule`` is ``pipeline_step``'s (the schedule's stages).
"""
from __future__ import annotations

import math

from contextlib import nullcontext
from typing import Any, Callable, Protocol

import torch

from functional_pp._torch import is_tracing
from functional_pp._torch.grad_leaves import differentiable
from functional_pp.compile.barrier import materialize
from functional_pp.compile.recompute import backward_region, recomputed_leaf
from functional_pp.core import step_values
from functional_pp.core.backward_thread import carry_to_backward
from functional_pp.core.tree import tree_flatten, tree_leaves
from functional_pp.ops.token_ids import checks_so_far
from functional_pp.parallel.buckets.eager import grad_buckets
from functional_pp.parallel.buckets.pending import resolve_pending
from functional_pp.parallel.collectives import psum as sum_over
from functional_pp.parallel.fsdp import param_uses
from functional_pp.parallel.fsdp.units import begin_forward
from functional_pp.parallel.grads import check_scalar_loss
from functional_pp.parallel.named import env, settle, wrap
from functional_pp.step import activation_offload, offload
from functional_pp.step.buffers import acc_dtype, as_dtype, device_of
from functional_pp.step.io import split_micro
from functional_pp.step.result import DeviceStepResult
from functional_pp.step.settings import PRECISIONS
from functional_pp.step.update import UpdateStrategy

StepParts = Any     # the TrainStep (step/train.py) a device function is bound to: its settings and parts

__all__ = ["DeviceFunction", "PlainDeviceStep", "micro_weights", "finish_update"]


class DeviceFunction(Protocol):
    """What a step asks of its device function. :meth:`bind` is called once, when the step is
    built (it may check the step's settings, refusing a bad one by name, and changes none of
    them); the others on every device."""

    def bind(self, step: StepParts) -> None:
        """Take the step whose settings and parts this function uses."""

    def init(self, params: Any) -> dict:
        """This device's training state from the named parameters."""

    def __call__(self, params, opt_state, count, skipped, batch, params_finite, peaks, seed,
                 update: UpdateStrategy) -> DeviceStepResult:
        """One step on this device, updating with ``update`` (step/update.py): the new state and
        the metrics, still on the device."""

    def logical_state(self, state: dict) -> dict:
        """The whole training state, as one device holds it."""

    def logical_params(self, params: Any) -> Any:
        """The whole parameter tree, as one device holds it."""

    def stage_state(self, state: dict) -> dict:
        """This device's part of a whole training state."""


class PlainDeviceStep:
    """``train_step``'s device function: the micro-batches (``grad_accum``) in turn, each's
    forward and backward, the gradients accumulated, then the update phase (step/update.py).
    Every device holds its shards of every parameter: the whole state is the state."""

    def bind(self, step: StepParts) -> None:
        self.step = step

    def init(self, params: Any) -> dict:
        return self.step.initial_state(params)

    def logical_state(self, state: dict) -> dict:
        return state

    def logical_params(self, params: Any) -> Any:
        return params

    def stage_state(self, state: dict) -> dict:
        return state

    def __call__(self, params, opt_state, count, skipped, batch, params_finite, peaks, seed,
                 update: UpdateStrategy) -> DeviceStepResult:
        # seed: what the parameters are made differentiable with in a compiled step on a
        # torch whose dynamo cannot (_torch/grad_leaves.py); None otherwise
        s = self.step
        leaves, treespec = tree_flatten(params)
        trains = s.spec.trainable or (True,) * len(leaves)
        micro = split_micro(batch, s.grad_accum)
        weights, tokens = micro_weights(micro, s.batch_dims, s.micro_weighting)
        tokens = throughput_tokens(micro, s.batch_dims, s.throughput_tokens, tokens)
        compute_device, work = s._offloaded_to(), leaves
        if compute_device is not None:   # offload: the shards on the device for this step, in the compute precision
            compute = PRECISIONS[s.precision]
            work = [offload.to_compute(x, compute_device, compute if t else None) for x, t in zip(leaves, trains)]
        grads = [torch.zeros_like(x, device=w.device) if len(micro) > 1 else w
                 for x, w, t in zip(leaves, work, trains) if t]   # (dtype template)
        acc = acc_dtype(leaves)
        total = torch.zeros((), dtype=acc, device=work[0].device)
        reported = []                    # the values the loss reports (core/step_values.py), per micro-batch
        # a compiled 16-bit step keeps the gradients of declared-tied parameters out of its
        # update kernel (compile/barrier.py; docs/compile.md "bf16 gradients and inductor")
        keep_ties_apart = is_tracing() and PRECISIONS[s.precision] is not None
        tied_leaves: set[int] = set()
        for mb, w in zip(micro, weights):
            # frozen leaves enter without requires_grad: autograd computes no gradient for them, so
            # no transpose runs (no DP all-reduce, no FSDP reduce-scatter; docs/adapters.md)
            xs = [_differentiable(x, seed, x.is_floating_point() and t) for x, t in zip(work, trains)]
            named_batch = {k: wrap(v, s.batch_dims[k]) for k, v in mb.items()}
            named_params = s._named_params(xs, treespec)
            begin_forward(named_params)     # FSDP forward prefetch follows the last forward's units
            checked = checks_so_far()
            learning = not is_tracing() and getattr(s._shared, "tied", None) is None   # (eager steps)
            acts = (activation_offload.offloading(device_of(work), s._said_not_offloaded)
                    if s.activation_offloading else nullcontext())
            blocks = [x.data for x in tree_leaves(named_params)] if keep_ties_apart else ()
            with step_values.collecting() as found, param_uses.counting(learning) as uses, acts, \
                    param_uses.declaring() as declared:
                loss_named = settle(call_loss(s.loss_fn, named_params, named_batch))
            tied_leaves |= param_uses.declared_positions(declared, blocks)
            blocks = declared = None
            if learning:                    # parameters gathered at several sites: tied from now on
                s._shared.tied = param_uses.gathered_more_than_once(
                    uses, [x.data for x in tree_leaves(named_params)])
            reported.append(found)
            named_params = None
            check_scalar_loss(loss_named, "train_step")
            loss = loss_named.data.to(acc) * w.to(acc)
            loss = s._metrics.loss(loss, checked)      # deferred: a bad token id makes it non-finite
            diff = [x for x in xs if x.requires_grad]
            with backward_region(), grad_buckets(s.policy.bucket_mb) as buckets:   # docs/communication.md
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
        if tied_leaves:       # keep their 16-bit gradient math (two layouts summed) out of the update kernel
            positions = [i for i, t in enumerate(trains) if t]     # (the leaves of ``grads``)
            grads = [materialize(g) if i in tied_leaves else g for g, i in zip(grads, positions)]
        if compute_device is not None:   # offload: the gradients and the update on the host
            work = xs = None
            masters = [x for x, t in zip(leaves, trains) if t]
            grads = [offload.grad_to_host(g, x.dtype) for g, x in zip(grads, masters)]
            total = total.to(offload.HOST)
        return finish_update(s, update, params, leaves, treespec, opt_state, grads, total, tokens, count, skipped,
                             step_values.combine(reported), s.spec.axis_groups(env()[0]),
                             params_finite=params_finite, peaks=peaks, reduce_on=compute_device)


def finish_update(s: StepParts, update: UpdateStrategy, params, leaves: list, treespec, opt_state, grads: list,
                  total: torch.Tensor, tokens: torch.Tensor, count, skipped, values: dict, groups: list, *,
                  params_finite=None, peaks=None, reduce_on: torch.device | None = None) -> DeviceStepResult:
    """The end every device function shares: ``update`` (the step's strategy, step/update.py)
    applied to the trainable leaves with their gradients ``grads``, the deferred mode's device-side choice,
    the frozen leaves merged back, and the metrics (loss ``total``, gradient norm, learning
    rate, ``tokens``, flags, the loss's reported ``values``) as a :class:`DeviceStepResult`."""
    if s.spec.frozen:       # the optimizer's tree: the trainable leaves
        trained = s.spec.trainable_tree(params)
        trained_leaves, trained_spec = tree_flatten(trained)
    else:                   # every leaf trains: the step's one flatten of the parameters serves
        trained, trained_leaves, trained_spec = params, leaves, treespec
    up = update.apply(grads, trained_spec, trained, opt_state, total, groups, params_finite=params_finite,
                      peaks=peaks, reduce_on=reduce_on, param_leaves=trained_leaves)
    # deferred: the skip chosen on the device (step/metrics_modes.py)
    up.params, up.opt_state = s._metrics.chosen(up, trained_leaves, opt_state)
    up.params = s.spec.merged(leaves, treespec, up.params)     # the frozen leaves as they were
    lr = s.lr_schedule(count) if s.lr_schedule is not None else torch.zeros((), device=total.device)
    # the skip and the flags as integers in one cast (one launch, not one per flag)
    skip, *flags = torch.stack([~up.finite if up.skip is None else up.skip, *up.flags.values()]
                               ).to(torch.int64).unbind()
    metrics = {"loss": total, "grad_norm": up.grad_norm,
               "lr": torch.as_tensor(lr, dtype=torch.float32, device=total.device),
               "tokens": tokens, "skipped": skip, **dict(zip(up.flags, flags)),
               **values}
    return DeviceStepResult(up.params, up.opt_state, count + 1, skipped + skip, metrics, up.written, up.peaks)


def micro_weights(micro: list[dict], batch_dims: dict, by: str = "labels"):
    """Weight of each micro-batch: its share of the (global) non-ignored labels (``by`` labels; rows:
    of the elements of its first entry, equal shares), so that accumulation equals one large
    batch. Also returns the global count."""
    counts = [_token_count(mb, batch_dims, by) for mb in micro]
    if len(counts) == 1:
        # c / max(c, 1) in one op: 1, or 0 when every label is ignored (docs/eager_overhead.md)
        return [counts[0].clamp_max(1)], counts[0]
    total = sum(counts[1:], counts[0])
    # every label ignored: a zero-weight step (loss 0, no gradient), not 0/0
    return [c / total.clamp_min(1) for c in counts], total


def throughput_tokens(micro: list[dict], batch_dims: dict, counted: str, labels: torch.Tensor) -> torch.Tensor:
    """The step's ``tokens`` metric: ``labels`` (the global non-ignored labels, given) or with
    ``counted`` "rows" every position of the micro-batches' ``tokens`` rows (their global sizes: no
    collective), what the step computes where its rows are longer than what they train."""
    if counted == "labels":
        return labels
    total = 0
    for mb in micro:
        key = "tokens" if "tokens" in mb else next(iter(mb))
        x = wrap(mb[key], batch_dims[key])
        total += math.prod(x.size(d) for d in x.dims)
    return torch.full((), float(total), dtype=torch.float64, device=labels.device)


def _token_count(mb: dict, batch_dims: dict, by: str = "labels") -> torch.Tensor:
    """The global number (float64) of non-ignored labels of a micro-batch (of elements of its
    first entry without labels or ``by`` rows): counted here, summed over the mesh axes splitting it."""
    key = "labels" if "labels" in mb and by == "labels" else next(iter(mb))
    x = wrap(mb[key], batch_dims[key])
    n = (torch.count_nonzero(x.data != -100) if key == "labels" else
         torch.full((), x.data.numel(), device=x.data.device)).to(torch.float64)
    axes = {a for s in x.split for a in s}
    return sum_over(n, tuple(a for a in env()[0].axis_names if a in axes)) if axes else n


def _differentiable(x, seed, requires):
    """A leaf to differentiate against (_torch/grad_leaves.py). Where it is ``x + seed`` (a new
    tensor in the traced graph, not the parameter's own storage), its backward uses read a copy
    made again in backward, so the step does not keep a second copy of every parameter until
    then (compile/recompute.py)."""
    if seed is None or not requires:
        return differentiable(x, seed, requires)
    with recomputed_leaf():
        return differentiable(x, seed, requires)


def call_loss(loss_fn: Callable[..., Any], params: Any, batch: dict, where: str = "train_step") -> Any:
    """``loss_fn(params, batch)``, its mistakes named: a ``KeyError`` for a key the batch does not
    have (a loss reading ``batch["labels"]`` of a batch built without them) is raised again naming
    the batch's keys; a tuple, mapping or Python number returned is refused naming the contract
    (settle's own message named neither the loss function nor what it returns)."""
    try:
        out = loss_fn(params, batch)
    except KeyError as exc:
        key = exc.args[0] if len(exc.args) == 1 else None
        if isinstance(key, str) and isinstance(batch, dict) and key not in batch:
            raise KeyError(f"loss_fn read {key!r}, which the batch does not have: the batch has {sorted(batch)} "
                           f"(add {key!r} to every batch the step gets, or read one of those)") from exc
        raise
    if isinstance(out, (tuple, list, dict, int, float)):
        raise TypeError(f"{where}: loss_fn(params, batch) returned a {type(out).__name__}; it must return the "
                        f"loss alone, a named scalar (e.g. ops.cross_entropy(logits, labels), or ops.mean(x, "
                        f"'batch seq') of per-token losses); auxiliary outputs are not returned with it")
    return out
