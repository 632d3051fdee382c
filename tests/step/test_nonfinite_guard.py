"""The step's non-finite guard (functional_pp/step/nonfinite.py, step/update.py) in each way the update
is made: new buffers chosen on the host (eager, and compiled without donation: the graph
returns the new state and a skipped step returns the old one); in place (eager, donated),
where AdamW's step holds back what it cannot show finite and the update is made in new
buffers; written into a donated state (compiled), where an update found non-finite only after
it was written stops the run instead of being silently kept."""
from __future__ import annotations

import functools

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step.train import NonFiniteError

CFG = llama.Config(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)
LOSS = functools.partial(llama.loss, cfg=CFG)


def _batch(seed: int = 1) -> dict:
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _pure_with_an_infinite_update():
    """SGD whose update holds one -inf (loss and gradients finite), written without in-place ops."""
    base = fpp.optim.sgd(0.1)

    def update(grads, state, params=None):
        updates, state = base.update(grads, state, params)
        leaves, spec = optree.tree_flatten(updates)
        leaves[1] = leaves[1] - torch.nn.functional.one_hot(torch.tensor(2), leaves[1].numel()).reshape(
            leaves[1].shape).to(leaves[1].dtype) * float("inf")
        return optree.tree_unflatten(spec, leaves), state
    return fpp.optim.GradientTransformation(base.init, update)


def _run(opt, **options):
    step = fpp.train_step(LOSS, opt, max_consecutive_skips=None, **options)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    before = [t.clone() for t in optree.tree_leaves(state["params"])]
    new_state, metrics = step(state, _batch())
    return state, new_state, metrics, before


@pytest.mark.parametrize("donate_state", [False, True], ids=["new-buffers", "in-place-held-back"])
def test_an_overflowing_adamw_update_is_skipped_and_the_old_state_kept(donate_state):
    # lr 1e39 (inf in fp32): the in-place step cannot show its result finite, writes nothing, and
    # the step makes the update in new buffers, as without donation: found non-finite, skipped
    state, new_state, metrics, before = _run(fpp.optim.adamw(1e39, weight_decay=0.1), donate_state=donate_state)
    assert (metrics["nonfinite_update"], metrics["nonfinite_grad"], metrics["skipped"]) == (1, 0, 1)
    assert "update_held" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(new_state["params"]), before))
    assert int(new_state["skipped"]) == 1 and int(new_state["step"]) == 1
    counts = [int(x) for x in optree.tree_leaves(new_state["opt_state"]) if x.dim() == 0]
    assert counts == [0], "the optimizer's step counter did not advance"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["aot_eager", True], ids=["aot_eager", "inductor"])
