"""Which model a training config trains: its family (:mod:`functional_pp.models.family`,
``model.family``) and that family's config, from the ``model`` section (a preset and
overrides) or from a Hugging Face ``base_model`` directory's ``config.json``."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from functional_pp.config.schema import ConfigError
from functional_pp.models.family import ModelFamily, UnknownFamilyError, get_family

__all__ = ["model_family", "model_config"]


def model_family(cfg: Any) -> ModelFamily:
    """The :class:`ModelFamily` named by ``cfg.model.family``."""
    try:
        return get_family(cfg.model.family)
    except UnknownFamilyError as exc:
        raise ConfigError(f"model.family: {exc}") from exc


def model_config(cfg: Any) -> Any:
    """The model's config (``llama.Config`` for llama): from ``base_model/config.json``, or the
    preset and overrides of the ``model`` section."""
    overrides = getattr(cfg, "overrides_of_model_config", None)
    if cfg.base_model is None:
        if overrides:
            raise ConfigError("overrides_of_model_config (model_config) replaces keys of base_model's config.json; "
                              "without base_model give them in the model section (model: {preset: ..., KEY: ...})")
        return _with_loss_chunks(cfg, _with_moe_options(cfg, cfg.model.build()))
    family = model_family(cfg)
    if family.hf_config_from_dict is None:
        raise ConfigError(f"base_model: model family {family.name!r} has no Hugging Face mapping; "
                          f"train it from a preset (model: {{family: {family.name}, preset: ...}})")
    path = Path(cfg.base_model) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: cannot read {path}: "
                          f"{exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: {path} is not valid JSON: {exc}") from exc
    if isinstance(hf, dict):                       # (the names its files hold: Replit's MPT)
        from functional_pp.models.remote_code_hf import with_file_layout
        hf = with_file_layout(hf, cfg.base_model)
    if overrides:
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise ConfigError(f"overrides_of_model_config must map config.json keys to values, got {overrides!r}")
        hf = {**hf, **overrides}          # as transformers' setattr on the loaded config (Axolotl's)
    try:
        model = family.hf_config_from_dict(hf)
    except (ValueError, KeyError, TypeError) as exc:
        where = f" with overrides_of_model_config {overrides}" if overrides else ""
        raise ConfigError(f"base_model {cfg.base_model!r}{where}: {exc}") from exc
    if getattr(cfg, "processor_type", None):            # images: the vision encoder and projector too
        import dataclasses
        from functional_pp.models.llama_hf import vision_from_hf
        try:
            model = dataclasses.replace(model, vision=vision_from_hf(hf))
        except ValueError as exc:
            raise ConfigError(f"processor_type: {exc}") from exc
    _refuse_dropout_where_unbuilt(cfg, model)
    named = getattr(cfg, "model_type", None)
    if named in AXOLOTL_CLASSES and getattr(model, "model_type", None) != AXOLOTL_CLASSES[named]:
        raise ConfigError(f"model_type: {named} is a {AXOLOTL_CLASSES[named]} model, but base_model "
                          f"{cfg.base_model!r}'s config.json has model_type {getattr(model, 'model_type', None)!r}; "
                          f"remove model_type (the architecture is config.json's)")
    model = _with_linearized_experts(cfg, model)
    return _with_loss_chunks(cfg, _with_score_head(cfg, _with_moe_options(cfg, _with_added_tokens(cfg, model))))


def _with_loss_chunks(cfg: Any, model: Any) -> Any:
    """``model`` with the config's ``loss_chunks`` / ``loss_chunk_bytes`` (the LM head and
    cross-entropy over token chunks). A model whose logits are soft-capped, scaled or biased, and an
    objective other than the next-token loss (preference, reward, diffusion), keep the whole logits
    (the chunked loss computes none of these), said in the start-up notes; a model config without
    the option is refused by name."""
    given = {k: getattr(cfg, k, None) for k in ("loss_chunks", "loss_chunk_bytes")}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return model
    key, value = next(iter(given.items()))
    if not all(hasattr(model, k) for k in given):
        raise ConfigError(f"{key}: the model's config ({type(model).__name__}) has no chunked LM head loss: "
                          f"remove {key}")
    reason = loss_chunking_refused(cfg, model)
    if reason:
        note = f"{key}: {value} not applied: {reason}; the whole logits are formed"
        if note not in cfg.notes:
            cfg.notes.append(note)
        return model
    other = {"loss_chunks": "loss_chunk_bytes", "loss_chunk_bytes": "loss_chunks"}[key]
    return dataclasses.replace(model, **{key: value, other: None})


def loss_chunking_refused(cfg: Any, model: Any) -> str | None:
    """Why ``model`` trained by ``cfg`` keeps the whole logits under ``loss_chunks``, or None where
    the chunked head loss applies: a model config without the option, logits soft-capped, scaled
    or biased, an objective other than the next-token loss (the planner searches the lever only
    where this is None: cli/plan.py ``config_space``)."""
    if not hasattr(model, "loss_chunks"):
        return f"the model's config ({type(model).__name__}) has no chunked LM head loss"
    objective = next((name for name, on in (
        (f"rl: {getattr(cfg, 'rl', None)}", getattr(cfg, "rl", None)),
        ("reward_model", getattr(cfg, "reward_model", False)),
        ("process_reward_model", getattr(cfg, "process_reward_model", False)),
        ("diffusion", getattr(cfg, "diffusion", None) is not None)) if on), None)
    why = [w for w, on in (("soft-capped (final_logit_softcapping)", getattr(model, "final_softcap", None)),
                           ("scaled (logit_scale)", getattr(model, "logit_scale", 1) != 1),
                           ("biased (an lm_head bias)", getattr(model, "lm_head_bias", False))) if on]
    if objective:
        return f"{objective}'s objective reads the whole logits (not the next-token loss)"
    if why:
        return f"this model's logits are {' and '.join(why)}, which the chunked head loss does not compute"
    return None


AXOLOTL_CLASSES = {"MambaLMHeadModel": "mamba"}
"""Axolotl's ``model_type`` class names that are not a transformers ``*ForCausalLM`` (mamba_ssm's
``MambaLMHeadModel``) -> the ``config.json`` ``model_type`` they must name."""


def _with_linearized_experts(cfg: Any, model: Any) -> Any:
    """``model`` marked ``experts_linearized`` where base_model's files hold Axolotl's linearized
    Llama 4 experts (export writes them back so); ``llama4_linearized_experts: true`` refused by
    name for other files (Axolotl's patch would not find its per-expert linears there)."""
    if getattr(model, "model_type", None) != "llama4_text":
        if getattr(cfg, "llama4_linearized_experts", False):
            raise ConfigError(f"llama4_linearized_experts: base_model {cfg.base_model!r} is "
                              f"{getattr(model, 'model_type', None)!r}, not Llama 4 (llama4 / llama4_text): "
                              f"remove the key")
        return model
    from functional_pp.checkpoint.format import CheckpointError
    from functional_pp.checkpoint.hf import experts_linearized
    try:
        linear = experts_linearized(cfg.base_model)
    except CheckpointError:             # (no weights: the loader names what is missing, before any work)
        linear = None
    if getattr(cfg, "llama4_linearized_experts", False) and linear is False:
        raise ConfigError(f"llama4_linearized_experts: base_model {cfg.base_model!r} holds the stacked experts "
                          f"(feed_forward.experts.gate_up_proj), not Axolotl's linearized ones "
                          f"(feed_forward.experts.gate_projs.N): remove the key (they are read as they are)")
    return dataclasses.replace(model, experts_linearized=True) if linear else model


def _refuse_dropout_where_unbuilt(cfg: Any, model: Any) -> None:
    """A model with dropout (config.json's ``attention_dropout`` / ``residual_dropout`` /
    ``embedding_dropout``) under a compiled step or pipeline stages, refused before any work
    (models/dropout_seeds.py)."""
    keys = ("attention_dropout", "residual_dropout", "embedding_dropout")
    rates = {k: getattr(model, k, 0.0) for k in keys if getattr(model, k, 0.0)}
    where = ("torch_compile" if getattr(cfg, "compile", False) else
             "pp_size" if getattr(cfg, "pp_size", 1) != 1 else None)
    if rates and where:
        what = ", ".join(f"{k}={v}" for k, v in rates.items())
        raise ConfigError(f"base_model {cfg.base_model!r}: config.json's {what} with {where} is not supported "
                          f"(dropout's mask seed advances on the host every forward); set {where} off, or "
                          f"overrides_of_model_config: {{{', '.join(f'{k}: 0.0' for k in rates)}}} to train "
                          f"without dropout")


_MOE_OPTIONS = ("router_z_loss_coef", "capacity_factor", "expert_parallel_token_capacity")
_MODEL_FIELD = {"expert_parallel_token_capacity": "token_capacity"}       # (the config key -> the model's)


def _with_moe_options(cfg: Any, model: Any) -> Any:
    """``model`` with the config's mixture-of-experts training options (``router_z_loss_coef``,
    ``capacity_factor``, ``expert_parallel_token_capacity`` as ``token_capacity``) where given; refused by name for a model without experts."""
    given = {k: getattr(cfg, k, None) for k in _MOE_OPTIONS if getattr(cfg, k, None) is not None}
    if not given:
        return model
    if not getattr(model, "experts", 0):
        raise ConfigError(f"{', '.join(given)}: the model has no mixture of experts (experts=0); remove "
                          f"{'them' if len(given) > 1 else 'it'}")
    try:
        return dataclasses.replace(model, **{_MODEL_FIELD.get(k, k): v for k, v in given.items()})
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _with_score_head(cfg: Any, model: Any) -> Any:
    """``model`` with the score head of ``reward_model`` (each sequence's score: "sequence") or
    ``process_reward_model`` (each token's: "token"; models/score_head.py), ``num_labels`` of
    them; a base_model that is itself a classifier keeps its head, which must be that one."""
    if not hasattr(model, "score_head"):
        if getattr(cfg, "reward_model", False) or getattr(cfg, "process_reward_model", False):
            raise ConfigError(f"reward_model / process_reward_model: model family {cfg.model.family!r} has no "
                              f"score head (the decoder's llama.Config has)")
        return model
    kind = "sequence" if cfg.reward_model else "token" if cfg.process_reward_model else None
    key = "reward_model" if cfg.reward_model else "process_reward_model"
    if kind is None:
        if model.score_head is not None:
            raise ConfigError(f"base_model {cfg.base_model!r} is a {model.score_head} classifier (its "
                              f"config.json's architectures), not a causal LM: set "
                              f"{'reward_model' if model.score_head == 'sequence' else 'process_reward_model'}: "
                              f"true to train it, or give a causal LM")
        return model
    if model.score_head not in (None, kind):
        raise ConfigError(f"{key}: base_model {cfg.base_model!r} is a {model.score_head} classifier; {key} "
                          f"trains a {kind} one: give a causal LM or a {kind} classifier")
    labels = cfg.num_labels or (model.num_labels if model.score_head else 1 if kind == "sequence" else 2)
    if model.score_head is not None and labels != model.num_labels:
        raise ConfigError(f"num_labels {labels}, but base_model {cfg.base_model!r}'s head has {model.num_labels} "
                          f"labels: set num_labels: {model.num_labels} (or train from the causal LM)")
    bias = model.score_bias if model.score_head else kind == "token"     # (transformers' defaults)
    return dataclasses.replace(model, score_head=kind, num_labels=labels, score_bias=bias)


def _with_added_tokens(cfg: Any, model: Any) -> Any:
    """``model`` with its vocabulary grown to hold ``cfg.tokens`` (Axolotl's added tokens) when
    the tokenizer with them is larger than the model's embedding (transformers' resize), rounded
    up to a multiple of 32 with ``resize_token_embeddings_to_32x`` (Axolotl's rule: never shrunk)."""
    if not (cfg.tokens or cfg.resize_token_embeddings_to_32x) or not hasattr(model, "vocab"):
        return model
    from functional_pp.data.tokenizer import HFTokenizer
    path = cfg.tokenizer or cfg.data.tokenizer or cfg.base_model
    try:
        tok = HFTokenizer(path, model_dir=cfg.base_model)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"tokens: need the tokenizer to add them to: {exc}") from exc
    tok.add_tokens(cfg.tokens or [])
    want = -(-tok.vocab_size // 32) * 32 if cfg.resize_token_embeddings_to_32x else tok.vocab_size
    return dataclasses.replace(model, vocab=want) if want > model.vocab else model
