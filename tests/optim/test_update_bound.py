"""AdamW's pre-update bound without a read of the parameters (functional_pp/optim/bounds.py,
functional_pp/step/known_finite.py; docs/optim.md "Bound before the update"): finite parameters up to
the dtype's largest value are updated where the Adam term stays below the margin, an update that
would overflow is held, non-finite parameters are never written over, and a donated step (eager
in place, compiled) decides as the step without donation."""
from __future__ import annotations

import functools

import optree
import pytest
import torch

import functional_pp as fpp
import functional_pp.optim as optim
from functional_pp.models import llama
from functional_pp.optim.bounds import grad_and_bound_norms, margin
from functional_pp.step import known_finite

MAX32 = torch.finfo(torch.float32).max


def _add_up(sums):
    return torch.stack(optree.tree_leaves(sums)).sum()


def _setup(dtype=torch.float32, lr=1e-3, weight_decay=0.0, b1=0.9, p_at=MAX32, m_at=0.0, eps=1e-8):
    """One leaf whose element [0] is ``p_at`` with first moment ``m_at`` and gradient 0 (the
    others of order 1), AdamW at its first step."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, generator=g).to(dtype)}
    params["w"][0] = p_at
    opt = optim.adamw(lr, b1=b1, eps=eps, weight_decay=weight_decay)
    state = opt.init(params)
    state[0].mu["w"][0] = m_at
    grads = {"w": torch.randn(8, generator=g).to(dtype)}
    grads["w"][0] = 0.0
    return opt, params, state, grads


def _decide(opt, params, state, grads, flag=None):
    bound = optim.update_bound(opt)
    _, n = grad_and_bound_norms(bound, optree.tree_leaves(grads), state, params, _add_up, flag)
    return bool(bound.shows_finite(n, state, params))


def _in_place(opt, params, state, grads):
    """The in-place step's held flag, and the parameters after it."""
    held = optim.in_place_step(opt)(grads, state, params, skip=torch.tensor(False),
                                    grad_norm=optim.global_norm(grads))
    return bool(held), params["w"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_parameter_at_the_dtypes_largest_value_with_a_small_update_is_shown_finite_and_written(dtype):
    # the old joint bound (|p| in the norm, below sqrt(max) / 4) held this step
    big = torch.finfo(dtype).max
    opt, params, state, grads = _setup(dtype, weight_decay=0.1, p_at=big)
    assert _decide(opt, params, state, grads)
    if dtype == torch.bfloat16:        # (the fused kernel takes no bf16 parameters with fp32 moments)
        return
    held, w = _in_place(opt, params, state, grads)
    assert not held and torch.isfinite(w).all() and w[0] == torch.tensor(big * (1 - 1e-4), dtype=dtype)


@pytest.mark.parametrize("m_at, lr, weight_decay, eps, shown", [
    (-1e27, 1e-3, 0.0, 1e-8, False), (-1e3, 1e-3, 0.0, 1e-8, True), (-1e3, 1e23, 0.0, 1e-8, False),
    (0.0, 1e23, 0.0, 1e-8, False), (10.0, 1e-9, 1.0, 1e-30, False), (10.0, 1e-9, 1.0, 1e-20, True)])
def test_an_update_that_could_overflow_the_largest_parameter_is_not_shown_and_held(m_at, lr, weight_decay, eps,
                                                                                   shown):
    # p = max: lr (|m|, |g|) / ((1 - b1) eps) beyond the margin (2**101) could round past it, and so
    # could the pure chain's a + wd p before it is scaled by a small lr (hence max(1, lr))
    opt, params, state, grads = _setup(lr=lr, m_at=m_at, weight_decay=weight_decay, eps=eps)
    assert _decide(opt, params, state, grads) is shown
    before = params["w"].clone()
    held, w = _in_place(opt, params, state, grads)
    assert held is not shown
    if held:
        assert torch.equal(w, before)          # nothing written
    else:
        assert torch.isfinite(w).all()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["large moment", "a + wd p", "b1 rounds to 1"])
