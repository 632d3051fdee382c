"""GRPO's formulas (functional_pp/preference/grpo.py) equal TRL 1.16's ``GRPOTrainer``: the clipped
policy loss with the KL term, for each loss type and importance-sampling level, its gradient
and the KL TRL logs (TRL's own ``_compute_loss`` on the same per-token log-probabilities and
advantages); the group-normalised advantages equal TRL's formula (with its ``nanstd``)."""
from __future__ import annotations

import pytest
import torch

from functional_pp.preference import grpo

trl = pytest.importorskip("trl")
from trl_oracle import grpo_loss  # noqa: E402

N, T = 6, 7


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)       # ratios on both sides of the clip
    ref = logps + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = torch.ones(N, T, dtype=torch.long)
    for i in range(N):
        mask[i, int(torch.randint(2, T + 1, (), generator=g)):] = 0
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, adv


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
@pytest.mark.parametrize("beta,level,delta,eps_high", [(0.0, "token", None, None), (0.04, "token", 1.5, 0.28),
                                                       (0.04, "sequence", None, None)])
def test_grpo_loss_equals_trl(loss_type, beta, level, delta, eps_high):
    logps, old, ref, mask, adv = _inputs(len(loss_type) + int(100 * beta) + len(level))
    mine_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    kw = dict(beta=beta, epsilon=0.2, epsilon_high=eps_high, delta=delta, importance_sampling_level=level)
    want, metrics = grpo_loss(trl_in, mask, adv, old_logps=old, ref_logps=ref if beta else None, loss_type=loss_type,
                              max_completion_length=T, **kw)
    want.backward()
    token_losses, kl = grpo.grpo_token_losses(mine_in, adv, mask, old_logps=old, ref_logps=ref if beta else None, **kw)
    got = grpo.grpo_loss(token_losses, mask, loss_type, max_completion_length=T)
    got.backward()
    assert abs(float(want)) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mine_in.grad, trl_in.grad, rtol=1e-12, atol=1e-14)
    if beta:
        m = mask.double()
        assert float((kl * m).sum() / m.sum()) == pytest.approx(metrics["kl"], rel=1e-12)


def test_on_policy_loss_is_minus_the_mean_advantage_and_its_gradient_the_policy_gradient():
    """With the policy's own log-probabilities as the old ones (one update per batch), every
    ratio is 1: the loss is -A per token, its gradient -A / tokens (grpo)."""
    logps, _, _, mask, adv = _inputs(5)
    x = logps.clone().requires_grad_()
    loss = grpo.grpo_loss(grpo.grpo_token_losses(x, adv, mask)[0], mask, "grpo")
    loss.backward()
    torch.testing.assert_close(loss, -adv.mean())
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / mask.sum(-1, keepdim=True) / N)


@pytest.mark.parametrize("scale", grpo.SCALE_REWARDS)
def test_group_advantages_equal_trls_formula(scale):
    from trl.trainer.utils import nanstd
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    rewards[4] = float("nan")                                     # unscorable: out of the mean, advantage 0
    got = grpo.group_advantages(rewards, 4, scale)
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)        # TRL's lines, its nanstd
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4) if scale == "group" else nanstd(rewards).expand(12)
    want = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(got, torch.nan_to_num(want, nan=0.0))
    assert got[4] == 0 and abs(float(got[:4].sum())) < 1e-9 and abs(float(got[5:8].sum())) < 1e-9
    with pytest.raises(ValueError, match="12 rewards do not split into groups of num_generations=5"):
        grpo.group_advantages(rewards, 5)


KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
P, C = 4, 6                                   # prompt and completion lengths (completions padded)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """(transformers' tiny Llama with TRL's fused head, our config, our parameters), same weights."""
    transformers = pytest.importorskip("transformers")
    from functional_pp.checkpoint import hf
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    m.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp("grpo-llama")
    m.save_pretrained(d)
    trl.trainer.utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    cfg, params = hf.load_hf_llama(d)
    return m, cfg, params


