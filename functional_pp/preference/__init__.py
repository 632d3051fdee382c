"""Preference fine-tuning from chosen / rejected pairs, and GRPO's online loop (docs/preference.md).

``rl: dpo | ipo | orpo | simpo | kto``: the losses over per-sequence log-probabilities
(:mod:`.losses`, TRL's formulas) and the training objective over a model's logits
(:mod:`.objective`); the pairs are read and batched in ``functional_pp/data/pairs.py`` and
``functional_pp/data/pair_loader.py`` (KTO's completions in ``functional_pp/data/unpaired.py``),
the run set up in ``functional_pp/app/preference_run.py``. GRPO (``rl: grpo`` / ``gdpo``):
its advantages and loss (:mod:`.grpo`, TRL's formulas), its ``trl:`` settings (:mod:`.grpo_spec`)
and the rollout (:mod:`.rollout`: sampling with the policy's weights, the reward functions, the
batch), the run set up in ``functional_pp/app/grpo_run.py``."""
from functional_pp.preference.losses import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, PairLosses, cpo_losses, dpo_losses,
                                             kto_losses, orpo_losses)
from functional_pp.preference.grpo import group_advantages, grpo_loss, grpo_token_losses

__all__ = ["DPO_LOSS_TYPES", "CPO_LOSS_TYPES", "PairLosses", "dpo_losses", "orpo_losses", "cpo_losses", "kto_losses",
           "group_advantages", "grpo_token_losses", "grpo_loss"]