def test_the_updates_the_bound_holds_do_overflow_in_the_pure_chain(case):
    # the held cases are real: the step without donation makes a non-finite parameter there
    # (eager and compiled pure chain), so these conditions are not merely loose
    if case == "large moment":
        opt, params, state, grads = _setup(m_at=-1e27)
    elif case == "a + wd p":
        opt, params, state, grads = _setup(m_at=10.0, lr=1e-9, weight_decay=1.0, eps=1e-30)
    else:       # 1 - 2**-25 is 1.0 in fp32: the fp32 bias correction 1 - b1^t is 0 at any step
        opt, params, state, grads = _setup(b1=1 - 2 ** -25, p_at=1.0, m_at=1.0)
        state[0].count.fill_(10 ** 6)      # (in fp64, 1 - b1^t is 0.03 there)
    assert not _decide(opt, params, state, grads)

    def pure(p, s, g):
        updates, _ = opt.update(g, s, p)
        return optim.apply_updates(p, updates)
    for fn in (pure, torch.compile(pure, backend="inductor", fullgraph=True)):
        assert not torch.isfinite(fn(params, state, grads)["w"][0])


@pytest.mark.parametrize("lr, weight_decay, shown", [(1e-3, 0.1, True), (5.0, 0.19, True), (10.0, 0.1, False),
                                                     (20.0, 0.1, False), (1e-3, 1.0, True)])
def test_decay_beyond_one_minus_a_margin_is_held(lr, weight_decay, shown):
    # lr wd > 1 - 2**-10: the decay factor 1 - lr wd may leave [0, 1] (|p (1 - lr wd)| > |p| at max)
    opt, params, state, grads = _setup(lr=lr, weight_decay=weight_decay, p_at=1.0)
    assert _decide(opt, params, state, grads) is shown


def test_decay_above_one_keeps_the_bound_that_reads_the_parameters():
    # wd > 1: the pure chain's wd * p overflows for p near max, so the bound needs |p| (the norm)
    opt, params, state, grads = _setup(lr=1e-3, weight_decay=2.0, p_at=1.0)
    assert not optim.update_bound(opt).needs_finite_params and _decide(opt, params, state, grads)
    opt, params, state, grads = _setup(lr=1e-3, weight_decay=2.0, p_at=MAX32)
    assert not _decide(opt, params, state, grads)


def test_a_first_moment_decay_that_rounds_to_one_in_fp32_is_held():
    # b1 = 1 - 1e-9 is 1.0 in fp32: the fp32 kernels' bias correction 1 - b1^t is 0
    opt, params, state, grads = _setup(b1=1 - 1e-9, p_at=1.0)
    assert not _decide(opt, params, state, grads)
    opt, params, state, grads = _setup(b1=1 - 1e-6, p_at=1.0)
    assert _decide(opt, params, state, grads)


def test_the_margin_is_an_eighth_of_the_spacing_at_the_largest_value():
    assert margin([torch.float32]) == 2.0 ** 101
    assert margin([torch.float32, torch.bfloat16]) == 2.0 ** 101
    assert margin([torch.bfloat16]) == 2.0 ** 117
    assert margin([torch.float16]) == 4.0
    assert margin([torch.float64]) == 2.0 ** 968
    assert torch.tensor(MAX32) + 4 * margin([torch.float32]) * (1 - 2 ** -20) == MAX32    # below half a spacing
    assert torch.isinf(torch.tensor(MAX32) + 8 * margin([torch.float32]))


def test_non_finite_parameters_are_not_shown_finite_without_a_flag_or_with_a_false_one():
    opt, params, state, grads = _setup(p_at=float("nan"))
    assert not _decide(opt, params, state, grads)
    opt, params, state, grads = _setup(p_at=1.0)
    assert _decide(opt, params, state, grads) and not _decide(opt, params, state, grads, torch.tensor(False))


# ----------------------------------------------------------------------------- training steps
CFG = llama.Config(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)
UNUSED = 2      # a token id the batch does not hold: its embedding row has gradient 0


def _batch() -> dict:
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    assert UNUSED not in ids[:, :-1]
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _three_edited_steps(donate_state: bool, compile):
    """Three steps of AdamW (lr 1e-3, no decay), the state edited by hand before each: an unused
    embedding element set to fp32's largest value (written: stays finite); then to NaN (never
    written over: skipped); then to the largest value with a first moment that makes it
    overflow (held, redone, skipped). Per step: the metrics, whether the step returned the
    tensors it was given, the edited element and the state after it."""
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), optim.adamw(1e-3), compile=compile,
                          donate_state=donate_state, max_consecutive_skips=None)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    out = []
    for value, moment in ((MAX32, None), (float("nan"), None), (MAX32, -1e27)):
        state["params"]["embed_tokens"][UNUSED, 0] = value
        if moment is not None:
            state["opt_state"][-3].mu["embed_tokens"][UNUSED, 0] = moment
        given = optree.tree_leaves(state["params"])
        state, m = step(state, _batch())
        new = optree.tree_leaves(state["params"])
        out.append(({k: m[k] for k in ("skipped", "nonfinite_update", "nonfinite_grad")},
                    all(a is b for a, b in zip(given, new)), float(state["params"]["embed_tokens"][UNUSED, 0]),
                    [t.clone() for t in optree.tree_leaves([state["params"], state["opt_state"]])]))
    return out


