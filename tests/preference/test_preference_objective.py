"""The preference objective (functional_pp/preference/objective.py) on our Llama equals TRL's
DPOTrainer (ORPO, CPO/SimPO, KTOTrainer) loss on transformers' Llama with the same weights: the
loss, the logged rewards (KTO: and its KL estimate) and the gradients; and a FSDP x TP layout
(vocabulary split) equals one device, on simulated devices and on gloo processes."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from harness import parallel, single_device

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import step_values
from functional_pp.core.runtime import active_rules, current_context
from functional_pp.core.tree import leaves_with_paths, tree_map
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.preference.grpo import grpo_objective
from functional_pp.preference.objective import PreferenceSpec, preference_loss

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from trl_oracle import dpo_loss, kto_loss, pair_trainer_loss  # noqa: E402

KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
B, S = 4, 12


def _hf(seed: int, scale: float):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy HF model, reference HF model, our config, our policy tree, our reference tree)."""
    out = []
    for seed in (0, 1):
        m = _hf(seed, 0.2)
        d = tmp_path_factory.mktemp(f"pref-{seed}")
        m.save_pretrained(d, safe_serialization=True)
        trl.trainer.utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1",
                                                        "log_sum_sq_probs"))
        cfg, params = hf.load_hf_llama(d)
        out += [m, params]
    return out[0], out[2], cfg, out[1], out[3]


def _pairs(seed: int = 0):
    """A pair batch: rows of prompt + completion + padding (pad id 0), labels -100 outside the
    completion; TRL's input is the chosen rows, then the rejected ones, with completion masks."""
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side in ("chosen", "rejected"):
        toks = torch.randint(1, KW["vocab_size"], (B, S), generator=g)
        labels = torch.full((B, S), -100)
        mask = torch.zeros(B, S, dtype=torch.long)
        for i in range(B):
            p = int(torch.randint(2, 5, (), generator=g))
            end = int(torch.randint(p + 2, S + 1, (), generator=g))
            toks[i, end:] = 0
            mask[i, p:end] = 1
            labels[i, p - 1:end - 1] = toks[i, p:end]
        batch[f"{side}_tokens"], batch[f"{side}_labels"], batch[f"{side}_mask"] = toks, labels, mask
        if side == "chosen":       # every next token up to the padding (ORPO's NLL)
            real = toks != 0
            batch["chosen_lm_labels"] = torch.where(real[:, 1:], toks[:, 1:], -100)
            batch["chosen_lm_labels"] = torch.cat([batch["chosen_lm_labels"], torch.full((B, 1), -100)], 1)
    return batch


#: TRL's MPO mix: per-pair losses and the batch's token-mean NLL (a mean over every rank's tokens)
MPO = (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0))
#: a weighted list without sft (TRL 1.16 fails on sft with use_weighting: refused here)
PAIRS_MIX = (("sigmoid", "bco_pair"), (0.8, 0.2))


def _trl(policy, reference, batch, loss_type, loss_weights=None, use_weighting=False):
    ids = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True).log_probs.sum(1)
    policy.zero_grad()
    loss, metrics = dpo_loss(policy, ids, mask, ref[:B], ref[B:], beta=0.5, loss_type=loss_type,
                             loss_weights=loss_weights, use_weighting=use_weighting)
    loss.backward()
    return loss.detach(), metrics, policy


def _our_loss(cfg, ref_full, loss_type, loss_weights=None, use_weighting=False):
    """``loss_fn(params, batch, cfg)`` for the harness: the reference the device's shards of
    ``ref_full``, the step metrics collected into ``found``."""
    spec = PreferenceSpec("dpo", beta=0.5, loss_type=loss_type, loss_weights=loss_weights,
                          use_weighting=use_weighting)
    forward = functools.partial(llama.forward, cfg=cfg)
    found = {}

    def loss_fn(params, batch, _cfg):
        decls = llama.init(cfg, torch.float64)
        ctx = current_context(required=False)
        local = ref_full if ctx is None else sharding.shard(ref_full, decls, ctx.mesh, active_rules(),
                                                            fpp.current_rank())
        ref = sharding.named_tree(local, decls)
        batch = {k: v for k, v in batch.items() if not k.endswith("_mask")}
        with step_values.collecting() as values:
            out = preference_loss(spec, lambda p, t: forward(p, t), lambda p, t: forward(ref, t))(params, batch)
        found.update({k: float(v) for k, (v, _) in values.items()})
        return out
    return loss_fn, found


