"""``train_step(donate_state=True)``: compiled steps, and eager steps of an optimizer with an
in-place step (``optim.adamw``: torch's fused kernel), write the new parameters and optimizer
state into the state passed in; other eager steps keep theirs in the buffers they own
(docs/memory.md "Donated state"); results equal the out-of-place step's, on one device, on
simulated devices and on gloo processes."""
import functools
import re

import pytest
import torch
from harness import local_batch, make_batch, nan_on_second_call

import functional_pp as fpp
from functional_pp.core.tree import tree_leaves
from functional_pp.models import llama

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
DATA = [make_batch(CFG, batch=4, seq=16, seed=i) for i in range(3)]
FSDP = (fpp.Mesh(dp_shard=2), llama.default_rules())


def _adamw():
    return fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0)


_RUNS: dict = {}


def _train_once(donate, *args, compile=None):
    """``_train`` of the keyword-free layouts, run once per module: several tests compare
    against the same out-of-place run."""
    key = (donate, tuple(map(id, args)), compile)
    if key not in _RUNS:
        _RUNS[key] = _train(donate, *args, compile=compile)
    return _RUNS[key]


def _train(donate, mesh=None, rules=None, loss_fn=LOSS, processes=False, opt=_adamw, **kw):
    """Losses, skipped flags, final state leaves, and whether every step returned the very
    tensors it was given (per rank)."""
    mesh, rules = mesh or fpp.Mesh(), rules or fpp.Rules()
    step = fpp.train_step(loss_fn, opt(), mesh=mesh, rules=rules, donate_state=donate, **kw)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        losses, skipped, same_tensors = [], [], True
        for b in DATA:
            with fpp.use_rules(rules):
                batch = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            given = tree_leaves([state["params"], state["opt_state"]])
            state, m = step(state, batch)
            out = tree_leaves([state["params"], state["opt_state"]])
            same_tensors &= all(a is b for a, b in zip(given, out) if a.dim() > 0)
            losses.append(m["loss"])
            skipped.append(m["skipped"])
        return losses, skipped, [t.clone() for t in tree_leaves([state["params"], state["opt_state"]])], same_tensors
    return fpp.launch(device, mesh, processes=processes, timeout=600)


FUSED = dict(rtol=1e-5, atol=1e-6)     # torch's fused AdamW kernel against the foreach chain, 3 steps


def _assert_same(a, b, exact=True):
    for (la, sa, ta, _), (lb, sb, tb, _) in zip(a, b):
        assert sa == sb
        tol = (dict(rtol=0, atol=0) if exact is True else dict(rtol=1e-6, atol=1e-7) if exact is False
               else exact)
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), equal_nan=True, **tol)
        assert len(ta) == len(tb)
        for x, y in zip(ta, tb):
            torch.testing.assert_close(x, y, **tol)


@pytest.mark.timeout(600)
def test_eager_donated_adamw_step_updates_the_state_in_place_and_matches_the_out_of_place_step():
    # one fused kernel (torch._fused_adamw_) against the foreach chain: rounding may differ in the last bit
    donated, kept = _train(True), _train(False)
    _assert_same(donated, kept, exact=FUSED)
    assert donated[0][3] and not kept[0][3]


@pytest.mark.timeout(600)
def test_eager_donated_step_without_an_in_place_step_equals_the_out_of_place_step_without_copying_back():
    sgd = functools.partial(fpp.optim.sgd, 3e-2, momentum=0.9, weight_decay=0.1, clip_norm=1.0)
    donated, kept = _train(True, opt=sgd), _train(False, opt=sgd)
    _assert_same(donated, kept)
    assert not donated[0][3] and not kept[0][3]     # the step's own buffers are the new state


@pytest.mark.timeout(600)
def test_donated_skipped_step_keeps_the_old_values():
    donated, kept = _train(True, loss_fn=nan_on_second_call(LOSS)), _train(False, loss_fn=nan_on_second_call(LOSS))
    assert donated[0][1] == [0, 1, 0]
    _assert_same(donated, kept, exact=FUSED)


@pytest.mark.timeout(900)
def test_aot_eager_donated_step_is_bitwise_the_out_of_place_step():
    donated, kept = _train(True, compile="aot_eager"), _train_once(False, compile="aot_eager")
    _assert_same(donated, kept)
    assert donated[0][3]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_donated_step_matches_the_out_of_place_step():
    # inductor fuses the copy into the input with the update, and the update's arithmetic:
    # fp32 rounding differs from the out-of-place traced (unfused) step, and three AdamW steps
    # amplify it to ~1e-6 absolute; a missed or stale update would differ by ~lr = 3e-3
    donated, kept = _train(True, compile=True), _train_once(False, compile="aot_eager")
    _assert_same(donated, kept, exact=dict(rtol=1e-4, atol=1e-5))
    assert donated[0][3]


