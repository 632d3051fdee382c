"""Ready-made optimizers (``sgd``, ``adamw``) and ``from_config``."""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Optional

from functional_pp.optim import schedules as _sched
from functional_pp.optim.adam import scale_by_adam
from functional_pp.optim.adam8bit import BLOCK, BLOCK_4BIT, scale_by_adam_4bit, scale_by_adam_8bit
from functional_pp.optim.base import (GradientTransformation, ScalarOrSchedule, check_learning_rate, check_number,
                                      scale_by_learning_rate, trace)
from functional_pp.optim.bounds import adamw_bound
from functional_pp.optim.clipping import clip_by_global_norm
from functional_pp.optim.combine import chain
from functional_pp.optim.fused import adamw_in_place
from functional_pp.optim.masking import Mask, add_decayed_weights

__all__ = ["sgd", "adamw", "adamw_8bit", "adamw_4bit", "make_schedule", "from_config", "CONFIG_KEYS"]


def _maybe_clip(clip_norm: Optional[float]) -> list[GradientTransformation]:
    return [clip_by_global_norm(clip_norm)] if clip_norm is not None else []


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Mask = None,
    clip_norm: Optional[float] = None,
) -> GradientTransformation:
    """SGD equivalent to ``torch.optim.SGD`` (coupled L2 weight decay, dampening 0).

    Chain: [clip_by_global_norm] -> add_decayed_weights -> trace -> scale(-lr).
    Arguments are range-checked here (a ``ValueError`` names the bad one).
    """
    lr = check_learning_rate("sgd", lr)
    momentum = check_number("sgd", "momentum", momentum, low=0.0, high=1.0, high_open=True,
                            hint=" (e.g. 0.9, or 0 for none)")
    if nesterov and momentum <= 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
    parts = _maybe_clip(clip_norm)
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask))
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    clip_norm: Optional[float] = None,
) -> GradientTransformation:
    """AdamW equivalent to ``torch.optim.AdamW`` (decoupled decay scaled by lr):
    ``p <- p - lr * (adam_update + wd * p)``.

    Chain: [clip_by_global_norm] -> scale_by_adam -> add_decayed_weights(mask) ->
    scale_by_learning_rate. Arguments are range-checked here (a ``ValueError`` names the bad
    one). Given donated gradients (the training step's), the chain works in place on them.
    Its in-place step (``optim.in_place_step``: a training step with donated state) is one
    fused kernel pass (``optim.fused``); its pre-update bound (``optim.update_bound``) lets a
    step that writes into its state show the result finite first (``optim.bounds``).
    """
    lr = check_learning_rate("adamw", lr)
    opt = chain(*_maybe_clip(clip_norm), scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                scale_by_learning_rate(lr))
    return GradientTransformation(
        opt.init, opt.update, returns=opt.returns,
        in_place=adamw_in_place(lr, float(b1), float(b2), float(eps), float(weight_decay), mask,
                                None if clip_norm is None else float(clip_norm)),
        bound=adamw_bound(lr, float(b1), float(eps), float(weight_decay)))


def _low_bit_adamw(name: str, moments: GradientTransformation, lr: ScalarOrSchedule, weight_decay: float,
                   mask: Mask, clip_norm: Optional[float]) -> GradientTransformation:
    """:func:`adamw` with ``moments`` (a low-bit ``scale_by_adam``) in its place."""
    lr = check_learning_rate(name, lr)
    return chain(*_maybe_clip(clip_norm), moments, add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(lr))


def adamw_8bit(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    clip_norm: Optional[float] = None,
    *,
    block: int = BLOCK,
) -> GradientTransformation:
    """AdamW with 8-bit moments (bitsandbytes' ``AdamW8bit``: blockwise dynamic quantization,
    blocks of ``block`` along the last dimension, vectors kept fp32;
    :mod:`functional_pp.optim.adam8bit`): :func:`adamw` with ``scale_by_adam_8bit`` in
    place of ``scale_by_adam``. State: 2 bytes per parameter plus 8 per block, instead of 8."""
    return _low_bit_adamw("adamw_8bit", scale_by_adam_8bit(b1, b2, eps, block=block), lr, weight_decay,
                          mask, clip_norm)


