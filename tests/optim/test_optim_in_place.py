"""In-place steps (``optim.in_place_step``): ``optim.adamw``'s, one ``torch._fused_adamw_`` pass,
equals ``torch.optim.AdamW`` and the pure chain, skips bitwise, and declines what the kernel
cannot take; the precomputed gradient norm reaches only the transformation that sees the
gradients as given (docs/optim.md "In place")."""
from __future__ import annotations

import optree
import pytest
import torch

import functional_pp.optim as optim
from functional_pp.optim import schedules
from functional_pp.optim.bounds import grad_and_bound_norms

STEPS = 5


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(6, 3, generator=g, dtype=dtype), "w": torch.randn(4, 3, generator=g, dtype=dtype),
            "b": torch.randn(4, generator=g, dtype=dtype)}


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda p: scale * torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def _run_in_place(opt, params, skip_at=(), scale=1.0):
    params = optree.tree_map(torch.clone, params)
    state = opt.init(params)
    step = optim.in_place_step(opt)
    for i in range(STEPS):
        grads = _grads(params, i, scale)
        norm = optim.global_norm(grads)
        held = step(grads, state, params, skip=torch.tensor(i in skip_at), grad_norm=norm)
        assert held is not None and not held
    return params, state


def _run_pure(opt, params, skip_at=(), scale=1.0):
    state = opt.init(params)
    for i in range(STEPS):
        if i in skip_at:
            continue
        updates, state = opt.update(_grads(params, i, scale), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(params, lr, wd, clip=None, scale=1.0, lr_at=None, decay=lambda name: True):
    names = list(params)
    tensors = {k: params[k].clone().requires_grad_() for k in names}
    groups = [{"params": [tensors[k] for k in names if decay(k)], "weight_decay": wd},
              {"params": [tensors[k] for k in names if not decay(k)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr or 0.0, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for i in range(STEPS):
        for k, g in _grads(params, i, scale).items():
            tensors[k].grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), clip)
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = float(lr_at(i))
        opt.step()
    return {k: t.detach() for k, t in tensors.items()}


def _close(a, b, rtol=1e-10, atol=1e-12):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_in_place_adamw_matches_torch_adamw(clip):
    params = _params()
    got, _ = _run_in_place(optim.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=clip), params, scale=2.0)
    _close(got, _run_torch(params, 1e-2, 0.1, clip=clip, scale=2.0))


def test_in_place_adamw_with_a_schedule_and_a_mask_matches_torch_and_the_pure_chain():
    params = _params()
    sched = schedules.warmup_cosine_decay(1e-2, 2, STEPS, 1e-4)
    opt = optim.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=optim.decay_mask_by_ndim)
    got, state = _run_in_place(opt, params)
    _close(got, _run_torch(params, None, 0.1, lr_at=sched, decay=lambda k: params[k].ndim >= 2))
    pure, pure_state = _run_pure(opt, params)
    _close(got, pure)
    for x, y in zip(optree.tree_leaves(state), optree.tree_leaves(pure_state)):   # moments and counters
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_a_skipped_in_place_step_changes_nothing_not_even_the_counters():
    params = _params()
    sched = schedules.warmup_linear_decay(1e-2, 1, STEPS)
    opt = optim.adamw(sched, weight_decay=0.1, clip_norm=1.0)
    got, state = _run_in_place(opt, params, skip_at=(1, 3))
    pure, pure_state = _run_pure(opt, params, skip_at=(1, 3))
    _close(got, pure)
    counts = [int(x) for x in optree.tree_leaves(state) if x.dim() == 0]
    assert counts == [int(x) for x in optree.tree_leaves(pure_state) if x.dim() == 0] == [3, 3]

    before = optree.tree_map(torch.clone, (got, state))
    grads = _grads(params, 0)
    optim.in_place_step(opt)(grads, state, got, skip=torch.tensor(True), grad_norm=optim.global_norm(grads))
    for x, y in zip(optree.tree_leaves((got, state)), optree.tree_leaves(before)):
        assert torch.equal(x, y)


