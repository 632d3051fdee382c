"""Optimizer constructors refuse bad settings; AdamW is a chain; donated updates are overwritten
in place (no parameter-sized temporaries) with the same numbers as the pure path."""
from __future__ import annotations

import math
import warnings

import optree
import pytest
import torch

import functional_pp as fpp
import functional_pp.optim as optim
from functional_pp.optim import schedules


def _params(n=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, 3, generator=g, dtype=dtype), "b": torch.randn(n, generator=g, dtype=dtype),
            "layers": [{"k": torch.randn(3, 3, generator=g, dtype=dtype)}]}


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def _leaves(t):
    return optree.tree_leaves(t, none_is_leaf=False)


# ------------------------------------------------------------------------- range validation
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("build,words", [
    (lambda: optim.adamw(NAN), ["adamw", "learning_rate=nan", "finite"]),
    (lambda: optim.adamw(-1e-3), ["adamw", "learning_rate=-0.001", "[0, inf)"]),
    (lambda: optim.adamw(INF), ["learning_rate=inf", "finite"]),
    (lambda: optim.adamw(1e-3, b1=1.5), ["b1=1.5", "[0, 1)", "first-moment"]),
    (lambda: optim.adamw(1e-3, b1=1.0), ["b1=1.0", "[0, 1)"]),
    (lambda: optim.adamw(1e-3, b2=-1), ["b2=-1", "[0, 1)", "second-moment"]),
    (lambda: optim.adamw(1e-3, eps=-1), ["eps=-1", "(0, inf)"]),
    (lambda: optim.adamw(1e-3, eps=0.0), ["eps=0.0", "(0, inf)"]),
    (lambda: optim.adamw(1e-3, weight_decay=-0.1), ["add_decayed_weights", "weight_decay=-0.1"]),
    (lambda: optim.adamw(1e-3, weight_decay=NAN), ["weight_decay=nan", "finite"]),
    (lambda: optim.adamw(1e-3, clip_norm=0.0), ["clip_by_global_norm", "max_norm=0.0", "(0, inf)"]),
    (lambda: optim.adamw(1e-3, clip_norm=-1.0), ["max_norm=-1.0"]),
    (lambda: optim.sgd(NAN), ["sgd", "learning_rate=nan"]),
    (lambda: optim.sgd(0.1, momentum=1.2), ["sgd", "momentum=1.2", "[0, 1)"]),
    (lambda: optim.sgd(0.1, momentum=-0.5), ["momentum=-0.5"]),
    (lambda: optim.sgd(0.1, nesterov=True), ["nesterov=True", "momentum > 0"]),
    (lambda: optim.scale_by_adam(b1=-0.1), ["scale_by_adam", "b1=-0.1"]),
    (lambda: optim.scale(NAN), ["scale", "step_size=nan"]),
    (lambda: optim.trace(1.5), ["trace", "decay=1.5"]),
    (lambda: schedules.warmup_cosine_decay(1e-3, 10, 100, end_value=1e-2), ["end_value=0.01", "above the peak"]),
    (lambda: schedules.warmup_linear_decay(1e-3, 10, 100, end_value=-1), ["end_value=-1", "[0, inf)"]),
    (lambda: schedules.warmup_cosine_decay(NAN, 10, 100), ["peak=nan", "finite"]),
    (lambda: schedules.warmup_cosine_decay(1e-3, -1, 100), ["warmup_steps=-1", "whole number"]),
    (lambda: schedules.warmup_cosine_decay(1e-3, 10, 5), ["total_steps (5) must be >= warmup_steps (10)"]),
    (lambda: schedules.linear_warmup(-1.0, 10), ["linear_warmup", "peak=-1.0"]),
    (lambda: schedules.linear_warmup(1.0, 2.5), ["warmup_steps=2.5"]),
    (lambda: schedules.constant(NAN), ["constant", "value=nan"]),
    (lambda: optim.make_schedule(1e-3, "cosine", 10, 100, min_lr=1e-2), ["min_lr=0.01", "above the peak"]),
    (lambda: optim.make_schedule(1e-3, "constant", min_lr=1e-2), ["min_lr=0.01", "above the peak"]),
    (lambda: optim.make_schedule(NAN, "constant"), ["learning_rate=nan"]),
    (lambda: optim.from_config("adamw", learning_rate=1e-3, betas=(0.9, 1.5)), ["b2=1.5"]),
    (lambda: optim.from_config("adamw", learning_rate=1e-3, lr_schedule="cosine", total_steps=10,
                               min_lr=1.0), ["min_lr=1.0"]),
])
def test_constructors_refuse_bad_settings(build, words):
    with pytest.raises(ValueError) as err:
        build()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_constructors_refuse_non_numbers():
    with pytest.raises(TypeError, match="learning_rate='1e-3' must be a number"):
        optim.adamw("1e-3")
    with pytest.raises(TypeError, match="b1=None must be a number"):
        optim.adamw(1e-3, b1=None)