def test_compiled_step_without_donation_returns_the_old_state_of_a_skipped_step(backend):
    # inductor folded the former check (u * 0).sum() to 0 and applied the infinite update
    state, new_state, metrics, before = _run(_pure_with_an_infinite_update(), compile=backend)
    assert (metrics["nonfinite_update"], metrics["nonfinite_grad"], metrics["skipped"]) == (1, 0, 1)
    assert new_state["params"] is state["params"] and new_state["opt_state"] is state["opt_state"]
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state["params"]), before))
    assert int(new_state["step"]) == 1 and int(new_state["skipped"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_donated_step_keeps_the_state_of_a_non_finite_loss_and_stops_on_a_written_update():
    def nan_loss(params, batch):
        return LOSS(params, batch) * float("nan")
    step = fpp.train_step(nan_loss, fpp.optim.adamw(1e-2), compile="aot_eager", donate_state=True,
                          max_consecutive_skips=None)
    state = step.init(fpp.init(llama.init, CFG, seed=0))
    given = optree.tree_leaves([state["params"], state["opt_state"]])
    before = [t.clone() for t in given]
    new_state, metrics = step(state, _batch())
    assert metrics["skipped"] == 1 and metrics["nonfinite_loss"] == 1
    returned = optree.tree_leaves([new_state["params"], new_state["opt_state"]])
    assert all(a is b for a, b in zip(returned, given) if a.dim())       # written into the state passed in
    assert all(torch.equal(a, b) for a, b in zip(returned, before))       # ... with its old values
    with pytest.raises(NonFiniteError, match="already written into the donated state"):
        _run(_pure_with_an_infinite_update(), compile="aot_eager", donate_state=True)


def _rates(count):
    """AdamW's bound (docs/optim.md "Bound before the update") lets lr 1e-3 through, not 20 (lr wd
    = 2: the decay factor 1 - lr wd leaves [0, 1]; its update is finite and small), nor inf (whose
    update is not finite): one compiled graph for the three steps (a skipped step does not
    advance the count)."""
    return torch.where(count == 0, 1e-3, torch.where(count == 1, 20.0, float("inf"))).to(torch.float32)


def _three_steps(donate_state, mesh=None, rules=None, processes=False, **options):
    """Per step: the metrics read, and whether the step returned the very tensors it was given."""
    mesh, rules = mesh or fpp.Mesh(), rules or fpp.Rules()
    step = fpp.train_step(LOSS, fpp.optim.adamw(_rates, weight_decay=0.1), mesh=mesh, rules=rules,
                          donate_state=donate_state, max_consecutive_skips=None, **options)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        out = []
        for _ in range(3):
            with fpp.use_rules(rules):
                batch = {k: fpp.named(v, "batch seq").data for k, v in _batch().items()}
            given = optree.tree_leaves([state["params"], state["opt_state"]])
            state, m = step(state, batch)
            new = optree.tree_leaves([state["params"], state["opt_state"]])
            out.append(({k: m[k] for k in ("loss", "skipped", "nonfinite_update", "nonfinite_grad")},
                        all(a is b for a, b in zip(given, new) if a.dim()), [t.clone() for t in new]))
        return out
    return fpp.launch(device, mesh, processes=processes, timeout=600)


def _assert_held_and_redone(donated, plain, exact):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    (m0, same0, _), (m1, same1, _), (m2, same2, last) = donated
    assert same0 and not same1 and same2       # written in place; held: new buffers; skipped: the state given
    assert m1["skipped"] == 0 and m2["skipped"] == 1 and m2["nonfinite_update"] == 1
    for (md, _, td), (mp, _, tp) in zip(donated, plain):
        assert md == mp if exact else {k: v for k, v in md.items() if k != "loss"} == {
            k: v for k, v in mp.items() if k != "loss"}
        torch.testing.assert_close(torch.tensor(md["loss"]), torch.tensor(mp["loss"]), **tol)
        for x, y in zip(td, tp):
            torch.testing.assert_close(x, y, **tol)
    assert all(torch.isfinite(t).all() for t in last if t.is_floating_point())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["aot_eager", True], ids=["aot_eager", "inductor"])
def test_a_compiled_donated_step_its_bound_cannot_show_finite_is_held_and_redone_as_without_donation(backend):
    # the donated step writes only where AdamW's pre-update bound shows the result finite; otherwise
    # it writes nothing and the host runs the step without donation: finite (kept) or not (skipped)
    donated, plain = _three_steps(True, compile=backend), _three_steps(False, compile=backend)
    _assert_held_and_redone(donated[0], plain[0], exact=backend == "aot_eager")


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_held_decision_of_a_sharded_compiled_step_is_the_same_on_every_gloo_rank():
    # dp_shard: the bound's norms are completed over the mesh as the gradient norm is, so both
    # ranks hold the same steps (a rank that wrote while the other redid would hang or diverge)
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules()
    real = _three_steps(True, mesh, rules, processes=True, compile="aot_eager")
    simulated = _three_steps(False, mesh, rules, compile="aot_eager")
    for r, s in zip(real, simulated):
        _assert_held_and_redone(r, s, exact=False)


def _held_beside_new_buffers(mesh=None, rules=None, processes=False):
    """Three eager steps of ``_three_steps``' AdamW, donated (the fused in-place step), each beside
    the step without donation run on a copy of the same state: per step, both metrics, whether the
    donated step returned the tensors it was given, and both new states."""
    mesh, rules = mesh or fpp.Mesh(), rules or fpp.Rules()
    donated, plain = (fpp.train_step(LOSS, fpp.optim.adamw(_rates, weight_decay=0.1), mesh=mesh, rules=rules,
                                     donate_state=d, max_consecutive_skips=None) for d in (True, False))

    def device():
        params = fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0)
        state, _ = donated.init(params), plain.init(params)
        out = []
        for _ in range(3):
            with fpp.use_rules(rules):
                batch = {k: fpp.named(v, "batch seq").data for k, v in _batch().items()}
            copy = optree.tree_map(torch.clone, state)
            given = optree.tree_leaves([state["params"], state["opt_state"]])
            state, m = donated(state, batch)
            ref, mr = plain(copy, batch)
            new = optree.tree_leaves([state["params"], state["opt_state"]])
            out.append((m, mr, all(a is b for a, b in zip(given, new) if a.dim()), [t.clone() for t in new],
                        optree.tree_leaves([ref["params"], ref["opt_state"]])))
        return out
    return fpp.launch(device, mesh, processes=processes, timeout=600)


def _assert_held_steps_are_the_steps_without_donation(steps):
    # lr 1e-3: written in place (the fused kernel: as without donation to its rounding); lr 20 and
    # inf: held (nothing written), run again by the host as the eager step without donation
    # (UpdateStrategy.redo): kept in new buffers, then skipped (the state given), bitwise its result
    keys = ("loss", "skipped", "nonfinite_update", "nonfinite_grad")
    assert [same for _, _, same, _, _ in steps] == [True, False, True]
    assert [(m["skipped"], m["nonfinite_update"]) for m, *_ in steps] == [(0, 0), (0, 0), (1, 1)]
    for k, (m, mr, _, new, ref) in enumerate(steps):
        assert {x: m[x] for x in keys} == {x: mr[x] for x in keys}
        for x, y in zip(new, ref):
            torch.testing.assert_close(x, y, **(dict(rtol=1e-6, atol=1e-7) if k == 0 else dict(rtol=0, atol=0)))


def test_a_held_eager_in_place_step_is_redone_as_the_step_without_donation():
    _assert_held_steps_are_the_steps_without_donation(_held_beside_new_buffers()[0])


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_held_eager_in_place_step_is_redone_on_every_gloo_rank():
    # dp_shard: both ranks hold the same steps (the bound's norm completed over the mesh) and run
    # them again without donation, their collectives included
    real = _held_beside_new_buffers(fpp.Mesh(dp_shard=2), llama.default_rules(), processes=True)
    assert len(real) == 2
    for steps in real:
        _assert_held_steps_are_the_steps_without_donation(steps)
