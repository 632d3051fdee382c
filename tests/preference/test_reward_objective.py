"""Reward-model objectives (preference/reward.py) on our decoder with a score head equal TRL's
``RewardTrainer.compute_loss`` (its own code) on transformers' Qwen2ForSequenceClassification
and transformers' Qwen3ForTokenClassification loss (a PRM's) with the same weights: loss, logged
metrics and gradients; dp / FSDP x TP / cp equal one device (simulated) and on gloo processes."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from harness import parallel, single_device

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import step_values
from functional_pp.core.runtime import current_context
from functional_pp.core.tree import leaves_with_paths, tree_map
from functional_pp.data.reward_data import last_token_mask
from functional_pp.models import llama, score_head
from functional_pp.parallel import sharding
from functional_pp.preference.reward import RewardSpec, process_reward_loss, reward_loss

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
B, S = 4, 12


def _scaled(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    seq = _scaled(transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**KW, num_labels=1)), 0)
    tok = _scaled(transformers.Qwen3ForTokenClassification(
        transformers.Qwen3Config(**KW, head_dim=8, num_labels=2, classifier_dropout=0.0)), 1)
    out = {}
    for name, m in (("seq", seq), ("tok", tok)):
        m.save_pretrained(root / name)
        m.config._attn_implementation = "eager"
        cfg, params = hf.load_hf_llama(root / name)
        out[name] = (m, cfg, params)
    return out


def _pairs(seed=0, margin=False):
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side in ("chosen", "rejected"):
        toks = torch.randint(1, KW["vocab_size"], (B, S), generator=g)
        for i in range(B):
            toks[i, int(torch.randint(3, S + 1, (), generator=g)):] = 0
        batch[f"{side}_tokens"] = toks
        batch[f"{side}_last"] = torch.from_numpy(last_token_mask(toks.numpy(), 0))
    m = torch.randn(B, generator=g) if margin else torch.zeros(B)
    batch["margin"] = m[:, None].expand(B, S).contiguous()
    batch["pair_weight"] = torch.ones(B, S)
    return batch


def _trl_reward(model, batch, coefficient, margin):
    """TRL 1.16 ``RewardTrainer.compute_loss`` itself, on a stand-in trainer (one process)."""
    ids = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    if margin:
        inputs["margin"] = batch["margin"][:, 0]
    ident = types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    fake = types.SimpleNamespace(model=model, args=types.SimpleNamespace(center_rewards_coefficient=coefficient),
                                 accelerator=ident, _total_train_tokens=0, _tp_size=1,
                                 _metrics={"train": __import__("collections").defaultdict(list)})
    model.train()
    loss = trl.RewardTrainer.compute_loss(fake, model, inputs)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


def _reward_fn(spec):
    return lambda p, b, cfg: reward_loss(spec, functools.partial(score_head.sequence_scores, cfg=cfg))(p, b)


def _prm_fn(p, b, cfg):
    return process_reward_loss(functools.partial(score_head.token_scores, cfg=cfg))(p, b)


def _hf_grad(model, name):
    return dict(model.named_parameters())[name].grad


@pytest.mark.parametrize("coefficient,margin", [(None, False), (0.01, True)])
def test_bradley_terry_equals_trl_reward_trainer(models, coefficient, margin):
    model, cfg, params = models["seq"]
    batch = _pairs(1, margin)
    model.zero_grad()
    want, logged = _trl_reward(model, batch, coefficient, margin)
    want.backward()
    spec = RewardSpec("reward", center_rewards_coefficient=coefficient)
    with step_values.collecting() as found:
        loss, grads = single_device(cfg, params, batch, loss_fn=_reward_fn(spec), dtype=torch.float32)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for ours, theirs in (("accuracy", "accuracy"), ("margin", "margin"), ("mean_reward", "mean_reward"),
                         ("min_reward", "min_reward"), ("max_reward", "max_reward")):
        # (fp32 sums in another order: rewards of order 1 agree to about 1e-6, on some CPUs a little more)
        assert float(found[ours][0]) == pytest.approx(logged[theirs], rel=1e-5, abs=1e-5), ours
    assert 0 < logged["accuracy"] < 1          # (a batch that can tell the sides apart)
    torch.testing.assert_close(grads["score"], _hf_grad(model, "score.weight").T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["embed_tokens"], _hf_grad(model, "model.embed_tokens.weight"), rtol=1e-4,
                               atol=1e-6)
    torch.testing.assert_close(grads["layers"][1]["mlp"]["down_proj"],
                               _hf_grad(model, "model.layers.1.mlp.down_proj.weight").T, rtol=1e-4, atol=1e-6)


def _steps(seed=2):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, KW["vocab_size"], (B, S), generator=g)
    labels = torch.full((B, S), -100)
    for i in range(B):
        for j in range(3, S, 3):                 # a step separator every third token
            labels[i, j] = int(torch.randint(0, 2, (), generator=g))
    return {"tokens": toks, "labels": labels}


def test_process_reward_loss_equals_token_classification(models):
    model, cfg, params = models["tok"]
    assert cfg.score_head == "token" and cfg.score_bias
    batch = _steps()
    model.zero_grad()
    model.train()
    out = model(input_ids=batch["tokens"], labels=batch["labels"])
    out.loss.backward()
    loss, grads = single_device(cfg, params, batch, loss_fn=_prm_fn, dtype=torch.float32)
    torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["score"], _hf_grad(model, "score.weight").T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["score_bias"], _hf_grad(model, "score.bias"), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][0]["self_attn"]["q_norm"],
                               _hf_grad(model, "model.layers.0.self_attn.q_norm.weight"), rtol=1e-4, atol=1e-6)


LAYOUTS = {"dp": (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard")),
           "fsdp_tp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()),
           "cp": (fpp.Mesh(cp=2), llama.default_rules(tp=False, fsdp=False))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["reward", "process"])
def test_layouts_equal_one_device(models, layout, kind):
    _, cfg, params = models["seq" if kind == "reward" else "tok"]
    full = tree_map(lambda x: x.double(), params)
    batch = _pairs(3, margin=True) if kind == "reward" else _steps(4)
    fn = _reward_fn(RewardSpec("reward", center_rewards_coefficient=0.1)) if kind == "reward" else _prm_fn
    want, want_grads = single_device(cfg, full, batch, loss_fn=fn)
    mesh, rules = LAYOUTS[layout]
    for loss, grads, _ in parallel(cfg, full, batch, mesh, rules, loss_fn=fn):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{p}: {m}")


def _device_losses(cfgs, fulls, batches):
    rules = llama.default_rules()
    out = []
    with fpp.use_rules(rules):
        ctx = current_context()
        fns = (_reward_fn(RewardSpec("reward", center_rewards_coefficient=0.1)), _prm_fn)
        for cfg, full, batch, fn in zip(cfgs, fulls, batches, fns):
            decls = llama.init(cfg, torch.float64)
            local = tree_map(lambda x: x.clone().requires_grad_(),
                             sharding.shard(full, decls, ctx.mesh, rules, fpp.current_rank()))
            with step_values.collecting() as found:
                loss = fn(sharding.named_tree(local, decls), {k: fpp.named(v, "batch seq") for k, v in batch.items()},
                          cfg).value()
            loss.backward()
            out.append((float(loss.detach()), fpp.gather_tree(tree_map(lambda p: p.grad, local), decls, rules),
                        {k: float(v) for k, (v, _) in found.items()}))
    return out


@pytest.mark.multiprocess
def test_gloo_processes_equal_simulation(models):
    cfgs = (models["seq"][1], models["tok"][1])
    fulls = tuple(tree_map(lambda x: x.double(), models[k][2]) for k in ("seq", "tok"))
    pairs = _pairs(5, margin=True)
    pairs["pair_weight"][2] = 0                  # an evaluation's wrapped pair: counts for nothing
    args = (cfgs, fulls, (pairs, _steps(6)))
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    real = fpp.launch(functools.partial(_device_losses, *args), mesh, processes=True, timeout=300)
    sim = fpp.launch(functools.partial(_device_losses, *args), mesh)
    for device_real, device_sim in zip(real, sim):
        for (loss, grads, found), (want, want_grads, want_found) in zip(device_real, device_sim):
            assert loss == pytest.approx(want, rel=1e-12)
            assert found.keys() == want_found.keys()
            assert all(found[k] == pytest.approx(want_found[k], rel=1e-12, abs=1e-14) for k in found)
            for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14, msg=lambda m: f"{p}: {m}")
    assert {"accuracy", "margin", "min_reward", "max_reward"} <= set(real[0][0][2])