def test_good_edge_values_are_accepted():
    optim.adamw(0.0, b1=0.0, b2=0.0, eps=1e-30, weight_decay=0.0)
    optim.sgd(0.0, momentum=0.0)
    schedules.warmup_cosine_decay(1e-3, 0, 0, end_value=1e-3)
    optim.make_schedule(1e-3, "linear", 2, 10, min_lr=1e-3)


# ---------------------------------------------------------------------------------- masks
def test_mask_forms_and_errors():
    params = _params()
    t = optim.add_decayed_weights(1.0, mask=optim.mask_by_path(lambda path, leaf: path[0] == "w"))
    zeros = optree.tree_map(torch.zeros_like, params)
    out, _ = t.update(zeros, t.init(params), params)
    torch.testing.assert_close(out["w"], params["w"])
    assert torch.count_nonzero(out["b"]) == 0 and torch.count_nonzero(out["layers"][0]["k"]) == 0
    # a per-leaf predicate passed as a mask: told to use mask_by_path
    bad = optim.add_decayed_weights(1.0, mask=lambda path, leaf: True)
    with pytest.raises(TypeError, match="mask_by_path"):
        bad.update(zeros, bad.init(params), params)
    # a tree of the wrong structure or of non-bools
    for mask in ({"w": True}, optree.tree_map(lambda p: 1, params)):
        t = optim.add_decayed_weights(1.0, mask=mask)
        with pytest.raises(ValueError, match="not a tree of Python bools"):
            t.update(zeros, t.init(params), params)


# ------------------------------------------------------------------ one Adam, adamw = chain
def test_adamw_is_the_chain_of_adam_decay_and_learning_rate():
    params = _params(dtype=torch.float64)
    sched = schedules.warmup_cosine_decay(1e-2, 2, 10, 1e-3)
    ours = optim.adamw(sched, b1=0.8, b2=0.9, eps=1e-7, weight_decay=0.1, mask=optim.decay_mask_by_ndim)
    chain = optim.chain(optim.scale_by_adam(0.8, 0.9, 1e-7), optim.add_decayed_weights(0.1, optim.decay_mask_by_ndim),
                        optim.scale_by_learning_rate(sched))
    s1, s2, p1, p2 = ours.init(params), chain.init(params), params, params
    for step in range(4):
        g = _grads(params, step)
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = chain.update(g, s2, p2)
        p1, p2 = optim.apply_updates(p1, u1), optim.apply_updates(p2, u2)
    for a, b in zip(_leaves((p1, s1)), _leaves((p2, s2))):
        assert torch.equal(a, b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = optim.scale_by_adamw(1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    new = optim.adamw(1e-2, 0.9, 0.95, 1e-8, 0.1)
    g = _grads(params, 0)
    for a, b in zip(_leaves(old.update(g, old.init(params), params)[0]), _leaves(new.update(g, new.init(params), params)[0])):
        assert torch.equal(a, b)


def test_adam_groups_leaves_by_dtype_in_one_implementation():
    params = {"a": torch.randn(5, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float32),
              "c": torch.randn(2, dtype=torch.bfloat16)}
    adam = optim.scale_by_adam(0.9, 0.99)
    state = adam.init(params)
    assert [m.dtype for m in _leaves(state.mu)] == [torch.float64, torch.float32, torch.float32]
    g = _grads(params, 1)
    u, state = adam.update(g, state, params)
    for key in params:                     # each leaf alone gives the same numbers
        alone = optim.scale_by_adam(0.9, 0.99)
        ua, _ = alone.update({key: g[key]}, alone.init({key: params[key]}))
        assert torch.equal(u[key], ua[key])
        # first Adam step: mu_hat / (sqrt(nu_hat) + eps) = g / (|g| + eps)
        gk = g[key].to(u[key].dtype)
        torch.testing.assert_close(u[key], gk / (gk.abs() + 1e-8))


# ------------------------------------------------------------------------ donated updates
@pytest.mark.parametrize("make,in_grads", [
    (lambda: optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask_by_ndim, clip_norm=0.5), True),
    (lambda: optim.adamw(schedules.linear_warmup(1e-2, 3), weight_decay=0.0), True),
    (lambda: optim.sgd(0.1, weight_decay=0.01, clip_norm=1.0), True),
    (lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.01, clip_norm=1.0), False),   # after the trace
    (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True), False),
])
def test_donated_updates_give_the_same_numbers_and_are_reused(make, in_grads):
    opt = make()
    params = _params()
    sa = sb = opt.init(params)
    pa = pb = params
    for step in range(3):
        g = _grads(params, step)
        g_copy = optree.tree_map(torch.clone, g)
        ua, sa = opt.update(g, sa, pa)
        ub, sb = opt.update(g_copy, sb, pb, donate_updates=True)
        new_a = optim.apply_updates(pa, ua)
        new_b = optim.apply_updates(pb, ub, donate_updates=optim.returns_fresh(opt, True))
        for x, y in zip(_leaves((new_a, sa)), _leaves((new_b, sb))):
            assert torch.equal(x, y)
        assert optim.returns_fresh(opt, True)
        # the new parameters live in the donated gradients (or, after a momentum trace, in the
        # one new tensor per leaf that scaling it made)
        assert all((x is y) == in_grads for x, y in zip(_leaves(new_b), _leaves(g_copy)))
        assert not any(x is y for x, y in zip(_leaves(g), _leaves(new_a)))   # the pure path is pure
        pa, pb = new_a, new_b
    for x, y in zip(_leaves(pa), _leaves(params)):
        assert not torch.equal(x, y)


