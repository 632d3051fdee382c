"""A mixture of experts with a static capacity per expert (``capacity_factor``) and the router
z-loss, in every layout and in the step: EP (borrowed from the batch's axis, on an ``ep`` axis
x FSDP, on an axis the batch does not use, x TP) equals one device in loss and every gradient
with assignments dropped; the step's metrics carry the routing (tokens per expert, balance,
drops, the z-loss) equal on every layout and read with no extra host read; a compiled step
(aot_eager) equals the eager one; the dry-run counts the slots' all-to-all bytes; the sequence
split over cp is refused by name."""
import functools

import pytest
import torch
from harness import make_batch, parallel, single_device
from host_reads import HostReads, transfers  # noqa: F401 (a fixture)

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.core.layout import Rules, balanced, inherit
from functional_pp.models import llama, moe
from functional_pp.parallel import sharding

CFG = llama.Config.tiny(model_type="qwen3_moe", qk_norm=True, experts=4, experts_top_k=2, moe_mlp=32,
                        norm_topk_prob=True, router_aux_loss_coef=0.1, router_z_loss_coef=0.01,
                        capacity_factor=1.0)
TP = dict(heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
LAYOUTS = {
    "ep_borrows_dp_shard": (fpp.Mesh(dp_shard=2), Rules(batch="dp_shard", experts="dp_shard")),
    "ep_axis_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")),
    "ep_replicated_batch_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch="dp_shard", experts="ep", hidden="dp_shard")),
    "ep_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", **TP)),
}
MOE_KEYS = ("moe_tokens_per_expert", "moe_load_balance", "moe_dropped", "moe_aux_loss", "moe_z_loss")


@pytest.fixture(scope="module")
def oracle():
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    return full, batch, single_device(CFG, full, batch)


def _stats(full, batch, cfg=CFG):
    """One device's loss and every layer's router statistics."""
    named = sharding.named_tree(full, llama.init(cfg, torch.float64))
    with moe.collect() as stats:
        loss = llama.loss(named, {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}, cfg).value()
    return loss, stats


def test_drops_happen_and_the_z_loss_is_in_the_loss(oracle):
    full, batch, (loss0, _) = oracle
    loss, stats = _stats(full, batch)
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    assert sum(s.dropped.value().item() for s in stats) > 0                # the capacity binds
    no_z, _ = _stats(full, batch, llama.Config(**{**vars(CFG), "router_z_loss_coef": 0.0}))
    torch.testing.assert_close(loss - no_z, 0.01 * moe.z_loss(stats).value(), rtol=1e-9, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_device(oracle, layout):
    full, batch, (loss0, grads0) = oracle
    mesh, rules = LAYOUTS[layout]
    for rank, (loss, grads, _) in enumerate(parallel(CFG, full, batch, mesh, rules)):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-9 * g0.abs().max().item(),
                                       msg=lambda m: f"{layout} rank {rank} {p}: {m}")


def _steps(mesh, rules, data, cfg=CFG, **kw):
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(3e-3), mesh=mesh, rules=rules, **kw)

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float64, mesh=mesh, rules=rules, seed=0))
        out = []
        for b in data:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
            state, m = step(state, local)
            out.append(dict(m))
        return out
    return fpp.launch(device, mesh)


def test_step_metrics_carry_the_routing(oracle):
    """The metrics of a step equal the statistics of its forward (global: every device's
    tokens), the same on every device of an EP layout."""
    full, batch, _ = oracle
    _, stats = _stats(fpp.init_params(llama.init(CFG, torch.float64), seed=0), batch)
    (one,), = _steps(fpp.Mesh(), Rules(), [batch])
    counts = torch.stack([s.tokens_per_expert() for s in stats])
    assert one["moe_tokens_per_expert"] == counts.sum(0).tolist()
    assert sum(one["moe_tokens_per_expert"]) == 4 * 8 * 2 * CFG.layers
    assert one["moe_dropped"] == sum(s.dropped.value().item() for s in stats) > 0
    assert one["moe_load_balance"] == pytest.approx((counts.max(1).values / counts.mean(1)).max().item())
    assert one["moe_z_loss"] == pytest.approx(moe.z_loss(stats).value().item(), rel=1e-12)
    assert one["moe_aux_loss"] == pytest.approx(moe.aux_loss(stats).value().item(), rel=1e-12)
    mesh, rules = LAYOUTS["ep_axis_x_fsdp"]
    for (m,) in _steps(mesh, rules, [batch]):
        for k in MOE_KEYS:
            assert m[k] == pytest.approx(one[k], rel=1e-9), k
    (accum,), = _steps(fpp.Mesh(), Rules(), [batch], grad_accum=2)       # micro-batches: counts summed
    assert sum(accum["moe_tokens_per_expert"]) == sum(one["moe_tokens_per_expert"])
    assert accum["moe_dropped"] > 0 and accum["moe_z_loss"] == pytest.approx(one["moe_z_loss"], rel=1e-9)   # (equal halves)


