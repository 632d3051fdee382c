"""The dry run of a generation (functional_pp/plan/generation.py): on one device and per device
under FSDP x TP, the meta run's peak equals the same forwards run on real tensors (the memory
tracker's accounting of real storages) to within 1 KiB (small index and position tensors), its
cache holds exactly ``cache_bytes`` of prompt + new tokens, and a real eager ``generate`` call's
measured peak lies within 15% below the estimate (its cache grows to one position fewer and
is never preallocated)."""
from __future__ import annotations

import functools

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.core.runtime import current_context
from functional_pp.models import llama
from functional_pp.models.kv_cache import cache_bytes
from functional_pp.models.sampling import generate
from functional_pp.parallel import sharding
from functional_pp.parallel.reshard import named
from functional_pp.plan.generation import estimate_generation, generation_forwards
from functional_pp.plan.tracker import MemoryTracker

CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=64)
FORWARD = functools.partial(llama.forward, cfg=CFG)
BATCH, PROMPT, NEW = 4, 8, 8
PROMPTS = torch.randint(1, 64, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))


def _measured(params) -> tuple[int, int, int]:
    """(peak of the dry run's forwards, their cache's bytes, peak of a whole eager generate) on
    real tensors of this device."""
    leaves = [x.data for x in optree.tree_leaves(params)]
    weights = sum(t.numel() * t.element_size() for t in leaves)
    forwards = MemoryTracker({"weights": weights}, leaves, timeline=False)
    with forwards:
        cache = generation_forwards(FORWARD, params, named(PROMPTS, "batch seq"), NEW)
    whole = MemoryTracker({"weights": weights}, leaves, timeline=False)
    with whole:
        generate(FORWARD, params, PROMPTS, max_new_tokens=NEW)
    return forwards.run.peak_bytes, cache.nbytes(), whole.run.peak_bytes


def _on_device(full, rules):
    decls = llama.init(CFG, torch.float32)
    with fpp.use_rules(rules):
        local = sharding.shard(full, decls, current_context().mesh, rules, fpp.current_rank())
        return _measured(sharding.named_tree(local, decls))


def _check(est, measured, batch_split=1, kv_heads_split=1):
    forwards, held, whole = measured
    assert est.cache_bytes == held == cache_bytes(CFG, BATCH, PROMPT + NEW, batch_split=batch_split,
                                                  kv_heads_split=kv_heads_split) > 0
    assert abs(est.peak_bytes - forwards) <= 1024, (est.peak_bytes, forwards)
    assert 0.85 * est.peak_bytes <= whole <= est.peak_bytes, (whole, est.peak_bytes)
    assert est.forward_bytes > 0 and est.peak_bytes == est.param_bytes + est.cache_bytes + est.forward_bytes


@pytest.fixture(scope="module")
def full():
    return fpp.init_params(llama.init(CFG, torch.float32), seed=0)


def test_one_device_estimate_equals_the_measured_generation(full):
    decls = llama.init(CFG, torch.float32)
    est = estimate_generation(FORWARD, decls, fpp.Mesh(), fpp.Rules(), batch=BATCH, prompt=PROMPT, new_tokens=NEW)
    assert est.param_bytes == sum(t.numel() * 4 for t in optree.tree_leaves(full))
    _check(est, _measured(sharding.named_tree(full, decls)))


def test_fsdp_tp_estimate_equals_each_devices_measured_generation(full):
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()
    est = estimate_generation(FORWARD, llama.init(CFG, torch.float32), mesh, rules, batch=BATCH, prompt=PROMPT,
                              new_tokens=NEW)
    one = estimate_generation(FORWARD, llama.init(CFG, torch.float32), fpp.Mesh(), fpp.Rules(), batch=BATCH,
                              prompt=PROMPT, new_tokens=NEW)
    assert est.cache_bytes * 4 == one.cache_bytes and est.param_bytes < one.param_bytes
    for measured in fpp.launch(functools.partial(_on_device, full, rules), mesh):
        _check(est, measured, batch_split=2, kv_heads_split=2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="new_tokens must be >= 1"):
        estimate_generation(FORWARD, llama.init(CFG, torch.float32), fpp.Mesh(), fpp.Rules(), batch=1, prompt=4,
                            new_tokens=0)


def test_bf16_estimate_equals_the_measured_forwards():
    """In bf16 the meta forwards hold what real ones hold (to 1 KiB): the cache's attention (a
    mask over the cached keys) runs flash-like on meta as on the CPU, its boolean mask made the
    additive one, not the math kernel's fp32 scores and widened q, k, v (2.9x the real
    temporaries of the rollout test's model before)."""
    decls = llama.init(CFG, torch.bfloat16)
    params = sharding.named_tree(fpp.init_params(decls, seed=0), decls)
    est = estimate_generation(FORWARD, decls, fpp.Mesh(), fpp.Rules(), batch=BATCH, prompt=PROMPT, new_tokens=NEW)
    forwards, held, _ = _measured(params)
    assert est.cache_bytes == held == cache_bytes(CFG, BATCH, PROMPT + NEW, torch.bfloat16)
    assert abs(est.peak_bytes - forwards) <= 1024, (est.peak_bytes, forwards)


def test_eager_estimate_is_a_measured_eager_generate(full):
    """``compiled=False`` models an eager ``generate`` (a rollout's): its cache is the prompt +
    new tokens - 1 positions the real call's holds, and the real call's peak is the estimate's
    to within the host's sampling tensors (above) and 5% (below); the
    static cache's estimate of the same call is higher than that."""
    decls = llama.init(CFG, torch.float32)
    params = sharding.named_tree(full, decls)
    est = estimate_generation(FORWARD, decls, fpp.Mesh(), fpp.Rules(), batch=BATCH, prompt=PROMPT, new_tokens=NEW,
                              compiled=False)
    leaves = [x.data for x in optree.tree_leaves(params)]
    forwards = MemoryTracker({"weights": est.param_bytes}, leaves, timeline=False)
    with forwards:
        cache = generation_forwards(FORWARD, params, named(PROMPTS, "batch seq"), NEW, compiled=False)
    _, _, whole = _measured(params)
    assert est.cache_bytes == cache.nbytes() == cache_bytes(CFG, BATCH, PROMPT + NEW - 1) > 0
    assert abs(est.peak_bytes - forwards.run.peak_bytes) <= 1024
    host = BATCH * (2 * CFG.vocab * 4 + 9)        # the sampling's float32 logits and probabilities, ids, flags
    assert 0.95 * est.peak_bytes <= whole <= est.peak_bytes + host, (whole, est.peak_bytes)
    static = estimate_generation(FORWARD, decls, fpp.Mesh(), fpp.Rules(), batch=BATCH, prompt=PROMPT, new_tokens=NEW)
    assert static.peak_bytes > est.peak_bytes
