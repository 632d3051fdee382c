"""Tests for functional_pp.optim (optax-style optimizers on torch pytrees)."""

from __future__ import annotations

import math
import threading

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_pp.optim as optim
from functional_pp.optim import schedules

STEPS = 5


def _make_params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "emb": r(5, 3),
        "layers": [
            {"w": r(4, 3), "b": r(4), "norm": (r(3),)},
            {"w": r(2, 4), "b": r(2)},
        ],
    }


def _grads_for_step(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return optree.tree_map(
        lambda p: (scale * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype), params
    )


def _leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=False)


def _run_functional(opt, params, steps=STEPS, grad_scale=1.0):
    state = opt.init(params)
    for step in range(steps):
        grads = _grads_for_step(params, step, grad_scale)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(make_opt, params, steps=STEPS, grad_scale=1.0, groups=None):
    """Run a torch.optim optimizer on clones of the leaves of ``params``."""
    leaves, spec = optree.tree_flatten(params, none_is_leaf=False)
    tensors = [p.clone().requires_grad_(True) for p in leaves]
    opt = make_opt(groups(tensors) if groups else tensors)
    for step in range(steps):
        grads = _leaves(_grads_for_step(params, step, grad_scale))
        for t, gr in zip(tensors, grads):
            t.grad = gr.clone()
        opt.step()
    return optree.tree_unflatten(spec, [t.detach() for t in tensors])


def _assert_trees_close(a, b, rtol=1e-10, atol=1e-12):
    assert optree.tree_structure(a, none_is_leaf=False) == optree.tree_structure(b, none_is_leaf=False)
    for x, y in zip(_leaves(a), _leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- #
# parity with torch.optim
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(weight_decay):
    params = _make_params()
    ours, _ = _run_functional(optim.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay), params)
    ref = _run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay), params
    )
    _assert_trees_close(ours, ref)
    # params actually moved
    assert not torch.allclose(ours["emb"], params["emb"])


def test_adamw_with_ndim_mask_matches_torch_param_groups():
    params = _make_params()
    wd = 0.3

    def groups(tensors):
        return [
            {"params": [t for t in tensors if t.ndim >= 2], "weight_decay": wd},
            {"params": [t for t in tensors if t.ndim < 2], "weight_decay": 0.0},
        ]

    ref = _run_torch(lambda gs: torch.optim.AdamW(gs, lr=1e-2, betas=(0.9, 0.95)), params, groups=groups)
    for mask in (optim.decay_mask_by_ndim, optim.mask_by_path(lambda path, leaf: path[-1] not in ("b", 0)),
                 optim.decay_mask_by_ndim(params)):
        ours, _ = _run_functional(optim.adamw(1e-2, weight_decay=wd, mask=mask), params)
        _assert_trees_close(ours, ref)
    # without the mask the result differs (1-D leaves are decayed)
    unmasked, _ = _run_functional(optim.adamw(1e-2, weight_decay=wd), params)
    assert not torch.allclose(unmasked["layers"][0]["b"], ref["layers"][0]["b"])


@pytest.mark.parametrize(
    "momentum,nesterov,weight_decay",
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, False, 0.05), (0.8, True, 0.05)],
)
def test_sgd_matches_torch(momentum, nesterov, weight_decay):
    params = _make_params()
    opt = optim.sgd(0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    ours, _ = _run_functional(opt, params)
    ref = _run_torch(
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay),
        params,
    )
    _assert_trees_close(ours, ref)


# --------------------------------------------------------------------------- #
# building blocks
# --------------------------------------------------------------------------- #
def test_add_decayed_weights_mask_excludes_1d():
    params = _make_params(torch.float32)
    zeros = optree.tree_map(torch.zeros_like, params)
    t = optim.add_decayed_weights(0.5, mask=optim.decay_mask_by_ndim)
    out, _ = t.update(zeros, t.init(params), params)
    for p, u in zip(_leaves(params), _leaves(out)):
        expected = 0.5 * p if p.ndim >= 2 else torch.zeros_like(p)
        torch.testing.assert_close(u, expected)
    with pytest.raises(ValueError):
        t.update(zeros, t.init(params), None)


