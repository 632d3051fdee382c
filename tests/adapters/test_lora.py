"""LoRA's pieces (functional_pp/adapters/lora.py): which weights are targeted (names, a regex,
all-linear), the options refused by name, rsLoRA's factor, the adapter's partial sum joined
with the base's before the one TP collective, merging equal to applying, and the dry-run's
bytes of a LoRA step (gradients and optimizer state of the adapters only)."""
import functools

import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters, plan
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.parallel import sharding

CFG = llama.Config.tiny()
DECLS = llama.init(CFG, torch.float64)
ALL = adapters.LoraConfig(r=4, alpha=8, target_linear=True)


def test_targets_by_name_regex_and_all_linear():
    by_name = adapters.targets(DECLS, adapters.LoraConfig(target_modules=("q_proj", "v_proj")))
    assert by_name == [f"layers.{i}.self_attn.{w}" for i in range(CFG.layers) for w in ("q_proj", "v_proj")]
    regex = adapters.targets(DECLS, adapters.LoraConfig(target_modules=r"layers\.1\..*_proj"))
    assert len(regex) == 7 and all(p.startswith("layers.1.") for p in regex)
    every = adapters.targets(DECLS, ALL)
    assert len(every) == 7 * CFG.layers and not any("embed" in p or "lm_head" in p for p in every)
    decls = adapters.init(DECLS, ALL)
    o = decls["layers"][0]["self_attn"]["lora"]["o_proj"]       # row-parallel: A over the contracted heads head_dim
    assert o["lora_A"].dims == ("heads", "head_dim", "lora_r") and o["lora_B"].dims == ("lora_r", "hidden")
    q = adapters.split(decls)[1]["layers.0.self_attn.q_proj"]
    assert q["lora_A"].dims == ("hidden", "lora_r") and q["lora_B"].dims == ("lora_r", "heads", "head_dim")


@pytest.mark.parametrize("kw, message", [
    (dict(target_modules=("qproj",)), "match no parameter of the model.*the model.s modules are named"),
    (dict(target_modules=("lm_head",)), "modules_to_save"),
    (dict(), "name the weights to adapt"),
    (dict(target_linear=True, r=0), "r \\(lora_r\\) must be an integer >= 1"),
])
def test_bad_options_are_refused_by_name(kw, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        adapters.targets(DECLS, adapters.LoraConfig(**kw))


def test_rslora_scale():
    assert adapters.LoraConfig(r=16, alpha=32, target_linear=True).scale == 2.0
    assert adapters.LoraConfig(r=16, alpha=32, target_linear=True, rslora=True).scale == 8.0


def _params(seed=0):
    """Whole parameters with adapters whose B is not zero."""
    decls = adapters.init(DECLS, ALL)
    g = torch.Generator().manual_seed(seed)
    flat = {p: (0.1 * torch.randn(x.data.shape, generator=g, dtype=x.data.dtype) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=seed))}
    return decls, map_with_path(lambda p, d: flat[p], decls)


def test_merged_weights_give_the_adapted_logits():
    decls, full = _params()
    toks = make_batch(CFG, batch=2, seq=8)["tokens"]
    with torch.no_grad():
        adapted = adapters.adapt(llama.forward, ALL)(sharding.named_tree(full, decls), fpp.wrap(toks, "batch seq"),
                                                     CFG).value()
        merged = llama.forward(sharding.named_tree(adapters.merge(full, ALL), DECLS), fpp.wrap(toks, "batch seq"),
                               CFG).value()
        plain = llama.forward(sharding.named_tree(adapters.split(full)[0], DECLS),
                              fpp.wrap(toks, "batch seq"), CFG).value()
    torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-12)
    assert (adapted - plain).abs().max() > 1e-3           # the adapters change the result


def test_one_tp_collective_per_row_parallel_projection():
    """Under TP the adapters add no all-reduce: each row-parallel projection's (o_proj, down_proj)
    adapter sum pends with the base's and both complete in one collective."""
    decls, full = _params()
    mesh, rules = fpp.Mesh(tp=2), llama.default_rules(fsdp=False)
    batch = make_batch(CFG, batch=2, seq=8)

    def device(with_lora):
        with fpp.use_rules(rules):
            tree = full if with_lora else adapters.split(full)[0]
            d = decls if with_lora else DECLS
            local = sharding.named_tree(sharding.shard(tree, d, mesh, rules, fpp.current_rank()), d)
            fn = adapters.adapt(llama.loss, ALL) if with_lora else llama.loss
            with fpp.comm_report() as rep, torch.no_grad():
                fn(local, {k: fpp.named(v, "batch seq") for k, v in batch.items()}, CFG).value()
        return [e for e in rep.events if e.axes == ("tp",) and e.kind == "all_reduce" and e.shape != ()]
    base = fpp.launch(lambda: device(False), mesh)[0]
    lora = fpp.launch(lambda: device(True), mesh)[0]
    assert len(lora) == len(base) >= 2 * CFG.layers
    assert sum(e.bytes_sent for e in lora) == sum(e.bytes_sent for e in base)


def test_dry_run_counts_gradients_and_state_of_the_adapters_only():
    cfg = llama.Config.tiny(layers=4)              # (run with 1 and 2 layers, the rest extrapolated)
    decls = adapters.init(llama.init(cfg), ALL)
    batch = {"tokens": ((4, 16), "batch seq"), "labels": ((4, 16), "batch seq")}
    loss = adapters.adapt(functools.partial(llama.loss, cfg=cfg), ALL)
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
    lora = plan.estimate(loss, decls, mesh, rules, batch, trainable=adapters.trainable(ALL))
    full = plan.estimate(loss, decls, mesh, rules, batch)
    assert lora.param_bytes == full.param_bytes
    trained = sum(4 * x.data.numel() for p, x in fpp.leaves_with_paths(
        fpp.init(lambda: adapters.split(decls)[1], seed=0)))
    # weights (all) + gradients (the adapters', sharded by 2 where their hidden is) + AdamW moments
    assert lora.state_bytes < full.state_bytes - lora.param_bytes
    assert lora.state_bytes - lora.param_bytes <= 3 * trained + 64
    lora_comm = sum(e.bytes_sent for e in lora.comm.events if e.backward and e.kind in ("reduce_scatter", "all_reduce"))
    full_comm = sum(e.bytes_sent for e in full.comm.events if e.backward and e.kind in ("reduce_scatter", "all_reduce"))
    assert 0 < lora_comm < full_comm / 5

