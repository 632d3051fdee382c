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


#: every TRL DPO loss type built, alone and as TRL's weighted lists (MPO's [sigmoid, bco_pair, sft])
DPO_CASES = [(t, 0.0, None) for t in L.DPO_PAIR_LOSSES if t not in ("robust", "exo_pair")] + [
    ("robust", 0.2, None), ("exo_pair", 1e-3, None), ("sft", 0.0, None),
    (["sigmoid", "bco_pair", "sft"], 0.0, [0.8, 0.2, 1.0]), (["ipo", "sigmoid_norm"], 0.0, None)]


def _ours_with_sft(out, logps, counts, loss_type, loss_weights):
    """The objective's loss: the per-pair losses' mean plus the weighted ``sft`` token mean."""
    terms = L.dpo_loss_terms(loss_type, loss_weights)
    sft = sum(w for t, w in terms if t == "sft")
    return out.losses.mean() + sft * (-logps[:B].sum() / counts[:B].sum())


@pytest.mark.parametrize("loss_type,smoothing,weights", DPO_CASES)
def test_dpo_losses_equal_trl(loss_type, smoothing, weights):
    gen = torch.Generator().manual_seed(1)
    beta = 0.3
    ids, mask = _rows(2 * B, gen)
    ref = torch.randn(2 * B, generator=gen) * 3 - 8
    w_trl = (torch.randn(V, generator=gen) * 2).requires_grad_()
    w_ours = w_trl.detach().clone().requires_grad_()
    want, metrics = dpo_loss(TableModel(w_trl), ids, mask, ref[:B], ref[B:], beta=beta, loss_type=loss_type,
                             label_smoothing=smoothing, loss_weights=weights, discopop_tau=0.3)
    logps, counts = _ours(w_ours, ids, mask)
    terms = L.dpo_loss_terms(loss_type, weights)
    out = L.dpo_losses(logps[:B], logps[B:], ref[:B], ref[B:], beta=beta, loss_type=[t for t, _ in terms if t != "sft"],
                       loss_weights=[w for t, w in terms if t != "sft"], label_smoothing=smoothing, discopop_tau=0.3,
                       chosen_tokens=counts[:B], rejected_tokens=counts[B:])
    got = _ours_with_sft(out, logps, counts, loss_type, weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    want.backward()
    got.backward()
    assert w_trl.grad.abs().sum() > 0
    torch.testing.assert_close(w_ours.grad, w_trl.grad, rtol=1e-5, atol=1e-6)
    assert out.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-6, abs=1e-6)
    assert out.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], rel=1e-6, abs=1e-6)
    acc = (out.chosen_rewards > out.rejected_rewards).float().mean().item()
    assert acc == pytest.approx(metrics["rewards/accuracies"])


def test_dpo_loss_types_differ():
    """Each formula is its own (a loss type mapped to another's formula would pass the TRL check
    only by the two being equal): all the per-pair losses differ on one batch."""
    gen = torch.Generator().manual_seed(5)
    c, r, rc, rr = (torch.randn(B, generator=gen) for _ in range(4))
    n = torch.full((B,), 3.0)
    values = {t: L.dpo_losses(c, r, rc, rr, beta=0.3, loss_type=t, label_smoothing=0.1, chosen_tokens=n,
                              rejected_tokens=n).losses for t in L.DPO_PAIR_LOSSES}
    for a in values:
        for b in values:
            assert a == b or not torch.allclose(values[a], values[b]), (a, b)


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


@pytest.mark.parametrize("loss_type", L.KTO_LOSS_TYPES)
def test_kto_losses_equal_trl(loss_type):
    gen = torch.Generator().manual_seed(4)
    ids, mask = _rows(2 * B, gen)
    kl_ids, kl_mask = _rows(2 * B, gen)
    labels = torch.tensor([True, False, True, True, False, True, False, False])
    ref = torch.randn(2 * B, generator=gen) - 6
    ref_kl = torch.randn(2 * B, generator=gen) - 9       # a positive KL estimate: its clamp does not hide it
    w_trl = torch.randn(V, generator=gen).requires_grad_()
    w_ours = w_trl.detach().clone().requires_grad_()
    want, metrics = kto_loss(TableModel(w_trl), ids, mask, labels, ref, kl_ids, kl_mask, ref_kl, beta=0.2,
                             desirable_weight=1.5, undesirable_weight=0.5, loss_type=loss_type)
    logps, _ = _ours(w_ours, ids, mask)
    kl_logps, _ = _ours(w_ours, kl_ids, kl_mask)
    kl = (kl_logps - ref_kl).mean()
    assert kl.item() > 0
    losses, rewards = L.kto_losses(logps, ref, labels, kl, beta=0.2, desirable_weight=1.5, undesirable_weight=0.5,
                                   loss_type=loss_type)
    torch.testing.assert_close(losses.mean(), want)
    assert (kl.item() if loss_type == "kto" else 0.0) == pytest.approx(metrics["kl"], rel=1e-6)
    want.backward()
    losses.mean().backward()
    torch.testing.assert_close(w_ours.grad, w_trl.grad)


def test_unknown_loss_types_are_refused_by_name():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="dpo loss_type 'bogus' is not one of sigmoid, hinge, ipo, robust, exo_pair"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="bogus")
    with pytest.raises(ValueError, match="'aot' sorts the log-ratios over the batch"):
        L.dpo_loss_terms(["sigmoid", "aot"])
    with pytest.raises(ValueError, match="gives 1 weights for 2 loss types"):
        L.dpo_loss_terms(["sigmoid", "sft"], [0.5])
    with pytest.raises(ValueError, match="'sft' is the chosen completions' token mean"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="sft")
    with pytest.raises(ValueError, match="'exo_pair' needs a label smoothing"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="exo_pair")
    with pytest.raises(ValueError, match="kto loss_type 'bco' is not one of kto, apo_zero_unpaired"):
        L.kto_losses(x, x, x.bool(), x, beta=0.1, loss_type="bco")
    with pytest.raises(ValueError, match="'ipo' / 'sigmoid_norm' needs the completions' token counts"):
        L.dpo_losses(x, x, x, x, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="cpo loss_type 'kto' is not one of"):
        L.cpo_losses(x, x, beta=0.1, loss_type="kto")