def test_chain_order():
    p = {"a": torch.tensor([1.0, -2.0]), "b": [torch.tensor([[3.0]])]}
    g = {"a": torch.tensor([0.5, 0.25]), "b": [torch.tensor([[-1.0]])]}
    t1 = optim.chain(optim.scale(2.0), optim.add_decayed_weights(1.0))  # 2g + p
    t2 = optim.chain(optim.add_decayed_weights(1.0), optim.scale(2.0))  # 2(g + p)
    u1, s1 = t1.update(g, t1.init(p), p)
    u2, _ = t2.update(g, t2.init(p), p)
    torch.testing.assert_close(u1["a"], 2 * g["a"] + p["a"])
    torch.testing.assert_close(u2["a"], 2 * (g["a"] + p["a"]))
    torch.testing.assert_close(u1["b"][0], torch.tensor([[1.0]]))
    torch.testing.assert_close(u2["b"][0], torch.tensor([[4.0]]))
    assert isinstance(s1, tuple) and len(s1) == 2


def test_scale_by_schedule_uses_previous_count():
    p = {"w": torch.ones(3)}
    t = optim.scale_by_schedule(lambda c: c.to(torch.float32) + 1.0)
    state = t.init(p)
    assert state.count.dtype == torch.int64 and state.count.ndim == 0
    seen = []
    for _ in range(3):
        u, state = t.update(p, state)
        seen.append(u["w"][0].item())
    assert seen == [1.0, 2.0, 3.0]
    assert int(state.count) == 3


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = _grads_for_step(_make_params(), 0, 2.0)
    t = optim.clip_by_global_norm(max_norm)
    ours, _ = t.update(grads, t.init(grads))
    tensors = [torch.zeros_like(g, requires_grad=True) for g in _leaves(grads)]
    for t, g in zip(tensors, _leaves(grads)):
        t.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
    assert total.dtype == torch.float64
    torch.testing.assert_close(optim.global_norm(grads), total)
    assert (total.item() > max_norm) == (max_norm < 1)  # one case clips, the other does not
    for a, b in zip(_leaves(ours), [t.grad for t in tensors]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    if max_norm < 1:
        torch.testing.assert_close(optim.global_norm(ours), torch.tensor(max_norm, dtype=torch.float64), rtol=1e-5, atol=0)


def test_norm_reducer_doubling_and_structure():
    tree = {"x": torch.tensor([3.0, 4.0]), "y": [torch.tensor([[0.0]])]}
    assert optim.global_norm(tree).item() == pytest.approx(5.0)
    seen = []

    def doubling(sq):
        seen.append(optree.tree_structure(sq, none_is_leaf=False))
        assert all(t.ndim == 0 for t in _leaves(sq))
        return 2 * sum(_leaves(sq))

    assert optim.global_norm(tree, doubling).item() == pytest.approx(5.0 * math.sqrt(2))
    # clip uses global_norm, so it sees the doubled norm: coef = 5 / (5*sqrt2); the reducer is an
    # argument of the transform or of update
    out, _ = optim.clip_by_global_norm(5.0, reducer=doubling).update(tree, optim.EmptyState())
    torch.testing.assert_close(out["x"], tree["x"] / math.sqrt(2), rtol=1e-5, atol=1e-6)
    clip = optim.chain(optim.clip_by_global_norm(5.0))
    out, _ = clip.update(tree, clip.init(tree), norm_reducer=doubling)
    torch.testing.assert_close(out["x"], tree["x"] / math.sqrt(2), rtol=1e-5, atol=1e-6)
    assert seen and seen[0] == optree.tree_structure(tree, none_is_leaf=False)
    # nothing ambient is left behind
    assert optim.global_norm(tree).item() == pytest.approx(5.0)
    out, _ = optim.clip_by_global_norm(5.0).update(tree, optim.EmptyState())
    torch.testing.assert_close(out["x"], tree["x"])


def test_norm_reducer_is_explicit_per_call_in_threads():
    """Two threads with different reducers at the same time: each call uses its own."""
    tree = {"x": torch.tensor([3.0, 4.0])}
    barrier = threading.Barrier(2, timeout=10)
    results = {}

    def worker():
        barrier.wait()
        results["thread"] = optim.global_norm(tree, lambda sq: 3 * sum(_leaves(sq))).item()
        results["thread_default"] = optim.global_norm(tree).item()

    th = threading.Thread(target=worker)
    th.start()
    barrier.wait()
    results["main"] = optim.global_norm(tree, lambda sq: 2 * sum(_leaves(sq))).item()
    th.join(timeout=30)
    assert results["thread_default"] == pytest.approx(5.0)
    assert results["main"] == pytest.approx(5.0 * math.sqrt(2))
    assert results["thread"] == pytest.approx(5.0 * math.sqrt(3))


def test_removed_ambient_reducer_names_say_what_to_do():
    with pytest.raises(AttributeError, match="norm_reducer=fn"):
        optim.norm_reducer  # noqa: B018
    with pytest.raises(AttributeError, match="no longer ambient"):
        optim.get_norm_reducer  # noqa: B018


# --------------------------------------------------------------------------- #
# schedules
# --------------------------------------------------------------------------- #
def test_schedules_values():
    peak, warm, total, end = 1e-3, 10, 110, 1e-4
    cos = schedules.warmup_cosine_decay(peak, warm, total, end)
    lin = schedules.warmup_linear_decay(peak, warm, total, end)
    wu = schedules.linear_warmup(peak, warm)
    const = schedules.constant(3e-4)
    cases = {
        0: (0.0, 0.0, 0.0),
        5: (peak * 0.5, peak * 0.5, peak * 0.5),
        10: (peak, peak, peak),
        35: (end + (peak - end) * 0.5 * (1 + math.cos(math.pi * 0.25)), end + (peak - end) * 0.75, peak),
        60: ((peak + end) / 2, (peak + end) / 2, peak),
        110: (end, end, peak),
        500: (end, end, peak),
    }
    for step, (c, l, w) in cases.items():
        for s in (step, torch.tensor(step, dtype=torch.int64)):  # python int and tensor
            for fn, want in ((cos, c), (lin, l), (wu, w), (const, 3e-4)):
                got = fn(s)
                assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.ndim == 0
                assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-9), (fn, step)
    # no warmup: starts at peak
    assert schedules.warmup_cosine_decay(1.0, 0, 10)(0).item() == pytest.approx(1.0)
    assert schedules.linear_warmup(2.0, 0)(0).item() == pytest.approx(2.0)


