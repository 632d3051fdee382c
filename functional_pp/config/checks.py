"""The checks of a training config: :func:`check_values` (ranges and consistency of the
values, run while parsing so that all problems of a file are reported at once) and
:func:`check_world` (what depends on the device count, the model and the data, run before any
work). Every problem raises :class:`ConfigError` saying what to change (``docs/config.md``)."""
from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

from functional_pp.config.keys import ADAM_OPTIMIZERS, LORA_KEYS, MESH_KEYS
from functional_pp.config.models import model_config, model_family
from functional_pp.config.schema import ConfigError, Issues, suggest

__all__ = ["check_values", "check_world", "resolved_precision"]




_BNB_KEYS = {"bnb_4bit_use_double_quant": (bool,), "bnb_4bit_quant_type": ("nf4",),
             "bnb_4bit_compute_dtype": None, "llm_int8_has_fp16_weight": (False,)}


def check_base_quantization(cfg: Any, add) -> None:
    """``load_in_4bit`` / ``load_in_8bit`` / ``bnb_config_kwargs``: a quantized frozen base under an
    adapter only, one of the two, and bitsandbytes options we implement."""
    if cfg.load_in_4bit and cfg.load_in_8bit:
        add("load_in_4bit and load_in_8bit are both set: choose one (4-bit NF4 for QLoRA)")
    if cfg.adapter == "qlora" and cfg.load_in_8bit:
        add("adapter: qlora quantizes the base to 4 bit (NF4): remove load_in_8bit, or use adapter: lora "
            "with load_in_8bit: true")
    if (cfg.load_in_4bit or cfg.load_in_8bit) and cfg.adapter is None:
        which = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
        add(f"{which}: a quantized base is frozen, so it trains only under an adapter: add adapter: qlora "
            f"(or adapter: lora), or remove {which} (bf16: true trains in bf16)")
    if cfg.quantize_moe_experts and not (cfg.load_in_4bit or cfg.load_in_8bit
                                                             or cfg.adapter == "qlora"):
        add("quantize_moe_experts quantizes the experts as the frozen base is quantized: add load_in_4bit: true "
            "with adapter: qlora (or load_in_8bit: true with adapter: lora), or remove quantize_moe_experts")
    if cfg.gptq:
        check_gptq(cfg, add)
    if cfg.nvfp4_merge_aware:
        check_nvfp4_merge_aware(cfg, add)
    kw = cfg.bnb_config_kwargs or {}
    if not isinstance(kw, dict):
        add(f"bnb_config_kwargs must be a mapping, got {kw!r}")
        return
    for k, v in kw.items():
        if k not in _BNB_KEYS:
            add(f"bnb_config_kwargs.{k} is not supported (supported: {', '.join(_BNB_KEYS)}): remove it")
        elif _BNB_KEYS[k] == (bool,) and not isinstance(v, bool):
            add(f"bnb_config_kwargs.{k} must be true or false, got {v!r}")
        elif _BNB_KEYS[k] not in (None, (bool,)) and v not in _BNB_KEYS[k]:
            add(f"bnb_config_kwargs.{k}: {v!r} is not supported (only {_BNB_KEYS[k][0]!r}: NF4 codes, "
                f"dequantized in the run's precision)")