@pytest.mark.parametrize("loss_type,loss_weights,weighting", [("sigmoid", None, False), ("ipo", None, False),
                                                               ("apo_down", None, False), (*MPO, False),
                                                               ("sigmoid", None, True), (*PAIRS_MIX, True)])
def test_dpo_objective_equals_trl_on_transformers_llama(models, loss_type, loss_weights, weighting):
    """(``weighting``: WPO's per-pair weights, TRL's use_weighting.)"""
    policy, reference, cfg, ours, ref_ours = models
    batch = _pairs()
    want, metrics, policy = _trl(policy, reference, batch, loss_type, loss_weights, weighting)
    loss_fn, found = _our_loss(cfg, tree_map(lambda x: x.double(), ref_ours), loss_type, loss_weights, weighting)
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), ours), batch, loss_fn=loss_fn)
    assert abs(float(want) - 0.693) > 1e-3 if loss_type == "sigmoid" else True     # policy != reference
    torch.testing.assert_close(loss.float(), want, rtol=2e-5, atol=2e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert found[name.replace("/", "_")] == pytest.approx(metrics[name], rel=1e-4, abs=1e-5), name
    assert found["logps_chosen"] == pytest.approx(metrics["logps/chosen"], rel=1e-5)
    torch.testing.assert_close(grads["embed_tokens"].float(), policy.model.embed_tokens.weight.grad,
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["lm_head"].float(), policy.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][1]["mlp"]["down_proj"].float(),
                               policy.model.layers[1].mlp.down_proj.weight.grad.T, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type,loss_weights,weighting", [("sigmoid", None, False), (*MPO, False),
                                                               (*PAIRS_MIX, True)])
def test_dpo_objective_fsdp_tp_equals_one_device(models, loss_type, loss_weights, weighting):
    _, _, cfg, ours, ref_ours = models
    full = tree_map(lambda x: x.double(), ours)
    ref = tree_map(lambda x: x.double(), ref_ours)
    batch = _pairs(1)
    loss_fn, _ = _our_loss(cfg, ref, loss_type, loss_weights, weighting)
    want, want_grads = single_device(cfg, full, batch, loss_fn=loss_fn)
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = llama.default_rules()
    results = parallel(cfg, full, batch, mesh, rules, loss_fn=loss_fn)
    for loss, grads, _ in results:
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{p}: {m}")


def _device_loss_and_grads(cfg, full, ref_full, batches):
    """On each device of a launched mesh: the DPO, KTO and GRPO objectives' losses and gathered
    gradients (the device's shards of the policy and the reference, its block of each batch)."""
    rules = llama.default_rules()
    out = []
    with fpp.use_rules(rules):
        ctx = current_context()
        decls = llama.init(cfg, torch.float64)
        ref = sharding.named_tree(sharding.shard(ref_full, decls, ctx.mesh, rules, fpp.current_rank()), decls)
        forward = functools.partial(llama.forward, cfg=cfg)
        objectives = [preference_loss(spec, forward, lambda p, t: forward(ref, t))
                      for spec in (PreferenceSpec("dpo", beta=0.5), KTO)]
        objectives.append(grpo_objective(forward, loss_type="dapo", beta=0.1, reference=lambda p, t: forward(ref, t)))
        for objective, batch in zip(objectives, batches):
            local = tree_map(lambda x: x.clone().requires_grad_(),
                             sharding.shard(full, decls, ctx.mesh, rules, fpp.current_rank()))
            named_batch = {k: fpp.named(v, "batch seq") for k, v in batch.items() if not k.endswith("_mask")}
            with step_values.collecting() as found:       # (the metrics TRL logs; pair-weighted for DPO)
                loss = objective(sharding.named_tree(local, decls), named_batch).value()
            loss.backward()
            out.append((float(loss.detach()), fpp.gather_tree(tree_map(lambda p: p.grad, local), decls, rules),
                        {k: float(v) for k, (v, _) in found.items()}))
    return out