@settings(max_examples=40, deadline=None)
@given(step=st.integers(0, 300), warm=st.integers(0, 50), extra=st.integers(0, 200))
def test_cosine_schedule_property(step, warm, extra):
    peak, end = 0.5, 0.05
    total = warm + extra
    got = schedules.warmup_cosine_decay(peak, warm, total, end)(step).item()
    if step < warm:
        want = peak * step / warm
    else:
        frac = min((step - warm) / max(total - warm, 1), 1.0)
        want = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert 0.0 <= got <= peak * (1 + 1e-6)


# --------------------------------------------------------------------------- #
# purity, compile, dtypes, state layout
# --------------------------------------------------------------------------- #
def test_update_is_pure():
    params = _make_params(torch.float32)
    opt = optim.adamw(optim.schedules.linear_warmup(1e-2, 2), weight_decay=0.1, clip_norm=1.0)
    state = opt.init(params)
    grads = _grads_for_step(params, 0)
    trees = (params, grads, state)
    snapshot = [(t, t.clone(), t._version) for t in _leaves(trees)]
    opt.update(grads, state, params)
    optim.apply_updates(params, grads)
    for t, before, version in snapshot:
        assert t._version == version
        assert torch.equal(t, before)


def test_compiled_adamw_update_matches_eager_without_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    params = _make_params(torch.float32)
    sched = schedules.warmup_cosine_decay(1e-2, 2, 10, 1e-3)
    opt = optim.adamw(sched, weight_decay=0.1, mask=optim.decay_mask_by_ndim, clip_norm=1.0)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(opt.update, backend=counter, fullgraph=True)

    state_e = state_c = opt.init(params)
    params_e = params_c = params
    for step in range(3):
        grads = _grads_for_step(params, step, 3.0)
        upd_e, state_e = opt.update(grads, state_e, params_e)
        upd_c, state_c = compiled(grads, state_c, params_c)
        params_e = optim.apply_updates(params_e, upd_e)
        params_c = optim.apply_updates(params_c, upd_c)
        _assert_trees_close(upd_c, upd_e, rtol=1e-5, atol=1e-7)
    _assert_trees_close(params_c, params_e, rtol=1e-5, atol=1e-7)
    _assert_trees_close(state_c, state_e, rtol=1e-5, atol=1e-7)
    assert counter.frame_count == 1


def test_compiled_global_norm_honours_reducer():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    gn = torch.compile(optim.global_norm, backend=counter, fullgraph=True)
    tree = {"x": torch.tensor([3.0, 4.0])}
    assert gn(tree).item() == pytest.approx(5.0)
    assert gn(tree, lambda sq: 4 * sum(_leaves(sq))).item() == pytest.approx(10.0)
    assert gn(tree).item() == pytest.approx(5.0)