def _assert_written_then_never_over_nan_then_held(donated):
    (m0, same0, e0, _), (m1, _, e1, _), (m2, _, e2, _) = donated
    assert m0 == {"skipped": 0, "nonfinite_update": 0, "nonfinite_grad": 0} and same0    # written, not held
    assert e0 == MAX32                                     # (lr * 0 added, no decay)
    assert m1["skipped"] == 1 and m1["nonfinite_update"] == 1 and m2 == m1          # held, redone, skipped
    assert e1 != e1 and e2 == MAX32                        # (NaN, then the old value)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("compile", ["aot_eager", pytest.param(True, marks=pytest.mark.slow)],
                         ids=["aot_eager", "inductor"])
def test_a_compiled_donated_step_writes_the_largest_value_holds_an_overflow_and_never_writes_over_nan(compile):
    # as the compiled step without donation decides (its check: each leaf's largest magnitude)
    donated, plain = _three_edited_steps(True, compile), _three_edited_steps(False, compile)
    _assert_written_then_never_over_nan_then_held(donated)
    for (md, _, _, sd), (mp, _, _, sp) in zip(donated, plain):
        assert md == mp
        for x, y in zip(sd, sp):
            exact = compile == "aot_eager"        # (inductor rounds the donated step's graph otherwise)
            torch.testing.assert_close(x, y, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, equal_nan=True)


def test_the_eager_in_place_step_writes_the_largest_value_holds_an_overflow_and_never_writes_over_nan():
    # (the eager step without donation checks a 2-norm, which overflows here: docs/optim.md)
    donated = _three_edited_steps(True, False)
    _assert_written_then_never_over_nan_then_held(donated)
    compiled = _three_edited_steps(True, "aot_eager")
    for (md, _, _, sd), (mc, _, _, sc) in zip(donated, compiled):
        assert md == mc
        for x, y in zip(sd, sc):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_donated_state_returned_by_a_step_is_not_read_again(monkeypatch):
    # the flag is carried: the parameters are read at the first step and after an edit only
    reads = []
    real = known_finite.params_finite
    monkeypatch.setattr(known_finite, "params_finite", lambda leaves: reads.append(1) or real(leaves))
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), optim.adamw(1e-3), donate_state=True)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    counts = []
    for i in range(4):
        if i == 2:
            state["params"]["norm"].mul_(1.0)      # an in-place edit: read again
        state, _ = step(state, _batch())
        counts.append(len(reads))
    assert counts == [1, 1, 2, 2]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_empty_leaves_are_finite_in_the_parameter_flag_and_the_update_check(backend):
    # an empty leaf has no extreme value (amax / aminmax of nothing raise): it counts as finite
    from functional_pp.optim.bounds import params_finite
    from functional_pp.step.update import all_finite
    empty, full = torch.zeros(0, 3), torch.ones(4)

    def flags(leaves):
        return params_finite(leaves), all_finite(leaves, [((), [0, 1])])

    fn = flags if backend is None else torch.compile(flags, backend=backend, fullgraph=True)
    assert [bool(x) for x in fn([empty, full])] == [True, True]
    assert [bool(x) for x in fn([empty, torch.tensor([1.0, float("nan")])])] == [False, False]


# ----------------------------------------------------------------------------- carried first-moment peaks
# docs/optim.md "Peaks carried instead of read": a compiled donated step bounds each leaf's largest
# |m| by a peak advanced from the gradients' norms, read exactly only for a state no step returned