def adamw_4bit(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    clip_norm: Optional[float] = None,
    *,
    block: int = BLOCK_4BIT,
) -> GradientTransformation:
    """AdamW with 4-bit moments (torchao's ``AdamW4bit``; :func:`scale_by_adam_4bit`): :func:`adamw`
    with ``scale_by_adam_4bit`` in place of ``scale_by_adam``. State: 1 byte per parameter plus 8
    per block of ``block``, instead of 8."""
    return _low_bit_adamw("adamw_4bit", scale_by_adam_4bit(b1, b2, eps, block=block), lr, weight_decay,
                          mask, clip_norm)


# --------------------------------------------------------------------------- #
# config
# --------------------------------------------------------------------------- #
_SCHEDULES = ("constant", "cosine", "linear")
_COMMON_KEYS = (
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "lr_schedule",
    "warmup_steps",
    "total_steps",
    "min_lr",
    "quadratic_warmup",
    "constant_ratio",
    "mask",
)
_OPT_KEYS = {
    "sgd": _COMMON_KEYS + ("momentum", "nesterov"),
    "adamw": _COMMON_KEYS + ("betas", "b1", "b2", "eps"),
    "adamw_8bit": _COMMON_KEYS + ("betas", "b1", "b2", "eps"),
    "adamw_4bit": _COMMON_KEYS + ("betas", "b1", "b2", "eps"),
}
CONFIG_KEYS = tuple(sorted({k for ks in _OPT_KEYS.values() for k in ks}))


def _closest(word: str, options) -> str:
    m = difflib.get_close_matches(word, list(options), n=1, cutoff=0.0)
    return m[0] if m else ""


def make_schedule(
    learning_rate: float,
    lr_schedule: Optional[str] = "constant",
    warmup_steps: int = 0,
    total_steps: Optional[int] = None,
    min_lr: float = 0.0,
    quadratic_warmup: bool = False,
    constant_ratio: Optional[float] = None,
) -> ScalarOrSchedule:
    """Build an lr (float or schedule) from config values.

    ``constant`` (+ optional linear warmup; ``min_lr``/``total_steps`` ignored),
    ``cosine`` or ``linear`` (warmup then decay to ``min_lr`` at ``total_steps``).
    ``cosine`` only: ``quadratic_warmup`` (Axolotl's ``lr_quadratic_warmup``) and
    ``constant_ratio`` (``cosine_constant_lr_ratio``: the cosine reaches ``min_lr`` at that
    fraction of ``total_steps`` and holds it, :func:`~functional_pp.optim.schedules.warmup_cosine_constant`).
    Values are range-checked (``min_lr`` may not exceed ``learning_rate``).
    """
    kind = (lr_schedule or "constant").lower()
    learning_rate = check_learning_rate("make_schedule", learning_rate)
    warmup_steps = _sched.check_steps("make_schedule", "warmup_steps", warmup_steps or 0)
    if kind not in _SCHEDULES:
        raise ValueError(
            f"unknown lr_schedule {lr_schedule!r}; did you mean {_closest(kind, _SCHEDULES)!r}? "
            f"(valid: {', '.join(_SCHEDULES)})"
        )
    min_lr = _sched.check_end_value("make_schedule", "min_lr", min_lr or 0.0, learning_rate)
    if kind == "constant":
        return learning_rate if warmup_steps == 0 else _sched.linear_warmup(learning_rate, warmup_steps)
    if total_steps is None:
        raise ValueError(f"lr_schedule {kind!r} requires total_steps")
    if (quadratic_warmup or constant_ratio is not None) and kind != "cosine":
        raise ValueError(f"quadratic_warmup / constant_ratio shape a cosine schedule, not lr_schedule {kind!r}")
    if quadratic_warmup and constant_ratio is not None:
        raise ValueError("quadratic_warmup and constant_ratio are two different cosine schedules: choose one")
    if constant_ratio is not None:
        return _sched.warmup_cosine_constant(learning_rate, warmup_steps, total_steps, constant_ratio, min_lr)
    if kind == "cosine":
        return _sched.warmup_cosine_decay(learning_rate, warmup_steps, total_steps, min_lr, 2 if quadratic_warmup else 1)
    return _sched.warmup_linear_decay(learning_rate, warmup_steps, total_steps, min_lr)


