"""``data.batch_shard``: each device's block of a global batch, from the mesh and the rules,
equals the block the named value takes by its layout (docs/data.md, "Each device's batch")."""
import pytest
import torch

import functional_pp as fpp
from functional_pp.data import DataLoader, batch_shard
from functional_pp.models import llama

CASES = [
    (fpp.Mesh(dp_shard=2, cp=2), llama.default_rules()),                     # seq balanced over cp
    (fpp.Mesh(dp_replicate=2, dp_shard=2, tp=2), llama.default_rules()),     # HSDP rows, tp idle
    (fpp.Mesh(dp_shard=2, cp=2), fpp.Rules(batch="dp_shard", seq="cp")),    # contiguous seq
    (fpp.Mesh(cp=2, tp=2), fpp.Rules(batch=(), seq=("cp", "tp"))),           # seq over 2 axes
]


@pytest.mark.parametrize("mesh,rules", CASES)
def test_cut_equals_the_layouts_block_on_every_device(mesh, rules):
    full = {"tokens": torch.arange(4 * 16).reshape(4, 16), "labels": -torch.arange(4 * 16).reshape(4, 16)}

    def device():
        shard = batch_shard(mesh, rules)
        with fpp.use_rules(rules):
            expected = {k: fpp.named(v, "batch seq").data for k, v in full.items()}
        got = shard.cut(full)
        return all(torch.equal(got[k], expected[k]) for k in full), shard
    results = fpp.launch(device, mesh)
    assert all(ok for ok, _ in results)
    shards = [s for _, s in results]
    assert shards == [batch_shard(mesh, rules, rank=r) for r in range(mesh.size)]
    blocks = {(s.dp_rank, s.cp_rank) for s in shards}
    assert len(blocks) == shards[0].dp_size * shards[0].cp_size      # every block is read


def test_loader_args_drive_the_loader_to_the_same_block():
    mesh, rules = fpp.Mesh(dp_shard=2, cp=2), llama.default_rules()
    tokens = torch.arange(2000) % 97
    full = next(DataLoader(tokens, global_batch_size=4, seq_len=16, seed=3))
    for rank in range(mesh.size):
        shard = batch_shard(mesh, rules, rank=rank)
        local = next(DataLoader(tokens, global_batch_size=4, seq_len=16, seed=3, **shard.loader_args()))
        cut = shard.cut(full)
        assert all(torch.equal(local[k], cut[k]) for k in cut)


def test_a_rank_outside_the_mesh_is_named():
    with pytest.raises(ValueError, match=r"rank 4 is not a device of the mesh .* \(ranks 0..3\)"):
        batch_shard(fpp.Mesh(dp_shard=2, cp=2), llama.default_rules(), rank=4)
