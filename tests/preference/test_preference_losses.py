"""The preference losses (functional_pp/preference/losses.py) equal TRL's own loss code on
random per-token log-probabilities: the loss, its gradient and the rewards TRL logs."""
from __future__ import annotations

import pytest
import torch

from functional_pp.preference import losses as L
from trl_oracle import TableModel, cpo_loss, dpo_loss, kto_loss, orpo_odds_ratio, token_logps

B, S, V = 4, 9, 31


def _rows(n: int, gen: torch.Generator):
    """``n`` rows of ids and completion masks: a prompt of 2-4 tokens, then a completion of at
    least one token, then padding (mask 0)."""
    ids = torch.randint(0, V, (n, S), generator=gen)
    mask = torch.zeros(n, S, dtype=torch.long)
    for i in range(n):
        start = int(torch.randint(2, 5, (), generator=gen))
        end = int(torch.randint(start + 1, S + 1, (), generator=gen))
        mask[i, start:end] = 1
    return ids, mask


def _ours(weights, ids, mask):
    """Per-sequence summed completion log-probs and token counts, as the objective forms them."""
    lp = token_logps(weights, ids[:, 1:]) * mask[:, 1:]
    return lp.sum(1), mask[:, 1:].sum(1).to(lp.dtype)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.2)])
def test_dpo_losses_equal_trl(loss_type, smoothing):
    gen = torch.Generator().manual_seed(1)
    beta = 0.3
    ids, mask = _rows(2 * B, gen)
    ref = torch.randn(2 * B, generator=gen) * 3 - 8
    w_trl = (torch.randn(V, generator=gen) * 2).requires_grad_()
    w_ours = w_trl.detach().clone().requires_grad_()
    want, metrics = dpo_loss(TableModel(w_trl), ids, mask, ref[:B], ref[B:], beta=beta, loss_type=loss_type,
                             label_smoothing=smoothing)
    logps, counts = _ours(w_ours, ids, mask)
    out = L.dpo_losses(logps[:B], logps[B:], ref[:B], ref[B:], beta=beta, loss_type=loss_type,
                       label_smoothing=smoothing, chosen_tokens=counts[:B], rejected_tokens=counts[B:])
    got = out.losses.mean()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    want.backward()
    got.backward()
    assert w_trl.grad.abs().sum() > 0
    torch.testing.assert_close(w_ours.grad, w_trl.grad, rtol=1e-5, atol=1e-6)
    assert out.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-6, abs=1e-6)
    assert out.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], rel=1e-6, abs=1e-6)
    acc = (out.chosen_rewards > out.rejected_rewards).float().mean().item()
    assert acc == pytest.approx(metrics["rewards/accuracies"])


def test_orpo_odds_ratio_equals_trl():
    gen = torch.Generator().manual_seed(2)
    # mean token log-probs, near 0 as well as far from it (log1mexp's two branches)
    c = -torch.rand(B * 2, generator=gen) * torch.tensor([0.05, 3.0]).repeat(B)
    r = -torch.rand(B * 2, generator=gen) * torch.tensor([2.0, 0.1]).repeat(B)
    c_ours, c_trl = c.clone().requires_grad_(), c.clone().requires_grad_()
    losses, chosen_rewards, rejected_rewards, ratio_mean, log_odds_mean = orpo_odds_ratio(c_trl, r, beta=0.25)
    out, log_odds = L.orpo_losses(c_ours, r, beta=0.25)
    # TRL's objective is nll - mean(beta * logsigmoid(log_odds)): ours is + mean(losses)
    torch.testing.assert_close(out.losses.mean(), -losses.mean())
    torch.testing.assert_close(log_odds.mean(), log_odds_mean)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards)
    out.losses.mean().backward()
    (-losses.mean()).backward()
    torch.testing.assert_close(c_ours.grad, c_trl.grad)


@pytest.mark.parametrize("loss_type,smoothing", [("simpo", 0.0), ("simpo", 0.1), ("sigmoid", 0.1), ("hinge", 0.0),
                                                 ("ipo", 0.0)])
def test_cpo_simpo_losses_equal_trl(loss_type, smoothing):
    gen = torch.Generator().manual_seed(3)
    c, r = -torch.rand(B, generator=gen) * 4, -torch.rand(B, generator=gen) * 4
    want, chosen_rewards, rejected_rewards = cpo_loss(c, r, beta=2.0, loss_type=loss_type, simpo_gamma=0.7,
                                                      label_smoothing=smoothing)
    out = L.cpo_losses(c, r, beta=2.0, loss_type=loss_type, simpo_gamma=0.7, label_smoothing=smoothing)
    torch.testing.assert_close(out.losses, want)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards)


def test_kto_losses_equal_trl():
    gen = torch.Generator().manual_seed(4)
    ids, mask = _rows(2 * B, gen)
    kl_ids, kl_mask = _rows(2 * B, gen)
    labels = torch.tensor([True, False, True, True, False, True, False, False])
    ref = torch.randn(2 * B, generator=gen) - 6
    ref_kl = torch.randn(2 * B, generator=gen) - 9       # a positive KL estimate: its clamp does not hide it
    w_trl = torch.randn(V, generator=gen).requires_grad_()
    w_ours = w_trl.detach().clone().requires_grad_()
    want, metrics = kto_loss(TableModel(w_trl), ids, mask, labels, ref, kl_ids, kl_mask, ref_kl, beta=0.2,
                             desirable_weight=1.5, undesirable_weight=0.5)
    logps, _ = _ours(w_ours, ids, mask)
    kl_logps, _ = _ours(w_ours, kl_ids, kl_mask)
    kl = (kl_logps - ref_kl).mean()
    assert kl.item() > 0
    losses, rewards = L.kto_losses(logps, ref, labels, kl, beta=0.2, desirable_weight=1.5, undesirable_weight=0.5)
    torch.testing.assert_close(losses.mean(), want)
    assert kl.item() == pytest.approx(metrics["kl"], rel=1e-6)
    want.backward()
    losses.mean().backward()
    torch.testing.assert_close(w_ours.grad, w_trl.grad)


def test_unknown_loss_types_are_refused_by_name():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="dpo loss_type 'exo_pair' is not one of sigmoid, hinge, ipo, robust"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="exo_pair")
    with pytest.raises(ValueError, match="'ipo' needs the completions' token counts"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="cpo loss_type 'kto' is not one of"):
        L.cpo_losses(x, x, beta=0.1, loss_type="kto")
