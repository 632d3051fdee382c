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