def test_bf16_params_fp32_state():
    params = _make_params(torch.bfloat16)
    opt = optim.adamw(1e-2, weight_decay=0.1, clip_norm=1.0)
    state = opt.init(params)
    p = params
    for step in range(3):
        grads = _grads_for_step(params, step)
        updates, state = opt.update(grads, state, p)
        for u in _leaves(updates):
            assert u.dtype == torch.float32
        new_p = optim.apply_updates(p, updates)
        for old, u, new in zip(_leaves(p), _leaves(updates), _leaves(new_p)):
            assert new.dtype == torch.bfloat16
            assert torch.equal(new, (old.float() + u).bfloat16())
        p = new_p
    adam_state = state[1]
    assert adam_state.count.dtype == torch.int64 and int(adam_state.count) == 3
    for moment in (adam_state.mu, adam_state.nu):
        for m, prm in zip(_leaves(moment), _leaves(params)):
            assert m.dtype == torch.float32 and m.shape == prm.shape
    # sgd momentum trace as well
    sgd = optim.sgd(0.1, momentum=0.9)
    (tr,) = [s for s in sgd.init(params) if isinstance(s, optim.TraceState)]
    assert all(t.dtype == torch.float32 for t in _leaves(tr.trace))


def test_state_like_params_marks_mirrored_leaves():
    params = _make_params(torch.float32)
    state = optim.adamw(optim.schedules.constant(1e-3), clip_norm=1.0, weight_decay=0.1).init(params)
    like = optim.state_like_params(state)
    spec = optree.tree_structure(state, none_is_leaf=False)
    assert optree.tree_structure(like, none_is_leaf=False) == spec
    flags, leaves = _leaves(like), _leaves(state)
    n_params = len(_leaves(params))
    assert sum(flags) == 2 * n_params  # mu and nu
    shapes = sorted(tuple(p.shape) for p in _leaves(params))
    assert sorted(tuple(t.shape) for f, t in zip(flags, leaves) if f) == sorted(shapes * 2)
    assert all(t.ndim == 0 for f, t in zip(flags, leaves) if not f)  # counts only
    assert like[1].mu == optree.tree_map(lambda _: True, params)


# --------------------------------------------------------------------------- #
# config
# --------------------------------------------------------------------------- #
def test_from_config_builds_equivalent_optimizers():
    params = _make_params()
    cfg = dict(name="adamw", learning_rate=1e-2, betas=[0.8, 0.9], eps=1e-7, weight_decay=0.1, max_grad_norm=1.0,
               lr_schedule="cosine", warmup_steps=2, total_steps=10, min_lr=1e-3)
    ours, _ = _run_functional(optim.from_config(**cfg), params, steps=3)
    sched = schedules.warmup_cosine_decay(1e-2, 2, 10, 1e-3)
    direct, _ = _run_functional(optim.adamw(sched, b1=0.8, b2=0.9, eps=1e-7, weight_decay=0.1, clip_norm=1.0),
                                params, steps=3)
    _assert_trees_close(ours, direct, rtol=0, atol=0)

    sgd_cfg = dict(name="SGD", learning_rate=0.05, momentum=0.9, weight_decay=0.05, betas=None)
    ours, _ = _run_functional(optim.from_config(**sgd_cfg), params)
    ref = _run_torch(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.05), params)
    _assert_trees_close(ours, ref)


def test_from_config_errors():
    with pytest.raises(ValueError, match="'learning_rate'"):
        optim.from_config("adamw", learning_rat=1e-3)
    with pytest.raises(ValueError, match="'warmup_steps'"):
        optim.from_config("adamw", learning_rate=1e-3, warmup_step=10)
    with pytest.raises(ValueError, match="'momentum'"):
        optim.from_config("adamw", learning_rate=1e-3, momentum=0.9)
    with pytest.raises(ValueError, match="'adamw'"):
        optim.from_config("adamww", learning_rate=1e-3)
    with pytest.raises(ValueError, match="'cosine'"):
        optim.from_config("sgd", learning_rate=1e-3, lr_schedule="cosin", total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        optim.from_config("sgd", learning_rate=1e-3, lr_schedule="linear")
    with pytest.raises(ValueError, match="learning_rate"):
        optim.from_config("sgd")


def test_adam_with_mixed_state_dtypes_matches_uniform_path():
    """Leaves of different dtypes take the per-leaf path; it equals the fused one."""
    import functional_pp.optim as O
    p64 = {"a": torch.randn(3, dtype=torch.float64), "b": torch.randn(2, dtype=torch.float64)}
    mixed = {"a": p64["a"].clone(), "b": p64["b"].float()}
    g64 = {"a": torch.randn(3, dtype=torch.float64), "b": torch.randn(2, dtype=torch.float64)}
    gmixed = {"a": g64["a"].clone(), "b": g64["b"].float()}
    opt = O.adamw(0.1, weight_decay=0.0)
    u1, _ = opt.update(g64, opt.init(p64), p64)
    u2, _ = opt.update(gmixed, opt.init(mixed), mixed)
    torch.testing.assert_close(u2["a"], u1["a"])
    torch.testing.assert_close(u2["b"], u1["b"].float())