def _rollouts(seed: int):
    """Prompts of P tokens, completions of 1..C tokens (padded, masked) and their advantages;
    our rows: prompt + completion, labels the completion's tokens at the positions before them."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, KW["vocab_size"], (N, P), generator=g)
    completion = torch.randint(1, KW["vocab_size"], (N, C), generator=g)
    mask = torch.ones(N, C, dtype=torch.long)
    for i in range(N):
        mask[i, int(torch.randint(1, C + 1, (), generator=g)):] = 0
    completion = completion * mask
    rewards = torch.randn(N, generator=g, dtype=torch.float64)
    adv = grpo.group_advantages(rewards, 3)
    tokens = torch.cat([prompt, completion], 1)
    labels = torch.full_like(tokens, -100)
    labels[:, P - 1:P + C - 1] = completion.masked_fill(mask == 0, -100)
    batch = {"tokens": tokens, "labels": labels, "advantages": adv[:, None].expand(N, P + C).contiguous()}
    return batch, tokens, mask, adv


def _trl_completion_logps(model, tokens, mask):
    labels = torch.full_like(tokens, -100)
    labels[:, P:] = tokens[:, P:].masked_fill(mask == 0, -100)
    return model(input_ids=tokens, labels=labels, fused_lm_head=True).log_probs[:, P - 1:]


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_grpo_objective_equals_trl_on_transformers_llama(llama_pair, loss_type):
    """On-policy (old log-probs the policy's own) with the KL to a reference (the policy's
    weights moved), TRL's loss and gradients on the same completions and advantages."""
    import functools

    from harness import single_device

    from functional_pp.core.tree import tree_map
    from functional_pp.models import llama
    from functional_pp.parallel import sharding
    m, cfg, params = llama_pair
    batch, tokens, mask, adv = _rollouts(7)
    ref_params = tree_map(lambda x: (x * 1.05).double(), params)
    with torch.no_grad():
        saved = {n: p.clone() for n, p in m.named_parameters()}
        for _, p in m.named_parameters():
            p.mul_(1.05)
        ref_logps = _trl_completion_logps(m, tokens, mask)
        for n, p in m.named_parameters():
            p.copy_(saved[n])
    m.zero_grad()
    logps = _trl_completion_logps(m, tokens, mask)
    want, metrics = grpo_loss(logps, mask, adv.float(), ref_logps=ref_logps, beta=0.05, loss_type=loss_type,
                              max_completion_length=C)
    want.backward()
    forward = functools.partial(llama.forward, cfg=cfg)

    def loss_fn(p, b, _cfg):
        ref = sharding.named_tree(ref_params, llama.init(cfg, torch.float64))
        return grpo.grpo_objective(forward, loss_type=loss_type, beta=0.05, max_completion_length=C,
                                   reference=lambda _p, t: forward(ref, t))(p, b)
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), params), batch, loss_fn=loss_fn)
    assert abs(float(want)) > 1e-4
    torch.testing.assert_close(loss.float(), want.detach(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(grads["lm_head"].float(), m.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][0]["mlp"]["down_proj"].float(),
                               m.model.layers[0].mlp.down_proj.weight.grad.T, rtol=1e-4, atol=1e-6)


def test_grpo_objective_fsdp_tp_equals_one_device(llama_pair):
    import functools

    from harness import parallel, single_device

    import functional_pp as fpp
    from functional_pp.core.tree import leaves_with_paths, tree_map
    from functional_pp.models import llama
    _, cfg, params = llama_pair
    batch, *_ = _rollouts(8)
    full = tree_map(lambda x: x.double(), params)
    objective = grpo.grpo_objective(functools.partial(llama.forward, cfg=cfg), loss_type="dapo")
    want, want_grads = single_device(cfg, full, batch, loss_fn=lambda p, b, _c: objective(p, b))
    for loss, grads, _ in parallel(cfg, full, batch, fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(),
                                   loss_fn=lambda p, b, _c: objective(p, b)):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda msg: f"{p}: {msg}")