@pytest.mark.timeout(900)
def test_donated_fsdp_step_on_simulated_devices_equals_the_out_of_place_step():
    _assert_same(_train(True, *FSDP), _train_once(False, *FSDP), exact=FUSED)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_donated_fsdp_step_on_gloo_processes_equals_simulation():
    real = _train(True, *FSDP, processes=True, compile="aot_eager")
    _assert_same(real, _train(False, *FSDP, compile="aot_eager"))
    assert all(r[3] for r in real)           # compiled: written into the state passed in


def _sgd_in_place(returns, **keywords):
    """``optim.sgd(lr)`` declared with a user's own in-place step (``p -= lr * g`` where not
    skipped) that returns ``returns``: a function of the step's ``skip``."""
    lr, calls = 3e-2, []
    plain = fpp.optim.sgd(lr)

    def step(grads, state, params, *, skip, grad_norm, **extra):
        calls.append(sorted(extra))
        for p, g in zip(tree_leaves(params), tree_leaves(grads)):
            p.copy_(torch.where(skip, p, p + g * -lr))
        return returns(skip)
    if keywords.get("no_extras"):        # a step that takes only the two keywords it needs
        def short(grads, state, params, *, skip, grad_norm):
            return step(grads, state, params, skip=skip, grad_norm=grad_norm)
        return fpp.optim.GradientTransformation(plain.init, plain.update, in_place=short), calls
    return fpp.optim.GradientTransformation(plain.init, plain.update, in_place=step), calls


@pytest.mark.parametrize("returns", [lambda skip: None, lambda skip: False, lambda skip: torch.zeros_like(skip)],
                         ids=["None", "False", "held tensor"])
def test_a_users_in_place_step_that_returns_none_is_an_update_written(returns):
    """An in-place step returning None (as ``Callable[..., None]`` hinted) failed the step with
    ``TypeError: unsupported operand type(s) for |: 'Tensor' and 'NoneType'``; None now means
    "written, not held", as a held flag of False does. The steps equal the step without
    donation, with a NaN step skipped in both."""
    opt, calls = _sgd_in_place(returns)
    donated = _train(True, opt=lambda: opt, loss_fn=nan_on_second_call(LOSS))
    kept = _train(False, opt=lambda: _sgd_in_place(returns)[0], loss_fn=nan_on_second_call(LOSS))
    assert donated[0][1] == [0, 1, 0] and len(calls) == 3      # the user's step ran every step
    assert calls[0] == ["leaves", "norm_reducer", "params_finite"]
    _assert_same(donated, kept, exact=False)


def test_an_in_place_step_may_decline_take_fewer_keywords_and_is_refused_when_it_returns_another_thing():
    """``optim.DECLINED`` (touched nothing) makes the update in new buffers; a step that takes only
    ``skip`` and ``grad_norm`` is called with those; a step that returns anything else, or takes
    no ``skip``, is refused naming the contract."""
    plain, calls = fpp.optim.sgd(3e-2), []
    kept = _train(False, opt=lambda: plain)

    def declines(grads, state, params, *, skip, grad_norm, **extra):   # (nothing written)
        calls.append(skip)
        return fpp.optim.DECLINED
    declined = fpp.optim.GradientTransformation(plain.init, plain.update, in_place=declines)
    _assert_same(_train(True, opt=lambda: declined), kept, exact=True)
    assert len(calls) == 3
    short, calls = _sgd_in_place(lambda skip: None, no_extras=True)
    _assert_same(_train(True, opt=lambda: short), kept, exact=False)
    assert calls == [[], [], []]
    wrong, _ = _sgd_in_place(lambda skip: [skip])
    with pytest.raises(fpp.DeviceError) as info:
        _train(True, opt=lambda: wrong)
    assert type(info.value.original) is TypeError
    assert re.search(r"in-place step \(.*step\) returned list \[tensor\(False\)\]; it returns None where it wrote "
                     r"the update, a 0-dim bool tensor 'held'", str(info.value.original))
    no_skip = fpp.optim.GradientTransformation(plain.init, plain.update, in_place=lambda grads, state, params: None)
    with pytest.raises(TypeError, match=r"takes no skip or grad_norm keyword: it is called step\(grads, state, params"):
        fpp.train_step(LOSS, no_skip, donate_state=True)