def test_deferred_metrics_read_nothing(oracle, transfers):  # noqa: F811 (the fixture)
    """With a capacity the routing has static shapes: a deferred-metrics step reads nothing
    from the device, the MoE metrics included, until its metrics are read."""
    _, batch, _ = oracle
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(3e-3), metrics="deferred")
    state = step.init(fpp.init(llama.init, CFG, torch.float64, seed=0))
    state, _ = step(state, batch)
    step.read()
    del transfers[:]
    with HostReads() as reads:
        state, m = step(state, batch)
    assert reads.reads == [] and transfers == [] and m.pending
    assert sum(m["moe_tokens_per_expert"]) == 4 * 8 * 2 * CFG.layers and transfers == ["tolist"]


@pytest.fixture
def fresh_dynamo():
    """The compiled steps' graphs dropped afterwards (dynamo allows few per code object)."""
    yield
    torch._dynamo.reset()


def test_compiled_step_equals_eager(oracle, fresh_dynamo):
    """Static shapes compile: two aot_eager steps on EP x 2 (one graph for both devices) equal
    the eager steps, drops, z-loss and all (a one-layer model: compiling takes a while)."""
    _, batch, _ = oracle
    mesh, rules = LAYOUTS["ep_borrows_dp_shard"]
    cfg = llama.Config(**{**vars(CFG), "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "moe_mlp": 16})
    data = [batch, make_batch(CFG, batch=4, seq=8, seed=2)]
    eager = _steps(mesh, rules, data, cfg)
    compiled = _steps(mesh, rules, data, cfg, compile="aot_eager")
    assert eager[0][0]["moe_dropped"] > 0
    for a, b in zip(compiled, eager):
        for ma, mb in zip(a, b):
            for k in ("loss", "grad_norm", *MOE_KEYS):
                assert ma[k] == pytest.approx(mb[k], rel=1e-9, abs=1e-12), k


def test_a_split_sequence_is_refused_by_name(oracle):
    full, batch, _ = oracle
    rules = Rules(batch="dp_shard", seq=balanced("cp"), res_seq=inherit("seq"), experts="dp_shard")
    with pytest.raises(Exception, match=r"capacity_factor .* 'seq' is split over \('cp',\); route dropless"):
        parallel(CFG, full, batch, fpp.Mesh(dp_shard=2, cp=2), rules)


def test_dry_run_counts_the_slots():
    """On meta tensors (plan.estimate) the capacity path runs as it does on data: each MoE
    layer's dispatch and combine, forward and backward, send R x E x capacity x hidden x bytes x
    (ep-1)/ep (the slots for the other devices' experts), whatever the routing."""
    from functional_pp import plan
    from functional_pp.ops.experts import capacity
    cfg = llama.Config(**{**vars(CFG), "capacity_factor": 1.5})
    mesh, rules = LAYOUTS["ep_axis_x_fsdp"]
    batch, seq = 8, 16
    shape = {"tokens": ((batch, seq), "batch seq"), "labels": ((batch, seq), "batch seq")}
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), mesh, rules, shape)
    rows = batch // 4                                          # sequences per device: batch over dp_shard x ep
    slots = rows * cfg.experts * capacity(seq, cfg.experts_top_k, cfg.experts, 1.5)
    formula = slots * cfg.hidden * 4 * (2 - 1) // 2
    moved = [e.bytes_sent for e in est.comm.events if e.kind == "all_to_all" and e.dtype == "float32"]
    assert moved == [formula] * 4 * cfg.layers and slots == 2 * 4 * 12
