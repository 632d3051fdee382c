"""Layout planning on meta tensors counts exactly what a real step sends."""
import functools

import pytest

import torch

import functional_pp as fpp
from functional_pp import plan
from functional_pp.layout import local_shape
from functional_pp.models import llama

from harness import make_batch, parallel

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 16), "batch seq"), "labels": ((8, 16), "batch seq")}


def test_estimate_matches_a_real_run_byte_for_byte():
    mesh, rules = fpp.Mesh(dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True)
    est = plan.estimate(LOSS, llama.init(CFG, torch.float64), mesh, rules, BATCH)
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    real = parallel(CFG, full, make_batch(CFG, batch=8, seq=16), mesh, rules, gather=False)[0][2]
    assert est.comm.by_axis() == real.by_axis()
    decls = llama.init(CFG, torch.float64)
    n_local = sum(torch.Size(local_shape(d.shape, rules.resolve(d.axes, d.shape, mesh), mesh)).numel()
                  for _, d in fpp.leaves_with_paths(decls))
    assert est.param_bytes == 8 * n_local and est.state_bytes == 16 * n_local
    assert est.activation_bytes > 0


def test_fsdp_memory_and_activation_scaling():
    decls = llama.init(CFG, torch.float32)
    one = plan.estimate(LOSS, decls, fpp.Mesh(), fpp.Rules(), BATCH)
    fsdp = plan.estimate(LOSS, decls, fpp.Mesh(dp_shard=4), fpp.Rules(batch="dp_shard", hidden="dp_shard"), BATCH)
    assert one.state_bytes == 16 * fpp.count_params(decls)            # ZeRO: 16 bytes per fp32 parameter
    assert fsdp.state_bytes == one.state_bytes // 4                   # FSDP over 4 divides it by 4
    assert fsdp.activation_bytes < one.activation_bytes / 2           # a quarter of the batch per device
    assert one.comm_bytes == 0


@pytest.mark.slow
def test_search_ranks_layouts_and_explains_the_impossible_ones():
    res = plan.search(LOSS, llama.init(CFG), 8, BATCH, rules_for=lambda m: llama.default_rules(),
                      bandwidth={"tp": 400e9, "cp": 50e9, "dp_shard": 50e9, "dp_replicate": 25e9})
    assert len(res) >= 10
    times = [e.comm_time_s for e in res]
    assert times == sorted(times)
    assert any("kv_heads" in n and "tp=8" in n for n in res[0].notes)   # kv_heads=2 cannot split 8 ways
    assert "comm GB" in plan.table(res) and "tp=2" in plan.table(res)
    memories = sorted(e.memory_bytes for e in res)
    limit = memories[len(memories) // 2]
    limited = plan.search(LOSS, llama.init(CFG), 8, BATCH, rules_for=lambda m: llama.default_rules(),
                          meshes=[e.mesh for e in res], memory_limit_bytes=limit)
    fits = [e.memory_bytes <= limit for e in limited]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)   # layouts that fit come first