def from_config(name: str, **kwargs: Any) -> GradientTransformation:
    """Build an optimizer from a config dict (e.g. ``from_config(**cfg["optimizer"])``).

    ``name``: ``sgd``, ``adamw``, ``adamw_8bit`` (8-bit moments) or ``adamw_4bit`` (4-bit).  Keys: ``learning_rate`` (required),
    ``weight_decay``, ``max_grad_norm``, ``lr_schedule`` (constant|cosine|linear),
    ``warmup_steps``, ``total_steps``, ``min_lr``, ``quadratic_warmup``, ``constant_ratio``
    (:func:`make_schedule`), ``mask``; sgd: ``momentum``,
    ``nesterov``; adamw: ``betas`` (pair) or ``b1``/``b2``, ``eps``.
    Unknown keys raise ``ValueError`` naming the closest valid key; a known key
    that does not apply to ``name`` raises too unless its value is ``None``.
    """
    opt = str(name).lower()
    if opt not in _OPT_KEYS:
        raise ValueError(f"unknown optimizer name {name!r}; did you mean {_closest(opt, _OPT_KEYS)!r}?")
    valid = _OPT_KEYS[opt]
    for key, value in kwargs.items():
        if key in valid:
            continue
        if key not in CONFIG_KEYS:
            raise ValueError(f"unknown optimizer config key {key!r}; did you mean {_closest(key, CONFIG_KEYS)!r}?")
        if value is not None:
            raise ValueError(
                f"optimizer config key {key!r} does not apply to {opt!r}; "
                f"did you mean {_closest(key, valid)!r}? (valid: {', '.join(valid)})"
            )
    cfg = {k: v for k, v in kwargs.items() if v is not None}
    if "learning_rate" not in cfg:
        raise ValueError("optimizer config requires 'learning_rate'")
    lr = make_schedule(
        cfg["learning_rate"],
        cfg.get("lr_schedule", "constant"),
        cfg.get("warmup_steps", 0),
        cfg.get("total_steps"),
        cfg.get("min_lr", 0.0),
        quadratic_warmup=bool(cfg.get("quadratic_warmup", False)),
        constant_ratio=cfg.get("constant_ratio"),
    )
    common = dict(
        weight_decay=float(cfg.get("weight_decay", 0.0)),
        mask=cfg.get("mask"),
        clip_norm=float(cfg["max_grad_norm"]) if "max_grad_norm" in cfg else None,
    )
    if opt == "sgd":
        return sgd(lr, momentum=float(cfg.get("momentum", 0.0)), nesterov=bool(cfg.get("nesterov", False)), **common)
    b1, b2 = 0.9, 0.95
    if "betas" in cfg:
        if "b1" in cfg or "b2" in cfg:
            raise ValueError("give either 'betas' or 'b1'/'b2', not both")
        betas = tuple(cfg["betas"])
        if len(betas) != 2:
            raise ValueError(f"'betas' must have two values, got {cfg['betas']!r}")
        b1, b2 = float(betas[0]), float(betas[1])
    b1 = float(cfg.get("b1", b1))
    b2 = float(cfg.get("b2", b2))
    build = {"adamw_8bit": adamw_8bit, "adamw_4bit": adamw_4bit}.get(opt, adamw)
    return build(lr, b1=b1, b2=b2, eps=float(cfg.get("eps", 1e-8)), **common)


def scale_by_adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, mask: Mask = None) -> GradientTransformation:
    """Deprecated name: ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, which is what it computed."""
    warnings.warn("optim.scale_by_adamw is deprecated: use optim.adamw(...) or chain(scale_by_adam, "
                  "add_decayed_weights, scale_by_learning_rate)", DeprecationWarning, stacklevel=2)
    return chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))