def _pairs(n=1 << 18):
    """Moments and gradients over many magnitudes, half of the pairs of equal sign; the gradients
    with few significant bits, so that sqrt(g * g) is |g| (the recurrence's G is exact)."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)) * 2 ** 11).round() / 2 ** 11
    g = torch.where(g.abs() < 2 ** -8, torch.ones_like(g), g)
    m = torch.where(torch.rand(n, generator=gen) < 0.5, m.abs() * g.sign(), m)
    assert torch.equal(torch.sqrt(g * g), g.abs())
    return m, g


def _new_moments(b1, m, g):
    """The first moment after one Adam step, as each way of the step computes it."""
    adam = optim.scale_by_adam(b1=b1)

    def pure(m, g):
        return adam.update({"w": g}, adam.init({"w": m})._replace(mu={"w": m}))[1].mu["w"]
    p, v, mf = torch.zeros_like(m), torch.zeros_like(m), m.clone()
    torch._fused_adamw_([p], [g.clone()], [mf], [v], [], [torch.tensor(1.0)], lr=1e-3, beta1=b1, beta2=0.95,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    return {"eager": pure(m, g), "fused": mf,
            "inductor": torch.compile(pure, backend="inductor", fullgraph=True)(m, g)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("b1", [0.9, 0.5, 0.1])
def test_the_carried_peak_bounds_the_new_first_moment_of_every_kernel_elementwise(b1):
    # M' = (A M + C G)(1 + s) with M = |m| and G = |g| per element (each element a leaf of its
    # own) is at least the new |m'| however it is rounded: eager lerp, the fused kernel, inductor's
    # m + w (g - m). Without the slack s (2**-19) some elements exceed it by an ulp or more.
    m, g = _pairs()
    opt = optim.adamw(1e-3, b1=b1)
    bound = optim.update_bound(opt)
    state = opt.init({"w": m})
    assert bound.carried.applies(state)
    peak = bound.carried.advance([m.abs()], [g * g], state)[0]
    for way, new in _new_moments(b1, m, g).items():
        over = new.abs() > peak
        assert not over.any(), f"{way}: |m'| above the carried peak at {int(over.sum())} elements"
        assert float((new.abs() / peak).max()) > 1 - 2 ** -17       # (and the bound is tight)


def test_the_carried_peak_applies_where_its_slack_cannot_compound_and_adamw_has_the_elementwise_bound():
    # A (1 + s) <= (1 + A) / 2: fp32/fp64 moments and b1 up to about 1 - 2**-18; 16-bit moments
    # (s = 2**-3) and weight decay above 1 (the joint bound reads the parameters) read as before
    params = {"w": torch.ones(3)}
    for b1, dtype, applies in [(0.9, torch.float32, True), (0.99999, torch.float32, True),
                               (0.9, torch.float64, True), (1 - 2 ** -20, torch.float32, False),
                               (0.9, torch.bfloat16, False), (0.5, torch.bfloat16, True)]:
        opt = optim.adamw(1e-3, b1=b1)
        state = opt.init(params)
        state[0].mu["w"] = state[0].mu["w"].to(dtype)
        assert optim.update_bound(opt).carried.applies(state) is applies, (b1, dtype)
    assert optim.update_bound(optim.adamw(1e-3, weight_decay=2.0)).carried is None


def test_a_constant_gradient_keeps_the_carried_peak_near_the_gradient_norm():
    # no compounding: the fixed point is C G (1 + s) / (1 - A (1 + s)), 1.00002 G for b1 = 0.9
    opt = optim.adamw(1e-3, b1=0.9)
    state = opt.init({"w": torch.ones(4)})
    bound = optim.update_bound(opt)
    peak, far = [torch.zeros(())], [torch.tensor(1e6)]
    for _ in range(400):
        peak = bound.carried.advance(peak, [torch.tensor(4.0)], state)
        far = bound.carried.advance(far, [torch.tensor(4.0)], state)
    assert 2.0 <= float(peak[0]) < 2.0 * 1.0001 and 2.0 <= float(far[0]) < 2.0 * 1.0001


def _carried(step, state):
    """The peaks the step would use for ``state`` without reading it (None: it would read), and
    each leaf's exact largest |m| (local)."""
    from functional_pp.optim.bounds import term_peaks
    from functional_pp.step.known_finite import _terms
    bound = optim.update_bound(step.optimizer)
    carried = step._known_peaks.get(_terms(bound, state["opt_state"], state["params"]), lambda _: None)
    return carried, term_peaks(bound, state["opt_state"], state["params"])


def _assert_bounds(carried, exact):
    assert carried is not None and len(carried) == len(exact)
    for c, e in zip(carried, exact):
        assert c >= e, f"carried peak {float(c)} below the first moment's largest |m| {float(e)}"


def _steps(step, state, seeds):
    out = []
    for seed in seeds:
        state, m = step(state, _batch_seeded(seed))
        out.append((m["skipped"], m["loss"]))
    return state, out