def check_gptq(cfg: Any, add) -> None:
    """``gptq: true``: a GPTQ base (read dequantized), frozen under ``adapter: lora``, not
    re-quantized; a local ``base_model`` must say ``quant_method: gptq`` in its config.json."""
    if cfg.adapter != "lora":
        add(f"gptq: true with adapter: {cfg.adapter}: the GPTQ base is frozen, so it trains under adapter: lora "
            f"(as in Axolotl): set adapter: lora")
    for key in ("load_in_4bit", "load_in_8bit"):
        if getattr(cfg, key):
            add(f"gptq: true with {key}: a GPTQ base is read dequantized, not quantized again: remove {key}")
    conf = Path(str(cfg.base_model or "")) / "config.json"
    if cfg.base_model and conf.is_file():
        try:
            qc = json.loads(conf.read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            return                                  # (an unreadable config.json is reported where it is read)
        if not isinstance(qc, dict) or qc.get("quant_method") != "gptq":
            add(f"gptq: true but {conf} has no GPTQ quantization_config (quant_method: gptq; found "
                f"{qc.get('quant_method') if isinstance(qc, dict) else qc!r}): remove gptq or use a GPTQ checkpoint")


def check_nvfp4_merge_aware(cfg: Any, add) -> None:
    """``nvfp4_merge_aware`` (Axolotl's): plain LoRA (``adapter: lora``, as Axolotl requires) of a
    ModelOpt NVFP4 base; a local ``base_model`` must say ``quant_algo: NVFP4`` in its config.json."""
    if cfg.adapter not in (None, "lora"):        # (None: refused with the other LoRA keys)
        add(f"nvfp4_merge_aware with adapter: {cfg.adapter}: it trains LoRA adapters through the merged weight "
            f"re-quantized to NVFP4 (as in Axolotl, adapter: lora): set adapter: lora")
    for key in ("load_in_4bit", "load_in_8bit", "gptq"):
        if getattr(cfg, key):
            add(f"nvfp4_merge_aware with {key}: its base is the ModelOpt NVFP4 checkpoint, read dequantized: "
                f"remove {key}")
    if cfg.qat:
        add("nvfp4_merge_aware with qat: both fake-quantize the adapted weights (merge-aware NVFP4 the merged "
            "weight with the base's scale): remove one of them")
    conf = Path(str(cfg.base_model or "")) / "config.json"
    if cfg.base_model and conf.is_file():
        try:
            qc = json.loads(conf.read_text()).get("quantization_config") or {}
        except (OSError, ValueError):
            return                                  # (an unreadable config.json is reported where it is read)
        if not isinstance(qc, dict) or (qc.get("quant_method"), qc.get("quant_algo")) != ("modelopt", "NVFP4"):
            add(f"nvfp4_merge_aware but {conf} has no ModelOpt NVFP4 quantization_config (quant_method: modelopt, "
                f"quant_algo: NVFP4): its merged export writes that checkpoint's NVFP4 layout; remove "
                f"nvfp4_merge_aware or use a ModelOpt NVFP4 checkpoint")


def check_model_quantization(cfg: Any, add) -> None:
    """``model_quantization_config`` (Axolotl passes it to transformers' ``from_pretrained``):
    ``Mxfp4Config`` with ``dequantize: true``, which is how an MXFP4 checkpoint is always read here."""
    name, kw = cfg.model_quantization_config, cfg.model_quantization_config_kwargs
    if name is None:
        if kw:
            add("model_quantization_config_kwargs without model_quantization_config: remove it")
        return
    if name != "Mxfp4Config":
        add(f"'model_quantization_config: {name}' is not supported (only Mxfp4Config with dequantize: true, "
            f"gpt-oss's MXFP4 experts read dequantized): remove it")
        return
    kw = kw or {}
    if not isinstance(kw, dict):
        add(f"model_quantization_config_kwargs must be a mapping (dequantize: true), got {kw!r}")
        return
    for k in kw:
        if k != "dequantize":
            add(f"model_quantization_config_kwargs.{k} is not supported (Mxfp4Config's option here is "
                f"dequantize: true): remove it")
    if kw.get("dequantize") is not True:
        add(f"model_quantization_config: Mxfp4Config needs dequantize: true in model_quantization_config_kwargs "
            f"(got dequantize: {kw.get('dequantize')!r}): training updates the experts' weights, which are "
            f"read dequantized from MXFP4 (MXFP4 weights themselves cannot be trained)")


_QAT_KEYS = ("weight_dtype", "activation_dtype", "group_size", "fake_quant_after_n_steps", "quantize_embedding")


def check_llmcompressor(cfg: Any, add) -> None:
    """``llmcompressor:`` (Axolotl's LLMCompressorPlugin): a recipe of ConstantPruningModifier only
    (config/sparse_recipe.py), on the full weights (no adapter); ``save_compressed`` noted."""
    if cfg.llmcompressor is None:
        return
    from functional_pp.config.sparse_recipe import read_recipe
    try:
        recipe = read_recipe(cfg.llmcompressor)
    except ValueError as exc:
        add(str(exc))
        return
    if cfg.adapter:
        add(f"llmcompressor with adapter: {cfg.adapter} is not supported (the recipe keeps the zeros of the trained "
            f"weights; an adapter trains others, and merging it fills the zeros): remove one of them")
    note = ("llmcompressor.save_compressed (checkpoints and exports are written dense, the zeros kept; "
            "compressed-tensors' sparse format is not written)")
    if recipe.save_compressed and note not in cfg.notes:
        cfg.notes.append(note)


def check_diffusion(cfg: Any, add) -> None:
    """``diffusion:`` (Axolotl's DiffusionPlugin): a mapping of its options, each in range; what the
    objective cannot run with refused by name. Its keys that do not change training are noted."""
    d = cfg.diffusion
    if d is None:
        return
    if not isinstance(d, dict):
        add(f"diffusion must be a mapping (mask_token_id, eps, importance_weighting, ...), got {d!r}")
        return
    import dataclasses
    from functional_pp.models.diffusion_lm import SAMPLING_KEYS, DiffusionSpec
    options = [f.name for f in dataclasses.fields(DiffusionSpec)]
    unknown = sorted(set(d) - set(options))
    if unknown:
        add(f"diffusion.{unknown[0]} is not an option of diffusion (options: {', '.join(options)}): remove it")
        return
    try:
        spec = DiffusionSpec.from_mapping(d)
    except ValueError as exc:
        add(str(exc))
        return
    if spec.mask_token_id is None:
        add("diffusion.mask_token_id is not set: give the id of a token of the vocabulary to mask with (adding a "
            "token, mask_token_str, is not supported)")
    elif spec.mask_token_str is not None and "diffusion.mask_token_str" not in " ".join(cfg.notes):
        cfg.notes.append("diffusion.mask_token_str (mask_token_id is given: the id is used, as in Axolotl)")
    for key, on in (("rl", cfg.rl), ("reward_model", cfg.reward_model),
                    ("process_reward_model", cfg.process_reward_model)):
        if on:
            add(f"diffusion with {key}: {on} is not supported (the diffusion objective replaces the causal "
                f"language-model loss): remove one of them")
    if (cfg.pp_size or 1) > 1:
        add("diffusion with pp_size > 1 is not supported yet (its masks are drawn per forward, which a "
            "pipeline's stages count apart): use FSDP, TP or CP (pp_size 1)")
    if cfg.compile:
        add("diffusion with torch_compile is not supported (its mask seed advances on the host every forward): "
            "set torch_compile: false")
    if cfg.qat:
        add("diffusion with qat is not supported: remove one of them")
    sampling = [k for k in SAMPLING_KEYS if k in d]
    note = (f"diffusion: {', '.join(sampling) + ' (' if sampling else ''}no samples are generated during "
                     f"training{')' if sampling else ''}; noise_schedule, min_mask_ratio and max_mask_ratio do not "
                     f"change the masking (p = (1 - eps) t + eps, t uniform: as Axolotl's trainer)")
    if note not in cfg.notes:
        cfg.notes.append(note)


def check_qat(cfg: Any, add) -> None:
    """``qat:`` (Axolotl's QATConfig): the schemes built here (int4 weights with int8 per-token
    inputs, or NVFP4 weights and inputs in blocks of 16; Axolotl's default weight_dtype int8 alone
    is refused by Axolotl too), full fine-tuning."""
    q = cfg.qat
    if q is None:
        return
    if not isinstance(q, dict):
        add(f"qat must be a mapping (weight_dtype, activation_dtype, group_size, fake_quant_after_n_steps), "
            f"got {q!r}")
        return
    for k in q:
        if k not in _QAT_KEYS:
            add(f"qat.{k} is not a QAT option (options: {', '.join(_QAT_KEYS)}): remove it")
    w, a = q.get("weight_dtype", "int8"), q.get("activation_dtype")
    if (w, a) not in (("int4", "int8"), ("nvfp4", "nvfp4")):
        add(f"'qat: weight_dtype {w}, activation_dtype {a}' is not supported (built: weight_dtype: int4 with "
            f"activation_dtype: int8, torchao's Int8DynamicActivationInt4Weight; weight_dtype and "
            f"activation_dtype nvfp4, its NVFP4DynamicActivationNVFP4Weight): use those or remove qat")
    g = q.get("group_size", 32)
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
        add(f"qat.group_size must be a positive whole number (input features per group), got {g!r}")
    elif w == "nvfp4" and g not in (None, 16):
        add(f"qat.group_size {g} with weight_dtype nvfp4: NVFP4's blocks are 16 inputs (as in Axolotl): "
            f"set group_size: 16")
    n = q.get("fake_quant_after_n_steps")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        add(f"qat.fake_quant_after_n_steps must be a whole number of steps >= 0, got {n!r}")
    if q.get("quantize_embedding"):
        add("'qat.quantize_embedding' is not supported (the embedding is not fake-quantized here): remove it")
    if cfg.rl:
        add(f"qat with rl: {cfg.rl} is not supported (QAT is built for supervised fine-tuning): remove qat")
    if cfg.adapter or cfg.load_in_4bit or cfg.load_in_8bit:
        add("qat with an adapter or a quantized base is not supported (QAT here fake-quantizes the trained "
            "weights of full fine-tuning): remove qat or the adapter")


#: ``rl:`` methods trained here (docs/preference.md); grpo / gdpo: the online loop
RL_METHODS = ("dpo", "ipo", "orpo", "simpo", "kto", "grpo", "gdpo", "ebft")
#: ``rl:`` methods that sample completions from the policy (with a key / value cache) while training
SAMPLING_RL = ("grpo", "gdpo", "ebft")
#: ``rl:`` methods of Axolotl not built yet -> why
RL_NOT_BUILT = {m: "it trains on completions sampled from the policy with another objective than GRPO's, "
                   "which is not built (GRPO is: rl: grpo)"
                for m in ("online_dpo", "ppo")}
_RL_KEYS = ("rl_beta", "dpo_loss_type", "dpo_loss_weights", "orpo_alpha", "kto_desirable_weight",
            "kto_undesirable_weight", "kto_loss_type")
_OFFLINE_ONLY = ("rl_beta", "dpo_loss_type", "dpo_loss_weights", "orpo_alpha")
_KTO_ONLY = ("kto_desirable_weight", "kto_undesirable_weight", "kto_loss_type")


def check_preference(cfg: Any, add) -> None:
    """``rl:``: one of :data:`RL_METHODS`; a known method not built yet refused by name with why;
    the preference keys only with ``rl``; preference data unpacked."""
    for key in ("trl", "vllm"):
        if getattr(cfg, key) is not None and str(cfg.rl).lower() not in ("grpo", "gdpo"):
            add(f"'{key}' is not supported with rl: {cfg.rl} (it holds the GRPO settings of rl: grpo / gdpo): "
                f"remove it")
    if str(cfg.rl).lower() not in ("dpo", "ipo", "orpo", "simpo"):
        for i, entry in enumerate(cfg.datasets or []):
            if isinstance(entry.type, dict):
                add(f"datasets[{i}].type is a mapping (Axolotl's user-defined preference type), read by "
                    f"rl: dpo / ipo / orpo / simpo only (this config has rl: {cfg.rl}): give a type name")
    if cfg.precompute_ref_log_probs and str(cfg.rl).lower() not in ("dpo", "ipo"):
        rl = str(cfg.rl).lower()
        add(f"precompute_ref_log_probs is built for rl: dpo / ipo (this config has rl: {cfg.rl}"
            f"{': it has no reference' if rl in ('orpo', 'simpo') else ''}): remove it")
    if cfg.dpo_use_weighting and str(cfg.rl).lower() not in ("dpo", "ipo"):
        add(f"dpo_use_weighting is read by rl: dpo / ipo only (this config has rl: {cfg.rl}): remove it")
    if cfg.ebft is not None and str(cfg.rl).lower() != "ebft":
        add(f"'ebft' is read by rl: ebft only (this config has rl: {cfg.rl}): remove it")
    if cfg.rl is None:
        given = [k for k in _RL_KEYS if getattr(cfg, k) is not None]
        if given:
            add(f"{given[0]} is set but rl is not: add rl: dpo (or ipo, orpo, simpo, kto), or remove it")
        return
    rl = str(cfg.rl).lower()
    if rl in RL_NOT_BUILT:
        add(f"'rl: {cfg.rl}' is not supported yet: {RL_NOT_BUILT[rl]}. Built: rl: {' | '.join(RL_METHODS)}")
        return
    if rl not in RL_METHODS:
        add(f"rl: {cfg.rl!r} is not a preference method here; choose one of {', '.join(RL_METHODS)}")
        return
    if rl in ("grpo", "gdpo"):
        _check_grpo(cfg, add)
        return
    if rl == "ebft":
        _check_ebft(cfg, add)
        return
    if cfg.rl_beta is not None and not cfg.rl_beta > 0:
        add(f"rl_beta must be > 0, got {cfg.rl_beta}")
    if cfg.orpo_alpha is not None and not cfg.orpo_alpha > 0:
        add(f"orpo_alpha must be > 0, got {cfg.orpo_alpha}")
    for key in _KTO_ONLY:
        value = getattr(cfg, key)
        if value is not None and rl != "kto":
            add(f"{key} is read by rl: kto only (this config has rl: {cfg.rl}): remove it")
        elif value is not None and key != "kto_loss_type" and not value > 0:
            add(f"{key} must be > 0, got {value}")
    for key in ("dpo_loss_type", "dpo_loss_weights"):
        if getattr(cfg, key) is not None and rl not in ("dpo", "ipo"):
            add(f"{key} is read by rl: dpo only (this config has rl: {cfg.rl}): remove it")
    if not 0 <= cfg.dpo_label_smoothing < 0.5:
        add(f"dpo_label_smoothing must be in [0, 0.5), got {cfg.dpo_label_smoothing}")
    from functional_pp.data.pairs import PAIR_TYPES, user_defined_problem
    from functional_pp.data.unpaired import KTO_TYPES
    types, fields = ((KTO_TYPES, "prompt / completion / label fields (field_prompt, field_completion, field_label)")
                     if rl == "kto" else
                     (PAIR_TYPES, "prompt / chosen / rejected fields (field_prompt, field_chosen, field_rejected)"))
    for i, entry in enumerate(cfg.datasets or []):
        if isinstance(entry.type, dict):
            problem = None if rl == "kto" else user_defined_problem(entry.type)
            if problem:
                add(f"rl: {cfg.rl}: datasets[{i}].type (user-defined): {problem}")
        elif entry.type is not None and entry.type not in types:
            add(f"rl: {cfg.rl}: datasets[{i}].type {entry.type!r} is not a "
                f"{'KTO' if rl == 'kto' else 'preference'} dataset type built here; "
                f"choose one of {', '.join(types)}, or leave type out for plain {fields}")
    if cfg.val_set_size and rl == "kto":
        add(f"rl: {cfg.rl} with val_set_size {cfg.val_set_size}: held-out KTO evaluation is not built (held-out "
            f"pairs are, for dpo / ipo / orpo / simpo); remove val_set_size")
    if not cfg.datasets:
        what = "unpaired completions labelled desirable or not" if rl == "kto" else "chosen / rejected pairs"
        add(f"rl: {cfg.rl} trains on {what}: give datasets: [{{path: data.jsonl}}] (docs/preference.md)")


#: reward_model / process_reward_model -> (the Axolotl model class, the dataset types read)
REWARD_KINDS = {"reward_model": ("AutoModelForSequenceClassification", ("bradley_terry.chat_template",)),
                "process_reward_model": ("AutoModelForTokenClassification", ("stepwise_supervised",))}


def check_reward(cfg: Any, add) -> None:
    """``reward_model`` / ``process_reward_model`` (docs/reward_models.md): one of them, without
    ``rl``, their model class and dataset types, their keys only with them, no pipeline (each
    example is its own row, never packed); ``model_type`` a classifier only with its kind."""
    on = [k for k in REWARD_KINDS if getattr(cfg, k)]
    mt = cfg.model_type or ""
    head = ("reward_model" if mt.endswith("ForSequenceClassification")
            else "process_reward_model" if mt.endswith("ForTokenClassification") else None)
    if head is not None and head not in on:
        add(f"model_type: {mt} is {REWARD_KINDS[head][0]}'s head: set {head}: true (or a *ForCausalLM model_type)")
    if not on:
        for key in ("num_labels", "center_rewards_coefficient"):
            if getattr(cfg, key) is not None:
                add(f"{key} is set but reward_model / process_reward_model is not: add one, or remove it")
        for i, entry in enumerate(cfg.datasets or []):
            for key, kind in (("bradley_terry.chat_template", "reward_model"), ("stepwise_supervised",
                                                                                "process_reward_model")):
                if entry.type == key:
                    add(f"datasets[{i}].type {key} is read by {kind}: true only: add it, or choose another type")
            for key in ("step_separator", "max_completion_length"):
                if getattr(entry, key) is not None:
                    add(f"datasets[{i}].{key} is read by stepwise_supervised data (process_reward_model) only: "
                        f"remove it")
        return
    if len(on) > 1:
        add("reward_model and process_reward_model are both set: a run trains one head; keep one")
        return
    kind = on[0]
    cls, types = REWARD_KINDS[kind]
    if cfg.rl is not None:
        add(f"{kind} with rl: {cfg.rl}: a reward model is trained on its own objective, not a preference method; "
            f"remove rl (or {kind})")
    if head is not None and head != kind:
        add(f"{kind}: model_type {mt} is not its head ({cls}); set model_type: {cls}")
    if kind == "reward_model" and cfg.num_labels not in (None, 1):
        add(f"reward_model: num_labels {cfg.num_labels}: the Bradley-Terry loss scores each sequence with one "
            f"number (TRL's RewardTrainer); set num_labels: 1")
    if kind == "process_reward_model" and cfg.num_labels is not None and cfg.num_labels < 2:
        add(f"process_reward_model: num_labels {cfg.num_labels}: the step labels need at least 2 classes")
    if kind != "reward_model" and cfg.center_rewards_coefficient is not None:
        add("center_rewards_coefficient is read by reward_model only: remove it")
    if cfg.center_rewards_coefficient is not None and cfg.center_rewards_coefficient < 0:
        add(f"center_rewards_coefficient must be >= 0, got {cfg.center_rewards_coefficient}")
    if cfg.pp_size > 1:
        add(f"{kind} with pp_size {cfg.pp_size}: reward models under a pipeline are not built; use dp / fsdp / tp / cp")
    if cfg.base_model is None:
        add(f"{kind} reads base_model's weights under a new score head: set base_model (a Hugging Face directory)")
    if not cfg.datasets:
        add(f"{kind} trains on {' / '.join(types)} data: give datasets: [{{path: data.jsonl, type: {types[0]}}}]")
    for i, entry in enumerate(cfg.datasets or []):
        if entry.type not in types:
            add(f"{kind}: datasets[{i}].type {entry.type!r} is not read by it; choose {', '.join(types)}")
        elif kind == "reward_model" and (entry.step_separator is not None or entry.max_completion_length is not None
                                         or entry.train_on_last_step_only):
            add(f"datasets[{i}]: step_separator / max_completion_length / train_on_last_step_only are "
                f"stepwise_supervised keys: remove them")
        elif entry.max_completion_length is not None and entry.max_completion_length < 1:
            add(f"datasets[{i}].max_completion_length must be >= 1, got {entry.max_completion_length}")
        elif entry.step_separator == "":
            add(f"datasets[{i}].step_separator is empty: give the text that ends each step (e.g. \"\\n\")")


def _check_grpo(cfg: Any, add) -> None:
    """``rl: grpo`` / ``gdpo``: the ``trl:`` section (preference/grpo_spec.py), prompts to sample
    from, no offline preference keys."""
    from functional_pp.preference.grpo_spec import grpo_spec
    try:
        spec = grpo_spec(cfg.rl, cfg.trl, cfg.vllm)
    except ValueError as exc:
        add(f"rl: {cfg.rl}: {exc}")
    else:
        if spec.sync_ref_model and cfg.adapter:
            add(f"rl: {cfg.rl}: trl.sync_ref_model with adapter: {cfg.adapter} is not supported (the reference is "
                f"the base without the adapters, nothing to mix; TRL refuses it too): remove one of them")
    for key in _OFFLINE_ONLY + _KTO_ONLY:
        if getattr(cfg, key) is not None:
            add(f"{key} is not read by rl: {cfg.rl} (its beta is trl.beta): remove it")
    if not cfg.datasets:
        add(f"rl: {cfg.rl} samples completions of prompts: give datasets: [{{path: prompts.jsonl}}] "
            f"(docs/preference.md)")


def _check_ebft(cfg: Any, add) -> None:
    """``rl: ebft``: the ``ebft:`` section's strided mode (preference/ebft_spec.py), documents of
    its two dataset types, no offline preference keys, no held-out set, no pipeline."""
    from functional_pp.data.ebft_documents import EBFT_TYPES
    from functional_pp.preference.ebft_spec import ebft_spec
    try:
        ebft_spec(cfg.ebft)
    except ValueError as exc:
        add(f"rl: ebft: {exc}")
    for key in _OFFLINE_ONLY + _KTO_ONLY:
        if getattr(cfg, key) is not None:
            add(f"{key} is not read by rl: ebft (its settings are the ebft: section): remove it")
    if not cfg.datasets:
        add("rl: ebft trains on documents: give datasets: [{path: docs.jsonl, type: ebft_pretrain.transform}] "
            "(docs/preference.md \"EBFT\")")
    for i, entry in enumerate(cfg.datasets or []):
        if entry.type not in EBFT_TYPES:
            add(f"rl: ebft: datasets[{i}].type {entry.type!r} is not an EBFT dataset type built here; choose one of "
                f"{', '.join(EBFT_TYPES)}")
    if cfg.val_set_size:
        add(f"rl: ebft with val_set_size {cfg.val_set_size}: held-out EBFT evaluation is not built; remove "
            f"val_set_size")
    if (cfg.pp_size or 1) > 1:
        add(f"rl: ebft with pp_size {cfg.pp_size}: the feature model's hidden states under a pipeline are not "
            f"built; use dp / fsdp / tp (pp_size 1)")


def _asks_nothing(value: Any) -> bool:
    """``false``, blank or empty (not 0: ``lora_dropout: 0.0`` is a LoRA setting)."""
    return value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value)


