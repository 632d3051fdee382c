"""The objective of a ``diffusion:`` run (Axolotl's DiffusionPlugin; models/diffusion_lm.py): the
family's forward made bidirectional, the mask token checked against the vocabulary and the
tokenizer's special tokens (BOS, EOS, padding) never masked; built before any work."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from functional_pp.config import ConfigError, TrainConfig
from functional_pp.models.diffusion_lm import DiffusionSpec, diffusion_loss

__all__ = ["diffusion_objective", "special_token_ids"]


def special_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids Axolotl's trainer never masks: the tokenizer's BOS, EOS and padding (those it has)."""
    if tokenizer is None:
        return ()
    ids = (getattr(tokenizer, k, None) for k in ("bos_id", "eos_id", "chat_eos_id", "pad_id"))
    return tuple(sorted({int(i) for i in ids if i is not None}))


def diffusion_objective(cfg: TrainConfig, spec: DiffusionSpec, family: Any, model_cfg: Any,
                        tokenizer: Any) -> Any:
    """``loss(params, batch)``: :func:`~functional_pp.models.diffusion_lm.diffusion_loss` over the
    family's forward with bidirectional attention; ConfigError naming what the model lacks."""
    if family.forward is None or not hasattr(model_cfg, "causal"):
        raise ConfigError(f"diffusion: model family {family.name!r} has no forward with bidirectional attention "
                          f"(a config field causal); train a decoder family of docs/models.md")
    try:
        spec.check_vocab(family.vocab_size(model_cfg))
        bidirectional = dataclasses.replace(model_cfg, causal=False)
    except ValueError as exc:
        raise ConfigError(f"diffusion: {exc}") from exc
    forward = functools.partial(family.forward, cfg=bidirectional)
    return functools.partial(diffusion_loss, forward=forward, spec=spec, special_ids=special_token_ids(tokenizer),
                             seed=cfg.seed)
