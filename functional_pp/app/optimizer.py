"""The optimizer and learning-rate schedule a config asks for (docs/optim.md), with a refused
setting reported as a config error naming the config key."""
from __future__ import annotations

import re

from functional_pp import optim
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.config.keys import ADAM_OPTIMIZERS

__all__ = ["optimizer_from_config", "check_lisa_layers", "check_sparse_targets"]


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
    opt = _lisa_adamw(cfg, schedule) if cfg.lisa_n_layers is not None else optim.from_config(cfg.optimizer, **kw)
    if cfg.llmcompressor is not None:           # sparse fine-tuning: the targeted zeros kept after each update
        opt = optim.chain(opt, optim.keep_zeros(_sparse_targets(cfg)))
    return opt, schedule


def _hf_names(cfg: TrainConfig):
    """``path -> its Hugging Face parameter name`` in the files of the config's model (None: none)."""
    from functional_pp.adapters.peft_fused import model_type_of
    from functional_pp.models.llama_hf import file_name
    model_type = model_type_of(cfg.base_model)

    def name(path: str) -> str | None:
        try:
            found = file_name(path, model_type)
        except (KeyError, ValueError):
            return None
        return found[0] if found else None
    return name


def _sparse_targets(cfg: TrainConfig):
    from functional_pp.config.sparse_recipe import read_recipe
    return read_recipe(cfg.llmcompressor).predicate(_hf_names(cfg))


def check_sparse_targets(cfg: TrainConfig, decls) -> None:
    """Each target of ``llmcompressor``'s ConstantPruningModifier names a parameter of the model (a
    misspelt one would leave its weights' zeros free to train, silently)."""
    if cfg.llmcompressor is None:
        return
    from functional_pp.config.sparse_recipe import SparseRecipe, read_recipe
    from functional_pp.core.tree import leaves_with_paths
    recipe, name = read_recipe(cfg.llmcompressor), _hf_names(cfg)
    names = [n for n in (name(p) for p, _ in leaves_with_paths(decls)) if n is not None]
    for target in recipe.targets:
        if not any(SparseRecipe([target], False).matches(n) for n in names):
            raise ConfigError(f"llmcompressor: the ConstantPruningModifier target {target!r} names no parameter of "
                              f"this model (its Hugging Face names: {', '.join(names[:4])}, ...): correct or remove it")


_MOMENTS = {"adamw": optim.scale_by_adam, "adamw_8bit": optim.scale_by_adam_8bit,
            "adamw_4bit": optim.scale_by_adam_4bit}


def _lisa_adamw(cfg: TrainConfig, schedule):
    """``lisa_n_layers`` / ``lisa_step_interval``: the config's AdamW (its moments, decay, clipping
    and schedule) with LISA's sampled layers (``optim.sample_layers``; docs/optim.md "LISA")."""
    moments = _MOMENTS[cfg.optimizer](cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon)
    sampled = optim.sample_layers(moments, n_layers=cfg.lisa_n_layers, interval=cfg.lisa_step_interval,
                                  total_steps=cfg.max_steps, weight_decay=cfg.weight_decay,
                                  mask=optim.decay_mask_by_ndim, clip_norm=cfg.max_grad_norm)
    return optim.chain(sampled, optim.scale_by_learning_rate(schedule))


def check_lisa_layers(cfg: TrainConfig, decls) -> None:
    """LISA's draws need the model's decoder layers (``layers.N``) and at most as many to draw."""
    if cfg.lisa_n_layers is None:
        return
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.optim.layer_sampling import layer_of_path
    found = {layer_of_path(p) for p, _ in leaves_with_paths(decls)} - {None}
    if not found:
        raise ConfigError("lisa_n_layers: this model has no decoder layers to draw (layers.N): remove the lisa_* keys")
    if cfg.lisa_n_layers > len(found):
        raise ConfigError(f"lisa_n_layers: {cfg.lisa_n_layers} but the model has {len(found)} decoder layers: give "
                          f"at most {len(found)}")
