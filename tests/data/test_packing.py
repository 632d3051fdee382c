"""Packed documents: EOS between them, labels -100 at document ends and on untrained tokens,
and a block-diagonal causal mask — the packed loss equals the documents run one by one, on one
device and with the sequence split over context parallelism."""

import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp.data import DataLoader, shard_batch
from functional_pp.models import llama
from functional_pp.step.train import DEFAULT_BATCH_DIMS

CFG = llama.Config.tiny(vocab=64)
DIMS = {**DEFAULT_BATCH_DIMS, "segments": "batch seq"}


def _loss_sum(params, batch, mesh=None, rules=None, processes=False):
    """Summed token NLL (loss x valid labels) of ``batch`` on ``mesh`` (one device if None)."""
    mesh = mesh or fpp.Mesh()
    rules = rules or llama.default_rules()
    n_valid = int((batch["labels"] != -100).sum())

    def device():
        cp = fpp.current_mesh().shape["cp"]
        i = fpp.device_coords()["cp"]
        local = shard_batch(batch, cp_rank=i, cp_size=cp) if cp > 1 else batch
        with fpp.use_rules(rules):
            p = fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=3)
            named = {k: fpp.wrap(v, DIMS[k]) for k, v in local.items() if k != "positions"}
            from functional_pp.parallel.named import settle
            return float(settle(llama.loss(p, named, CFG)).data)
    if processes:
        return fpp.launch(device, mesh, processes=True, timeout=240)[0] * n_valid
    return fpp.launch(device, mesh)[0] * n_valid


def test_loader_marks_documents_and_untrained_tokens():
    eos = 9
    tokens = np.array([1, 2, 3, eos, 4, 5, eos, 6, 7, 8, eos, 1, 2], dtype=np.int64)
    trained = np.array([1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=np.uint8)
    loader = DataLoader(tokens, global_batch_size=1, seq_len=12, eos_id=eos, trained=trained)
    b = loader.global_batch(0)
    assert b["tokens"][0].tolist() == tokens[:12].tolist()
    assert b["labels"][0].tolist() == [2, 3, eos, -100, -100, eos, -100, 7, 8, eos, -100, 2]
    assert b["segments"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
    part = loader.__class__(tokens, global_batch_size=1, seq_len=12, eos_id=eos, trained=trained,
                            cp_size=2, cp_rank=1).batch(0)
    assert part["segments"].tolist() == shard_batch(b, cp_size=2, cp_rank=1)["segments"].tolist()


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_loss_equals_the_documents_one_by_one(cp):
    eos = 0
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (n,), generator=g) for n in (5, 9, 6)]   # 3 documents, 20 + 3 EOS
    stream = torch.cat([torch.cat([d, torch.tensor([eos])]) for d in docs] + [torch.tensor([eos, 5])])
    packed = DataLoader(stream.numpy(), global_batch_size=1, seq_len=24, eos_id=eos).global_batch(0)
    assert packed["segments"][0, -1] == 3 and packed["labels"][0, -1] == -100
    mesh = fpp.Mesh(cp=cp)
    rules = llama.default_rules(tp=False, fsdp=False)
    total = _loss_sum(None, packed, mesh, rules)
    alone = 0.0
    for d in docs:                                          # each document with its EOS
        toks = torch.cat([d, torch.tensor([eos])])
        b = {"tokens": toks[None, :-1], "labels": toks[None, 1:],
             "positions": torch.arange(len(d))}
        alone += _loss_sum(None, b)
    assert total == pytest.approx(alone, rel=1e-5)
    no_mask = dict(packed)
    no_mask.pop("segments")
    assert abs(_loss_sum(None, no_mask, mesh, rules) - alone) > 1e-3   # the mask matters


@pytest.mark.multiprocess
def test_packed_context_parallel_attention_on_real_gloo_processes():
    """Under CP the segment ids (int64) are all-gathered with K/V: the same on gloo processes
    as on simulated devices."""
    eos = 0
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 64, (n,), generator=g) for n in (7, 10, 4)]
    stream = torch.cat([torch.cat([d, torch.tensor([eos])]) for d in docs] + [torch.tensor([eos, 3])])
    batch = DataLoader(stream.numpy(), global_batch_size=1, seq_len=24, eos_id=eos).global_batch(0)
    mesh = fpp.Mesh(cp=2, tp=2)
    rules = llama.default_rules(fsdp=False)
    simulated = _loss_sum(None, batch, mesh, rules)
    real = _loss_sum(None, batch, mesh, rules, processes=True)
    assert real == pytest.approx(simulated, rel=1e-6)
    assert real == pytest.approx(_loss_sum(None, batch), rel=1e-5)
