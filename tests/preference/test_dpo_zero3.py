"""A DPO step runs the policy twice (chosen, rejected) and still keeps ZeRO-3 under FSDP from its
second step on: the step's first forward sees every weight gathered twice, once per pass, and
must not take them for tied (parallel/fsdp/param_uses.py), or every gathered weight would be
held from forward to backward instead of re-gathered per layer. Measured by the bytes each step
all-gathers in forward and re-gathers in backward (a weight held gathered is not re-gathered):
every DPO step moves those of two SFT steps on the same rows per pass. A tied Llama's table is
still tied within a pass (gathered once per pass, not re-gathered). dp_shard=2, simulated and on
two gloo processes."""
import functools
import math

import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.parallel.fsdp.param_uses import one_pass
from functional_pp.preference.objective import PreferenceSpec, preference_loss

MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
B, S, STEPS = 4, 8, 3


def _pairs(cfg, seed: int, precomputed: bool = True) -> dict:
    """B chosen and B rejected rows, the reference's log-probabilities precomputed or not."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for side in ("chosen", "rejected"):
        tokens = torch.randint(1, cfg.vocab, (B, S), generator=g)
        labels = torch.roll(tokens, -1, 1)
        labels[:, -1] = -100
        labels[:, :2] = -100                          # the prompt
        out[f"{side}_tokens"], out[f"{side}_labels"] = tokens, labels
        if precomputed:
            out[f"ref_{side}_logps"] = (-20.0 + torch.randn(B, 1, generator=g, dtype=torch.float64)).expand(B, S)
    return out


def _rows(cfg, seed: int) -> dict:
    """An SFT batch of B rows (one DPO pass's rows)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, cfg.vocab, (B, S + 1), generator=g)
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def _bytes_per_step(cfg, dpo: bool, processes: bool = False, self_reference: bool = False) -> list[dict]:
    """On each device, per step: the bytes of forward all-gathers, backward all-gathers
    (re-gathers) and reduce-scatters. ``self_reference``: the reference is the policy's own
    weights, run without gradient (two more forwards gathering the same shards)."""
    forward = functools.partial(llama.forward, cfg=cfg)
    if dpo:
        loss = preference_loss(PreferenceSpec("dpo", beta=0.5), forward, forward if self_reference else None)
        data = [_pairs(cfg, i, precomputed=not self_reference) for i in range(STEPS)]
    else:
        loss, data = functools.partial(llama.loss, cfg=cfg), [_rows(cfg, i) for i in range(STEPS)]
    step = fpp.train_step(loss, fpp.optim.adamw(1e-3), mesh=MESH, rules=RULES,
                          batch_dims={k: "batch seq" for k in data[0]})

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float64, mesh=MESH, rules=RULES, seed=0))
        out = []
        for batch in data:
            with fpp.use_rules(RULES):
                local = {k: fpp.named(v, "batch seq").data for k, v in batch.items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            assert math.isfinite(float(m["loss"]))
            sent = dict.fromkeys(("gather", "regather", "scatter"), 0)
            for e in rep.events:
                key = {("all_gather", False): "gather", ("all_gather", True): "regather",
                       ("reduce_scatter", True): "scatter"}.get((e.kind, e.backward))
                if key:
                    sent[key] += e.bytes_sent
            out.append(sent)
        return out
    return fpp.launch(device, MESH, processes=processes, timeout=300)


@pytest.mark.parametrize("tie", [False, True])
def test_a_dpo_step_keeps_zero3_from_its_second_step(tie):
    cfg = llama.Config.tiny(vocab=64, tie_embeddings=tie)
    for dpo, sft in zip(_bytes_per_step(cfg, dpo=True), _bytes_per_step(cfg, dpo=False)):
        assert sft[0]["regather"] > 0                       # the SFT step is ZeRO-3
        if not tie:                                         # (tied: the table's two sites learned in step 1)
            assert dpo[0] == dpo[1]
        for i in range(1, STEPS):
            assert sft[i] == sft[1], i                      # (a tied table learned in step 1)
            assert dpo[i] == dpo[1], i
            # two passes, each gathering, re-gathering and reduce-scattering what one SFT step does
            assert dpo[i] == {k: 2 * v for k, v in sft[i].items()}, (i, dpo[i], sft[i])


def test_a_reference_forward_on_the_policy_weights_does_not_tie_them():
    """Gathers without gradient (the reference's forwards on the same shards) are not counted:
    the step's backward still re-gathers and reduce-scatters per pass, from its first step on."""
    cfg = llama.Config.tiny(vocab=64)
    for dpo, sft in zip(_bytes_per_step(cfg, dpo=True, self_reference=True), _bytes_per_step(cfg, dpo=False)):
        for step in dpo:
            assert step == dpo[0]
            assert (step["regather"], step["scatter"]) == (2 * sft[0]["regather"], 2 * sft[0]["scatter"])


@pytest.mark.multiprocess
def test_a_dpo_step_keeps_zero3_on_gloo_processes():
    cfg = llama.Config.tiny(vocab=64)
    real = _bytes_per_step(cfg, dpo=True, processes=True)
    assert real == _bytes_per_step(cfg, dpo=True)
    assert all(step == real[0][0] and step["regather"] > 0 for device in real for step in device)


def test_one_pass_is_the_shortest_repeated_prefix():
    assert one_pass([1, 2, 3, 1, 2, 3]) == [1, 2, 3]
    assert one_pass([1, 2, 3, 1]) == [1, 2, 3, 1]           # a table used again as the head: one pass
    assert one_pass([1, 2, 1, 1, 2, 1]) == [1, 2, 1]
    assert one_pass([4, 4, 4]) == [4]
    assert one_pass([]) == []