@pytest.mark.multiprocess
def test_dpo_kto_and_grpo_objectives_on_gloo_processes_equal_simulation(models):
    _, _, cfg, ours, ref_ours = models
    pairs = _pairs(2)
    weight = torch.ones(B, S, dtype=torch.float64)
    weight[1] = 0                                           # an evaluation's wrapped pair: counts for nothing
    args = (cfg, tree_map(lambda x: x.double(), ours), tree_map(lambda x: x.double(), ref_ours),
            ({**pairs, "pair_weight": weight}, _kto_batch(2), _grpo_batch(2)))
    mesh = fpp.Mesh(dp_shard=2)
    real = fpp.launch(functools.partial(_device_loss_and_grads, *args), mesh, processes=True, timeout=300)
    sim = fpp.launch(functools.partial(_device_loss_and_grads, *args), mesh)
    for device_real, device_sim in zip(real, sim):
        for (loss, grads, found), (want, want_grads, want_found) in zip(device_real, device_sim):
            assert loss == want
            assert found.keys() == want_found.keys() and all(
                found[k] == pytest.approx(want_found[k], rel=1e-12, abs=1e-14) for k in found), (found, want_found)
            for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14, msg=lambda m: f"{p}: {m}")


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_orpo_and_simpo_objectives_equal_trl_on_transformers_llama(models, method):
    policy, _, cfg, ours, _ = models
    batch = _pairs(3)
    trl_batch = {}
    for side in ("chosen", "rejected"):
        toks, mask = batch[f"{side}_tokens"], batch[f"{side}_mask"]
        trl_batch[f"{side}_input_ids"] = toks
        trl_batch[f"{side}_attention_mask"] = (toks != 0).long()
        trl_batch[f"{side}_labels"] = toks.masked_fill(mask == 0, -100)
    beta = 0.3 if method == "orpo" else 2.0
    policy.zero_grad()
    want, metrics = pair_trainer_loss(method, policy, trl_batch, beta=beta, simpo_gamma=0.6, cpo_alpha=0.5)
    want.backward()
    spec = PreferenceSpec(method, beta=beta, loss_type="simpo" if method == "simpo" else "sigmoid",
                          simpo_gamma=0.6, cpo_alpha=0.5)
    forward = functools.partial(llama.forward, cfg=cfg)
    found = {}

    def loss_fn(params, b, _cfg):
        with step_values.collecting() as values:
            out = preference_loss(spec, forward)(params, {k: v for k, v in b.items() if not k.endswith("_mask")})
        found.update({k: float(v) for k, (v, _) in values.items()})
        return out
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), ours), batch, loss_fn=loss_fn)
    torch.testing.assert_close(loss.float(), want.detach(), rtol=2e-5, atol=2e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll_loss"):
        assert found[name.replace("/", "_")] == pytest.approx(metrics[name], rel=1e-4, abs=1e-5), name
    torch.testing.assert_close(grads["lm_head"].float(), policy.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)


KTO = PreferenceSpec("kto", beta=0.4, desirable_weight=1.3, undesirable_weight=0.7)


def _kto_batch(seed: int = 0):
    """Unpaired completions (pad id 0): rows of prompt + completion, labels -100 outside the
    completion, ``desirable`` (constant along each row), and TRL's KL rows: each prompt with
    the previous row's completion; masks for TRL."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, KW["vocab_size"], (int(torch.randint(2, 5, (), generator=g)),), generator=g)
               for _ in range(B)]
    completions = [torch.randint(1, KW["vocab_size"], (int(torch.randint(2, 7, (), generator=g)),), generator=g)
                   for _ in range(B)]
    batch = {}
    for key, pick in (("", lambda i: completions[i]), ("kl_", lambda i: completions[i - 1])):
        toks, labels, mask = torch.zeros(B, S, dtype=torch.long), torch.full((B, S), -100), torch.zeros(B, S)
        for i in range(B):
            p, c = prompts[i], pick(i)
            toks[i, :len(p) + len(c)] = torch.cat([p, c])
            labels[i, len(p) - 1:len(p) + len(c) - 1] = c
            mask[i, len(p):len(p) + len(c)] = 1
        batch[f"{key}tokens"], batch[f"{key}labels"], batch[f"{key}completion_mask"] = toks, labels, mask.long()
    flags = torch.tensor([True, False, True, True])[torch.randperm(B, generator=g)]
    batch["desirable"] = flags.double()[:, None].expand(B, S).contiguous()
    batch["flags_mask"] = flags[:, None].expand(B, S).contiguous()     # TRL's labels (kept out of ours)
    return batch


def _kto_loss_fn(cfg, ref_full, spec=KTO):
    """``loss_fn(params, batch, cfg)`` of the KTO objective (the reference the device's shards
    of ``ref_full``), its step metrics collected into ``found``."""
    forward = functools.partial(llama.forward, cfg=cfg)
    found = {}

    def loss_fn(params, batch, _cfg):
        decls = llama.init(cfg, torch.float64)
        ctx = current_context(required=False)
        local = ref_full if ctx is None else sharding.shard(ref_full, decls, ctx.mesh, active_rules(),
                                                            fpp.current_rank())
        ref = sharding.named_tree(local, decls)
        batch = {k: v for k, v in batch.items() if not k.endswith("_mask")}
        with step_values.collecting() as values:
            out = preference_loss(spec, forward, lambda p, t: forward(ref, t))(params, batch)
        found.update({k: float(v) for k, (v, _) in values.items()})
        return out
    return loss_fn, found


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_objective_equals_trl_on_transformers_llama(models, loss_type):
    policy, reference, cfg, ours, ref_ours = models
    spec = dataclasses.replace(KTO, kto_loss_type=loss_type)
    batch = _kto_batch()
    ids, mask, kl_ids, kl_mask = (batch[k] for k in ("tokens", "completion_mask", "kl_tokens", "kl_completion_mask"))
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True).log_probs.sum(1)
        ref_kl = reference(input_ids=kl_ids, labels=kl_ids.masked_fill(kl_mask == 0, -100),
                           fused_lm_head=True).log_probs.sum(1)
    policy.zero_grad()
    want, metrics = kto_loss(policy, ids, mask, batch["flags_mask"][:, 0], ref, kl_ids, kl_mask, ref_kl, beta=KTO.beta,
                             desirable_weight=KTO.desirable_weight, undesirable_weight=KTO.undesirable_weight,
                             loss_type=loss_type)
    want.backward()
    assert (metrics["kl"] > 0) == (loss_type == "kto")     # the KL estimate acts (policy != reference)
    loss_fn, found = _kto_loss_fn(cfg, tree_map(lambda x: x.double(), ref_ours), spec)
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), ours), batch, loss_fn=loss_fn)
    torch.testing.assert_close(loss.float(), want.detach(), rtol=2e-5, atol=2e-6)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert found[name.replace("/", "_")] == pytest.approx(metrics[name], rel=1e-4, abs=1e-5), name
    torch.testing.assert_close(grads["lm_head"].float(), policy.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][0]["mlp"]["down_proj"].float(),
                               policy.model.layers[0].mlp.down_proj.weight.grad.T, rtol=1e-4, atol=1e-6)


def test_kto_objective_fsdp_tp_equals_one_device(models):
    """The KL estimate is the mean over every data-parallel rank's rows, as on one device."""
    _, _, cfg, ours, ref_ours = models
    full, ref = tree_map(lambda x: x.double(), ours), tree_map(lambda x: x.double(), ref_ours)
    batch = _kto_batch(1)
    loss_fn, found = _kto_loss_fn(cfg, ref)
    want, want_grads = single_device(cfg, full, batch, loss_fn=loss_fn)
    one = dict(found)
    results = parallel(cfg, full, batch, fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(), loss_fn=loss_fn)
    for loss, grads, _ in results:
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{p}: {m}")
    assert found["kl"] == pytest.approx(one["kl"], rel=1e-10) and one["kl"] > 0


def _grpo_batch(seed: int):
    """Sampled completions after prompts (padding 0, labels -100 outside the completions) and
    each row's advantage along the row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, KW["vocab_size"], (B, S), generator=g)
    labels = torch.full((B, S), -100)
    for i in range(B):
        end = int(torch.randint(6, S + 1, (), generator=g))
        tokens[i, end:] = 0
        labels[i, 3:end - 1] = tokens[i, 4:end]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return {"tokens": tokens, "labels": labels, "advantages": adv[:, None].expand(B, S).contiguous()}
