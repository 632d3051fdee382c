"""The training config's top level, :class:`TrainConfig`: every key declared once as a field
with its type and help text (``functional-pp train --help`` prints them), and the values
derived from them (mesh, rules, batch, schedule). Reading is in ``config.loading``, checking
in ``config.checks``, the sections in ``config.sections`` (``docs/config.md``)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping

from functional_pp.config.checks import check_values, check_world, resolved_precision
from functional_pp.config.keys import MESH_KEYS
from functional_pp.config.loading import build_from_dict, config_to_dict, read_yaml
from functional_pp.config.models import model_family
from functional_pp.config.schema import ConfigError, Issues, fld
from functional_pp.config.sections import CheckpointConfig, DataConfig, LoggingConfig, ModelConfig
from functional_pp.core.policy import Policy

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Everything a training run needs. Build with :meth:`from_yaml` / :meth:`from_dict`;
    call :meth:`validate` with the world size before doing any work."""

    # mesh (Accelerate's ParallelismConfig names)
    dp_replicate_size: int = fld(1, "replicated data parallelism (the HSDP outer axis)")
    dp_shard_size: int = fld(1, "sharded data parallelism: FSDP / ZeRO-3 over N devices; -1: "
                                "the rest of the world")
    cp_size: int = fld(1, "context parallelism: the sequence split over N devices (ring "
                          "attention); alias context_parallel_size")
    tp_size: int = fld(1, "tensor parallelism over N devices; alias tensor_parallel_size")
    pp_size: int = fld(1, "pipeline parallelism: the model's layers split into N stages over the "
                          "outermost mesh axis pp (docs/pipelines.md); alias pipeline_parallel_size")
    pp_schedule: str = fld("1f1b", "the pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zb_h1")
    pp_virtual_stages: int = fld(1, "model chunks per pipeline device (interleaved_1f1b)")
    pp_fsdp_gather: str = fld("step", "FSDP under a pipeline: step (a stage's weights gathered once per "
                                      "step, reduce-scattered once) | micro (per micro-batch)")
    ep_size: int = fld(1, "expert parallelism: the experts of a mixture of experts split over N "
                          "devices, which the batch uses too (docs/experts.md); alias "
                          "expert_parallel_size")
    router_z_loss_coef: float | None = fld(None, "mixture of experts: ST-MoE's router z-loss added with this "
                                                 "coefficient (null: the model's, 0 unless set there; "
                                                 "docs/experts.md)")
    capacity_factor: float | None = fld(None, "mixture of experts: a static capacity per expert and sequence, "
                                              "ceil(factor x seq x top_k / experts) slots, the assignments past "
                                              "it dropped and counted (moe_dropped); compiles. null: dropless "
                                              "(docs/experts.md)")
    expert_parallel_token_capacity: int | None = fld(None, "mixture of experts (Axolotl's expert-parallel "
                                                     "plugin): at most this many (token, expert) assignments per "
                                                     "expert of one device's tokens per forward, the lowest "
                                                     "weights dropped and each token's kept weights scaled back "
                                                     "to their sum (moe_dropped); dropless routing only. null: no "
                                                     "cap (docs/experts.md)")
    overrides_of_model_config: dict | None = fld(None, "base_model: keys of its config.json replaced before the "
                                                       "model is built (e.g. output_router_logits: true adds "
                                                       "the router's auxiliary loss); alias model_config "
                                                       "(Axolotl's)")
    sequence_parallel: bool = fld(False, "split the residual stream's sequence over tp too")
    num_processes: int | None = fld(None, "Accelerate: the world size the config expects "
                                          "(checked against torchrun / --simulate)")
    use_ray: bool = fld(False, "Axolotl's Ray launch: here the processes come from torchrun / --simulate "
                               "(one rank per device); ray_num_workers is then checked against their number")
    ray_num_workers: int | None = fld(None, "use_ray: the world size the config expects (checked against "
                                            "torchrun / --simulate, as num_processes)")
    resources_per_worker: dict | None = fld(None, "use_ray: Ray's resources per worker; GPU must be 1 (one "
                                                  "device per process), the others only schedule Ray workers")
    # batch (Axolotl names)
    micro_batch_size: int = fld(1, "sequences per data-parallel rank per micro-step")
    gradient_accumulation_steps: int = fld(1, "micro-steps per optimizer step")
    global_batch_size: int | None = fld(None, "sequences per optimizer step (derives "
                                              "gradient_accumulation_steps)")
    sequence_len: int = fld(128, "tokens per sequence")
    sample_packing: bool = fld(True, "pack documents into full sequences, EOS between them, "
                                     "attention never crossing a document boundary; false: one "
                                     "document per row, padded")
    # optimization
    learning_rate: float = fld(3e-4, "peak learning rate")
    lr_scheduler: Literal["constant", "cosine", "linear"] = fld(
        "cosine", "constant | cosine | linear (aliases constant_with_warmup, "
                  "cosine_with_restarts)")
    warmup_steps: int | float = fld(0, "linear warmup steps; a fraction < 1: of max_steps (as "
                                       "transformers reads warmup_steps: 0.1)")
    warmup_ratio: float | None = fld(None, "warmup as a fraction of max_steps (instead of "
                                           "warmup_steps)")
    min_learning_rate: float = fld(0.0, "learning rate at the end of the decay")
    cosine_constant_lr_ratio: float | None = fld(None, "cosine only, with cosine_min_lr_ratio: the "
                                                       "cosine reaches the minimum at this fraction of "
                                                       "max_steps and holds it (Axolotl's; 0: none)")
    lr_quadratic_warmup: bool = fld(False, "cosine only: warm up as (step / warmup) ** 2 (Axolotl's)")
    cosine_min_lr_ratio: float | None = fld(None, "min_learning_rate as a fraction of "
                                                  "learning_rate")
    max_steps: int = fld(100, "optimizer steps (wins over num_epochs)")
    num_epochs: int | None = fld(None, "epochs over the training data when max_steps is not "
                                       "given")
    weight_decay: float = fld(0.0, "decoupled weight decay (matrices only)")
    max_grad_norm: float | None = fld(1.0, "clip the global gradient norm; null: no clipping")
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit", "sgd"] = fld(
        "adamw", "adamw | adamw_8bit (8-bit moments, bitsandbytes' blockwise scheme) | adamw_4bit (4-bit "
                 "moments, torchao's AdamW4bit; aliases adamw_torch_4bit, ao_adamw_4bit) | sgd (aliases "
                 "adamw_torch, adamw_torch_fused; adamw_bnb_8bit, paged_adamw_8bit, adamw_torch_8bit, "
                 "ao_adamw_8bit = adamw_8bit; "
                 "paged_adamw_32bit = adamw)")
    adam_beta1: float = fld(0.9, "AdamW beta1")
    adam_beta2: float = fld(0.95, "AdamW beta2")
    adam_epsilon: float = fld(1e-8, "AdamW epsilon")
    momentum: float = fld(0.0, "SGD momentum")
    seed: int = fld(0, "seed of initialization and data order")
    precision: str = fld("fp32", "fp32 | bf16 | fp16 (bf16: fp32 master weights; alias "
                                 "mixed_precision)")
    bf16: bool | Literal["auto"] | None = fld(None, "Axolotl: true = precision bf16; auto: bf16 "
                                                    "where the GPU supports it, else fp32")
    fp16: bool | None = fld(None, "Axolotl: true = precision fp16")
    tf32: bool | None = fld(None, "allow TF32 matmuls on CUDA")
    activation_checkpointing: bool | Literal["selective", "selective_alternate"] = fld(
        False, "recompute each layer in backward (alias gradient_checkpointing); selective: keep "
               "the matmul and attention results, recompute the rest; selective_alternate: torchtitan's "
               "op policy, every second matmul recomputed too (docs/memory.md)")
    reshard_after_forward: bool = fld(True, "FSDP: re-gather each layer's weights in backward "
                                            "(ZeRO-3); false: keep them gathered for backward "
                                            "(ZeRO-2, SHARD_GRAD_OP; more memory, fewer gathers)")
    offload_params: bool = fld(False, "keep the master weights, gradients and optimizer state in host "
                                      "memory between steps and update there (Axolotl fsdp_config."
                                      "offload_params, FSDP2's CPUOffloadPolicy; docs/memory.md)")
    activation_offloading: bool = fld(False, "move the tensors saved for backward to pinned host memory "
                                             "in forward and back in backward (CUDA; docs/memory.md)")
    loss_chunks: int | None = fld(None, "the LM head and cross-entropy over this many chunks of each device's "
                                        "tokens, the full logits never stored (Axolotl's cut_cross_entropy, "
                                        "liger_fused_linear_cross_entropy, chunked_cross_entropy: 8 or "
                                        "chunked_cross_entropy_num_chunks); null: the whole logits (docs/memory.md)")
    loss_chunk_bytes: int | None = fld(None, "the same over chunks of this many bytes of fp32 logits (instead of "
                                             "loss_chunks)")
    compile: bool | str = fld(False, "torch.compile the step: true, or a backend name (alias "
                                     "torch_compile, torch_compile_backend)")
    on_nonfinite: Literal["skip", "raise"] = fld("skip", "a non-finite loss/gradient: skip the "
                                                         "step or stop")
    peak_flops_per_device: float | None = fld(None, "peak FLOP/s of one device, for MFU "
                                                    "(known GPUs are detected)")
    max_consecutive_skips: int | None = fld(10, "stop the run after this many non-finite steps "
                                                "in a row; null: never stop")
    loss_watchdog_threshold: float | None = fld(None, "stop the run (non-zero exit status) when the "
                                                      "loss stays above this for "
                                                      "loss_watchdog_patience steps")
    loss_watchdog_patience: int | None = fld(None, "steps in a row above loss_watchdog_threshold "
                                                   "that stop the run (default 3)")
    metric_for_best_model: str | None = fld(None, "the metric save_strategy: best watches: loss / eval_loss "
                                                  "(the held-out loss, the only metric computed here)")
    greater_is_better: bool | None = fld(None, "save_strategy: best: a higher metric is better (default: "
                                               "false for the loss, as transformers)")
    early_stopping_patience: int | None = fld(None, "stop the run (non-zero exit status) after this "
                                                    "many evaluations without a lower held-out loss")
    collective_timeout: float | None = fld(None, "seconds a device waits for a peer in a "
                                                 "collective before the run fails naming it")
    simulation: Literal["threaded", "batched", "auto"] = fld(
        "threaded", "how simulated devices run (--simulate N, or a multi-device mesh on a CPU "
                    "machine): threaded (one thread per device), batched (all devices in one "
                    "batched run: same numbers, ~4x faster for 16 devices), auto: batched unless "
                    "the config needs threads (compile); alias --sim-mode; docs/simulation.md")
    layout: Literal["manual", "auto"] = fld("manual", "auto: functional_pp.plan picks the mesh and "
                                                      "rules for the devices at hand (docs/planning.md)")
    # preference fine-tuning (Axolotl / TRL names; docs/preference.md)
    rl: str | None = fld(None, "preference fine-tuning from chosen / rejected pairs: dpo | ipo | orpo | simpo; "
                               "from unpaired completions labelled desirable or not: kto (TRL's losses; "
                               "docs/preference.md)")
    rl_beta: float | None = fld(None, "the preference loss's beta (TRL's; default 0.1, simpo 2.0)")
    dpo_loss_type: str | list | None = fld(None, "rl: dpo: TRL's loss_type, one or a list (summed, weighted by "
                                                 "dpo_loss_weights): sigmoid | hinge | ipo | robust | exo_pair | "
                                                 "nca_pair | bco_pair | sppo_hard | apo_zero | apo_down | discopop "
                                                 "| sigmoid_norm | sft (default sigmoid; rl: ipo is ipo)")
    dpo_loss_weights: list | None = fld(None, "rl: dpo: one weight per dpo_loss_type (TRL's loss_weights; "
                                              "default 1.0 each)")
    dpo_label_smoothing: float = fld(0.0, "rl: dpo with dpo_loss_type robust (in [0, 0.5)) or exo_pair (> 0): "
                                          "the label smoothing")
    orpo_alpha: float | None = fld(None, "rl: orpo: the odds-ratio term's weight (TRL's beta; default 0.1)")
    simpo_gamma: float = fld(0.5, "rl: simpo: the target reward margin")
    cpo_alpha: float = fld(1.0, "rl: simpo: the weight of the chosen completions' NLL (TRL's cpo_alpha; 0: none)")
    dataset_exact_deduplication: bool = fld(False, "leave out rows equal to an earlier one (the same tokens and "
                                                   "trained positions), in every dataset (rl: preference pairs, "
                                                   "KTO completions); counted in the summary (Axolotl's)")
    kto_desirable_weight: float | None = fld(None, "rl: kto: the weight of desirable completions' losses "
                                                   "(TRL's desirable_weight; default 1.0)")
    kto_undesirable_weight: float | None = fld(None, "rl: kto: the weight of undesirable completions' losses "
                                                     "(TRL's undesirable_weight; default 1.0)")
    dpo_use_weighting: bool | None = fld(None, "rl: dpo / ipo: WPO's weights of the pairs (TRL's use_weighting)")
    precompute_ref_log_probs: bool | None = fld(None, "rl: dpo / ipo: the reference's log-probabilities of every "
                                                      "pair computed once before training and stored with the pairs "
                                                      "(the reference then not held; TRL's)")
    kto_loss_type: str | None = fld(None, "rl: kto: TRL's loss_type, kto (default) | apo_zero_unpaired (APO-zero, "
                                          "no KL term)")
    # reward models (Axolotl / TRL names; docs/reward_models.md)
    reward_model: bool = fld(False, "train a reward model: a score head over the decoder read at each sequence's "
                                    "last token, TRL RewardTrainer's Bradley-Terry loss on "
                                    "bradley_terry.chat_template pairs (model_type: "
                                    "AutoModelForSequenceClassification)")
    process_reward_model: bool = fld(False, "train a process reward model: a score head on every token, "
                                            "cross-entropy of the step labels at the step separators of "
                                            "stepwise_supervised data (model_type: AutoModelForTokenClassification)")
    num_labels: int | None = fld(None, "reward_model: 1 (the default); process_reward_model: the step "
                                       "labels' classes (default 2)")
    center_rewards_coefficient: float | None = fld(None, "reward_model: TRL's weight of mean((r_chosen + "
                                                         "r_rejected)^2) added to the loss (default none)")
    model_type: str | None = fld(None, "Axolotl's model class: any *ForCausalLM or *ForConditionalGeneration "
                                       "(the architecture is base_model's config.json; a multimodal one's text "
                                       "decoder is trained), AutoModelForSequenceClassification "
                                       "(reward_model), AutoModelForTokenClassification (process_reward_model)")
    trl: dict | None = fld(None, "rl: grpo / gdpo: TRL's GRPO arguments as Axolotl writes them (reward_funcs, "
                                 "reward_weights, num_generations, max_completion_length, temperature, top_p, "
                                 "top_k, beta, epsilon, loss_type, scale_rewards, ...; docs/preference.md)")
    vllm: dict | None = fld(None, "rl: grpo / gdpo: Axolotl's vLLM server settings, accepted and unused "
                                  "(generation runs in-process here)")
    ebft: dict | None = fld(None, "rl: ebft: Axolotl's EBFT settings, the strided mode (mode: strided, stride, "
                                  "context_length, generate_max_len, n_samples_per_prompt, feature_layers, "
                                  "embed_method, use_whitening, alignment_coef, diversity_coef, rl_coef, ce_coef, "
                                  "advantage_estimator, ...; docs/preference.md \"EBFT\")")
    # adapters and frozen parameters (Axolotl / peft names; docs/adapters.md)
    adapter: Literal["lora", "qlora"] | None = fld(None, "lora: train LoRA adapters of the targeted "
                                                         "weights, the rest frozen; qlora: lora on an NF4 "
                                                         "base (load_in_4bit)")
    load_in_4bit: bool = fld(False, "hold the adapted weights' frozen base as NF4 (QLoRA; "
                                    "docs/quantization.md); with an adapter only")
    load_in_8bit: bool = fld(False, "hold the adapted weights' frozen base as blockwise int8; with "
                                    "an adapter only")
    gptq: bool = fld(False, "base_model is a GPTQ checkpoint (qweight / qzeros / scales / g_idx, 2-, 4- or "
                            "8-bit, checkpoint_format gptq or gptq_v2): its linears read dequantized, frozen "
                            "under adapter: lora (docs/quantization.md)")
    quantize_moe_experts: bool = fld(False, "with load_in_4bit / load_in_8bit: quantize the experts' "
                                            "stacked weights too, each stack as bitsandbytes quantizes "
                                            "the stacked [experts, out, in] tensor (Axolotl's; "
                                            "docs/quantization.md)")
    llama4_linearized_experts: bool = fld(False, "Axolotl's linearized Llama 4 checkpoints (each expert's gate / "
                                                 "up / down its own nn.Linear: feed_forward.experts.gate_projs.N): "
                                                 "read into the stacked experts (the same math), written back "
                                                 "under those names; with load_in_4bit / load_in_8bit the experts "
                                                 "are quantized too, as bitsandbytes reaches each expert's linear "
                                                 "(docs/models.md)")
    bnb_config_kwargs: dict | None = fld(None, "bitsandbytes' options as Axolotl passes them: "
                                               "bnb_4bit_use_double_quant (default true), "
                                               "bnb_4bit_quant_type (nf4 only), bnb_4bit_compute_dtype "
                                               "(the run's precision), llm_int8_has_fp16_weight (false)")
    model_quantization_config: str | None = fld(None, "the transformers quantization config the base model "
                                                      "loads with: Mxfp4Config (gpt-oss's MXFP4 experts, "
                                                      "read dequantized, as every MXFP4 checkpoint is read "
                                                      "here), with model_quantization_config_kwargs "
                                                      "{dequantize: true}")
    model_quantization_config_kwargs: dict | None = fld(None, "the options of model_quantization_config: "
                                                              "dequantize: true")
    lora_r: int = fld(8, "LoRA rank")
    lora_alpha: float = fld(16, "LoRA alpha: the adapter is scaled by alpha / r")
    lora_dropout: float = fld(0.0, "dropout on the adapter's input")
    lora_target_modules: list | str | None = fld(None, "weights to adapt: module names "
                                                       "([q_proj, v_proj]) or one regex, as peft")
    lora_target_parameters: list | None = fld(None, "peft's target_parameters: the experts' fused tensors to "
                                                    "adapt (mlp.experts.gate_up_proj: gate and up sharing one "
                                                    "lora_A, mlp.experts.down_proj; docs/adapters.md)")
    lora_target_linear: bool = fld(False, "adapt every linear weight (peft's all-linear; not the "
                                          "embedding or LM head)")
    lora_modules_to_save: list | None = fld(None, "modules trained whole beside the adapters "
                                                  "(e.g. [lm_head, embed_tokens])")
    peft_use_rslora: bool = fld(False, "rank-stabilised LoRA: scale by alpha / sqrt(r)")
    peft_use_dora: bool = fld(False, "DoRA: a trained magnitude per output of each adapted weight (peft's use_dora)")
    nvfp4_merge_aware: bool = fld(False, "Axolotl's merge-aware NVFP4 LoRA on a ModelOpt NVFP4 base: each adapted "
                                         "weight trains as Q(W + s B A), the merged weight through NVFP4, gradients "
                                         "straight through; --merge-adapter exports that NVFP4 checkpoint "
                                         "(docs/adapters.md)")
    peft: dict | None = fld(None, "peft's own LoRA options as Axolotl passes them: loftq_config: {loftq_bits: 4 | "
                                  "8, loftq_iter: 1}: LoftQ initialisation (the base replaced by its quantized "
                                  "form, the adapters the SVD of the rest; docs/adapters.md \"LoftQ\")")
    lora_model_dir: str | None = fld(None, "start from this PEFT adapter directory "
                                           "(adapter_config.json + adapter_model.safetensors)")
    unfrozen_parameters: list | None = fld(None, "regexes of the parameters to train (our paths or "
                                                 "Hugging Face names); every other one frozen")
    lisa_n_layers: int | None = fld(None, "LISA (Axolotl's): train only this many decoder layers at a time, drawn "
                                          "as Axolotl draws them every lisa_step_interval steps; embeddings, "
                                          "final norm and head train at every step (docs/optim.md \"LISA\")")
    lisa_step_interval: int | None = fld(None, "LISA: steps between draws of the trained layers")
    lisa_layers_attribute: str = fld("model.layers", "LISA: the model's list of decoder layers (Hugging Face's "
                                                     "name; every family's is its decoder layers here)")
    qat: dict | None = fld(None, "quantization-aware training (Axolotl's / torchao's): {weight_dtype: int4, "
                                 "activation_dtype: int8, group_size: 32, fake_quant_after_n_steps: N}: the "
                                 "linear weights (groups of group_size inputs) and their inputs (per token) "
                                 "fake-quantized in the forward, rounding straight through; or weight_dtype "
                                 "and activation_dtype nvfp4 (group_size 16: NVFP4's blocks); exported "
                                 "unquantized")
    llmcompressor: dict | None = fld(None, "sparse fine-tuning (Axolotl's LLMCompressorPlugin): {recipe: {STAGE: "
                                           "{finetuning_modifiers: {ConstantPruningModifier: {targets: ['re:.*q_proj"
                                           ".weight', ...], start: 0}}}}, save_compressed: true}: the targeted "
                                           "weights' zeros (|w| <= 1e-8 when loaded) stay zero through training "
                                           "(docs/finetune.md \"Sparse fine-tuning\"); weights written dense")
    diffusion: dict | None = fld(None, "masked-diffusion language-model training (Axolotl's DiffusionPlugin, LLaDA): "
                                       "{mask_token_id: ID, eps: 1e-3, importance_weighting: true, ...}; each "
                                       "row's answer tokens masked with probability (1 - eps) t + eps, t uniform, "
                                       "bidirectional attention inside each document, the loss on the masked "
                                       "tokens (docs/finetune.md \"Diffusion language models\")")
    # model and data
    base_model: str | None = fld(None, "a local Hugging Face Llama directory (config.json + "
                                       "safetensors) to start from; its tokenizer is used")
    tokenizer: str | None = fld(None, "tokenizer.json or a directory holding it (default: "
                                      "base_model's)")
    processor_type: str | None = fld(None, "AutoProcessor (or the processor class base_model's files name: "
                                           "Llama4Processor, ...): a vision-language base_model (Mistral 3: "
                                           "Pixtral's encoder and the projector) trained on chat_template datasets "
                                           "with images, encoded by base_model's processor files (docs/data.md, "
                                           "\"Images\"); needs sample_packing: false")
    freeze_mm_modules: bool = fld(False, "with processor_type: the vision encoder and projector are frozen (no "
                                         "gradient, no optimizer state), only the text decoder trains (under "
                                         "adapter: lora / qlora they are frozen already)")
    tokenizer_use_mistral_common: bool = fld(False, "read the tokenizer with mistral-common (tekken.json or "
                                                    "tokenizer.model.v*: pip install 'functional_pp[mistral]'); "
                                                    "chats encoded by mistral-common, not a chat template")
    special_tokens: dict | None = fld(None, "Axolotl: {eos_token: <|im_end|>, bos_token: ..., "
                                            "pad_token: ...}: tokens of the tokenizer made its "
                                            "special tokens (EOS: ends documents and chat turns); "
                                            "tokens not in the vocabulary are refused")
    chat_template: str | None = fld(None, "chat template of chat_template datasets: a name "
                                          "(chatml, llama3, llama4, mistral_v1, gemma3, phi_3, "
                                          "qwen_25, qwen3, ...: Axolotl's templates), "
                                          "tokenizer_default (the tokenizer's), "
                                          "tokenizer_default_fallback_<name>, or jinja with "
                                          "chat_template_jinja; unset: the tokenizer's, else "
                                          "chatml")
    chat_template_jinja: str | None = fld(None, "chat_template: jinja: the template text or a "
                                                ".jinja file")
    chat_template_kwargs: dict | None = fld(None, "chat_template: extra template variables (e.g. "
                                                  "{enable_thinking: false})")
    eot_tokens: list | None = fld(None, "chat_template: end-of-turn tokens trained after a turn "
                                        "(default: the tokenizer's EOS); see train_on_eot")
    tokens: list | None = fld(None, "texts added to the tokenizer as tokens; the embedding and head "
                                    "grow to hold them, new rows the mean of the old (as "
                                    "transformers' resize_token_embeddings)")
    resize_token_embeddings_to_32x: bool = fld(False, "grow the embedding and head to a multiple of 32 "
                                                      "rows above the tokenizer's size (new rows: the "
                                                      "mean of the old)")
    dataset_prepared_path: str | None = fld(None, "datasets: cache the tokenized data in this "
                                                  "directory and reuse it while the config and the "
                                                  "data are unchanged")
    excess_length_strategy: Literal["drop", "truncate", "raise"] | None = fld(
        None, "datasets: a row longer than sequence_len is dropped (counted in the summary), truncated "
              "(nothing trained at the cut) or refused naming it (Axolotl's); unset: drop when "
              "sample_packing is false, packed documents continue in the next window")
    min_sample_len: int | None = fld(None, "datasets: leave out rows of fewer tokens (with EOS), counted in "
                                           "the summary (Axolotl's)")
    train_on_inputs: bool = fld(False, "alpaca / chat: also train on prompt tokens")
    datasets: list | None = fld(None, "training data: a list of entries (path, type, ...); see "
                                      "the datasets keys below")
    val_set_size: float = fld(0.0, "held-out share of the data: a fraction < 1 or a count of "
                                   "sequences")
    do_causal_lm_eval: bool = fld(False, "Axolotl's causal-LM evaluation: at each evaluation also the metrics of "
                                         "eval_causal_lm_metrics on the held-out rows (perplexity only: the "
                                         "metrics of generated text are not built; docs/finetune.md)")
    eval_causal_lm_metrics: list | None = fld(None, "do_causal_lm_eval's metrics: [perplexity] (Axolotl's default "
                                                    "adds sacrebleu, comet, ter, chrf: generated text, refused)")
    eval_max_new_tokens: int = fld(128, "do_causal_lm_eval: the perplexity's window of tokens (Axolotl's "
                                        "max_seq_len of its Perplexity metric; no text is generated here)")
    eval_steps: int | None = fld(None, "held-out loss every N steps (default: at log steps "
                                       "and at the end when val_set_size > 0)")
    evals_per_epoch: int | None = fld(None, "held-out loss N times per epoch: eval_steps = "
                                            "ceil(max_steps / (N x num_epochs)), as Axolotl")
    saves_per_epoch: int | None = fld(None, "checkpoints N times per epoch: save_steps = "
                                            "ceil(max_steps / (N x num_epochs)), as Axolotl")
    resume_from_checkpoint: bool | str | None = fld(None, "true: continue from the newest "
                                                          "checkpoint of the output directory; "
                                                          "a path: from that checkpoint")
    # metrics
    use_tensorboard: bool = fld(False, "also log to TensorBoard (output_dir/tensorboard)")
    wandb_project: str | None = fld(None, "also log to Weights & Biases in this project")
    wandb_mode: Literal["online", "offline", "disabled"] | None = fld(
        None, "W&B mode (offline needs no network)")
    wandb_name: str | None = fld(None, "W&B run name")
    wandb_entity: str | None = fld(None, "W&B entity")
    use_swanlab: bool = fld(False, "also log to SwanLab (the swanlab package: pip install "
                                   "'functional_pp[swanlab]'; Axolotl's SwanLabPlugin)")
    swanlab_project: str | None = fld(None, "SwanLab project (default: the output directory's name)")
    swanlab_experiment_name: str | None = fld(None, "SwanLab experiment name")
    swanlab_description: str | None = fld(None, "SwanLab experiment description")
    swanlab_mode: Literal["cloud", "local", "offline", "disabled"] | None = fld(
        None, "SwanLab mode (default cloud: needs swanlab login; offline and local need no network)")
    swanlab_workspace: str | None = fld(None, "SwanLab workspace (a team's)")
    use_otel_metrics: bool = fld(False, "also export the metrics through OpenTelemetry, served to Prometheus "
                                        "on otel_metrics_host:otel_metrics_port/metrics (Axolotl's gauges; "
                                        "pip install 'functional_pp[otel]')")
    otel_metrics_host: str = fld("localhost", "use_otel_metrics: the metrics server's address")
    otel_metrics_port: int = fld(8000, "use_otel_metrics: the metrics server's port")
    # sections
    model: ModelConfig = fld(help="model family, preset and overrides (training from scratch)",
                             factory=ModelConfig)
    data: DataConfig = fld(help="a single corpus (when there is no datasets list)",
                           factory=DataConfig)
    rules: dict = fld(help="dimension name -> mesh axis / list / null, replacing the defaults",
                      factory=dict)
    logging: LoggingConfig = fld(help="output directory and progress line", factory=LoggingConfig)
    checkpoint: CheckpointConfig = fld(help="checkpoint saving", factory=CheckpointConfig)
    name: str = "train"            # from the YAML file name; names the default output dir

    # ------------------------------------------------------------------ parsing
    @classmethod
    def valid_keys(cls) -> list[str]:
        """Top-level keys a config may have (besides aliases)."""
        return [f.name for f in fields(cls) if f.name != "name"]

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "TrainConfig":
        """Read a YAML config; ``overrides`` are ``key=value`` strings (dotted keys for
        sections, values parsed as YAML) applied before checking."""
        cfg = cls.from_dict(read_yaml(path, overrides), name=Path(path).stem, source=str(path))
        cfg.source_path = str(path)        # (not a key: where modules named by the config are looked for)
        return cfg

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "train", source: str = "") -> "TrainConfig":
        """Build from a mapping, checking key names and value types; every problem is
        reported at once."""
        return build_from_dict(cls, d, name, source)

    def _check_values(self, issues: Issues | None = None) -> None:
        check_values(self, issues)

    def lora_config(self):
        """The run's :class:`functional_pp.adapters.LoraConfig` (``adapter: lora``), else None."""
        from functional_pp.adapters import LoraConfig
        from functional_pp.adapters.peft_fused import model_type_of, part_names
        if self.adapter not in ("lora", "qlora"):
            return None
        from functional_pp.adapters.target_parameters import expert_targets
        names = self.lora_target_modules      # (a fused module, Phi-3's qkv_proj, names its parts)
        try:
            experts, shared = expert_targets(self.lora_target_parameters or ())
            if experts and isinstance(names, str):      # peft: the regex, or one of the expert tensors
                # (our expert paths, layers.N.mlp.gate: not the router's Hugging Face name, mlp.gate)
                names = "|".join([f"(?:{names})"] + [rf"(?:layers\.\d+\.)?{re.escape(e)}" for e in experts])
            modules = names if isinstance(names, str) else (
                part_names(names or (), model_type_of(self.base_model)) + experts or None)
            return LoraConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                              target_modules=modules, shared_a=shared,
                              target_linear=self.lora_target_linear,
                              modules_to_save=tuple(self.lora_modules_to_save or ()),
                              rslora=self.peft_use_rslora, dora=self.peft_use_dora,
                              nvfp4_merge_aware=self.nvfp4_merge_aware,
                              unfrozen_parameters=tuple(self.unfrozen_parameters or ()))
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(f"adapter: {self.adapter}: {exc}") from exc

    def loftq(self) -> dict | None:
        """``{"bits", "iters"}`` of ``peft: {loftq_config: ...}`` (peft's ``LoftQConfig``: 4 bits, 1
        iteration by default), else None."""
        conf = (self.peft or {}).get("loftq_config")
        if not isinstance(conf, dict):
            return None
        return {"bits": conf.get("loftq_bits", 4), "iters": conf.get("loftq_iter", 1)}

    def diffusion_spec(self):
        """The run's :class:`functional_pp.models.diffusion_lm.DiffusionSpec` (``diffusion:``), else None."""
        if self.diffusion is None:
            return None
        from functional_pp.models.diffusion_lm import DiffusionSpec
        return DiffusionSpec.from_mapping(self.diffusion)

    def qat_config(self):
        """The run's :class:`functional_pp.ops.fake_quant.QatConfig` (``qat:``), else None."""
        if not self.qat:
            return None
        from functional_pp.ops.fake_quant import QatConfig
        q = self.qat
        return QatConfig(weight_dtype=q.get("weight_dtype", "int4"), activation_dtype=q.get("activation_dtype"),
                         group_size=int(q.get("group_size") or 32),
                         fake_quant_after_n_steps=q.get("fake_quant_after_n_steps"))

    def base_quantization(self) -> dict | None:
        """How the adapted weights' frozen base is quantized: ``{"kind": "nf4" | "int8",
        "double_quant": bool, "experts": bool}`` (``adapter: qlora`` or ``load_in_4bit``;
        ``load_in_8bit``; ``experts``: ``quantize_moe_experts``), else None."""
        kw = dict(self.bnb_config_kwargs or {})
        experts = bool(self.quantize_moe_experts or self.llama4_linearized_experts)
        if self.load_in_8bit:
            return {"kind": "int8", "double_quant": False, "experts": experts}
        if self.adapter == "qlora" or self.load_in_4bit:
            return {"kind": "nf4", "double_quant": bool(kw.get("bnb_4bit_use_double_quant", True)),
                    "experts": experts}
        return None

    def resolved_precision(self) -> str:
        """``precision``, reconciled with Axolotl's ``bf16`` / ``fp16`` flags."""
        return resolved_precision(self)

    def policy(self) -> Policy:
        """The training step's :class:`functional_pp.Policy` this config asks for:
        ``activation_checkpointing`` (remat) and ``reshard_after_forward`` (its negation
        keeps the gathered weights, ZeRO-2); the rest the step's defaults."""
        return Policy(remat=self.activation_checkpointing, keep_gathered=not self.reshard_after_forward)

    def offload_options(self) -> dict:
        """The training step's offload settings this config asks for (``train_step`` keywords,
        those set only): ``offload_params``, ``activation_offloading`` (docs/memory.md)."""
        return {k: True for k in ("offload_params", "activation_offloading") if getattr(self, k)}

    def warmup(self) -> int:
        """Warmup steps: ``warmup_steps``, or ``ceil(warmup_ratio x max_steps)``."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * self.max_steps)
        if isinstance(self.warmup_steps, float) and self.warmup_steps < 1:
            return math.ceil(self.warmup_steps * self.max_steps)
        return int(self.warmup_steps)

    def min_lr(self) -> float:
        """``min_learning_rate``, or ``cosine_min_lr_ratio x learning_rate``."""
        if self.cosine_min_lr_ratio is not None:
            return self.cosine_min_lr_ratio * self.learning_rate
        return self.min_learning_rate

    def set_epochs(self, steps_per_epoch: int) -> None:
        """``max_steps = num_epochs x steps_per_epoch`` when ``num_epochs`` is given and
        ``max_steps`` is not (as Axolotl: max_steps wins)."""
        self.steps_per_epoch = steps_per_epoch
        if self.num_epochs is not None and "max_steps" not in self._given:
            self.max_steps = max(1, self.num_epochs * steps_per_epoch)
            self.epochs_derived = True
            self._given.add("max_steps")
            self._check_values()
        self.set_per_epoch()

    def set_per_epoch(self) -> None:
        """``saves_per_epoch`` / ``evals_per_epoch`` as step intervals: Axolotl's fraction
        ``1 / (N x num_epochs)`` of the run's steps, rounded up as Hugging Face does."""
        epochs = self.num_epochs or 1
        if self.saves_per_epoch:
            self.checkpoint.save_every = max(1, math.ceil(self.max_steps / (self.saves_per_epoch * epochs)))
            self._given.add("saves_per_epoch_applied")
        if self.evals_per_epoch:
            self.eval_steps = max(1, math.ceil(self.max_steps / (self.evals_per_epoch * epochs)))
            self._given.add("evals_per_epoch_applied")

    def output_dir(self) -> Path:
        """``logging.output_dir``, or ``runs/<config name>``."""
        return Path(self.logging.output_dir or f"runs/{self.name}")

    def sizes_given(self) -> bool:
        """Whether the config gives any mesh size (else all devices are data parallel): a size
        key in its YAML, a size other than 1 set in Python (``dataclasses.replace``, the layout
        ``layout: auto`` chose), or ``layout: auto`` itself."""
        return (any(k in self._given for k in (*MESH_KEYS, "pp_size"))
                or any(getattr(self, k) != 1 for k in (*MESH_KEYS, "pp_size"))
                or self.layout == "auto")

    def mesh_sizes(self, world_size: int | None = None) -> dict[str, int]:
        """Mesh axis sizes; ``dp_shard_size: -1`` takes what the world size leaves. A config
        without any size uses every device for data parallelism (``dp_shard`` = the world size,
        as Axolotl / Accelerate do); with no known world size that is one device."""
        sizes = {axis: getattr(self, key) for key, axis in MESH_KEYS.items()}
        if self.pp_size != 1:             # pipeline stages: the outermost axis, only when used
            sizes = {"pp": self.pp_size, **sizes}
        if not self.sizes_given() and all(v == 1 for v in sizes.values()):
            sizes["dp_shard"] = world_size or 1
        if sizes["ep"] == 1:
            del sizes["ep"]                 # (a mesh axis only where there is expert parallelism)
        if sizes["dp_shard"] == -1:
            rest = sizes.get("pp", 1) * sizes["dp_replicate"] * sizes["cp"] * sizes["tp"] * sizes.get("ep", 1)
            if world_size is None:
                raise ConfigError("dp_shard_size: -1 needs a known world size (torchrun or --simulate N)")
            if world_size % rest:
                raise ConfigError(f"dp_shard_size: -1 cannot fill a world of {world_size} devices: "
                                  f"pp_size x dp_replicate_size x cp_size x tp_size x ep_size = {rest} does not "
                                  f"divide it")
            sizes["dp_shard"] = world_size // rest
        return sizes

    def mesh(self, world_size: int | None = None):
        """The :class:`functional_pp.Mesh`."""
        from functional_pp.core.mesh import Mesh
        return Mesh(**self.mesh_sizes(world_size))

    def build_rules(self, mesh=None):
        """The model family's default rules (``llama.default_rules``) with the config's
        ``rules`` entries replacing (null: removing) the defaults."""
        from functional_pp.core.layout import Rules
        rules = model_family(self).default_rules(sequence_parallel=self.sequence_parallel)
        if self.ep_size > 1:               # the experts over ep, a data axis for everything else
            rules = rules.replace(batch=(*rules["batch"], "ep"), experts="ep", hidden=(*rules["hidden"], "ep"))
        try:
            rules = rules.replace(**{k: (tuple(v) if isinstance(v, list) else v)
                                     for k, v in self.rules.items()})
            if mesh is not None and "pp" in mesh.shape and "layers" not in self.rules:
                rules = rules.replace(layers="pp")      # pipeline stages: the layers over pp
            if mesh is not None:
                rules.check(mesh)
        except ValueError as exc:
            raise ConfigError(f"rules: {exc}") from exc
        assert isinstance(rules, Rules)
        return rules.as_defaults()     # (the names of the config's rules are checked against the model's: config/checks.py)

    def batch_axes(self, mesh, rules) -> tuple[str, ...]:
        """Mesh axes that split the batch (size > 1)."""
        return tuple(a for a in rules["batch"] if mesh.shape[a] > 1)

    def seq_axes(self, mesh, rules) -> tuple[str, ...]:
        """Mesh axes that split the sequence (context parallelism)."""
        return rules.resolve(("batch", "seq"), None, mesh)[1]

    def dp_size(self, mesh, rules) -> int:
        return math.prod(mesh.shape[a] for a in self.batch_axes(mesh, rules))

    def grad_accum(self, mesh, rules) -> int:
        """Micro-batches per step (derived from ``global_batch_size`` if that is given)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        return self.global_batch_size // (self.micro_batch_size * self.dp_size(mesh, rules))

    def global_batch(self, mesh, rules) -> int:
        """Sequences per optimizer step: micro_batch_size x gradient_accumulation_steps x dp."""
        return self.micro_batch_size * self.grad_accum(mesh, rules) * self.dp_size(mesh, rules)

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int | None = None, *, launcher: str = "") -> None:
        """Check everything that must hold before training starts: the mesh covers
        ``world_size`` devices (``launcher`` names where that number comes from), the batch and
        sequence split evenly, the model's dimensions divide by their mesh axes, the data and
        tokenizer paths exist. Raises :class:`ConfigError`."""
        check_world(self, world_size, launcher)

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """A JSON-able dict that :meth:`from_dict` reads back."""
        return config_to_dict(self)

    def __post_init__(self) -> None:
        self._given: set[str] = set()
        self.notes: list[str] = []      # keys accepted without effect, and why
        self.auto_dp: int | None = None  # no sizes given: the data-parallel size chosen
        self.steps_per_epoch: int | None = None   # set_epochs: of the training data
        self.epochs_derived = False               # max_steps came from num_epochs
