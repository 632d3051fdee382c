"""The eager step's casts of the parameters to the compute precision (step/precision_cast.py):
one foreach copy each way for every leaf, with the numbers of ``x.to(dtype)`` leaf by leaf and
its gradients (``x.to``'s backward), on one device and on real gloo processes."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step import precision_cast, train
from tests.harness import assert_same_run, launch_steps, local_batch, make_batch


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _leaf_by_leaf(leaves, dtype):
    """The casts as they were: ``x.to(dtype)`` per floating-point leaf."""
    return [x.to(dtype) if x.is_floating_point() else x for x in leaves]


def _leaves(grad=True):
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 2, 5), (16,)]
    return [(torch.randn(s, generator=g) * 10).requires_grad_(grad) for s in shapes]


def test_casts_and_gradients_equal_casting_leaf_by_leaf_in_one_op_each_way():
    xs = _leaves()
    ys = [x.detach().clone().requires_grad_() for x in xs]
    with _Ops() as forward:
        ours = precision_cast.cast_floating(xs, torch.bfloat16)
    theirs = _leaf_by_leaf(ys, torch.bfloat16)
    for a, b in zip(ours, theirs):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape and torch.equal(a, b)
    assert forward.names["_foreach_copy_"] == 1 and forward.names["_to_copy"] == 0, forward.names
    weights = [torch.randn(a.shape).to(torch.bfloat16) for a in ours]   # every entry weighed differently
    loss = lambda outs: sum((o * w).sum() for o, w in zip(outs, weights))  # noqa: E731
    ours_loss = loss(ours)
    with _Ops() as backward:
        gs = torch.autograd.grad(ours_loss, xs)
    hs = torch.autograd.grad(loss(theirs), ys)
    for g, h in zip(gs, hs):
        assert g.dtype == torch.float32 and torch.equal(g, h)
    assert backward.names["_foreach_copy_"] == 1 and backward.names["_to_copy"] == 0, backward.names


def test_frozen_integer_and_same_dtype_leaves_keep_their_way():
    trained, frozen = _leaves(), _leaves(grad=False)
    ints, same = torch.arange(4), torch.ones(3, dtype=torch.bfloat16)
    out = precision_cast.cast_floating([trained[0], frozen[0], ints, same, trained[1], frozen[1]], torch.bfloat16)
    assert out[2] is ints and out[3] is same
    assert out[0].requires_grad and out[4].requires_grad
    assert not out[1].requires_grad and not out[5].requires_grad      # no gradient computed for frozen leaves
    assert torch.equal(out[1], frozen[0].to(torch.bfloat16))


def test_an_unused_parameter_is_still_named_by_autograd():
    """A leaf the loss does not use gets no gradient: ``autograd.grad`` refuses as it did."""
    xs = _leaves()
    out = precision_cast.cast_floating(xs, torch.bfloat16)
    with pytest.raises(RuntimeError, match="not have been used"):
        torch.autograd.grad(out[0].float().sum(), xs)
    gs = torch.autograd.grad(out[0].float().sum(), xs, allow_unused=True)
    assert gs[1] is None and torch.equal(gs[0], torch.ones_like(xs[0]))


CFG = llama.Config.tiny(layers=2)


@pytest.mark.parametrize("accum", [1, 2])
def test_a_bf16_step_is_bitwise_the_step_that_cast_leaf_by_leaf(monkeypatch, accum):
    ours = launch_steps(CFG, precision="bf16", grad_accum=accum)[0]
    monkeypatch.setattr(train, "cast_floating", _leaf_by_leaf)
    theirs = launch_steps(CFG, precision="bf16", grad_accum=accum)[0]
    assert_same_run(ours, theirs)


@pytest.mark.parametrize("mesh", [fpp.Mesh(dp_replicate=2), fpp.Mesh(dp_shard=2)], ids=["dp", "fsdp"])
def test_simulated_dp_and_fsdp_steps_issue_the_collectives_of_casting_leaf_by_leaf(monkeypatch, mesh):
    """DP: the gradients still go to the buckets (one flat all-reduce); FSDP: each parameter is
    still told apart (its own block), so no parameter passes for tied and the units are kept."""
    ours = fpp.launch(_later_steps_collectives(mesh), mesh)
    monkeypatch.setattr(train, "cast_floating", _leaf_by_leaf)
    theirs = fpp.launch(_later_steps_collectives(mesh), mesh)
    assert ours == theirs


def _later_steps_collectives(mesh):
    """Per step of three, the collectives (from the second step on, FSDP hands parameters it
    saw gathered twice to the model as tied) and the loss."""
    import functools
    rules = llama.default_rules()
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3), mesh=mesh, rules=rules,
                          precision="bf16")
    data = [make_batch(CFG, batch=4, seq=16, seed=i) for i in range(3)]

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        out = []
        for b in data:
            with fpp.use_rules(rules):
                local = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            out.append((float(m["loss"]), sorted((e.kind, e.axes, tuple(e.shape)) for e in rep.events)))
        return out
    return device


@pytest.mark.multiprocess
def test_bf16_steps_on_gloo_processes_equal_casting_leaf_by_leaf(monkeypatch):
    """FSDP x TP on 4 real processes (gradients reduce-scattered and all-reduced in fp32 inside
    backward, before the casts back) against the same layout simulated with the old casts."""
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    real = launch_steps(CFG, mesh=mesh, rules=rules, precision="bf16", processes=True)
    monkeypatch.setattr(train, "cast_floating", _leaf_by_leaf)
    simulated = launch_steps(CFG, mesh=mesh, rules=rules, precision="bf16")
    for a, b in zip(real, simulated):
        assert_same_run(a, b)
        assert sorted(map(repr, a[2])) == sorted(map(repr, b[2]))     # the same collectives (FSDP units)


def test_a_leaf_of_other_strides_keeps_them_as_to_does():
    x = torch.randn(4, 6).t().requires_grad_()          # (6, 4), strides (1, 6)
    y = torch.randn(5).requires_grad_()
    z = torch.randn(3).requires_grad_()
    out = precision_cast.cast_floating([x, y, z], torch.bfloat16)
    assert out[0].stride() == x.to(torch.bfloat16).stride() and torch.equal(out[0], x.to(torch.bfloat16))
    gs = torch.autograd.grad(sum(o.float().sum() for o in out), [x, y, z])
    assert [g.dtype for g in gs] == [torch.float32] * 3
