"""Names users already type (Axolotl, Accelerate) mapped onto the config's own keys, and the
keys that have no meaning here (each refused with the reason, never ignored).

:func:`normalize` rewrites a raw config mapping before it is checked: ``alias: value`` becomes
``canonical: translated value`` (a section key like ``logging.output_dir`` for ``output_dir``);
giving an alias and its key with different values is a problem; Accelerate's
``parallelism_config`` section becomes the mesh sizes. See ``docs/config.md``.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from functional_pp.config import sparse_recipe
from functional_pp.config.fsdp_keys import FSDP_KEYS, deepspeed_settings, fsdp_settings
from functional_pp.config.keys import LORA_KEYS
from functional_pp.config.schema import Issues
from functional_pp.core.policy import SELECTIVE_REMAT

__all__ = ["ALIASES", "UNSUPPORTED", "DATASET_UNSUPPORTED", "UNSUPPORTED_PREFIXES", "VALUE_ALIASES", "VALUE_NOTES",
           "REFUSED_VALUES", "ACCELERATE_LAUNCHER",
           "NOT_USED", "ATTN_IMPLEMENTATIONS", "ACCEPTED_PLUGINS", "normalize"]

_same: Callable[[Any], Any] = lambda v: v  # noqa: E731

#: ``special_tokens`` keys (Axolotl's): each names an existing token of the tokenizer
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")

#: alias -> (canonical key, dotted for a section; value translation)
ALIASES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "tensor_parallel_size": ("tp_size", _same),
    "context_parallel_size": ("cp_size", _same),
    "pipeline_parallel_size": ("pp_size", _same),
    "expert_parallel_size": ("ep_size", _same),
    "gradient_checkpointing": ("activation_checkpointing", _same),
    "torch_compile": ("compile", lambda v: _auto_compile() if v == "auto" else v),
    "torch_compile_backend": ("compile", _same),
    "output_dir": ("logging.output_dir", _same),
    "logging_steps": ("logging.log_every", _same),
    "save_steps": ("checkpoint.save_every", _same),
    "save_total_limit": ("checkpoint.keep_last", _same),
    "mixed_precision": ("precision", lambda v: {"no": "fp32"}.get(v, v)),
    "auto_resume_from_checkpoints": ("resume_from_checkpoint", _same),
    "seq_len": ("sequence_len", _same),
    "tokenizer_config": ("tokenizer", _same),
    "adam_eps": ("adam_epsilon", _same),
    # torch's CosineAnnealingLR name for the learning rate the decay ends at
    "eta_min": ("min_learning_rate", _same),
    "model_config": ("overrides_of_model_config", _same),
    # Axolotl's half-precision weights: bf16 / fp16 compute here (with fp32 master weights)
    "bfloat16": ("precision", lambda v: "bf16" if v else None),
    "float16": ("precision", lambda v: "fp16" if v else None),
    "max_seq_length": ("sequence_len", _same),
}

#: choices written the Axolotl / Hugging Face way -> ours (same meaning)
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "optimizer": {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                  "adam_w": "adamw", "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit",
                  "paged_adamw_32bit": "adamw",
                  # torchao's AdamW8bit (Axolotl's names): the same algorithm as bitsandbytes' AdamW8bit
                  # (tests/optim/test_adam8bit_torchao.py)
                  "adamw_torch_8bit": "adamw_8bit", "ao_adamw_8bit": "adamw_8bit",
                  # torchao's AdamW4bit (tests/optim/test_adam4bit_torchao.py)
                  "adamw_torch_4bit": "adamw_4bit", "ao_adamw_4bit": "adamw_4bit"},
    # HF's cosine_with_restarts with its default num_cycles=1 is the plain cosine decay
    "lr_scheduler": {"constant_with_warmup": "constant", "cosine_with_restarts": "cosine",
                     "cosine_with_min_lr": "cosine"},
}

_PAGED = ("paging (bitsandbytes' paged optimizers) moves optimizer state to CUDA unified memory "
          "under memory pressure; here the state is sharded like the parameters and stays on its "
          "device")

#: value aliases noted in the start-up summary: what the alias does not do here
VALUE_NOTES: dict[str, dict[str, str]] = {
    "optimizer": {"paged_adamw_8bit": f"optimizer: paged_adamw_8bit = adamw_8bit ({_PAGED})",
                  "paged_adamw_32bit": f"optimizer: paged_adamw_32bit = adamw ({_PAGED})",
                  **{k: f"optimizer: {k} = adamw_8bit (torchao's AdamW8bit: dynamic 8-bit moments in blocks of 256; "
                        f"here a leaf's blocks run along its last dimension and matrices under 4096 entries are "
                        f"quantized too, docs/quantization.md)" for k in ("adamw_torch_8bit", "ao_adamw_8bit")},
                  **{k: f"optimizer: {k} = adamw_4bit (torchao's AdamW4bit: 4-bit moments in blocks of 128; "
                        f"here a leaf's blocks run along its last dimension and matrices under 4096 entries are "
                        f"quantized too, docs/quantization.md)" for k in ("adamw_torch_4bit", "ao_adamw_4bit")}},
}

#: values refused with the reason (another optimizer, not a spelling of ours)
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "optimizer": {**{k: f"optimizer {k!r} is not supported (adamw, adamw_8bit or sgd)"
                     for k in ("paged_lion_8bit", "lion_8bit")},
                  **{k: f"optimizer {k!r} is not supported (adamw or sgd)"
                     for k in ("adafactor", "lion", "adamw_anyprecision", "schedule_free_adamw",
                               "muon", "adopt_adamw", "ao_adamw_fp8")}},
    "activation_checkpointing": {"offload_disk": "offload_disk: activations offloaded to disk are not supported: use "
                                                 "offload (host memory) or gradient_checkpointing: true or selective"},
    "activation_offloading": {"disk": "activation_offloading: disk is not supported: use true (pinned host memory) "
                                      "or gradient_checkpointing: true or selective (recomputes instead)"},
    "lr_scheduler": {k: f"lr_scheduler {k!r} is not supported (constant, cosine, linear)"
                     for k in ("polynomial", "inverse_sqrt", "reduce_lr_on_plateau", "one_cycle",
                               "rex", "log_sweep", "warmup_stable_decay")},
}

_MOE = ("this mixture-of-experts option is not supported (experts are the (dropless, or capacity_factor) "
        "block of functional_pp/ops/experts.py; expert parallelism is ep_size / expert_parallel_size, "
        "docs/experts.md): remove it")
_MOE_KERNEL = ("a kernel for the experts (the same math as the dropless experts block here, "
               "functional_pp/ops/experts.py, whose kernels are torch's)")
_EP = ("expert parallelism is ep_size / expert_parallel_size here (docs/experts.md): the experts split over "
       "the ep axis, tokens exchanged all-to-all")
_RL = ("this RL option is not supported (preference training is rl: dpo | ipo | orpo | simpo with the TRL "
       "options of docs/preference.md): remove it")
_HUB = ("nothing is uploaded (no network): write an HF directory with `functional-pp export "
        "RUN_DIR OUT_DIR` and upload it yourself; remove it")

#: keys with no meaning here -> why, and what to do instead
UNSUPPORTED: dict[str, str] = {
    "s2_attention": "shifted-sparse attention (LongLoRA's S2) is not supported: remove it",
    "nvfp4_merge_aware_start_step": ("a warm-up before merge-aware NVFP4 is not built: nvfp4_merge_aware "
                                     "snaps the merged weight from the first step: remove it"),
    **{k: ("the GPTQ format (bits, group size, checkpoint_format) is read from base_model's config.json "
           "quantization_config: remove it") for k in ("gptq_groupsize", "gptq_model_v1")},
    "rpo_alpha": ("TRL 1.16's DPO has no rpo_alpha: its RPO is dpo_loss_type [sigmoid, sft] with "
                  "dpo_loss_weights [1.0, alpha] (docs/preference.md); write that instead"),
    **{k: _HUB for k in ("hub_model_id", "push_to_hub", "hub_strategy",
                         "push_dataset_to_hub")},
    "liger_use_token_scaling": "Liger's token scaling weights each token's loss by its predicted probability "
                               "(another loss): remove it",
    "neftune_noise_alpha": "NEFTune noise is not supported: remove it",
    "wandb_watch": "gradient watching is not supported: remove it",
    "wandb_log_model": "model upload is not supported: remove it",
    "do_bench_eval": "benchmark evaluation is not supported: remove it",
    "sample_packing_eff_est": "packing needs no efficiency estimate: remove it",
    "test_datasets": ("separate evaluation datasets are not supported: the held-out data is the val_set_size "
                      "share of datasets (docs/config.md); remove test_datasets (moved into datasets it would "
                      "be trained on) and set val_set_size"),
}

#: keys of a ``datasets`` entry that belong to a feature not supported -> why
DATASET_UNSUPPORTED: dict[str, str] = {
    **{k: _RL for k in ("chosen_key", "rejected_key")},
}

#: keys under a refused prefix that are config fields (the SwanLab sink's)
_PREFIXED_FIELDS = ("swanlab_project", "swanlab_experiment_name", "swanlab_description", "swanlab_mode",
                    "swanlab_workspace", "otel_metrics_host", "otel_metrics_port", "ray_num_workers")

#: key prefixes of features that are not supported -> why (Axolotl's integrations)
UNSUPPORTED_PREFIXES: dict[str, str] = {
    "swanlab_": "this SwanLab option is not supported (use_swanlab logs the metrics with swanlab_project, "
                "swanlab_experiment_name, swanlab_description, swanlab_mode, swanlab_workspace): remove it",
    "trackio_": "Trackio logging is not supported (metrics.jsonl, TensorBoard, W&B): remove it",
    "otel_": "this OpenTelemetry option is not supported (use_otel_metrics exports the metrics with "
             "otel_metrics_host and otel_metrics_port): remove it",
    "ray_": "this Ray option is not supported (use_ray with ray_num_workers and resources_per_worker: the "
            "processes come from torchrun or --simulate): remove it",
}

_SAME_ATTENTION = ("attention is torch's scaled_dot_product_attention (its flash / memory-efficient "
                   "kernels on a GPU; ring attention under context parallelism): the same math")
_LIGER = ("Liger's kernels compute the same math; the ops here are torch's (the head and cross-entropy over "
          "token chunks with loss_chunks, which liger_fused_linear_cross_entropy turns on)")
_UNSLOTH = ("Unsloth's kernels compute the same math; the ops here are torch's (the head and cross-entropy over "
            "token chunks with loss_chunks) and LoRA is computed by the named einsum")
_HUB_KERNELS = ("Hugging Face hub kernels (the kernels package) replace modules' forward with kernels of the "
                "same math; kernels here are torch's (the head and cross-entropy over token chunks with loss_chunks)")
#: Axolotl's fused / chunked head-and-loss keys: each turns loss_chunks on (the CutCrossEntropyPlugin
#: too, whose cut_cross_entropy defaults to true); chunked_cross_entropy_num_chunks gives their number
LOSS_CHUNK_KEYS = ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy")
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
DEFAULT_LOSS_CHUNKS = 8

#: keys accepted without effect, each with the reason shown in the start-up summary
NOT_USED: dict[str, str] = {
    "gptq_disable_exllama": "a GPTQ base is dequantized once here (docs/quantization.md): no exllama kernel",
    "eval_sample_packing": "held-out data is packed like the training data",
    **{k: _SAME_ATTENTION for k in ("flash_attention", "sdp_attention", "xformers_attention",
                                    "flex_attention", "eager_attention", "flash_attn_fuse_qkv",
                                    "flash_attn_fuse_mlp")},
    "cut_cross_entropy_accum_c_fp32": "the head's gradient is summed over the token chunks in fp32 here anyway",
    "cut_cross_entropy_c_grad_chunk_size": ("the head's gradient is one fp32 buffer summed over the token chunks "
                                            "(loss_chunks); it is not split over the vocabulary"),
    "flash_attn_cross_entropy": ("the cross-entropy here reduces the logits in row chunks (loss_chunks also "
                                 "chunks the head: no full logits)"),
    "dpo_use_liger_kernel": "Liger's fused DPO loss computes the same math as TRL's (docs/preference.md)",
    "dpo_padding_free": ("TRL 1.16's DPOTrainer falls back to padded rows (padding-free DPO is 'temporarily "
                         "unavailable' there); here each side of a pair is one padded row: the same math"),
    "flash_attn_rms_norm": "RMSNorm is a torch op: the same math",
    **{k: "LoRA is computed by the named einsum (base and adapter joined before the one TP collective): "
          "the same math" for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")},
    **{k: _LIGER for k in ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm",
                           "liger_cross_entropy", "liger_swiglu", "liger_rms_norm_gated")},
    **{k: _UNSLOTH for k in ("unsloth_cross_entropy_loss", "unsloth_rms_norm", "unsloth_rope", "unsloth_lora_mlp",
                             "unsloth_lora_qkv", "unsloth_lora_o")},
    **{k: _MOE_KERNEL for k in ("use_scattermoe", "use_sonicmoe", "experts_implementation")},
    "expert_parallel_num_nvl_bytes": "DeepEP's NVLink buffer size: " + _EP,
    "trust_remote_code": "no remote code is run: the model is built by functional_pp's own "
                         "implementation of its family (a base_model of another architecture is "
                         "refused when its config.json is read)",
    "strict": "Axolotl's strict has no effect on training",
    "remove_unused_columns": "datasets are read by their fields; other columns are never used",
    "ddp_find_unused_parameters": "every parameter takes part in each step; gradients are reduced "
                                  "from the layouts",
    "group_by_length": "batches are packed windows, not grouped by length",
    "skip_prepare_dataset": "datasets are tokenized at start, as they are streamed",
    "use_kernels": "kernels are torch's (the head and cross-entropy over token chunks with loss_chunks)",
    "wandb_run_id": "the W&B run id is chosen by wandb",
    "eval_batch_size": "held-out batches have the training batch's size",
    "save_only_model": "checkpoints hold the optimizer state too, for exact resumption",
    **{k: "each device reads only its slices of base_model; the mesh places them" for k in (
        "device_map", "low_cpu_mem_usage", "experimental_skip_move_to_device")},
    "ddp": "data parallelism comes from the mesh sizes (all devices when none are given)",
    "torch_dtype": "the training dtype comes from bf16 / fp16 / precision",
    **{k: "the tokenizer.json is read by the tokenizers library" for k in (
        "tokenizer_legacy", "tokenizer_use_fast")},
    "save_safetensors": "checkpoints and exports are safetensors",
    **{k: "base_model is a local directory: nothing is downloaded" for k in (
        "revision_of_model", "base_model_ignore_patterns")},
    "use_wandb": "W&B logs when wandb_project is set",
    "eval_table_size": "no table of generated predictions is logged (the held-out loss is)",
    "hf_use_auth_token": "base_model is a local directory: nothing is downloaded, no hub token is used",
    "lora_fan_in_fan_out": ("peft sets fan_in_fan_out to false for torch.nn.Linear weights, which every "
                            "family here has (it is for GPT-2's Conv1D): no effect"),
    **{k: "SwanLab gets the metrics only (no completion tables, no model upload)" for k in (
        "swanlab_log_completions", "swanlab_completion_log_interval", "swanlab_completion_max_buffer",
        "swanlab_log_model")},
    **{k: "kernels are torch's (the same math)" for k in (
        "fused_attn_kernel", "gemma4_hybrid_attn_impl", "use_dsv4_kernels", "use_glm_dsa_kernels",
        "dsv4_fp4_grouped_mode", "flash_optimum")},
    **{k: "torch.compile runs with its default options" for k in (
        "flex_attn_compile_kwargs", "torch_compile_mode")},
    "full_finetune": "every parameter is trained (full fine-tuning)",
    "local_rank": "torchrun sets each process's rank",
    "shuffle_merged_datasets": "the merged datasets' windows are drawn in a seeded random order "
                               "each epoch (as the trainer's sampler)",
    "tiled_mlp": "the MLP is computed whole (the same math; tiling only saves activation memory)",
}

#: attn_implementation values: all run the same attention here (NOT_USED's note)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
                        "kernels-community/flash-attn", "kernels-community/flash-attn3", "xformers")

#: Axolotl plugins whose work our ops already do; any other is refused by name
ACCEPTED_PLUGINS = {"axolotl.integrations.liger.LigerPlugin": _LIGER,
                    "axolotl.integrations.liger.plugin.LigerPlugin": _LIGER,
                    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin":
                        "cut cross-entropy: its cut_cross_entropy (true unless set false) turns "
                        "loss_chunks on",
                    "axolotl.integrations.kernels.KernelsPlugin": _HUB_KERNELS,
                    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": _EP,
                    "axolotl.integrations.swanlab.SwanLabPlugin": "SwanLab logging is use_swanlab's sink"}

#: Axolotl's LLMCompressorPlugin: it applies the ``llmcompressor:`` recipe (sparse fine-tuning)
SPARSE_PLUGIN = sparse_recipe.PLUGIN

#: Axolotl's diffusion plugin: it switches on the ``diffusion:`` objective (models/diffusion_lm.py)
DIFFUSION_PLUGIN = "axolotl.integrations.diffusion.DiffusionPlugin"

#: Accelerate config-file keys that describe how ``accelerate launch`` starts processes; they
#: are shown as "not used" in the start-up summary (torchrun / --simulate launch here)
ACCELERATE_LAUNCHER = ("compute_environment", "distributed_type", "machine_rank",
                       "main_training_function", "num_machines", "rdzv_backend", "same_network",
                       "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "downcast_bf16",
                       "enable_cpu_affinity", "gpu_ids", "main_process_ip", "main_process_port",
                       "debug")

_PARALLELISM = {"dp_replicate_size": "dp_replicate_size", "dp_shard_size": "dp_shard_size",
                "tp_size": "tp_size", "cp_size": "cp_size"}

#: Axolotl keys accepted when their value means what this trainer does anyway
_ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    # remat recomputes each layer either way; reentrancy does not change the numbers
    "gradient_checkpointing_kwargs": ({"use_reentrant": False}, {"use_reentrant": True}),
    # the architecture comes from base_model's config.json (its model_type), whichever is named
    # (any transformers ``*ForCausalLM`` class name is accepted: normalize())
    "model_type": ("LlamaForCausalLM", "AutoModelForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                   "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                   "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
    "tokenizer_type": ("AutoTokenizer", "LlamaTokenizer", "LlamaTokenizerFast",
                       "PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast", "GemmaTokenizer",
                       "GemmaTokenizerFast"),
    "pad_to_sequence_len": (True, False),          # packed windows always fill sequence_len
    "is_llama_derived_model": (True, False),
    "is_mistral_derived_model": (True, False),
    "is_qwen_derived_model": (True, False),
}


def _auto_compile() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def _put(out: dict, key: str, value: Any, source: str, issues: Issues) -> None:
    if value is None:
        return                        # a blank alias is unset
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            issues.add(f"{source}: '{part}' must be a mapping to hold {key}")
            return
        node = child
    last = parts[-1]
    if last in node and node[last] != value:
        issues.add(f"{source}: {value!r} contradicts {key}: {node[last]!r}; give one of them")
        return
    node[last] = value


def _off(value: Any) -> bool:
    """A value that asks for nothing (``false``, ``null``, empty)."""
    return value is None or value is False or value in ("", [], {})


def _batch_size_as_accumulation(d: dict, issues: Issues) -> dict:
    """Axolotl's deprecated ``batch_size`` (sequences per device per optimizer step) as
    ``gradient_accumulation_steps = batch_size / micro_batch_size``."""
    if d.get("batch_size") is None:
        return {k: v for k, v in d.items() if k != "batch_size"}
    d = dict(d)
    total, micro = d.pop("batch_size"), d.get("micro_batch_size") or 1
    if not isinstance(total, int) or not isinstance(micro, int) or total < 1 or total % micro:
        issues.add(f"batch_size={total!r} must be a whole multiple of micro_batch_size={micro!r} "
                   f"(batch_size = micro_batch_size x gradient_accumulation_steps)")
        return d
    accum = d.get("gradient_accumulation_steps")
    if accum is not None and accum != total // micro:
        issues.add(f"batch_size={total} contradicts micro_batch_size={micro} x gradient_accumulation_steps="
                   f"{accum}; give batch_size or gradient_accumulation_steps, not both")
        return d
    d["gradient_accumulation_steps"] = total // micro
    return d


#: keys of a ``pretraining_dataset`` entry passed on to its ``datasets`` entry
_PRETRAIN_KEYS = ("path", "data_files", "split", "name", "ds_type")


def _pretraining_as_datasets(d: dict, issues: Issues, unused: list[str]) -> dict:
    """Axolotl's ``pretraining_dataset`` (``type: pretrain``, the text in ``text_column``,
    default ``text``) as ``datasets`` of ``type: completion`` packed to ``sequence_len``
    (``sample_packing``, which Axolotl's pretraining always does): read from local files, not
    streamed (docs/data.md "Pretraining data")."""
    entries = d.get("pretraining_dataset")
    if _off(entries):
        return {k: v for k, v in d.items() if k != "pretraining_dataset"}
    d = dict(d)
    d.pop("pretraining_dataset")
    if not _off(d.get("datasets")):
        issues.add("pretraining_dataset and datasets are both set: Axolotl trains on pretraining_dataset alone; "
                   "remove one")
        return d
    if d.get("sample_packing") is False:
        issues.add("pretraining_dataset with sample_packing: false (Axolotl's concatenation across documents) is "
                   "not supported: remove sample_packing (pretraining data is packed, each document its own)")
        return d
    out = []
    for i, e in enumerate(entries if isinstance(entries, list) else [entries]):
        e = {"path": e} if isinstance(e, str) else e
        if not isinstance(e, dict) or not e.get("path"):
            issues.add(f"pretraining_dataset[{i}] must be a path or a mapping with a path, got {e!r}")
            continue
        if e.get("type", "pretrain") != "pretrain":
            issues.add(f"pretraining_dataset[{i}].type: {e['type']!r}: pretraining data is type: pretrain (for "
                       f"other types use datasets)")
            continue
        other = sorted(set(e) - {*_PRETRAIN_KEYS, "type", "text_column", "skip", "trust_remote_code"})
        if other:
            issues.add(f"pretraining_dataset[{i}]: {', '.join(other)} not supported (supported: "
                       f"{', '.join(_PRETRAIN_KEYS)}, text_column, type)")
        if e.get("skip"):
            issues.add(f"pretraining_dataset[{i}].skip: skipping the first rows is not supported: remove it")
        out.append({**{k: e[k] for k in _PRETRAIN_KEYS if k in e}, "type": "completion",
                    "field": e.get("text_column") or "text"})
    d["datasets"] = out
    d["sample_packing"] = True
    unused.append("pretraining_dataset: read whole from its files (not streamed) as datasets of type completion, "
                  "packed to sequence_len")
    return d


def _without_unused_lora_keys(d: dict, unused: list[str]) -> dict:
    """``adapter:`` written blank is full fine-tuning (as in Axolotl): the LoRA keys next to it
    are unused (noted). Without an ``adapter`` key they are refused (``check_adapter``)."""
    if "adapter" not in d or not _off(d["adapter"]):
        return d
    given = [k for k in LORA_KEYS if k in d and not _off(d[k])]
    if given:
        unused.append(f"{', '.join(given)} (adapter is blank: every parameter is trained, the LoRA keys "
                      f"are unused)")
    return {k: v for k, v in d.items() if k not in given}


def _loss_chunking(d: dict, issues: Issues, unused: list[str]) -> dict:
    """Axolotl's fused or chunked head-and-loss keys (``LOSS_CHUNK_KEYS``, the CutCrossEntropyPlugin)
    as ``loss_chunks``: the LM head and cross-entropy over that many chunks of each device's
    tokens, the full logits never stored (``chunked_cross_entropy_num_chunks``, else 8). What they
    ask for is the memory of the logits; the math is the same."""
    plugins = d.get("plugins") if isinstance(d.get("plugins"), list) else [d.get("plugins")]
    asked = [k for k in LOSS_CHUNK_KEYS if d.get(k) is True]
    if CCE_PLUGIN in plugins and d.get("cut_cross_entropy") is None:
        asked.append("the CutCrossEntropyPlugin")
    n = d.get("chunked_cross_entropy_num_chunks")
    rest = {k: v for k, v in d.items() if k not in LOSS_CHUNK_KEYS + ("chunked_cross_entropy_num_chunks",)}
    for k in LOSS_CHUNK_KEYS:
        if d.get(k) not in (None, True, False):
            issues.add(f"{k} must be true or false, got {d[k]!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        issues.add(f"chunked_cross_entropy_num_chunks must be a positive integer, got {n!r}")
        return rest
    if not asked:
        if n is not None:
            unused.append("chunked_cross_entropy_num_chunks (chunked_cross_entropy is off)")
        return rest
    if rest.get("loss_chunks") is not None or rest.get("loss_chunk_bytes") is not None:
        unused.append(f"{', '.join(asked)} (loss_chunks / loss_chunk_bytes is given)")
        return rest
    chunks = n or DEFAULT_LOSS_CHUNKS
    unused.append(f"{', '.join(asked)}: loss_chunks {chunks} (the LM head and cross-entropy over {chunks} chunks of "
                  f"each device's tokens, the full logits never stored: the same math)")
    return {**rest, "loss_chunks": chunks}


def normalize(d: dict, issues: Issues) -> tuple[dict, list[str]]:
    """``(canonical mapping, notes on keys accepted without effect)``: aliases rewritten,
    unsupported keys (unless switched off) and contradicting duplicates recorded in ``issues``."""
    out: dict = {}
    aliased: list[tuple[str, str, Any]] = []
    unused: list[str] = []
    d = _without_unused_lora_keys(_batch_size_as_accumulation(d, issues), unused)
    d = _pretraining_as_datasets(d, issues, unused)
    d = _loss_chunking(d, issues, unused)
    if d.get("tokenizer_use_mistral_common") is None and any(
            "magistral" in str(d.get(k) or "").lower() for k in ("base_model", "base_model_config", "tokenizer_config")):
        d = {**d, "tokenizer_use_mistral_common": True}         # Axolotl's check_tokenizer_use_mistral_common
        unused.append("tokenizer_use_mistral_common unset: true for a Magistral model, as Axolotl infers it "
                      "(set it false to read tokenizer.json)")
    launcher: list[str] = []
    diffusion_plugin = sparse_plugin = False
    refused: dict[str, list[str]] = {}           # reason -> the keys refused for it
    for key, value in d.items():
        prefix = next((p for p in UNSUPPORTED_PREFIXES if key.startswith(p)
                       and key not in _PREFIXED_FIELDS and key not in NOT_USED), None)
        if (key in UNSUPPORTED or prefix) and _off(value):
            continue                                 # switched off: nothing is asked for
        if prefix and key not in UNSUPPORTED:
            refused.setdefault(UNSUPPORTED_PREFIXES[prefix], []).append(key)
            continue
        if value is None and key not in ("parallelism_config",) and (
                key in ALIASES or key in NOT_USED or key in _ACCEPTED_VALUES or key in ACCELERATE_LAUNCHER
                or key in ("attn_implementation", "tokenizer_type", "plugins", "save_strategy", "eval_strategy",
                           "evaluation_strategy")):
            continue                                 # blank: unset (docs/config.md)
        if key == "special_tokens":
            if value is None:
                continue                             # blank: unset
            if not isinstance(value, dict) or not set(value) <= set(SPECIAL_TOKEN_KEYS):
                issues.add(f"special_tokens must map some of {', '.join(SPECIAL_TOKEN_KEYS)} to "
                           f"tokens of the tokenizer, got {value!r}")
                continue
            if "pad_token" in value and value["pad_token"] is not None and not _off(d.get("do_causal_lm_eval")):
                issues.add("special_tokens.pad_token with do_causal_lm_eval: the perplexity pads the references with "
                           "the tokenizer's own pad token (else its EOS); setting another is not supported: remove "
                           "special_tokens.pad_token or do_causal_lm_eval")
            if "pad_token" in value:
                unused.append("special_tokens.pad_token (packed rows need no padding; unpacked rows "
                              "are padded with EOS whose labels are ignored)")
            rest = {k: v for k, v in value.items() if k != "pad_token" and v is not None}
            if rest:
                out[key] = rest
        elif key == "deepspeed":
            if not _off(value):
                ds, ds_notes = deepspeed_settings(value, issues)
                aliased += [(key, k, v) for k, v in ds.items()]
                unused += ds_notes
        elif key in FSDP_KEYS:
            continue                                 # read together below
        elif key in UNSUPPORTED:
            refused.setdefault(UNSUPPORTED[key], []).append(key)
        elif key in NOT_USED:
            if not _off(value):
                unused.append(f"{key} ({NOT_USED[key]})")
        elif key == "eval_max_new_tokens" and _off(d.get("do_causal_lm_eval")) and not _off(value):
            unused.append(f"{key} (the perplexity window of do_causal_lm_eval, which is off; no text is generated)")
        elif key == "max_packed_sequence_len":          # Axolotl's old name of the packed length
            if d.get("sample_packing") is False:
                issues.add("max_packed_sequence_len packs rows into sequences of that length, but sample_packing "
                           "is false: remove one (sequence_len is the packed length here)")
            else:
                aliased.append((key, "sequence_len", value))
        elif key in ("save_strategy", "eval_strategy", "evaluation_strategy"):
            per = "saves_per_epoch" if key == "save_strategy" else "evals_per_epoch"
            if value == "epoch":
                aliased.append((key, per, 1))
            elif value == "no" and key == "save_strategy":
                aliased.append((key, "checkpoint.save_every", 0))
            elif value == "best" and key == "save_strategy":       # (transformers' SaveStrategy.BEST)
                aliased.append((key, "checkpoint.save_best", True))
            elif value == "no":
                issues.add(f"{key}: 'no' is not supported: the held-out loss is computed when "
                           f"val_set_size > 0; set val_set_size: 0 instead")
            elif value != "steps":
                issues.add(f"{key}: {value!r} is not supported (steps, epoch, no"
                           + (", best)" if key == "save_strategy" else ")"))
        elif key == "attn_implementation":
            if isinstance(value, str) and value not in ATTN_IMPLEMENTATIONS and "/" in value.strip("/"):
                unused.append(f"attn_implementation: {value} (a hub attention kernel, {_SAME_ATTENTION})")
            elif value not in ATTN_IMPLEMENTATIONS:
                issues.add(f"attn_implementation: {value!r} is not an attention implementation "
                           f"(choose {', '.join(ATTN_IMPLEMENTATIONS)}, or a hub kernel ORG/NAME)")
            else:
                unused.append(f"attn_implementation: {value} ({_SAME_ATTENTION})")
        elif key == "plugins":
            for name in value if isinstance(value, list) else [value]:
                if name == DIFFUSION_PLUGIN:            # its options: the diffusion key (its defaults when absent)
                    diffusion_plugin = True
                elif name == SPARSE_PLUGIN:             # its options: the llmcompressor key (checks.py)
                    sparse_plugin = True
                elif name in ACCEPTED_PLUGINS:
                    unused.append(f"plugin {name} ({ACCEPTED_PLUGINS[name]})")
                else:
                    issues.add(f"plugins: {name!r} is not supported (accepted: "
                               f"{', '.join([*ACCEPTED_PLUGINS, DIFFUSION_PLUGIN, SPARSE_PLUGIN])}): remove it")
        elif key == "tokenizer_type":
            if isinstance(value, str) and value.endswith(("Tokenizer", "TokenizerFast")):
                unused.append(f"tokenizer_type: {value} (the tokenizer.json is read by the tokenizers "
                              f"library, whichever class is named)")
            else:
                issues.add(f"tokenizer_type: {value!r} is not a tokenizer class (e.g. AutoTokenizer, "
                           f"LlamaTokenizerFast)")
        elif key in _ACCEPTED_VALUES:
            if key == "model_type" and isinstance(value, str) and (re.fullmatch(
                    r"[A-Z]\w*For(CausalLM|ConditionalGeneration|SequenceClassification|TokenClassification)",
                    value) or value in ("MambaLMHeadModel", "AutoModelForImageTextToText")):
                # a transformers causal-LM class: the architecture is config.json's (a multimodal
                # *ForConditionalGeneration or AutoModelForImageTextToText: its text decoder, or with
                # processor_type the whole vision-language model, docs/models.md); a classifier's
                # head is reward_model's / process_reward_model's (checked with them: checks.py);
                # mamba_ssm's MambaLMHeadModel: config.json's model_type must be mamba (models.py)
                out["model_type"] = value
                continue
            if value not in _ACCEPTED_VALUES[key]:
                ok = ", ".join(repr(v) for v in _ACCEPTED_VALUES[key])
                issues.add(f"{key}: {value!r} is not supported here (accepted: {ok}; only "
                           f"the decoder families of docs/models.md are trained): remove it")
        elif key in ACCELERATE_LAUNCHER:
            launcher.append(key)
        elif key == "parallelism_config":
            if value is None:
                continue
            if not isinstance(value, dict):
                issues.add(f"parallelism_config must be a mapping, got {value!r}")
                continue
            for k, v in value.items():
                short = k.removeprefix("parallelism_config_")
                if short in _PARALLELISM:
                    aliased.append((k, _PARALLELISM[short], v))
                else:
                    issues.add(f"unknown key 'parallelism_config.{k}' (valid: "
                               f"{', '.join('parallelism_config_' + p for p in _PARALLELISM)})")
        elif key in ALIASES:
            canonical, translate = ALIASES[key]
            aliased.append((key, canonical, translate(value)))
        else:
            out[key] = value
    if diffusion_plugin and out.get("diffusion") is None:
        out["diffusion"] = {}
    if sparse_plugin != (out.get("llmcompressor") is not None):
        issues.add(f"plugins: {SPARSE_PLUGIN} and the llmcompressor key go together (the plugin reads its recipe "
                   f"from llmcompressor; without the plugin Axolotl ignores the key): give both or neither")
    fsdp, fsdp_notes = fsdp_settings(d, issues)
    unused += fsdp_notes
    for why, keys in refused.items():             # one problem per feature, not per key
        order = list(UNSUPPORTED)
        first, *rest = sorted(keys, key=lambda k: order.index(k) if k in order else len(order))
        also = f" (with {', '.join(rest)})" if rest else ""
        issues.add(f"'{first}' is not supported{also}: {why}")
    for alias, canonical, value in aliased:
        _put(out, canonical, value, alias, issues)
    if isinstance(out.get("activation_checkpointing"), str) and out["activation_checkpointing"].lower() == "offload":
        out["activation_checkpointing"] = True      # Axolotl's checkpointing with the checkpoints offloaded
        out.setdefault("activation_offloading", True)
    if isinstance(out.get("activation_offloading"), str) and out["activation_offloading"].lower() == "legacy":
        out["activation_offloading"] = True         # Axolotl's older implementation of the same
    fsdp_remat = fsdp.pop("activation_checkpointing", False)
    if fsdp_remat and out.get("activation_checkpointing") not in SELECTIVE_REMAT:   # FSDP's or the trainer's: either
        out["activation_checkpointing"] = fsdp_remat
    for k, v in fsdp.items():
        _put(out, k, v, f"fsdp_config.{k}", issues)
    for key in {**VALUE_ALIASES, **REFUSED_VALUES}:
        table = VALUE_ALIASES.get(key, {})
        v = out.get(key)
        if isinstance(v, str) and v.lower() in table:
            out[key] = table[v.lower()]
            if v.lower() in VALUE_NOTES.get(key, {}):
                unused.append(VALUE_NOTES[key][v.lower()])
        elif isinstance(v, str) and v.lower() in REFUSED_VALUES.get(key, {}):
            issues.add(f"{key}: {REFUSED_VALUES[key][v.lower()]}")
            out.pop(key)
    if launcher:
        unused.append(f"{', '.join(launcher)} (accelerate launcher settings: this run is launched "
                      f"by torchrun or --simulate)")
    return out, unused
