"""A model that declares no ``fpp.layer`` still gets ZeRO-3's memory under FSDP from its first
step, whatever its dimensions are called: the first step warns, naming the fix, and every weight
the forward all-gathers is all-gathered again in backward (none is kept from forward to
backward); the numbers are those of ``fsdp_keep_root=False`` and of one device. A model with
layers is not affected."""
import functools
import pathlib
import sys
import warnings

import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step.train import NoLayerWarning

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import gpt2  # noqa: E402  (a model written without fpp.layer)

CFG = gpt2.Config(vocab=64, embd=24, layers=2, heads=4, ff=48, max_pos=16, token_mixing=False, layered=False)
MESH = fpp.Mesh(dp_shard=2)
RULES = gpt2.rules(tp=False)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, CFG.vocab, (8, 17), generator=g)
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


DATA = [_batch(i) for i in range(3)]


def _gather_bytes(events, backward):
    return sum(e.bytes_sent for e in events if e.kind == "all_gather" and e.backward == backward
               and e.axes == ("dp_shard",))


def _run(mesh, rules, cfg=CFG, **step_kw):
    step = fpp.train_step(functools.partial(gpt2.loss, cfg=cfg), fpp.optim.adamw(1e-2), mesh=mesh,
                          rules=rules, batch_dims=gpt2.BATCH_DIMS, **step_kw)

    def device():
        state = step.init(fpp.init(gpt2.init, cfg, torch.float64, mesh=mesh, rules=rules, seed=0))
        losses, reports = [], []
        for b in DATA:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, gpt2.BATCH_DIMS[k]).data for k, v in b.items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            losses.append(m["loss"])
            reports.append(rep.events)
        return losses, reports
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fpp.launch(device, mesh)
    return out, [w for w in caught if issubclass(w.category, NoLayerWarning)]


def test_a_model_without_layers_is_warned_once_and_regathers_every_weight_from_the_first_step():
    (losses, reports), *_ = (out := _run(MESH, RULES))[0]
    warned = out[1]
    assert len(warned) == 1 and "functional_pp.layer" in str(warned[0].message)
    # ZeRO-3 per weight on every step, the first included: as fsdp_keep_root=False, every weight
    # backward uses is gathered again (all but those no backward formula reads: biases)
    (ref_losses, ref_reports), *_ = _run(MESH, RULES, fsdp_keep_root=False)[0]
    for report, ref in zip(reports[:2], ref_reports[:2]):
        assert _gather_bytes(report, True) == _gather_bytes(ref, True) > 0.9 * _gather_bytes(report, False)
    assert losses == ref_losses                                     # same numbers, bitwise
    (one, _), = _run(fpp.Mesh(), fpp.Rules())[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one), rtol=1e-10, atol=1e-12)


def test_a_model_with_layers_keeps_its_root_and_is_not_warned():
    cfg = llama.Config.tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fpp.launch(train_steps(cfg, [make_batch(cfg, batch=4, seq=8, seed=0)], MESH,
                               llama.default_rules(tp=False)), MESH)
    assert not [w for w in caught if issubclass(w.category, NoLayerWarning)]


def test_the_example_model_declares_its_layers_with_the_same_numbers():
    """examples/gpt2.py marks its block with fpp.layer: no warning, and the numbers of the
    unlayered model (FSDP units gather the same elements), step 1's backward re-gathering
    the layers' weights where the unlayered model kept them."""
    layered = gpt2.Config(**{**CFG.__dict__, "layered": True})
    (losses, reports), *_ = (out := _run(MESH, RULES, layered))[0]
    assert not out[1]
    assert _gather_bytes(reports[0], backward=True) > 0
    (ref_losses, _), *_ = _run(MESH, RULES, fsdp_keep_root=False)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=0)


def test_a_compiled_model_without_layers_is_warned_once_and_regathers_every_weight():
    """Compiled steps are told the same way and re-gather the same weights from step 1 on."""
    (losses, reports), *_ = (out := _run(MESH, RULES, compile="aot_eager"))[0]
    assert len(out[1]) == 1
    for report in reports[:2]:
        assert _gather_bytes(report, True) > 0.9 * _gather_bytes(report, False)
