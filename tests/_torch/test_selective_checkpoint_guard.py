"""The guard of selective activation checkpointing (functional_pp/_torch/selective_checkpoint.py):
torch hands the recomputation's k-th call of a kept op the forward's k-th cached result of that op;
where a region's forward and recomputation issue a kept op differently, torch alone returns another
call's result (a silently wrong gradient, shown here against plain autograd) and the guarded
contexts raise :class:`SelectiveRecomputeMismatch` naming the op, the call and the region. A region
that runs the same ops keeps its exact gradient, on one device and on real gloo processes."""
import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, \
    set_checkpoint_early_stop

import functional_pp as fpp
from functional_pp._torch.selective_checkpoint import (SelectiveRecomputeMismatch, checkpoint_modes_index_calls,
                                                       selective_checkpoint_contexts)

_mm = torch.ops.aten.mm.default
guarded = pytest.mark.skipif(not checkpoint_modes_index_calls(), reason="this torch's selective-checkpoint modes "
                             "do not index calls per op (docs/torch_versions.md): the contexts are torch's own")


def _keep_mm(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func is _mm else CheckpointPolicy.PREFER_RECOMPUTE


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]


def _grads(context_fn, monitor_last=False):
    """Gradients of a region whose forward also computes a statistic (without gradient) with a
    matrix product that its recomputation skips: before the region's products, or after them."""
    x, w1, w2 = _inputs()
    forward = {"now": True}

    def region(x, w1, w2):
        if forward["now"] and not monitor_last:
            with torch.no_grad():
                (x * x) @ w2                               # (a statistic the forward logs)
        y = (x @ w1).sin() @ w2
        if forward["now"] and monitor_last:
            with torch.no_grad():
                (x * x) @ w2
        forward["now"] = False
        return y.sin().sum()
    y = checkpoint(region, x, w1, w2, use_reentrant=False, context_fn=context_fn)
    return torch.autograd.grad(y, (x, w1, w2))


def _plain_grads():
    x, w1, w2 = _inputs()
    return torch.autograd.grad(((x @ w1).sin() @ w2).sin().sum(), (x, w1, w2))


def test_torch_alone_gives_a_silently_wrong_gradient_when_a_kept_op_is_issued_differently():
    wrong = _grads(functools.partial(create_selective_checkpoint_contexts, _keep_mm))
    assert not torch.allclose(wrong[0], _plain_grads()[0])


@guarded
def test_the_guard_names_the_op_the_call_and_the_layer():
    with pytest.raises(SelectiveRecomputeMismatch, match=r"(?s)aten.mm.default: its call 0 in the recomputation "
                       r"\(op #0 of the region.*call 0 in the forward \(op #1 of the region.*layer 'my_block'"
                       r".*remat=True"):
        _grads(functools.partial(selective_checkpoint_contexts, _keep_mm, "my_block"))


@guarded
def test_a_recomputation_run_to_its_end_must_take_every_cached_result():
    with set_checkpoint_early_stop(False), \
            pytest.raises(SelectiveRecomputeMismatch, match=r"aten.mm.default: the recomputation called it 2 times, "
                          r"the forward 3; call 2 \(op #4 of the region"):
        _grads(functools.partial(selective_checkpoint_contexts, _keep_mm, "my_block"), monitor_last=True)


def test_the_capability_on_this_torch():
    print(f"torch {torch.__version__}: selective checkpoint modes index calls per op (guarded): "
          f"{checkpoint_modes_index_calls()}")


def test_a_region_that_runs_the_same_ops_keeps_its_exact_gradient():
    x, w1, w2 = _inputs()
    y = checkpoint(lambda x, w1, w2: ((x @ w1).sin() @ w2).sin().sum(), x, w1, w2, use_reentrant=False,
                   context_fn=functools.partial(selective_checkpoint_contexts, _keep_mm))
    for got, want in zip(torch.autograd.grad(y, (x, w1, w2)), _plain_grads()):
        assert torch.equal(got, want)


# a model's layer under train_step(remat="selective"), with a statistic its forward alone computes

MONITOR = {"on": False}


@fpp.layer
def block(p, x):
    if MONITOR["on"]:
        with torch.no_grad():
            fpp.ops.einsum("tok d, d f -> tok f", x * x, p["w_in"])
    h = fpp.ops.einsum("tok d, d f -> tok f", x, p["w_in"])
    return x + fpp.ops.einsum("tok f, f d -> tok d", fpp.ops.silu(h) * h, p["w_out"])


def loss_fn(params, batch):
    x = batch["x"]
    for p in params["blocks"]:
        x = block(p, x)
    MONITOR["on"] = False                               # (the forward's monitoring ends before backward)
    return fpp.ops.mean(x * x, ("tok", "d"))


def decls():
    return {"blocks": [{"w_in": fpp.param((8, 32), "d f", init="normal", scale=0.2, dtype=torch.float64),
                        "w_out": fpp.param((32, 8), "f d", init="normal", scale=0.2, dtype=torch.float64)}
                       for _ in range(2)]}


RULES = fpp.Rules(tok="dp_shard", f="dp_shard")          # data over dp_shard, weights sharded along f (FSDP)


def _train(mesh, rules, remat, monitor):
    """One SGD step on a device of ``mesh``: the loss and the gathered parameters, or the guard's message."""
    step = fpp.train_step(loss_fn, fpp.optim.sgd(0.1), mesh=mesh, rules=rules, remat=remat,
                          batch_dims={"x": "tok d"})
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def device():
        state = step.init(fpp.init(decls, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            local = {"x": fpp.named(x, "tok d").data}
        MONITOR["on"] = monitor
        try:
            state, m = step(state, local)
        except SelectiveRecomputeMismatch as e:
            return str(e)
        with fpp.use_rules(rules):
            full = fpp.gather_tree(state["params"], decls(), rules)
        return float(m["loss"]), {path: p.detach().numpy() for path, p in fpp.leaves_with_paths(full)}
    return device


@guarded
def test_a_layer_whose_recomputation_differs_raises_on_every_gloo_process_and_a_faithful_one_trains_as_one_device():
    one = fpp.launch(_train(fpp.Mesh(), fpp.Rules(), False, monitor=False), fpp.Mesh())[0]
    mesh = fpp.Mesh(dp_shard=2)
    faithful, differing = (fpp.launch(_train(mesh, RULES, "selective", monitor=m), mesh, processes=True, timeout=120)
                           for m in (False, True))
    for loss, params in faithful:
        assert loss == pytest.approx(one[0], rel=1e-12)
        for path, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][path]), rtol=1e-10, atol=1e-12)
    for message in differing:
        assert isinstance(message, str) and "aten.mm.default: its call 0" in message and "layer 'block'" in message
