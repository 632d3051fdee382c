"""A rollout's sampling (functional_pp/preference/rollout.py ``sample_completions``) in one
left-padded ``generate`` call for prompts of every length: each row's completion is the one it
gets in any other batching (one call per row, calls bounded by ``max_call_tokens``, rows padded
to ``row_multiple``, another pad token), greedy and sampled with its own seed; a simulated dp_shard=2 draws one
device's completions; ``call_rows`` packs the shortest prompts first within the budget."""
from __future__ import annotations

import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.preference import rollout
from functional_pp.preference.rollout import call_rows, sample_completions

CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64)
PROMPTS = [[5, 9, 17, 3, 40], [11, 2], [30, 31, 7, 12, 8, 60, 1], [44], [20, 21, 22]]   # 5 lengths
G, NEW = 3, 6


@pytest.fixture(scope="module")
def params():
    with torch.no_grad():
        return fpp.init(llama.init, CFG, torch.float32, seed=0)


def _sample(params, monkeypatch=None, **kw):
    """``(completions, truncated, the generate calls' prompt shapes)``."""
    shapes = []
    generate = rollout.generate

    def counted(*args, **kwargs):
        shapes.append(tuple(args[2].shape))
        return generate(*args, **kwargs)
    monkeypatch.setattr(rollout, "generate", counted)
    args = dict(num_generations=G, max_completion_length=NEW, stop_ids=[17], pad_id=0, temperature=1.0, top_k=20,
                key=5, step=3)
    out, cut = sample_completions(functools.partial(llama.forward, cfg=CFG), params, PROMPTS, **{**args, **kw})
    monkeypatch.setattr(rollout, "generate", generate)
    return out, cut, shapes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_call_samples_what_each_row_alone_does(params, monkeypatch, temperature):
    one, cut, shapes = _sample(params, monkeypatch, temperature=temperature)
    assert shapes == [(len(PROMPTS) * G, 7)]                              # one call, left-padded to the longest
    alone, alone_cut, alone_shapes = _sample(params, monkeypatch, temperature=temperature, max_call_tokens=1)
    assert len(alone_shapes) == len(PROMPTS) * G and {b for b, _ in alone_shapes} == {1}
    assert one == alone and cut == alone_cut
    assert all(c == one[i // G * G] for i, c in enumerate(one)) == (temperature == 0)  # sampled: a group differs
    assert any(cut) and not all(cut)                                       # some stop at 17, some are cut


def test_row_multiple_and_bounded_calls_change_no_completion(params, monkeypatch):
    one, cut, _ = _sample(params, monkeypatch)
    padded, padded_cut, shapes = _sample(params, monkeypatch, row_multiple=4)
    assert shapes == [(16, 7)] and (padded, padded_cut) == (one, cut)
    bounded, bounded_cut, shapes = _sample(params, monkeypatch, row_multiple=4, max_call_tokens=8 * (5 + NEW))
    assert len(shapes) > 1 and all(b % 4 == 0 and b * (t + NEW) <= 8 * (5 + NEW) for b, t in shapes)
    assert (bounded, bounded_cut) == (one, cut)
    assert _sample(params, monkeypatch, pad_id=63)[:2] == (one, cut)        # the padding's token: never seen
    other, _, _ = _sample(params, monkeypatch, step=4)
    assert other != one                                                     # the seeds are the step's


def _device_sample(params):
    from functional_pp.core.runtime import current_context
    from functional_pp.core.tree import tree_map
    from functional_pp.parallel import sharding
    rules = llama.default_rules()
    with fpp.use_rules(rules):
        decls = llama.init(CFG, torch.float32)
        whole = tree_map(lambda x: x.value(), params)
        local = sharding.named_tree(sharding.shard(whole, decls, current_context().mesh, rules, fpp.current_rank()),
                                    decls)
        return sample_completions(functools.partial(llama.forward, cfg=CFG), local, PROMPTS, num_generations=G,
                                  max_completion_length=NEW, stop_ids=[17], pad_id=0, temperature=1.0, top_k=20,
                                  key=5, step=3, row_multiple=2)


def test_dp_shard_2_samples_one_devices_completions(params, monkeypatch):
    want = _sample(params, monkeypatch)[:2]
    for got in fpp.launch(functools.partial(_device_sample, params), fpp.Mesh(dp_shard=2)):
        assert got == want


def test_call_rows_packs_the_shortest_prompts_first_within_the_budget():
    lengths = [5, 2, 9, 2, 4]
    assert call_rows(lengths, 3) == [[0, 1, 2, 3, 4]]
    assert call_rows(lengths, 3, max_call_tokens=3 * (4 + 3)) == [[1, 3, 4], [0], [2]]
    assert call_rows(lengths, 3, row_multiple=2, max_call_tokens=2 * (5 + 3)) == [[1, 3], [4, 0], [2]]
    assert call_rows([], 3) == []
