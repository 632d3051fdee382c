"""ZeRO-3 for any model from its first step: a model with dimension names unlike Llama's
(``rows tok``, ``feat``; ``batch_dims=``) and no ``fpp.layer`` under ``Mesh(dp_shard=2)`` is
warned (NoLayerWarning) and re-gathers every weight its backward reads on steps 1 and 2, its
comm report ZeRO-3's formula (docs/communication.md), its losses those of one device; on the
simulated mesh and on two gloo processes."""
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


def _steps(mesh, rules, steps=2, step=None, **kw):
    """Per step: (loss, forward all-gather bytes, backward all-gather bytes, reduce-scatter bytes)."""
    step = step or _train_step(mesh, rules, **kw)
    state = step.init(fpp.init(init, mesh=mesh, rules=rules, seed=0))
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


def _one_device(**kw):
    return fpp.launch(functools.partial(_steps, fpp.Mesh(), fpp.Rules(), **kw), fpp.Mesh())[0]


def _check_zero3(steps, one):
    n = MESH.size
    for (loss_, forward, backward, scatter), (ref, *_) in zip(steps, one):
        assert forward == (n - 1) * P * B // n                        # every weight gathered once
        # ... and again in backward, but the embedding table (its backward reads only the ids)
        assert backward == (n - 1) * (P - VOCAB * FEAT) * B // n
        assert scatter == (n - 1) * P * B // n                        # every gradient reduce-scattered
        assert loss_ == pytest.approx(ref, rel=1e-12)


def test_a_model_with_unusual_names_and_no_layer_is_zero3_from_step_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = fpp.launch(functools.partial(_zero3_steps, _train_step(MESH, RULES)), MESH)[0]
    warned = [w for w in caught if issubclass(w.category, NoLayerWarning)]
    assert len(warned) == 1 and "functional_pp.layer" in str(warned[0].message)
    _check_zero3(steps, _one_device())


@pytest.mark.multiprocess
def test_a_model_with_unusual_names_is_zero3_from_step_one_on_gloo_processes():
    real = fpp.launch(_zero3_steps, MESH, processes=True, timeout=300)
    one = _one_device()
    for steps in real:
        _check_zero3(steps, one)