def test_in_place_step_declines_what_the_fused_kernel_cannot_take_and_touches_nothing():
    params = {"w": torch.randn(3, 2), "n": torch.arange(3)}       # an integer leaf
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    before = optree.tree_map(torch.clone, (params, state))
    grads = {"w": torch.randn(3, 2), "n": torch.zeros(3)}
    assert optim.in_place_step(opt)(grads, state, params, skip=torch.tensor(False),
                                   grad_norm=torch.tensor(1.0)) is optim.DECLINED
    for x, y in zip(optree.tree_leaves((params, state)), optree.tree_leaves(before)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_in_place_step_that_cannot_show_its_result_finite_holds_back_and_touches_nothing(dtype):
    params = _params(dtype)
    # lr |g| / eps beyond the bound's margin (fp32: 2**101, fp64: 2**968)
    opt = optim.adamw(1e30 if dtype == torch.float32 else 1e300, clip_norm=1.0)
    state = opt.init(params)
    before = optree.tree_map(torch.clone, (params, state))
    grads = _grads(params, 0)
    given = optree.tree_map(torch.clone, grads)
    held = optim.in_place_step(opt)(grads, state, params, skip=torch.tensor(False), grad_norm=optim.global_norm(grads))
    assert held
    for x, y in zip(optree.tree_leaves((params, state, grads)), optree.tree_leaves((*before, given))):
        assert torch.equal(x, y)
    # a usual learning rate is far inside the bound
    ok = optim.adamw(1.0, clip_norm=1.0)
    state = ok.init(params)
    assert not optim.in_place_step(ok)(grads, state, params, skip=torch.tensor(False),
                                       grad_norm=optim.global_norm(grads))


@pytest.mark.parametrize("lr, shown", [(1.0, True), (1e12, False), (1e30, False), (float("inf"), False)])
def test_adamw_bound_shows_the_new_parameters_finite_before_the_update_as_its_in_place_step_decides(lr, shown):
    params = _params(torch.float32)
    opt = optim.adamw((lambda count: torch.tensor(lr)) if lr == float("inf") else lr, weight_decay=0.1)
    state = opt.init(params)
    grads = _grads(params, 0)
    norm = optim.global_norm(grads)
    before = optree.tree_map(torch.clone, (params, state, grads))
    bound = optim.update_bound(opt)
    grad_norm, n = grad_and_bound_norms(bound, optree.tree_leaves(grads), state, params, _add_up)
    torch.testing.assert_close(grad_norm, norm)
    assert bool(bound.shows_finite(n, state, params)) is shown
    for x, y in zip(optree.tree_leaves((params, state, grads)), optree.tree_leaves(before)):
        assert torch.equal(x, y)                        # reductions only: nothing written
    held = optim.in_place_step(opt)(grads, state, params, skip=torch.tensor(False), grad_norm=norm)
    assert bool(held) is not shown
    if shown:       # and what the bound let through is finite
        assert all(torch.isfinite(x).all() for x in optree.tree_leaves(params))


def _add_up(sums):
    return torch.stack(optree.tree_leaves(sums)).sum()


@pytest.mark.parametrize("weight_decay, kinds", [(0.1, "gm"), (2.0, "gpm")], ids=["decay<=1", "decay>1"])
def test_the_bound_norm_is_the_norm_of_gradients_and_first_moments_and_parameters_only_above_unit_decay(
        weight_decay, kinds):
    # weight decay <= 1: no read of the parameters (their finiteness is a flag, docs/optim.md
    # "Bound before the update"); above, the joint norm of gradients, parameters and first moments
    params = _params(torch.float32)
    opt = optim.adamw(1e-3, weight_decay=weight_decay)
    state = opt.init(params)
    state[0].mu.update({k: torch.full_like(v, 0.5) for k, v in params.items()})
    grads = _grads(params, 0)
    named = {"g": grads, "p": params, "m": state[0].mu}
    expected = torch.cat([x.flatten() for k in kinds for x in optree.tree_leaves(named[k])]).double().norm()
    bound = optim.update_bound(opt)
    assert bound.needs_finite_params is (kinds == "gm")
    eager = grad_and_bound_norms(bound, optree.tree_leaves(grads), state, params, _add_up)
    traced = torch.compile(lambda g, s, p: grad_and_bound_norms(optim.update_bound(opt), optree.tree_leaves(g), s, p,
                                                                _add_up), backend="eager", fullgraph=True)
    for grad_norm, n in (eager, traced(grads, state, params)):
        torch.testing.assert_close(n, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad_norm, optim.global_norm(grads), rtol=1e-6, atol=0)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_the_bound_norm_is_infinite_for_non_finite_parameters_read_or_flagged(traced):
    # a parameter that is not finite makes n infinite (the bound shows nothing), whether the
    # bound reads the parameters (no flag given) or is told by the caller's flag (then it reads
    # nothing: a wrong flag is believed)
    params = _params(torch.float32)
    opt = optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)
    grads = _grads(params, 0)
    bad = optree.tree_map(torch.clone, params)
    bad["w"][1, 2] = float("nan")
    fn = lambda g, s, p, f: grad_and_bound_norms(optim.update_bound(opt), optree.tree_leaves(g), s, p,  # noqa: E731
                                                 _add_up, f)
    if traced:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    yes, no = torch.tensor(True), torch.tensor(False)
    assert torch.isfinite(fn(grads, state, params, None)[1]) and torch.isfinite(fn(grads, state, params, yes)[1])
    assert fn(grads, state, bad, None)[1] == float("inf") and fn(grads, state, params, no)[1] == float("inf")
    assert torch.isfinite(fn(grads, state, bad, yes)[1])
    assert not bool(optim.update_bound(opt).shows_finite(fn(grads, state, bad, None)[1], state, bad))


