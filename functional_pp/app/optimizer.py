"""The optimizer and learning-rate schedule a config asks for (docs/optim.md), with a refused
setting reported as a config error naming the config key."""
from __future__ import annotations

import re

from functional_pp import optim
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.config.keys import ADAM_OPTIMIZERS

__all__ = ["optimizer_from_config"]


# optimizer argument -> config key, so that a refused setting is named as the user wrote it
_OPTIMIZER_CONFIG_KEYS = {"b1": "adam_beta1", "b2": "adam_beta2", "eps": "adam_epsilon", "min_lr": "min_learning_rate",
                          "end_value": "min_learning_rate", "max_norm": "max_grad_norm", "total_steps": "max_steps",
                          "peak": "learning_rate", "value": "learning_rate"}


def optimizer_from_config(cfg: TrainConfig):
    """The optimizer and the learning-rate schedule of ``cfg``; a setting the optimizer
    constructors refuse is a ConfigError naming the config key."""
    try:
        return _build_optimizer(cfg)
    except (TypeError, ValueError) as exc:
        found = re.search(r": (\w+)=", str(exc))
        key = _OPTIMIZER_CONFIG_KEYS.get(found.group(1), found.group(1)) if found else None
        raise ConfigError(f"optimizer settings: {exc}" + (f" [config key: {key}]" if key else "")) from exc


def _build_optimizer(cfg: TrainConfig):
    kw = dict(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
              max_grad_norm=cfg.max_grad_norm, lr_schedule=cfg.lr_scheduler,
              warmup_steps=cfg.warmup(), total_steps=cfg.max_steps,
              min_lr=cfg.min_lr(), mask=optim.decay_mask_by_ndim, quadratic_warmup=cfg.lr_quadratic_warmup or None,
              constant_ratio=cfg.cosine_constant_lr_ratio or None)
    if cfg.optimizer in ADAM_OPTIMIZERS:
        kw.update(b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon)
    else:
        kw.update(momentum=cfg.momentum)
    schedule = optim.make_schedule(cfg.learning_rate, cfg.lr_scheduler, cfg.warmup(),
                                   cfg.max_steps, cfg.min_lr(), quadratic_warmup=cfg.lr_quadratic_warmup,
                                   constant_ratio=cfg.cosine_constant_lr_ratio or None)
    if not callable(schedule):
        schedule = optim.schedules.constant(schedule)
    return optim.from_config(cfg.optimizer, **kw), schedule
