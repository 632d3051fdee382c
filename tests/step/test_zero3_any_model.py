"""ZeRO-3 for any model from its first step: a model with dimension names unlike Llama's
(``rows tok``, ``feat``; ``batch_dims=``) and no ``fpp.layer`` under ``Mesh(dp_shard=2)`` is
warned (NoLayerWarning) and re-gathers every weight its backward reads on steps 1 and 2, its
comm report ZeRO-3's formula (docs/communication.md), its losses those of one device. Its
embedding table used again as the LM head without ``fpp.tied`` is gathered once per step from
the second step on (parallel/fsdp/param_uses.py). On the simulated mesh and on two gloo processes."""
import functools
import warnings

import pytest
import torch
from odd_names_model import BATCH_DIMS, FEAT, HID, RULES, VOCAB, batch, init, loss

import functional_pp as fpp
from functional_pp.step.train import NoLayerWarning

MESH = fpp.Mesh(dp_shard=2)
B = 8                                   # float64
P = VOCAB * FEAT + FEAT * HID + HID * FEAT + FEAT * VOCAB


def _train_step(mesh, rules, tie=False, **kw):
    return fpp.train_step(functools.partial(loss, tie=tie), fpp.optim.adamw(1e-2), mesh=mesh, rules=rules,
                          batch_dims=BATCH_DIMS, **kw)


def _steps(mesh, rules, steps=2, step=None, tie=False, **kw):
    """Per step: (loss, forward all-gather bytes, backward all-gather bytes, reduce-scatter bytes)."""
    step = step or _train_step(mesh, rules, tie=tie, **kw)
    state = step.init(fpp.init(functools.partial(init, tie=tie), mesh=mesh, rules=rules, seed=0))
    out = []
    for i in range(steps):
        with fpp.use_rules(rules):
            local = {k: fpp.named(v, BATCH_DIMS[k]).data for k, v in batch(i).items()}
        with fpp.comm_report() as rep:
            state, m = step(state, local)
        sent = {(kind, back): 0 for kind in ("all_gather", "reduce_scatter") for back in (False, True)}
        for e in rep.events:
            if (e.kind, e.backward) in sent:
                sent[e.kind, e.backward] += e.bytes_sent
        out.append((m["loss"], sent["all_gather", False], sent["all_gather", True],
                    sent["reduce_scatter", True] + sent["reduce_scatter", False]))
    return out


def _zero3_steps(step=None):
    return _steps(MESH, RULES, step=step)


def _both_steps():
    """On a device: the untied model's two steps and the tied one's three."""
    return _steps(MESH, RULES), _steps(MESH, RULES, steps=3, tie=True)


def _one_device(**kw):
    return fpp.launch(functools.partial(_steps, fpp.Mesh(), fpp.Rules(), **kw), fpp.Mesh())[0]


def _check_zero3(steps, one, params=P, unsaved=VOCAB * FEAT):
    """ZeRO-3's bytes on every step: each of the ``params`` weights gathered once in forward,
    once again in backward but the ``unsaved`` ones no backward formula reads (the untied
    embedding table: its backward reads only the ids), each gradient reduce-scattered once."""
    n = MESH.size
    for (loss_, forward, backward, scatter), (ref, *_) in zip(steps, one):
        assert forward == (n - 1) * params * B // n
        assert backward == (n - 1) * (params - unsaved) * B // n
        assert scatter == (n - 1) * params * B // n
        assert loss_ == pytest.approx(ref, rel=1e-12)


TIED = P - FEAT * VOCAB                 # the tied model has no separate head


def _check_tied(steps, one):
    """The table used by the embedding and the head without ``fpp.tied``: gathered at both
    sites in the first step (learned there), once from the second step on."""
    n = MESH.size
    loss_, forward, _, scatter = steps[0]
    assert forward == scatter == (n - 1) * (TIED + VOCAB * FEAT) * B // n
    assert loss_ == pytest.approx(one[0][0], rel=1e-12)
    _check_zero3(steps[1:], one[1:], params=TIED, unsaved=0)


def test_a_model_with_unusual_names_and_no_layer_is_zero3_from_step_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = fpp.launch(functools.partial(_zero3_steps, _train_step(MESH, RULES)), MESH)[0]
    warned = [w for w in caught if issubclass(w.category, NoLayerWarning)]
    assert len(warned) == 1 and "functional_pp.layer" in str(warned[0].message)
    _check_zero3(steps, _one_device())


def test_a_parameter_used_at_two_sites_is_gathered_once_per_step_without_being_declared_tied():
    steps = fpp.launch(functools.partial(_steps, MESH, RULES, steps=3, tie=True), MESH)[0]
    _check_tied(steps, _one_device(steps=3, tie=True))


@pytest.mark.multiprocess
def test_zero3_and_undeclared_ties_on_gloo_processes():
    real = fpp.launch(_both_steps, MESH, processes=True, timeout=300)
    one, one_tied = _one_device(), _one_device(steps=3, tie=True)
    for untied, tied in real:
        _check_zero3(untied, one)
        _check_tied(tied, one_tied)