def test_only_adamw_offers_a_bound():
    assert optim.update_bound(optim.adamw(1e-3, clip_norm=1.0)) is not None
    assert optim.update_bound(optim.sgd(1e-3, momentum=0.9)) is None
    assert optim.update_bound(optim.chain(optim.scale_by_adam(), optim.scale(-1e-3))) is None


def test_only_optimizers_that_have_one_offer_an_in_place_step():
    assert optim.in_place_step(optim.adamw(1e-3)) is not None
    assert optim.in_place_step(optim.sgd(1e-3, momentum=0.9)) is None
    assert optim.in_place_step(optim.chain(optim.scale_by_adam(), optim.scale(-1e-3))) is None


def test_the_given_gradient_norm_reaches_only_the_first_transformation_of_a_chain():
    params = _params()
    grads = _grads(params, 0, scale=3.0)
    norm = optim.global_norm(grads)
    first = optim.clip_by_global_norm(1.0)
    upd, _ = first.update(grads, first.init(params), params, grad_norm=norm * 2)   # used as given
    torch.testing.assert_close(optim.global_norm(upd), torch.tensor(0.5, dtype=torch.float64), rtol=1e-5, atol=0)
    # after a scaling the norm is no longer the updates': the clip computes its own
    later = optim.chain(optim.scale(2.0), optim.clip_by_global_norm(1.0))
    upd, _ = later.update(grads, later.init(params), params, grad_norm=norm)
    torch.testing.assert_close(optim.global_norm(upd), torch.tensor(1.0, dtype=torch.float64), rtol=1e-5, atol=0)


def test_the_eager_global_norm_equals_the_sum_of_squares_within_rounding():
    tree = {"a": torch.randn(100, 7), "b": torch.randn(3, dtype=torch.float64), "c": torch.randn(5).bfloat16()}
    ref = torch.sqrt(sum(torch.sum(x.double() ** 2) for x in optree.tree_leaves(tree)))
    got = optim.global_norm(tree)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    assert not torch.isfinite(optim.global_norm({"a": torch.tensor([1.0, float("nan")])}))
    assert not torch.isfinite(optim.global_norm({"a": torch.tensor([1.0, float("inf")])}))