def _batch_seeded(seed):
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    ids[ids == UNUSED] = UNUSED + 1
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


@pytest.mark.timeout(900)
def test_the_carried_peaks_bound_the_first_moments_over_many_steps_and_change_no_result(monkeypatch):
    # aot_eager, donated: after every step each leaf's carried peak is at least its largest |m|,
    # carried (the moments are read once, at the first step); the states are bitwise those of the
    # same steps reading the moments (the joint norm of gradients and first moments)
    reads = []
    real = known_finite.term_peaks
    monkeypatch.setattr(known_finite, "term_peaks", lambda *a: reads.append(1) or real(*a))

    def run(carry):
        step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), optim.adamw(3e-2, b1=0.8, weight_decay=0.1),
                              compile="aot_eager", donate_state=True)
        if not carry:
            monkeypatch.setattr(step, "_carried_peaks", lambda state: (None, None))
        state = step.init(fpp.init(llama.init, CFG, seed=0))
        losses = []
        for seed in range(12):
            state, m = step(state, _batch_seeded(seed))
            losses.append(m["loss"])
            if carry:
                _assert_bounds(*_carried(step, state))
        return losses, [t.clone() for t in optree.tree_leaves([state["params"], state["opt_state"]])]

    carried, read = run(True), run(False)
    assert len(reads) == 1                # the first step's read only
    assert carried[0] == read[0]
    for x, y in zip(carried[1], read[1]):
        assert torch.equal(x, y)