def check_adapter(cfg: Any, add) -> None:
    """The adapter keys: ``adapter: lora`` with a valid LoRA config; LoRA keys without it,
    bad QLoRA settings refused with what to do instead."""
    import re
    check_base_quantization(cfg, add)
    check_model_quantization(cfg, add)
    if cfg.adapter is None:
        from dataclasses import fields
        defaults = {f.name: f.default for f in fields(cfg)}
        # a key written in the config counts even at its default (`lora_r: 8`); `false` / blank
        # ask for nothing. (A saved config writes `adapter: null`, whose LoRA keys are dropped
        # as unused before this: config/aliases._without_unused_lora_keys.)
        given = [k for k in LORA_KEYS
                 if getattr(cfg, k) != defaults[k]
                 or (k in cfg._given and not _asks_nothing(getattr(cfg, k)))]
        if given:
            add(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but adapter is not: add adapter: lora "
                f"(or adapter: qlora with load_in_4bit) to train LoRA adapters, or remove the LoRA keys for full "
                f"fine-tuning (without adapter the whole model is trained and the LoRA keys are ignored)")
    elif cfg.lora_target_modules is None and not cfg.lora_target_linear and not cfg.lora_target_parameters:
        add(f"adapter: {cfg.adapter} names no weights to adapt; set lora_target_modules ([q_proj, v_proj] "
            f"or a regex) or lora_target_linear: true")
    else:
        try:
            cfg.lora_config()
        except Exception as exc:       # (a ConfigError naming the key)
            add(str(exc))
    check_loftq(cfg, add)
    if cfg.lora_model_dir is not None and cfg.base_model is None:
        add("lora_model_dir needs base_model: the adapter directory holds only the adapters of that base model")
    for p in cfg.unfrozen_parameters or ():
        if isinstance(p, str) and re.match(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$", p):
            add(f"unfrozen_parameters: {p!r}: a row range [a:b] (Axolotl's partly unfrozen tensor) is not "
                f"supported: unfreeze the whole tensor (remove the range)")
            continue
        try:
            re.compile(p)
        except (re.error, TypeError) as exc:
            add(f"unfrozen_parameters: {p!r} is not a regex ({exc})")


#: Axolotl's eval_causal_lm_metrics when do_causal_lm_eval gives none
CAUSAL_LM_METRICS = ("sacrebleu", "comet", "ter", "chrf", "perplexity")


def check_causal_lm_eval(cfg: Any, add) -> None:
    """``do_causal_lm_eval``: its metrics perplexity only (the others score generated text), a
    held-out set of language-model rows, a window of at least 2 tokens within ``sequence_len``."""
    if not cfg.do_causal_lm_eval:
        return
    metrics = list(cfg.eval_causal_lm_metrics or CAUSAL_LM_METRICS)
    other = [m for m in metrics if m != "perplexity"]
    if other:
        add(f"eval_causal_lm_metrics: {', '.join(map(str, other))} score text generated during evaluation, which is "
            f"not supported: give eval_causal_lm_metrics: [perplexity] (Axolotl's default is all five)")
    if not cfg.val_set_size:
        add("do_causal_lm_eval evaluates the held-out rows: set val_set_size > 0")
    if cfg.rl or getattr(cfg, "reward_model", False) or getattr(cfg, "process_reward_model", False):
        add("do_causal_lm_eval (perplexity of the held-out completions) is for supervised fine-tuning, not "
            "preference or reward training: remove it")
    if not isinstance(cfg.eval_max_new_tokens, int) or not 2 <= cfg.eval_max_new_tokens <= cfg.sequence_len:
        add(f"eval_max_new_tokens={cfg.eval_max_new_tokens}: the perplexity window must be 2 to sequence_len "
            f"({cfg.sequence_len}) tokens")
    if cfg.base_model is None and cfg.tokenizer is None:
        add("do_causal_lm_eval re-tokenizes the held-out references with a Hugging Face tokenizer: give "
            "base_model (or tokenizer:)")
    if cfg.tokenizer_use_mistral_common:
        add("do_causal_lm_eval re-tokenizes the references with a Hugging Face tokenizer: not with "
            "tokenizer_use_mistral_common")


def check_images(cfg: Any, add) -> None:
    """``processor_type`` (images in the data, a vision-language base_model: docs/data.md, "Images"):
    ``AutoProcessor`` from ``base_model``, rows not packed, no pipeline stages, supervised
    fine-tuning only."""
    if cfg.processor_type is None:
        return
    from functional_pp.data.vision_chat import PROCESSORS
    if cfg.processor_type != "AutoProcessor" and cfg.processor_type not in PROCESSORS:
        add(f"processor_type: {cfg.processor_type!r} is not supported: AutoProcessor (base_model's own "
            f"processor files) or the class they name, one of {PROCESSORS}")
    elif cfg.processor_type != "AutoProcessor" and cfg.base_model is not None:
        _check_processor_class(Path(str(cfg.base_model)) / "processor_config.json", cfg.processor_type, add)
    if cfg.base_model is None:
        add("processor_type reads base_model's processor files and vision weights: give base_model")
    else:
        _check_vision_tower(Path(str(cfg.base_model)) / "config.json", add)
    if cfg.sample_packing:
        add("sample_packing: true with processor_type: rows with images are not packed (Axolotl sets "
            "sample_packing: false for them); set sample_packing: false")
    if cfg.pp_size > 1:
        add(f"pp_size {cfg.pp_size} with processor_type: the vision encoder is not placed on pipeline stages yet; "
            f"use FSDP, TP or CP (pp_size 1)")
    if cfg.rl or getattr(cfg, "reward_model", False) or getattr(cfg, "process_reward_model", False):
        add("processor_type with rl / reward_model: images are read for supervised fine-tuning only")
    if not cfg.datasets:
        add("processor_type needs datasets: (chat_template rows with an images column)")


def _check_processor_class(conf: Path, named: str, add) -> None:
    """A processor class named by ``processor_type`` must be the one base_model's files name
    (Axolotl loads that class from them)."""
    try:
        kind = json.loads(conf.read_text()).get("processor_class")
    except (OSError, ValueError, AttributeError):
        return                                  # (missing or unreadable files are reported where they are read)
    if kind != named:
        add(f"processor_type: {named} but base_model's processor_config.json names {kind!r}; name that class or "
            f"AutoProcessor")


def _check_vision_tower(conf: Path, add) -> None:
    """A local base_model's vision tower must be one that is built (models/llama_hf.py's
    ``vision_from_hf``: Pixtral's, CLIP's, Qwen's, GLM-4V's, SigLIP2's, InternViT's, Gemma 4's, Llama 4's), named
    here with the config's other problems (whatever else refuses it: another processor_type)."""
    if not conf.is_file():
        return
    try:
        hf = json.loads(conf.read_text())
    except (OSError, ValueError):
        return                                  # (an unreadable config.json is reported where it is read)
    if not isinstance(hf, dict) or not isinstance(hf.get("vision_config"), dict):
        return                                  # (no tower declared: reading the model refuses it)
    from functional_pp.models.llama_hf import vision_from_hf
    try:
        vision_from_hf(hf)
    except ValueError as exc:
        add(f"processor_type: {exc}")


def check_loftq(cfg: Any, add) -> None:
    """``peft:``: only ``loftq_config`` (``loftq_bits`` 4 or 8, ``loftq_iter`` >= 1), with
    ``adapter: lora`` on an unquantized base from ``base_model`` (peft quantizes the base itself:
    LoftQ on a bitsandbytes model is refused there too), plain LoRA (not DoRA), fresh adapters."""
    if cfg.peft is None:
        return
    if not isinstance(cfg.peft, dict) or set(cfg.peft) - {"loftq_config"}:
        extra = sorted(set(cfg.peft) - {"loftq_config"}) if isinstance(cfg.peft, dict) else [repr(cfg.peft)]
        add(f"peft: {', '.join(map(str, extra))} is not supported: peft's own options here are loftq_config only "
            f"(the adapter is set by adapter, lora_* and peft_use_* keys)")
        return
    conf = cfg.peft.get("loftq_config")
    if conf is None:
        return
    if not isinstance(conf, dict) or set(conf) - {"loftq_bits", "loftq_iter"}:
        extra = sorted(set(conf) - {"loftq_bits", "loftq_iter"}) if isinstance(conf, dict) else [repr(conf)]
        add(f"peft.loftq_config: {', '.join(map(str, extra))} is not a LoftQ option (loftq_bits, loftq_iter)")
        return
    lq = cfg.loftq()
    if lq["bits"] not in (4, 8):
        add(f"peft.loftq_config.loftq_bits: {lq['bits']!r}: peft's LoftQ quantizes with 4 (NF4) or 8 (int8) bits")
    if not isinstance(lq["iters"], int) or lq["iters"] < 1:
        add(f"peft.loftq_config.loftq_iter: {lq['iters']!r}: give a number of iterations >= 1")
    if cfg.adapter not in (None, "lora"):
        add(f"peft.loftq_config (LoftQ) initialises adapter: lora, not {cfg.adapter!r}: LoftQ quantizes the base "
            f"itself (peft refuses a bitsandbytes-quantized base): use adapter: lora without load_in_4bit")
    for k in ("load_in_4bit", "load_in_8bit"):
        if getattr(cfg, k):
            add(f"peft.loftq_config (LoftQ) with {k}: LoftQ replaces the base by its own quantized form (peft "
                f"refuses an already quantized model): remove {k}")
    for k, why in (("peft_use_dora", "DoRA's magnitudes"), ("lora_model_dir", "adapters read from a directory"),
                   ("lora_target_parameters", "the experts' adapters")):
        if getattr(cfg, k):
            add(f"peft.loftq_config (LoftQ) with {k}: LoftQ initialises plain LoRA adapters of linear weights, "
                f"not {why}: remove one of them")
    if cfg.base_model is None:
        add("peft.loftq_config (LoftQ) needs base_model: it starts from the base model's weights")


#: Hugging Face's names of the decoder-layer list (``model.layers``, GPT-2 / Falcon ``transformer.h``,
#: GPT-NeoX ``gpt_neox.layers``, DBRX ``transformer.blocks``): each family's decoder layers here
_LISA_LAYER_LISTS = ("layers", "h", "blocks")


def check_ray(cfg: Any, add) -> None:
    """``use_ray`` / ``ray_num_workers`` / ``resources_per_worker`` (Axolotl runs its trainer in Ray
    workers): a launcher choice here, where the processes come from torchrun or ``--simulate``
    (one rank per device). ``ray_num_workers`` is the world size the config expects (checked in
    :func:`check_world`); ``resources_per_worker.GPU`` must be 1; a start-up note says so."""
    n, res = cfg.ray_num_workers, cfg.resources_per_worker
    if not cfg.use_ray:
        for key, v in (("ray_num_workers", n), ("resources_per_worker", res)):
            if v is not None:
                add(f"{key} without use_ray: true has no effect: remove it (or set use_ray: true)")
        return
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        add(f"ray_num_workers must be a whole number >= 1 (the processes, one per device), got {n!r}")
    if res is not None and not isinstance(res, dict):
        add(f"resources_per_worker must be a mapping of Ray resources (GPU: 1), got {res!r}")
    elif res is not None and res.get("GPU", 1) != 1:
        add(f"resources_per_worker.GPU: {res['GPU']!r}: each process drives one device here (one rank per GPU, "
            f"as torchrun starts them): use GPU: 1, and ray_num_workers (or --nproc_per_node) for more GPUs")
    note = (f"use_ray (ray_num_workers: {n if n is not None else 'unset'}): the processes come from torchrun "
            f"or --simulate, one rank per device, not from Ray; ray_num_workers is checked against their number"
            + ("; resources_per_worker only schedules Ray workers: no effect" if res else ""))
    if note not in cfg.notes:
        cfg.notes.append(note)


def check_lisa(cfg: Any, add) -> None:
    """``lisa_n_layers`` / ``lisa_step_interval`` / ``lisa_layers_attribute``: both numbers or
    neither, at least 1, full fine-tuning of a model's decoder layers (not adapters, frozen
    parameters, preference training or a pipeline)."""
    n, every = cfg.lisa_n_layers, cfg.lisa_step_interval
    if n is None and every is None:
        return
    if n is None or every is None:
        given, missing = ("lisa_n_layers", "lisa_step_interval")[::1 if n is not None else -1]
        add(f"{given} is set without {missing}: LISA needs both (the layers trained at once, and the steps "
            f"between draws), or neither")
        return
    for key, v in (("lisa_n_layers", n), ("lisa_step_interval", every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            add(f"{key} must be a whole number >= 1, got {v!r}")
    attr = str(cfg.lisa_layers_attribute or "model.layers")
    if attr.rpartition(".")[2] not in _LISA_LAYER_LISTS:
        add(f"lisa_layers_attribute: {attr!r} is not a model's list of decoder layers (e.g. model.layers, "
            f"transformer.h): LISA samples the decoder layers")
    for key, why in (("adapter", cfg.adapter), ("unfrozen_parameters", cfg.unfrozen_parameters),
                     ("rl", cfg.rl)):
        if why:
            add(f"lisa_n_layers with {key}: LISA trains whole decoder layers of a full fine-tuning (Axolotl "
                f"turns on every weight of the drawn layers): remove {key} or the lisa_* keys")
    if cfg.optimizer not in ADAM_OPTIMIZERS:
        add(f"lisa_n_layers with optimizer {cfg.optimizer!r}: LISA is built on AdamW here (adamw, adamw_8bit, "
            f"adamw_4bit)")
    if cfg.pp_size > 1:
        add("lisa_n_layers with pp_size > 1: LISA's draws over the layers of a pipeline are not supported: "
            "remove pp_size or the lisa_* keys")


def check_schedule_shape(cfg: Any, add) -> None:
    """``lr_quadratic_warmup`` / ``cosine_constant_lr_ratio`` shape Axolotl's cosine schedule;
    where Axolotl would ignore them (another scheduler, the constant tail without its
    ``cosine_min_lr_ratio``, both at once, a minimum beside the quadratic warmup) refused."""
    if cfg.lr_quadratic_warmup:
        if cfg.lr_scheduler != "cosine":
            add(f"lr_quadratic_warmup shapes the cosine schedule's warmup (Axolotl's), not lr_scheduler: "
                f"{cfg.lr_scheduler}: set lr_scheduler: cosine or remove it")
        if cfg.min_lr() > 0:
            add("lr_quadratic_warmup decays the cosine to 0 (Axolotl ignores a minimum beside it): remove "
                "cosine_min_lr_ratio / min_learning_rate, or lr_quadratic_warmup")
    if cfg.cosine_constant_lr_ratio:
        if cfg.lr_scheduler != "cosine" or not cfg.cosine_min_lr_ratio:
            add("cosine_constant_lr_ratio holds the cosine schedule at cosine_min_lr_ratio x learning_rate from "
                "that fraction of max_steps: set lr_scheduler: cosine and cosine_min_lr_ratio (> 0)")
        if cfg.lr_quadratic_warmup:
            add("cosine_constant_lr_ratio and lr_quadratic_warmup are two cosine schedules: choose one")


def check_values(cfg: Any, issues: Issues | None = None) -> None:
    """Range and consistency checks of the values that parsed; problems go to ``issues`` (raised
    here when none is given)."""
    own = issues is None
    issues = issues if issues is not None else Issues()
    add = issues.add
    for k in MESH_KEYS:
        v = getattr(cfg, k)
        if v < 1 and not (k == "dp_shard_size" and v == -1):
            add(f"{k} must be >= 1 (or -1 for dp_shard_size: the rest of the world), got {v}")
    _check_pipeline_values(cfg, add)
    for k in ("micro_batch_size", "gradient_accumulation_steps", "sequence_len", "max_steps"):
        if getattr(cfg, k) < 1:
            add(f"{k} must be >= 1, got {getattr(cfg, k)}")
    for k in ("saves_per_epoch", "evals_per_epoch"):
        if getattr(cfg, k) is not None and getattr(cfg, k) < 0:
            add(f"{k} must be >= 0 (0: none), got {getattr(cfg, k)}")
    for k in ("loss_chunks", "loss_chunk_bytes"):
        if getattr(cfg, k) is not None and getattr(cfg, k) < 1:
            add(f"{k} must be >= 1 (or null: the whole logits), got {getattr(cfg, k)}")
    if cfg.loss_chunks is not None and cfg.loss_chunk_bytes is not None:
        add("give loss_chunks (the number of token chunks) or loss_chunk_bytes (bytes of fp32 logits per chunk), "
            "not both")
    for k in ("global_batch_size", "num_epochs", "eval_steps", "num_processes"):
        if getattr(cfg, k) is not None and getattr(cfg, k) < 1:
            add(f"{k} must be >= 1, got {getattr(cfg, k)}")
    check_adapter(cfg, add)
    check_preference(cfg, add)
    check_reward(cfg, add)
    check_lisa(cfg, add)
    check_ray(cfg, add)
    if cfg.use_otel_metrics and not 0 <= cfg.otel_metrics_port <= 65535:
        add(f"otel_metrics_port must be a port number 0-65535 (0: any free port), got {cfg.otel_metrics_port}")
    if cfg.warmup_steps < 0:
        add(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    elif isinstance(cfg.warmup_steps, float) and cfg.warmup_steps >= 1 and not cfg.warmup_steps.is_integer():
        add(f"warmup_steps must be a whole number of steps or a fraction < 1 of max_steps, got "
            f"{cfg.warmup_steps}")
    if not cfg.learning_rate > 0 or not math.isfinite(cfg.learning_rate):
        add(f"learning_rate must be a finite number > 0, got {cfg.learning_rate}")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        add(f"max_grad_norm must be > 0 (or null to disable clipping), got {cfg.max_grad_norm}")
    check_schedule_shape(cfg, add)
    for k in ("warmup_ratio", "cosine_min_lr_ratio", "cosine_constant_lr_ratio"):
        v = getattr(cfg, k)
        if v is not None and not 0 <= v <= 1:
            add(f"{k} must be in [0, 1], got {v}")
    if cfg.saves_per_epoch and "checkpoint" in cfg._given and cfg.checkpoint.save_every and \
            "saves_per_epoch_applied" not in cfg._given:
        add("give save_steps or saves_per_epoch, not both")
    if cfg.evals_per_epoch and cfg.eval_steps is not None and "evals_per_epoch_applied" not in cfg._given:
        add("give eval_steps or evals_per_epoch, not both")
    if cfg.warmup_ratio is not None and "warmup_steps" in cfg._given:
        add("give warmup_steps or warmup_ratio, not both")
    if cfg.cosine_min_lr_ratio is not None and "min_learning_rate" in cfg._given:
        add("give min_learning_rate or cosine_min_lr_ratio, not both")
    if not 0 <= cfg.val_set_size or (cfg.val_set_size >= 1 and not float(cfg.val_set_size).is_integer()):
        add(f"val_set_size must be a fraction in [0, 1) or a whole count of sequences, got "
            f"{cfg.val_set_size}")
    if cfg.lr_scheduler != "constant" and cfg.warmup() > cfg.max_steps:
        add(f"warmup_steps={cfg.warmup()} exceeds max_steps={cfg.max_steps} (the "
            f"{cfg.lr_scheduler} schedule decays after warmup); lower it, e.g. --set "
            f"warmup_steps={cfg.max_steps // 2}")
    try:
        cfg.precision = resolved_precision(cfg)
    except ConfigError as exc:
        add(str(exc))
    if cfg.max_consecutive_skips is not None and cfg.max_consecutive_skips < 1:
        add(f"max_consecutive_skips must be >= 1 (or null: never stop), got "
            f"{cfg.max_consecutive_skips}")
    for key in ("loss_watchdog_patience", "early_stopping_patience"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            add(f"{key} must be >= 1 (or unset), got {getattr(cfg, key)}")
    if cfg.metric_for_best_model not in (None, "loss", "eval_loss"):
        add(f"metric_for_best_model: {cfg.metric_for_best_model!r} is not computed here (the held-out loss is: "
            f"loss or eval_loss)")
    if cfg.checkpoint.save_best and not cfg.val_set_size:
        add("save_strategy: best saves at the best held-out loss: set val_set_size > 0")
    check_causal_lm_eval(cfg, add)
    if cfg.early_stopping_patience is not None and not cfg.val_set_size:
        add("early_stopping_patience watches the held-out loss: set val_set_size > 0")
    if cfg.collective_timeout is not None and not cfg.collective_timeout > 0:
        add(f"collective_timeout must be a positive number of seconds (or null: the default), "
            f"got {cfg.collective_timeout}")
    if isinstance(cfg.compile, str):
        from functional_pp._torch import compile_backend_names
        from functional_pp.compile.layer_compile import split_mode
        backends = compile_backend_names()
        name = next((m for m in split_mode(cfg.compile) if isinstance(m, str)), None)  # "per_layer:x"
        if name is not None and name not in backends:
            add(f"compile: unknown torch.compile backend {name!r}{suggest(name, backends)} "
                f"(or \"per_layer\" / \"per_layer:<backend>\")")
    if cfg.offload_params:
        from functional_pp.compile.layer_compile import split_mode
        if split_mode(cfg.compile)[0]:
            add(f"offload_params: true with compile: {cfg.compile}: a compiled step cannot offload yet; use "
                f"compile: per_layer (each layer compiled, the step eager) or compile: false")
        if (cfg.pp_size or 1) > 1:
            add("offload_params: true with pp_size > 1: a pipeline step cannot offload yet; remove one of them")
    if cfg.logging.log_every < 1:
        add(f"logging.log_every must be >= 1, got {cfg.logging.log_every}")
    if cfg.checkpoint.save_every < 0:
        add(f"checkpoint.save_every must be >= 0 (0: no periodic saves), got "
            f"{cfg.checkpoint.save_every}")
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last < 1:
        add(f"checkpoint.keep_last must be >= 1 (or null: keep all), got {cfg.checkpoint.keep_last}")
    if cfg.data.max_bytes is not None and cfg.data.max_bytes < 1:
        add(f"data.max_bytes must be >= 1 (or null: no cap), got {cfg.data.max_bytes}")
    if cfg.data.kind in ("text", "dir", "jsonl") and cfg.data.path is None:
        add(f"data.kind {cfg.data.kind!r} needs data.path")
    if cfg.datasets and cfg.data.path is not None:
        add("give either datasets (a list) or data.path, not both")
    check_qat(cfg, add)
    check_diffusion(cfg, add)
    check_images(cfg, add)
    check_llmcompressor(cfg, add)
    if cfg.tokenizer_use_mistral_common:      # (Axolotl's check_mistral_common_incompatible_options)
        for k in ("special_tokens", "tokens", "chat_template", "chat_template_jinja"):
            if getattr(cfg, k):
                add(f"{k} with tokenizer_use_mistral_common: a mistral-common tokenizer has its own special "
                    f"tokens and encodes chats itself (as in Axolotl); remove {k}")
    from functional_pp.data.chat import check_template_choice
    problem = check_template_choice(cfg.chat_template, cfg.chat_template_jinja)
    if problem:
        add(problem)
    for i, entry in enumerate(cfg.datasets or []):
        if entry.chat_template is not None:
            problem = check_template_choice(entry.chat_template, entry.chat_template_jinja,
                                            f"datasets[{i}].chat_template")
            if problem:
                add(problem)
        elif entry.chat_template_jinja is not None:
            add(f"datasets[{i}].chat_template_jinja is only read with datasets[{i}].chat_template: "
                f"jinja; set it or remove chat_template_jinja")
    if own:
        issues.raise_if_any()


def _check_pipeline_values(cfg: Any, add) -> None:
    """pp_size, pp_schedule and pp_virtual_stages: known, in range, consistent."""
    from functional_pp.parallel.pipeline.schedule import check_sizes
    for k in ("pp_size", "pp_virtual_stages"):
        if not isinstance(getattr(cfg, k), int) or getattr(cfg, k) < 1:
            add(f"{k} must be an integer >= 1, got {getattr(cfg, k)!r}")
            return
    from functional_pp.parallel.fsdp.gather_once import GATHER_POLICIES
    if cfg.pp_fsdp_gather not in GATHER_POLICIES:
        add(f"pp_fsdp_gather {cfg.pp_fsdp_gather!r}: choose one of {', '.join(GATHER_POLICIES)} (docs/pipelines.md)")
    try:
        check_sizes(cfg.pp_schedule, cfg.pp_size, cfg.pp_virtual_stages, 1 if cfg.pp_schedule != "interleaved_1f1b"
                    else cfg.pp_size)    # (the micro-batches are checked with the world: check_pipeline)
    except ValueError as exc:
        add(str(exc))


def check_pipeline(cfg: Any, layers: int | None, micro_batches: int) -> None:
    """Before work: the model's ``layers`` split into pp_size x pp_virtual_stages stages, the
    schedule fits ``micro_batches``; fewer micro-batches than stages is a warning (most of the
    step would be bubble), as in torchtitan."""
    import warnings

    from functional_pp.parallel.pipeline.schedule import check_sizes
    if cfg.pp_size == 1 and cfg.pp_virtual_stages == 1:
        return
    try:
        check_sizes(cfg.pp_schedule, cfg.pp_size, cfg.pp_virtual_stages, micro_batches, layers=layers)
    except ValueError as exc:
        raise ConfigError(f"{exc} (pp_size {cfg.pp_size}, pp_virtual_stages {cfg.pp_virtual_stages}, "
                          f"gradient_accumulation_steps {micro_batches})") from exc
    if micro_batches < cfg.pp_size:
        warnings.warn(f"gradient_accumulation_steps {micro_batches} < pp_size {cfg.pp_size}: the pipeline runs "
                      f"fewer micro-batches than stages and most of each step is bubble; use at least "
                      f"{cfg.pp_size}", UserWarning, stacklevel=2)


def resolved_precision(cfg: Any) -> str:
    """``precision``, reconciled with Axolotl's ``bf16`` / ``fp16`` flags."""
    p = cfg.precision.lower()
    aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "no": "fp32"}
    p = aliases.get(p, p)
    if p not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"precision {cfg.precision!r} is not supported"
                          f"{suggest(p, ('fp32', 'bf16', 'fp16'))} (choose fp32, bf16, fp16)")
    bf16 = _bf16_supported() if cfg.bf16 == "auto" else cfg.bf16
    flags = [f for f, on in (("bf16", bf16), ("fp16", cfg.fp16)) if on]
    if len(flags) > 1:
        raise ConfigError("bf16 and fp16 are both true; choose one")
    if flags:
        if "precision" in cfg._given and p != flags[0]:
            raise ConfigError(f"{flags[0]}: true contradicts precision: {cfg.precision}")
        p = flags[0]
    return p

# ------------------------------------------------------------------ derived values

def _bf16_supported() -> bool:
    import torch
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def check_world(cfg: Any, world_size: int | None = None, launcher: str = "") -> None:
    """Check everything that must hold before training starts: the mesh covers
    ``world_size`` devices (``launcher`` names where that number comes from), the batch and
    sequence split evenly, the model's dimensions divide by their mesh axes, the data and
    tokenizer paths exist. Raises :class:`ConfigError`."""
    check_values(cfg)            # again, for configs built without from_dict
    if cfg.num_processes is not None and world_size is not None and cfg.num_processes != world_size:
        raise ConfigError(f"num_processes: {cfg.num_processes} but {launcher or 'the world size'} "
                          f"gives {world_size} devices; fix one of them")
    workers = cfg.ray_num_workers if cfg.use_ray else None
    if workers is not None and world_size is not None and workers != world_size:
        raise ConfigError(f"ray_num_workers: {workers} but {launcher or 'the world size'} gives {world_size} "
                          f"devices (the processes come from torchrun / --simulate here, one per device): "
                          f"start {workers} (torchrun --nproc_per_node {workers}, --simulate {workers}) or "
                          f"set ray_num_workers: {world_size}")
    if world_size is not None and not cfg.sizes_given() and world_size > 1:
        cfg.dp_shard_size = world_size      # no sizes: every device data parallel (FSDP),
        cfg._given.add("dp_shard_size")     # recorded so checkpoints keep the mesh
        cfg.auto_dp = world_size
    sizes = cfg.mesh_sizes(world_size)
    product = math.prod(sizes.values())
    if workers is not None and world_size is None and cfg.sizes_given() and product != workers:
        raise ConfigError(f"ray_num_workers: {workers} but the mesh's sizes need {product} devices: make them "
                          f"agree (one process per device)")
    if world_size is not None and product != world_size:
        shown = {"pp_size": "pp", **MESH_KEYS}     # pp and ep named only when used
        dims = " x ".join(f"{k}={getattr(cfg, k) if getattr(cfg, k) != -1 else sizes[a]}"
                          for k, a in shown.items() if k not in ("pp_size", "ep_size") or getattr(cfg, k) != 1)
        raise ConfigError(f"the mesh needs {product} devices ({dims} = {product}) but "
                          f"{launcher or 'the world size'} gives {world_size}; choose sizes "
                          f"whose product is {world_size}")
    mesh = cfg.mesh(world_size)
    rules = cfg.build_rules(mesh)
    known = known_dims(cfg)
    for dim in cfg.rules:
        if dim not in known:
            raise ConfigError(f"rules: unknown dim name '{dim}'{suggest(dim, sorted(known))}")
    _check_batch_and_sequence(cfg, mesh, rules)
    _check_model_layout(cfg, mesh, rules)
    check_pipeline(cfg, getattr(model_config(cfg), "layers", None), cfg.grad_accum(mesh, rules))
    _check_paths(cfg)


def known_dims(cfg: Any) -> set[str]:
    """Dimension names ``rules`` may map: the batch's and the model family's (its parameters'
    and checked activations', for the family's first preset)."""
    family = model_family(cfg)
    return {"batch", "seq"} | family.dim_names(family.build_config(next(iter(family.presets))))


def _check_batch_and_sequence(cfg: Any, mesh, rules) -> None:
    b_axes = cfg.batch_axes(mesh, rules)
    dp = cfg.dp_size(mesh, rules)
    if cfg.global_batch_size is not None:
        per = cfg.micro_batch_size * dp
        if cfg.global_batch_size % per:
            raise ConfigError(
                f"global_batch_size={cfg.global_batch_size} is not divisible by "
                f"micro_batch_size x dp = {cfg.micro_batch_size} x {dp} = {per} (dp = "
                f"{' x '.join(f'{a}={mesh.shape[a]}' for a in b_axes) or '1'})")
        accum = cfg.global_batch_size // per
        if "gradient_accumulation_steps" in cfg._given and accum != cfg.gradient_accumulation_steps:
            raise ConfigError(
                f"global_batch_size={cfg.global_batch_size} != micro_batch_size x "
                f"gradient_accumulation_steps x dp = {cfg.micro_batch_size} x "
                f"{cfg.gradient_accumulation_steps} x {dp} = "
                f"{cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp}; give one of "
                f"global_batch_size and gradient_accumulation_steps")
    s_axes = cfg.seq_axes(mesh, rules)
    if len(s_axes) > 1:
        raise ConfigError(f"rules: the sequence may be split over one mesh axis (context "
                          f"parallelism), not {s_axes}")
    cp = mesh.shape[s_axes[0]] if s_axes else 1
    if cp > 1 and cfg.sequence_len % (2 * cp):
        raise ConfigError(
            f"sequence_len={cfg.sequence_len} is not divisible by 2 x cp_size = {2 * cp} "
            f"(context parallelism with causal load balancing cuts the sequence into "
            f"2 x cp_size chunks); use a multiple of {2 * cp}")


def sampling_key(cfg: Any) -> str | None:
    """The config key that makes the run sample from the model (``rl: grpo``), or None."""
    return f"rl: {cfg.rl}" if cfg.rl is not None and str(cfg.rl).lower() in SAMPLING_RL else None


def _check_model_layout(cfg: Any, mesh, rules) -> None:
    """The model's parameters and activations split evenly on the mesh."""
    from functional_pp.core.tree import leaves_with_paths
    if cfg.base_model is not None and not (Path(cfg.base_model) / "config.json").is_file():
        raise ConfigError(f"base_model {cfg.base_model!r} is not a Hugging Face model directory "
                          f"(no {Path(cfg.base_model).resolve() / 'config.json'}); give a local "
                          f"directory with config.json and safetensors (nothing is downloaded)")
    family, model = model_family(cfg), model_config(cfg)
    _check_sequence_fits(cfg, model)
    serial = family.serial_under_cp(model) if family.serial_under_cp is not None else None
    s_axes = cfg.seq_axes(mesh, rules)
    if s_axes and getattr(model, "index_topk", 0):
        raise ConfigError(f"context_parallel_size / cp_size {mesh.shape[s_axes[0]]}: the model's DeepSeek sparse "
                          f"attention (index_topk={model.index_topk}, models/dsa.py) picks each query's top-k over "
                          f"every earlier key, which is not split across cp ranks exactly yet; use cp_size 1")
    if serial and s_axes and cfg.compile:
        raise ConfigError(f"compile: {cfg.compile} with the sequence split over {s_axes} (context parallelism, cp_size "
                          f"{mesh.shape[s_axes[0]]}): the model's {serial}, whose blocks run device after device, "
                          f"is not traced by torch.compile yet; use compile: false, or cp_size 1")
    what = sampling_key(cfg)
    refusal = family.sampling_refusal(model, what, instead=", or an offline method that does not sample (rl: dpo, "
                                      "ipo, orpo, simpo or kto on preference pairs)") if what else None
    if refusal:
        raise ConfigError(refusal)
    try:
        micro_global = cfg.micro_batch_size * cfg.dp_size(mesh, rules)
        for dims, shape in family.activations(model, micro_global, cfg.sequence_len).items():
            rules.resolve(tuple(dims.split()), shape, mesh, name=f"activations ({dims})")
        for path, decl in leaves_with_paths(family.param_decls(model)):
            rules.resolve(decl.dims, decl.shape, mesh, name=f"parameter {path}")
    except ValueError as exc:
        what = f"base_model {cfg.base_model!r}" if cfg.base_model else f"model preset {cfg.model.preset!r}"
        raise ConfigError(f"{exc} ({what}, mesh {dict(mesh.shape)})") from exc


def _check_sequence_fits(cfg: Any, model: Any) -> None:
    """``sequence_len`` within the positions the model was built for: a Hugging Face base's
    ``max_position_embeddings`` (which a model's rope scaling already extends), a preset's
    ``max_seq``. Positions beyond it are extrapolated, not trained for: refused."""
    limit = getattr(model, "max_seq", None)
    if not limit or cfg.sequence_len <= limit:
        return
    if cfg.base_model is not None:
        where = (f"base_model {cfg.base_model!r} has max_position_embeddings={limit} (its config.json, rope "
                 f"scaling included)")
        fix = (f"lower sequence_len to at most {limit}, or start from a model trained for longer "
               f"contexts")
    else:
        where = f"model preset {cfg.model.preset!r} has max_seq={limit}"
        fix = f"lower sequence_len to at most {limit}, or raise it with model: {{max_seq: {cfg.sequence_len}}}"
    raise ConfigError(f"sequence_len={cfg.sequence_len} is longer than the model's positions: {where}; {fix}")


def _path_problem(path: str) -> str | None:
    """Why ``path`` cannot be read as data: it does not exist, or it is a named pipe, a socket or
    a device (reading one waits for a writer, silently, and data is read more than once)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        return f"does not exist (looked for {p.resolve()})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return (f"is {kind}, not a file or directory ({p.resolve()}): data is read more than once and a pipe "
            f"would wait for its writer forever; write the data to a file first")


def _check_paths(cfg: Any) -> None:
    """The data, tokenizer and base model paths exist and are files or directories (all the
    problems reported at once)."""
    issues = Issues()
    checked = [("data.path", cfg.data.path, "; fix the path or remove it to train on the Python "
                                                   "standard library"),
               ("data.tokenizer", cfg.data.tokenizer, ""),
               *((f"datasets[{i}].path", e.path, "") for i, e in enumerate(cfg.datasets or [])),
               *((key, getattr(cfg, key), "; give a local Hugging Face directory (nothing is downloaded)")
                 for key in ("base_model", "tokenizer"))]
    for key, path, fix in checked:
        problem = None if path is None else _path_problem(path)
        if problem is not None:
            issues.add(f"{key} {path!r} {problem}" + (fix if problem.startswith("does not exist") else ""))
    issues.raise_if_any()