def test_momentum_trace_is_never_overwritten_as_an_update():
    """trace returns its own state as the update: a donated chain must not write into it."""
    opt = optim.chain(optim.trace(0.9))
    assert not optim.returns_fresh(opt, True)
    params = _params()
    g = _grads(params, 0)
    u, s = opt.update(g, opt.init(params), params, donate_updates=True)
    assert u["w"] is s[0].trace["w"]


def _peak_allocated_during(fn) -> int:
    """Peak of bytes allocated by torch's CPU allocator while ``fn`` runs, above the start."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    del keep
    return peak


def test_adamw_step_allocates_only_the_new_moments_when_gradients_are_donated():
    n = 1 << 18                                       # 1 MiB per fp32 tensor: small allocations vanish
    params = {"w": torch.randn(n), "v": torch.randn(n // 2)}
    size = sum(p.numel() * 4 for p in params.values())
    opt = optim.adamw(1e-3, weight_decay=0.1, clip_norm=1.0)
    state = opt.init(params)

    def step(donate):
        g = _grads(params, 0)
        def run():
            u, s = opt.update(g, state, params, donate_updates=donate)
            return optim.apply_updates(params, u, donate_updates=donate), s
        return _peak_allocated_during(run)

    donated, pure = step(True), step(False)
    assert donated <= 2 * size + size // 8, (donated / size)   # mu', nu' and nothing parameter-sized
    assert pure >= 3 * size                                    # the pure path allocates updates and params


# -------------------------------------------------------------------- in the training step
def test_train_step_gradients_shared_by_two_parameters_are_not_corrupted():
    """``a + b`` hands both parameters one gradient tensor; donating it must not apply the
    update of one parameter to the other."""
    decls = {"a": fpp.param((4, 3), "x y", init="normal"), "b": fpp.param((4, 3), "x y", init="normal")}

    def loss_fn(p, batch):
        s = p["a"] + p["b"]
        return fpp.ops.sum(s * s)

    def loss_plain(p):
        s = p["a"] + p["b"]
        return (s * s).sum()

    opt = optim.adamw(0.1, weight_decay=0.1)
    step = fpp.train_step(loss_fn, opt)
    params = fpp.init(lambda: decls, seed=0)
    state = step.init(params)
    full = {k: v.data.clone().requires_grad_(True) for k, v in params.items()}
    ref = torch.optim.AdamW(list(full.values()), lr=0.1, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    batch = {"tokens": torch.ones(2, 2, dtype=torch.long)}
    for _ in range(3):
        state, _ = step(state, batch)
        ref.zero_grad()
        loss_plain(full).backward()
        ref.step()
    for k in ("a", "b"):
        torch.testing.assert_close(state["params"][k], full[k].detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(state["params"]["a"], state["params"]["b"])
    assert math.isfinite(float(state["params"]["a"].sum()))


@pytest.mark.parametrize("key,value,words", [
    ("adam_beta1", 1.5, ["b1=1.5", "[0, 1)", "config key: adam_beta1"]),
    ("adam_beta2", -1.0, ["b2=-1.0", "config key: adam_beta2"]),
    ("adam_epsilon", -1.0, ["eps=-1.0", "config key: adam_epsilon"]),
    ("learning_rate", float("nan"), ["learning_rate=nan", "config key: learning_rate"]),
    ("min_learning_rate", 1.0, ["above the peak", "config key: min_learning_rate"]),
])
def test_config_settings_the_optimizer_refuses_name_the_config_key(tmp_path, key, value, words):
    from functional_pp.app.optimizer import optimizer_from_config as _optimizer
    from functional_pp.config import ConfigError, TrainConfig
    d = {"learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "max_steps": 10, "model": "tiny",
         "logging": {"output_dir": str(tmp_path)}}
    d[key] = value
    try:
        cfg = TrainConfig.from_dict(d, name="t")
    except ConfigError as exc:                 # the config itself may refuse it first: also fine
        assert key in str(exc)
        return
    with pytest.raises(ConfigError) as err:
        _optimizer(cfg)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert not any(tmp_path.iterdir())         # nothing written