@pytest.mark.timeout(900)
def test_the_peaks_of_a_state_no_step_returned_are_read_and_an_overflow_there_is_held(monkeypatch):
    # an edited moment (in place, in a new tree, a state loaded from a checkpoint) is read before
    # the step: a moment of -1e31 under a parameter at fp32's largest value (its update overflows, weight
    # decay or not) is held, redone and skipped (a stale peak would write inf); after a held step the peaks are read again, after a
    # skipped one (a NaN parameter: nothing written) they are carried on
    import io

    def rate(count):       # lr wd = 2 at the second update: not shown finite, held, redone and kept
        return torch.where(count == 1, 20.0, 1e-3).to(torch.float32)
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), optim.adamw(rate, weight_decay=0.1),
                          compile="aot_eager", donate_state=True, max_consecutive_skips=None)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    state, _ = step(state, _batch_seeded(0))
    _assert_bounds(*_carried(step, state))
    given = optree.tree_leaves(state["opt_state"])
    state, m = step(state, _batch_seeded(5))
    assert m["skipped"] == 0 and not any(a is b for a, b in zip(given, optree.tree_leaves(state["opt_state"])))
    assert _carried(step, state)[0] is None     # new buffers of the redo: read at the next step
    state, _ = step(state, _batch_seeded(0))
    _assert_bounds(*_carried(step, state))

    def in_place(state):
        state["opt_state"][-3].mu["embed_tokens"][UNUSED, 0] = -1e31
        return state

    def new_tree(state):
        mu = optree.tree_map(torch.clone, state["opt_state"][-3].mu)
        mu["embed_tokens"][UNUSED, 0] = -1e31
        opt_state = list(state["opt_state"])
        opt_state[-3] = opt_state[-3]._replace(mu=mu)
        return {**state, "opt_state": tuple(opt_state)}

    def checkpoint(state):
        buffer = io.BytesIO()
        saved = optree.tree_map(torch.clone, state)
        saved["opt_state"][-3].mu["embed_tokens"][UNUSED, 0] = -1e31
        torch.save(saved, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    for edit in (in_place, new_tree, checkpoint):
        state["params"]["embed_tokens"][UNUSED, 0] = MAX32
        state = edit(state)
        assert _carried(step, state)[0] is None, edit.__name__        # not the tensors returned: read
        state, m = step(state, _batch_seeded(1))
        assert (m["skipped"], m["nonfinite_update"]) == (1, 1), edit.__name__      # held, redone, skipped
        assert float(state["params"]["embed_tokens"][UNUSED, 0]) == MAX32
        assert _carried(step, state)[0] is None            # forgotten after the redo
        state["opt_state"][-3].mu["embed_tokens"][UNUSED, 0] = 0.0
        state["params"]["embed_tokens"][UNUSED, 0] = 0.5
        state, m = step(state, _batch_seeded(2))
        assert m["skipped"] == 0
        _assert_bounds(*_carried(step, state))
    # a skipped step writes nothing: its peaks carry on (the moments are unchanged)
    used = int(_batch_seeded(3)["tokens"][0, 0])
    state["params"]["embed_tokens"][used, 0] = float("nan")
    state, m = step(state, _batch_seeded(3))
    assert (m["skipped"], m["nonfinite_loss"]) == (1, 1) and m.get("update_held", 0) == 0
    carried, exact = _carried(step, state)
    _assert_bounds(carried, exact)
    state["params"]["embed_tokens"][used, 0] = 0.5
    state, m = step(state, _batch_seeded(4))
    assert m["skipped"] == 0
    _assert_bounds(*_carried(step, state))


CFG_TP = llama.Config(vocab=64, hidden=16, layers=1, heads=2, kv_heads=2, mlp=32, max_seq=16,
                      tie_embeddings=False, rope_scaling=None)
FSDP_TP = (fpp.Mesh(dp_shard=2, tp=2), fpp.Rules(batch="dp_shard", heads="tp", kv_heads="tp", mlp="tp",
                                                  hidden="dp_shard"))
FSDP = (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard"))


def _mesh_steps(mesh, rules, donate_state, processes=False):
    """Four compiled (aot_eager) AdamW steps on ``mesh``; before the third, the device at the last
    coordinate of every axis sets one element of its shard of a split first moment (the MLP's
    gate, split over every axis) to -1e31, which no other device holds. Per device and step: the
    metrics, whether the step returned the tensors it was given, whether the carried peaks
    (donated) bounded the local moments, and the state."""
    from functional_pp.core.runtime import device_coords
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG_TP), optim.adamw(1e-3, weight_decay=0.1),
                          mesh=mesh, rules=rules, compile="aot_eager", donate_state=donate_state,
                          max_consecutive_skips=None)

    def device():
        state = step.init(fpp.init(llama.init, CFG_TP, mesh=mesh, rules=rules, seed=0))
        last = all(c == mesh.shape[a] - 1 for a, c in device_coords().items())
        out = []
        for i in range(4):
            if i == 2 and last:
                state["opt_state"][-3].mu["layers"][0]["mlp"]["gate_proj"][0, 0] = -1e31
            with fpp.use_rules(rules):
                batch = {k: fpp.named(v, "batch seq").data for k, v in _batch_seeded(i).items()}
            given = optree.tree_leaves(state["opt_state"])
            state, m = step(state, batch)
            bounded = None
            if donate_state:
                carried, exact = _carried(step, state)
                bounded = carried is None or all(bool(c >= e) for c, e in zip(carried, exact))
            out.append(({k: m[k] for k in ("loss", "skipped", "nonfinite_update")},
                        all(a is b for a, b in zip(given, optree.tree_leaves(state["opt_state"])) if a.dim()),
                        bounded, [t.clone() for t in optree.tree_leaves([state["params"], state["opt_state"]])]))
        return out
    return fpp.launch(device, mesh, processes=processes, timeout=600)


def _assert_every_device_held_the_edited_step(donated, plain):
    for dev_d, dev_p in zip(donated, plain):
        # held from the edit on (the moment stays near 1e31: its square overflows): redone, new buffers
        assert [same for _, same, _, _ in dev_d] == [True, True, False, False]
        assert all(b for _, _, b, _ in dev_d)
        for (md, _, _, sd), (mp, _, _, sp) in zip(dev_d, dev_p):
            assert md == mp
            for x, y in zip(sd, sp):
                assert torch.equal(x, y)


@pytest.mark.timeout(900)
def test_the_carried_peaks_complete_over_the_mesh_like_the_sums_on_simulated_fsdp_and_tp():
    # each device carries the peaks of its own shards; the bound's per-leaf partial sums (gradient
    # sums plus squared peaks) are completed over the axes that split each leaf, so a huge moment on
    # one device's shard holds the step on every device, which then redo it as the step without
    # donation makes it (bitwise, aot_eager)
    donated, plain = _mesh_steps(*FSDP_TP, True), _mesh_steps(*FSDP_TP, False)
    assert len(donated) == 4
    _assert_every_device_held_the_edited_step(donated, plain)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_carried_peaks_complete_over_the_mesh_on_two_gloo_processes():
    real, simulated = _mesh_steps(*FSDP, True, processes=True), _mesh_steps(*FSDP, False)
    assert len(real) == 2
    _assert_every_device_held_the_edited_step(real, simulated)
