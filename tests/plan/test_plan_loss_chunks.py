"""Loss chunking as a memory lever of the search (issue 44 item 1): the LM head and cross-entropy
over token chunks costs the same FLOPs plus the head's fp32 gradient accumulator's traffic, and
where only a chunked layout fits, the exhaustive search and the beam find it. Oracle: the same
search without the lever, which finds nothing within the limit."""
from __future__ import annotations

import dataclasses
import functools

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama

# a big vocabulary for the hidden size: the logits decide the peak
CFG = llama.Config.tiny(vocab=16384)
BATCH = {"tokens": ((8, 256), "batch seq"), "labels": ((8, 256), "batch seq")}
# 2 devices, data parallel or FSDP, with or without whole-layer checkpointing
SPACE = dict(max_axis={"cp": 1, "tp": 1}, remat=(False, True), sequence_parallel=(False,),
             regather_activations=(False,), keep_gathered=(False,), precision="bf16")


def _loss_for(chunks):
    return functools.partial(llama.loss, cfg=dataclasses.replace(CFG, loss_chunks=chunks))


def _search(space, **kw):
    return plan.search(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), 2, BATCH, cluster="h100x8",
                       space=space, **kw)


def test_chunked_loss_costs_the_same_flops_and_the_accumulator_traffic():
    args = (llama.init(CFG), fpp.Mesh(dp_shard=2), plan.standard_rules(("dp_shard",)), BATCH)
    whole = plan.estimate(functools.partial(llama.loss, cfg=CFG), *args, precision="bf16")
    two, eight = (plan.estimate(_loss_for(n), *args, precision="bf16") for n in (2, 8))
    for e in (two, eight):    # the same three products of the head (each chunk's dx into its slice too)
        assert sum(e.runs[0].flops.values()) == pytest.approx(sum(whole.runs[0].flops.values()), rel=1e-12)
    # the logits' traffic is the same in any number of chunks; each chunk more reads and writes the
    # head's fp32 gradient accumulator (vocab x hidden x 4 bytes) at least once more
    accumulator = CFG.vocab * CFG.hidden * 4
    assert sum(eight.runs[0].traffic.values()) - sum(two.runs[0].traffic.values()) >= (8 - 2) * 2 * accumulator
    assert plan.cost(eight, "h100x8").step_s > plan.cost(two, "h100x8").step_s
    assert eight.peak_bytes < two.peak_bytes < whole.peak_bytes


def test_only_a_chunked_layout_fits_and_the_search_and_the_beam_find_it():
    lever = plan.Space(**SPACE, loss_chunks=(None, 8))
    everything = _search(lever, loss_for=_loss_for, strategy=plan.exhaustive)
    whole = [e for e in everything if "loss_chunks" not in e.settings]
    chunked = [e for e in everything if e.settings.get("loss_chunks") == 8]
    assert whole and chunked and len(whole) == len(chunked)
    limit = min(e.reserved_bytes for e in whole) - 1        # no layout with the whole logits fits
    assert any(e.reserved_bytes <= limit for e in chunked)
    best = min((e for e in chunked if e.reserved_bytes <= limit), key=lambda e: e.time.step_s)
    assert not _search(plan.Space(**SPACE), memory_limit_bytes=limit).fitting()    # without the lever: nothing
    for strategy in (plan.exhaustive, plan.beam(1), plan.beam(2)):
        ranking = _search(lever, loss_for=_loss_for, memory_limit_bytes=limit, strategy=strategy)
        chosen = ranking.fitting()[0]
        assert chosen.settings["loss_chunks"] == 8 and "loss_chunks=8" in chosen.describe()
        assert (chosen.describe(), chosen.time.step_s) == (best.describe(), best.time.step_s)
    beamed = _search(lever, loss_for=_loss_for, strategy=plan.beam(1))      # the whole logits fit: not expanded
    assert len(beamed) < len(everything)


def test_the_lever_needs_a_loss_for_each_chunk_count():
    with pytest.raises(ValueError, match=r"loss_chunks searches \[8\].*pass loss_for"):
        _search(plan.Space(**SPACE, loss_chunks=(None, 8)))
    with pytest.raises(ValueError, match=r"loss_chunks holds \[0\]"):
        _search(plan.Space(**SPACE, loss_chunks=(None, 0)), loss_for=_loss_for)


def test_the_beam_does_not_skip_less_chunking_with_more_recomputation():
    """The expansion's pruning: a fitting chunked variant does not stand for one with the whole
    logits and more recomputation (it may be faster), so that one is still evaluated."""
    from types import SimpleNamespace

    from functional_pp.plan.search import Candidate
    mesh, rules = fpp.Mesh(dp_shard=2), plan.standard_rules(("dp_shard",))
    # (remat, loss_chunks) -> (fits, step seconds): here chunking costs more than recomputation
    table = {(False, None): (False, 1.0), (False, 8): (True, 1.5), (True, None): (True, 1.2), (True, 8): (True, 1.7)}
    cands = [Candidate(mesh, rules, "fsdp", remat=r, loss_chunks=k) for r, k in table]

    def evaluate(c):
        fits, seconds = table[(c.remat, c.loss_chunks)]
        return SimpleNamespace(settings={"fits": fits}, time=SimpleNamespace(step_s=seconds), candidate=c)
    found = plan.beam(1)(cands, evaluate)
    best = min((e for e in found if e.settings["fits"]), key=lambda e: e.time.step_s)
    assert (best.candidate.remat, best.candidate.loss_chunks) == (True, None)
