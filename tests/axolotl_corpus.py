"""Axolotl's example configs (``tests/data/axolotl_examples/corpus/``, Apache-2.0) run as an
Axolotl user would: :func:`edit` changes only paths and sizes (``base_model`` -> a tiny local model
of the config's architecture built by ``transformers``, each dataset -> local rows of its dataset
type, ``output_dir`` / ``dataset_prepared_path`` -> a temporary directory, GRPO's reward and
dataset modules -> stand-ins beside the config, sequence length, batch and steps small);
:func:`classify` says whether the config is accepted or names each feature that refuses it. ``tests/cli/test_axolotl_corpus.py`` checks the classification against
``tests/data/axolotl_examples/expected.yaml``; ``python tests/axolotl_corpus.py --write``
regenerates that table and README's counts after a feature lands (the change is then visible in
the diff)."""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "axolotl_examples" / "corpus"
EXPECTED = HERE / "data" / "axolotl_examples" / "expected.yaml"
ACCEPTED = "accepted"

#: base_model -> the model_type of its config.json on the Hugging Face hub (what the tiny
#: stand-in is built as; nothing is downloaded)
MODEL_TYPES = {
    "LiquidAI/LFM2-350M": "lfm2", "LiquidAI/LFM2-VL-450M": "lfm2_vl",
    "meta-llama/Llama-3.1-8B": "llama", "meta-llama/Llama-3.2-1B": "llama",
    "meta-llama/Llama-3.2-3B": "llama", "meta-llama/Llama-3.2-1B-Instruct": "llama",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama", "NousResearch/Meta-Llama-3-8B-Instruct": "llama",
    "NousResearch/Meta-Llama-3-8B": "llama", "NousResearch/Meta-Llama-3.1-8B": "llama",
    "NousResearch/Llama-3.2-1B": "llama", "NousResearch/Llama-2-7b-hf": "llama",
    "TheBloke/Llama-2-7B-GPTQ": "llama_gptq", "casperhansen/llama-3-70b-fp16": "llama",
    "neuralmagic/Sparse-Llama-3.1-8B-2of4": "llama", "codellama/CodeLlama-13b-hf": "llama",
    "codellama/CodeLlama-34b-hf": "llama", "codellama/CodeLlama-7b-hf": "llama",
    "openlm-research/open_llama_3b_v2": "llama", "TinyLlama/TinyLlama_v1.1": "llama",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "llama", "deepcogito/cogito-v1-preview-llama-3B": "llama",
    "cerebras/Cerebras-GPT-1.3B": "gpt2", "LnL-AI/dbrx-base-converted-v2": "dbrx",
    "agentica-org/DeepCoder-14B-Preview": "qwen2", "deepcogito/cogito-v1-preview-qwen-14B": "qwen2",
    "Qwen/Qwen2.5-72B": "qwen2", "Qwen/Qwen2.5-3B": "qwen2", "Qwen/Qwen2.5-0.5B": "qwen2",
    "Qwen/Qwen2-7B": "qwen2", "Qwen/Qwen3-8B": "qwen3", "Skywork/Skywork-Reward-V2-Qwen3-8B": "qwen3",
    "Qwen/Qwen-7B": "qwen", "Qwen/Qwen1.5-MoE-A2.7B": "qwen2_moe",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_moe", "Qwen/Qwen3.5-4B": "qwen3_5",
    "Qwen/Qwen3.5-9B": "qwen3_5", "Qwen/Qwen3.5-27B": "qwen3_5", "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe",
    "Qwen/Qwen3.5-122B-A10B": "qwen3_5_moe", "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl",
    "nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4": "qwen3_next_nvfp4",
    "tiiuae/falcon-7b": "falcon", "tiiuae/Falcon-H1-1.5B-Base": "falcon_h1",
    "tiiuae/Falcon-H1-0.5B-Instruct": "falcon_h1", "mhenrichsen/gemma-7b": "gemma",
    "google/gemma-2-9b": "gemma2", "google/gemma-3-270m-it": "gemma3_text",
    "google/gemma-3-12b-it": "gemma3", "google/gemma-3-27b-it": "gemma3",
    "google/gemma-3n-E2B-it": "gemma3n", "google/gemma-4-12B-it": "gemma4_unified",
    "google/gemma-4-26B-A4B": "gemma4_moe", "google/gemma-4-31B": "gemma4",
    "EleutherAI/pythia-12b-deduped": "gpt_neox", "EleutherAI/pythia-1.4b-deduped": "gpt_neox",
    "replit/replit-code-v1-3b": "replit_mpt", "stabilityai/stablelm-2-1_6b": "stablelm",
    "bigcode/starcoder2-3b": "starcoder2", "CohereForAI/c4ai-command-r7b-12-2024": "cohere2",
    "nvidia/DeepSeek-V4-Flash-NVFP4": "deepseek_v4", "mistralai/Devstral-Small-2507": "mistral",
    "mistralai/Mistral-7B-v0.1": "mistral", "mistralai/Ministral-8B-Instruct-2410": "mistral",
    "mistralai/Magistral-Small-2507": "mistral", "mistralai/Magistral-Small-2509": "mistral3",
    "mistralai/Ministral-3-3B-Reasoning-2512": "mistral3_ministral3",
    # (Mistral Medium 3.5: Mistral3ForConditionalGeneration, a Pixtral tower beside a dense Ministral 3 text
    # decoder, Devstral 2's backbone: text_config model_type ministral3, as NVIDIA NeMo AutoModel's model page)
    "axolotl-ai-co/Mistral-Medium-3.5-128B-BF16": "mistral3_ministral3",
    "axolotl-ai-co/Mistral-Small-4-119B-2603-BF16": "mistral4",
    "mistral-community/Mixtral-8x22B-v0.1": "mixtral", "mistralai/Mixtral-8x7B-v0.1": "mixtral",
    "mistral-community/pixtral-12b": "llava_pixtral", "llava-hf/llava-1.5-7b-hf": "llava",
    "THUDM/GLM-4-32B-0414": "glm4", "zai-org/GLM-4.6V-Flash": "glm4v",
    "zai-org/GLM-4.7-Flash": "glm4_moe_lite", "Mapika/GLM-5.2-NVFP4": "glm_moe_dsa_nvfp4",
    "openai/gpt-oss-20b": "gpt_oss", "ibm-granite/granite-4.0-tiny-preview": "granitemoehybrid",
    "tencent/Hunyuan-0.5B-Instruct": "hunyuan_v1_dense", "OpenGVLab/InternVL3_5-8B-HF": "internvl",
    "ai21labs/Jamba-v0.1": "jamba", "moonshotai/Kimi-Linear-48B-A3B-Instruct": "kimi_linear",
    "axolotl-quants/Llama-4-Maverick-17B-128E-Linearized-bnb-nf4-bf16": "llama4",
    "axolotl-quants/Llama-4-Scout-17B-16E-Linearized-bnb-nf4-bf16": "llama4",
    "state-spaces/mamba-2.8b": "mamba", "XiaomiMiMo/MiMo-7B-RL": "mimo",
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "nemotron_h",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron_h",
    "nvidia/Nemotron-Mini-4B-Instruct": "nemotron", "PaddlePaddle/PaddleOCR-VL-1.6": "paddleocr_vl",
    "microsoft/Phi-3.5-mini-instruct": "phi3", "microsoft/Phi-3-mini-4k-instruct": "phi3",
    "microsoft/phi-1_5": "phi", "ByteDance-Seed/Seed-OSS-36B-Instruct": "seed_oss",
    "arcee-ai/Trinity-Nano-Preview": "afmoe",
}

# (head_dim 64: whole blocks of 64 along o_proj's input features, for the quantized bases)
_TINY = dict(vocab_size=384, hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=256, max_position_embeddings=512)
#: model_type -> (transformers config class, model class, extra config fields) of the families
#: the decoder implements; any other model_type gets only a config.json (refused when read)
_HF = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
       "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 64}),
       "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
       "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
       "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "pad_token_id": None}),
       "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "pad_token_id": None}),
       "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
       "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 64, "num_experts": 4,
                                                              "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
       "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                              "moe_intermediate_size": 32,
                                                              "shared_expert_intermediate_size": 64}),
       # (the experts' weights written in MXFP4, as the hub's gpt-oss checkpoints hold them)
       "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 64, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2, "intermediate_size": 64}),
       "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
       "phi": ("PhiConfig", "PhiForCausalLM", {"pad_token_id": None}),
       "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"head_dim": 64, "pad_token_id": None, "bos_token_id": None,
                                                        "eos_token_id": None}),
       "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 64}),
       "falcon": ("FalconConfig", "FalconForCausalLM", {"bos_token_id": None, "eos_token_id": None}),
       "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 64, "pad_token_id": None}),
       # (Glm4Config's EOS ids, past the tiny vocabulary, where none is given: the tokenizer's instead)
       "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 64, "pad_token_id": None, "eos_token_id": []}),
       "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"bos_token_id": None, "eos_token_id": None}),
       "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_inner": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                  "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}),
       "dbrx": ("DbrxConfig", "DbrxForCausalLM", {"d_model": 512, "n_heads": 8, "n_layers": 2, "max_seq_len": 512,
                                                  "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4},
                                                  "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4,
                                                                 "moe_top_k": 2}}),
       "nemotron": ("NemotronConfig", "NemotronForCausalLM", {"bos_token_id": None, "eos_token_id": None}),
       "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": 8}),     # (no GQA)
       # (SeedOssConfig's dropouts, 0.1 as in the published files: trained with them)
       "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 64}),
       # (transformers' MptForCausalLM: ALiBi, q/k/v fused in Wqkv; Replit's remote-code files: _REMOTE)
       "mpt": ("MptConfig", "MptForCausalLM", {"bos_token_id": None, "eos_token_id": None, "max_seq_len": 512}),
       # (a short-convolution layer, then an attention layer, as LFM2's; tied embeddings)
       "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"], "pad_token_id": None,
                                                  "bos_token_id": None, "eos_token_id": None}),
       # (latent attention: a k/v head per head)
       "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", {
           "num_key_value_heads": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}),
       # (GLM-5: DeepSeek sparse attention, a top-k of 4 keys that bites at the edited lengths; a dense
       # layer, then experts)
       "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {
           "num_key_value_heads": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
           "index_topk": 4, "index_n_heads": 2, "index_head_dim": 32, "first_k_dense_replace": 1,
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       # (Kimi Linear: a Kimi Delta Attention layer, then a latent attention one; a dense MLP, then experts)
       "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", {
           "num_key_value_heads": 8, "layer_types": ["linear_attention", "full_attention"],
           "mlp_layer_types": ["dense", "sparse"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": None,
           "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "linear_num_heads": 8,
           "linear_head_dim": 64, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       # (Mistral Small 4: DeepSeek-V3's latent attention and experts, its default YaRN rope)
       "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", {
           "num_key_value_heads": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       # (a dense first layer, then experts; a sliding layer, then a full one)
       "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", {
           "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "num_shared_experts": 1, "global_attn_every_n_layers": 2, "sliding_window": 128, "pad_token_id": None,
           "bos_token_id": None, "eos_token_id": None}),
       # (a Gated DeltaNet layer, then a full-attention one; experts in both)
       "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
           **(_GDN := dict(head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                           linear_value_head_dim=64, layer_types=["linear_attention", "full_attention"],
                           pad_token_id=None, bos_token_id=None, eos_token_id=None)),
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 64}),
       # (Falcon-H1: a Mamba2 mixer of 8 heads of 64 in 2 groups beside attention in each layer)
       "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
           "head_dim": 64, "mamba_d_ssm": 512, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
           "mamba_chunk_size": 32, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       # (Granite 4 tiny's layout: a Mamba2 layer, then an attention one, experts and the shared MLP, NoPE)
       "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
           "layer_types": ["mamba", "attention"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "intermediate_size": 32, "shared_intermediate_size": 128, "mamba_n_heads": 16, "mamba_n_groups": 2,
           "mamba_d_state": 16, "mamba_chunk_size": 32, "position_embedding_type": None, "pad_token_id": None,
           "bos_token_id": None, "eos_token_id": None}),
       # (Nemotron 3 Nano's layer kinds: Mamba2, experts not gated in grouped sigmoid routing, attention)
       "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
           "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"], "num_hidden_layers": 4,
           "head_dim": 64, "mamba_num_heads": 8, "mamba_head_dim": 64, "n_groups": 2, "ssm_state_size": 16,
           "chunk_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "moe_shared_expert_intermediate_size": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
       # (Mamba (v1): two layers of the selective scan, 256 channels, tied embeddings)
       "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 16, "time_step_rank": 32, "pad_token_id": None,
                                                     "bos_token_id": None, "eos_token_id": None}),
       # (Jamba: a Mamba layer with the MLP, then attention with experts; a time step of rank 64: whole NF4 blocks)
       "jamba": ("JambaConfig", "JambaForCausalLM", {
           "num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
           "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_dt_rank": 64,
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None})}
#: Gemma 4 (31B's text decoder: full layers of their own widths, v their k projection, no per-layer
#: embeddings) inside the multimodal Gemma4ForConditionalGeneration with a one-layer vision tower; the
#: 26B-A4B (experts beside the MLP: enable_moe_block) the same with experts
_GEMMA4_TEXT = dict(_TINY, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                    hidden_size_per_layer_input=0, final_logit_softcapping=30.0, sliding_window=128, pad_token_id=0,
                    bos_token_id=None, eos_token_id=None)
_GEMMA4_SPECIAL = dict(video_token_id=403, boa_token_id=None, eoa_token_index=None,
                       audio_token_id=None)         # (past the tiny vocabulary; the image's: the tokenizer's)
#: Gemma 4 unified (12B, Gemma4UnifiedForConditionalGeneration): Gemma 4's text decoder, no vision encoder
_UNIFIED_VISION = dict(patch_size=16, pooling_kernel_size=3, mm_embed_dim=32, mm_posemb_size=64, output_proj_dims=32)
#: the Gemma 4 stand-ins (their tokenizers hold Gemma 4's image tokens)
_GEMMA4 = ("gemma4", "gemma4_moe", "gemma4_unified")
_GEMMA4_MOE_TEXT = dict(_GEMMA4_TEXT, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
#: multimodal wrappers built as such (a one-layer vision tower beside the text decoder): Gemma 3
#: (12B / 27B: text gemma3_text), Magistral Small 2509 (Mistral Small 3.2's layout: text mistral), Ministral 3
#: (text ministral3: Ministral3Config's rope, YaRN with the queries scaled past 16384 positions)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
               patch_size=16)
_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=512, patch_size=16,
                       num_position_embeddings=16)
_QWEN3_5_SPECIAL = dict(image_token_id=380, video_token_id=381, vision_start_token_id=382, vision_end_token_id=383)
_WRAPPED = {"gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="gemma3_text", head_dim=64, pad_token_id=0, bos_token_id=None,
                                 eos_token_id=None), vision_config=_VISION, mm_tokens_per_image=4,
                image_token_index=400, boi_token_index=401, eoi_token_index=402)),
            "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="mistral", head_dim=64, pad_token_id=None, bos_token_id=None,
                                 eos_token_id=None, sliding_window=None),
                vision_config=dict(_VISION, model_type="pixtral", head_dim=16), image_token_index=400)),
            "mistral3_ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="ministral3", head_dim=64, pad_token_id=None, bos_token_id=None,
                                 eos_token_id=None),
                vision_config=dict(_VISION, model_type="pixtral", head_dim=16), image_token_index=400)),
            # Pixtral 12B: LLaVA's wrapper around a Pixtral tower (no patch merger) and a Mistral decoder;
            # LLaVA-1.5: a CLIP tower and a Llama decoder
            "llava_pixtral": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="mistral", head_dim=64, pad_token_id=None, bos_token_id=None,
                                 eos_token_id=None, sliding_window=None),
                vision_config=dict(_VISION, model_type="pixtral", head_dim=16), image_token_index=400,
                vision_feature_layer=-1, vision_feature_select_strategy="full")),
            "llava": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="llama", pad_token_id=None, bos_token_id=None, eos_token_id=None),
                vision_config=dict(_VISION, model_type="clip_vision_model", num_hidden_layers=2),
                image_token_index=400)),
            # Qwen3.5 / Qwen3.5-MoE (27B, 35B-A3B, 122B-A10B: the multimodal wrapper, a one-block vision tower)
            "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
                text_config=dict(_TINY, **_GDN), vision_config=_QWEN3_5_VISION, **_QWEN3_5_SPECIAL)),
            # Qwen2-VL: its vision tower (no learned positions) beside a Qwen2 decoder (the multimodal rotary)
            "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(
                text_config=dict(_TINY, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                 rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12])),
                vision_config=dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=512, patch_size=16),
                **_QWEN3_5_SPECIAL)),
            # PaddleOCR-VL: a one-layer NaViT SigLIP tower (raster patches) beside an ERNIE 4.5 decoder
            "paddleocr_vl": ("PaddleOCRVLConfig", "PaddleOCRVLForConditionalGeneration", dict(
                text_config=dict(_TINY, head_dim=64, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                 rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[8, 12, 12])),
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   patch_size=16, image_size=64, spatial_merge_size=2), image_token_id=400)),
            # LFM2-VL: a one-layer SigLIP2 tower and the pixel-unshuffle projector beside an LFM2 decoder
            "lfm2_vl": ("Lfm2VlConfig", "Lfm2VlForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="lfm2", layer_types=["conv", "full_attention"], pad_token_id=None,
                                 bos_token_id=None, eos_token_id=None),
                vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, patch_size=16, num_patches=16,
                                   vision_use_head=False), projector_hidden_size=64, image_token_id=400)),
            # InternVL 3.5 (-HF): a one-layer InternViT (64-pixel tiles, 4 tokens each) beside a Qwen3 decoder
            "internvl": ("InternVLConfig", "InternVLForConditionalGeneration", dict(
                text_config=dict(_TINY, model_type="qwen3", head_dim=64, pad_token_id=None, bos_token_id=None,
                                 eos_token_id=None),
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=64, patch_size=16, attention_bias=True), image_seq_length=4,
                image_token_id=400)),
            # GLM-4.6V-Flash: GLM-4V's tower (one block) beside a GLM-4-0414 decoder (the multimodal rotary)
            "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", dict(
                text_config=dict(_TINY, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                             partial_rotary_factor=0.5, mrope_section=[4, 6, 6])),
                vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=512,
                                   patch_size=16, image_size=64), image_start_token_id=382, image_end_token_id=383,
                image_token_id=380, video_token_id=381)),
            "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
                text_config=dict(_TINY, **_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64), vision_config=_QWEN3_5_VISION,
                **_QWEN3_5_SPECIAL))}
#: Llama 4 Scout / Maverick as Axolotl's linearized bnb-nf4 repositories hold them: the multimodal
#: Llama4ForConditionalGeneration (a one-layer vision model), a dense layer then an MoE one, each
#: expert's gate / up / down its own linear, every linear serialized 4-bit by bitsandbytes
_LLAMA4 = dict(text_config=dict(_TINY, head_dim=64, intermediate_size=64, intermediate_size_mlp=256,
                                num_local_experts=4, interleave_moe_layer_step=2, pad_token_id=None, bos_token_id=None,
                               eos_token_id=None),
               vision_config=dict(_VISION, intermediate_size=128, vision_output_dim=64, projector_input_dim=64,
                                  projector_output_dim=64),     # (intermediate: the pixel shuffle's width, 4 x 32)
               image_token_index=400, boi_token_index=401, eoi_token_index=402)
#: Llama4Processor's tokens (its stand-in's processor files: tiles of the vision model's image_size)
_LLAMA4_IMAGE_TOKENS = ("<|image_start|>", "<|image|>", "<|patch|>", "<|image_end|>", "<|tile_x_separator|>",
                        "<|tile_y_separator|>")
#: the wrappers whose stand-in holds a Pixtral processor (images: processor_type) and its image tokens
_PIXTRAL = {"mistral3": 2, "mistral3_ministral3": 2, "llava_pixtral": 1}     # (-> spatial_merge_size)
_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
#: the wrappers whose stand-in holds a Qwen processor (Qwen2VLImageProcessor, <|image_pad|> its image token)
_QWEN_VL = {"qwen3_5": "Qwen3VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}
_QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
#: the wrappers whose stand-in holds a GLM-4V processor (Glm4vImageProcessor, <|image|> its image token)
_GLM_VL = {"glm4v": "Glm4vProcessor"}
_GLM_IMAGE_TOKENS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>")
#: the wrappers whose stand-in holds a PaddleOCR-VL processor (<|IMAGE_PLACEHOLDER|> per merged patch)
_PADDLEOCR_VL = ("paddleocr_vl",)
#: the wrappers whose stand-in holds a LLaVA-1.5 processor (a CLIP tower: ``<image>`` per patch)
_LLAVA = ("llava",)
#: the wrappers whose stand-in holds an LFM2-VL processor (<image> per 2 x 2 patches, tiles and their markers)
_LFM2_VL = ("lfm2_vl",)
#: the wrappers whose stand-in holds an InternVL processor (<img>, <IMG_CONTEXT> per token of each tile, </img>)
_INTERNVL = ("internvl",)
#: the end-of-turn token of each family's tokenizer (the tiny tokenizer's EOS)
_EOS = {"llama": "<|eot_id|>", "llama4": "<|eot|>", "gemma2": "<end_of_turn>", "gemma3_text": "<end_of_turn>",
        "phi3": "<|end|>", "mistral": "</s>", "falcon": "<|endoftext|>", "gemma4": "<turn|>", "gemma4_moe": "<turn|>",
        "gemma4_unified": "<turn|>",
        "gemma3": "<end_of_turn>", "llava_pixtral": "</s>"}
#: the families whose repositories' tokenizers hold a chat template (``chat_template: tokenizer_default``):
#: the tiny tokenizer holds that named template (Nemotron 3's is ChatML's markers)
_TEMPLATES = {"nemotron_h": "chatml", "qwen3_next_nvfp4": "chatml", "glm_moe_dsa_nvfp4": "chatml"}
_SIZE_KEYS = ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "tp_size",
              "context_parallel_size", "cp_size", "expert_parallel_size", "ep_size",
              "ray_num_workers")


def corpus_files() -> list[str]:
    """The corpus's configs, as paths relative to :data:`CORPUS`."""
    return sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.y*ml"))


def tiny_model(model_type: str, root: Path) -> Path:
    """A directory with a tiny random ``model_type`` model (config.json + safetensors) built by
    ``transformers``, and a byte-level tokenizer with every chat template's markers; made once
    per model_type under ``root``."""
    d = root / model_type
    if (d / "config.json").is_file():
        return d
    from chat_tokenizer import (GEMMA4_IMAGE_TOKENS, INTERNVL_SPECIALS, LFM2_VL_SPECIALS, PADDLEOCR_VL_SPECIALS,
                                make_tekken, make_tokenizer, write_gemma4_processor_files, write_glm4v_processor_files,
                                write_internvl_processor_files, write_lfm2_vl_processor_files,
                                write_llama4_processor_files, write_llava_processor_files,
                                write_paddleocr_vl_processor_files, write_pixtral_processor_files,
                                write_qwen_vl_processor_files)
    from functional_pp.data.chat import template_text
    tok = make_tokenizer(d, "<|begin_of_text|>", _EOS.get(model_type, "<|im_end|>"),
                         template_text(_TEMPLATES[model_type]) if model_type in _TEMPLATES else None,
                         extra=(_IMAGE_TOKENS if model_type in _PIXTRAL else
                                _QWEN_IMAGE_TOKENS if model_type in _QWEN_VL else
                                _GLM_IMAGE_TOKENS if model_type in _GLM_VL else
                                ("<image>",) if model_type in _LLAVA else
                                GEMMA4_IMAGE_TOKENS if model_type in _GEMMA4 else
                                _LLAMA4_IMAGE_TOKENS if model_type == "llama4" else
                                tuple(LFM2_VL_SPECIALS) if model_type in _LFM2_VL else
                                tuple(INTERNVL_SPECIALS) if model_type in _INTERNVL else
                                tuple(PADDLEOCR_VL_SPECIALS[1:]) if model_type in _PADDLEOCR_VL else ()))
    if model_type in ("mistral", "mistral3", "mistral3_ministral3"):     # (Mistral's repositories hold tekken.json too)
        make_tekken(d)
    if model_type in _REMOTE:
        _remote_code_model(model_type, d)
        return d
    if model_type in ("qwen3_next_nvfp4", "glm_moe_dsa_nvfp4"):
        _modelopt_nvfp4(tiny_model(model_type.removesuffix("_nvfp4"), root), d)
        return d
    if model_type not in _HF and model_type not in (*_GEMMA4, "llama4", "llama_gptq", *_WRAPPED):
        (d / "config.json").write_text(json.dumps({"model_type": model_type, **_TINY}))
        return d
    import torch
    import transformers
    if model_type in _WRAPPED:
        conf, cls, kw = _WRAPPED[model_type]
        if model_type in _PIXTRAL:       # (Mistral 3: its processor's files, [IMG] the tokenizer's own id)
            kw = dict(kw, image_token_index=tok.tok.token_to_id("[IMG]"))
            write_pixtral_processor_files(d, _VISION["patch_size"], _PIXTRAL[model_type], 64)
        if model_type in _QWEN_VL:       # (Qwen3.5: its processor's files, <|image_pad|> the tokenizer's own id)
            kw = dict(kw, image_token_id=tok.tok.token_to_id("<|image_pad|>"))
            write_qwen_vl_processor_files(d, _QWEN3_5_VISION["patch_size"], 2, 2, 64 * 64, _QWEN_VL[model_type])
        if model_type in _GLM_VL:        # (GLM-4V: its processor's files, <|image|> the tokenizer's own id)
            kw = dict(kw, image_token_id=tok.tok.token_to_id("<|image|>"),
                      image_start_token_id=tok.tok.token_to_id("<|begin_of_image|>"),
                      image_end_token_id=tok.tok.token_to_id("<|end_of_image|>"))
            write_glm4v_processor_files(d, 16, 2, 2, 64 * 64, _GLM_VL[model_type])
        if model_type in _LLAVA:         # (LLaVA-1.5: its processor's files, <image> the tokenizer's own id)
            kw = dict(kw, image_token_index=tok.tok.token_to_id("<image>"))
            write_llava_processor_files(d, _VISION["patch_size"], _VISION["image_size"], "default")
        if model_type in _LFM2_VL:       # (LFM2-VL: its processor's files, <image> the tokenizer's own id)
            kw = dict(kw, image_token_id=tok.tok.token_to_id("<image>"))
            write_lfm2_vl_processor_files(d, 16, 2, 64, 16)
        if model_type in _PADDLEOCR_VL:  # (PaddleOCR-VL: its processor's files, its placeholder the tokenizer's id)
            kw = dict(kw, image_token_id=tok.tok.token_to_id("<|IMAGE_PLACEHOLDER|>"))
            write_paddleocr_vl_processor_files(d, 16, 2, 64 * 64)
        if model_type in _INTERNVL:      # (InternVL: its processor's files, <IMG_CONTEXT> the tokenizer's own id)
            kw = dict(kw, image_token_id=tok.tok.token_to_id("<IMG_CONTEXT>"))
            write_internvl_processor_files(d, 64, 4, 4)
        torch.manual_seed(0)
        getattr(transformers, cls)(getattr(transformers, conf)(**kw)).save_pretrained(d)
        return d
    if model_type == "llama4":       # (its processor's files, <|patch|> the tokenizer's own id)
        write_llama4_processor_files(d, _VISION["patch_size"], _VISION["image_size"], template_text("llama4"))
        _linearized_nf4_llama4(d, image_token_index=tok.tok.token_to_id("<|patch|>"))
        return d
    if model_type == "llama_gptq":
        _gptq_llama(d)
        return d
    if model_type in ("gemma4", "gemma4_moe"):
        torch.manual_seed(0)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16)
        text = _GEMMA4_MOE_TEXT if model_type == "gemma4_moe" else _GEMMA4_TEXT
        ids = dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"),     # (images: Gemma 4's processor, its
                       map(tok.tok.token_to_id, GEMMA4_IMAGE_TOKENS)))         # tokens the tokenizer's own ids)
        conf = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                         **{**_GEMMA4_SPECIAL, **ids})
        write_gemma4_processor_files(d)
        transformers.Gemma4ForConditionalGeneration(conf).save_pretrained(d)
        return d
    if model_type == "gemma4_unified":       # (Gemma 4 12B: no vision encoder, the unified embedder)
        torch.manual_seed(0)
        text = {k: v for k, v in _GEMMA4_TEXT.items() if k != "hidden_size_per_layer_input"}
        ids = dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"), map(tok.tok.token_to_id, GEMMA4_IMAGE_TOKENS)))
        conf = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=_UNIFIED_VISION, audio_config=None,
                                                **{**_GEMMA4_SPECIAL, **ids})
        write_gemma4_processor_files(d, unified=True)
        transformers.Gemma4UnifiedForConditionalGeneration(conf).save_pretrained(d)
        return d
    conf, cls, extra = _HF[model_type]
    torch.manual_seed(0)
    getattr(transformers, cls)(getattr(transformers, conf)(**{**_TINY, **extra})).save_pretrained(d)
    if model_type == "gpt_oss":
        _experts_as_mxfp4(d)
    return d


#: remote-code checkpoints (trust_remote_code): a tiny transformers model of the same math written in the hub
#: repository's layout (tests/remote_layouts.py): Qwen (v1) from a Qwen2 of one k/v head per head, MiMo from a
#: Qwen2 plus one multi-token-prediction layer, Replit's MPT from transformers' MPT
_REMOTE = {"qwen": ("qwen2", dict(num_key_value_heads=8, tie_word_embeddings=False)),
           "mimo": ("qwen2", dict(tie_word_embeddings=False)), "replit_mpt": ("mpt", {})}


def _remote_code_model(model_type: str, d: Path) -> None:
    """A tiny ``model_type`` checkpoint in its remote code's layout in ``d`` (:data:`_REMOTE`)."""
    import torch
    import transformers
    from remote_layouts import mimo_from_qwen2, qwen_v1_from_qwen2, replit_from_mpt
    base, extra = _REMOTE[model_type]
    conf, cls, more = _HF[base]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**{**_TINY, **more, **extra, "bos_token_id": None,
                                                                       "eos_token_id": None}))
    {"qwen": qwen_v1_from_qwen2, "mimo": mimo_from_qwen2, "replit_mpt": replit_from_mpt}[model_type](model, d)


def _linearized_nf4_llama4(d: Path, **kw) -> None:
    """A tiny ``Llama-4-*-Linearized-bnb-nf4-bf16`` in ``d`` (:data:`_LLAMA4`, ``kw`` set)."""
    import torch
    import transformers
    from harness import bnb_nf4_serialized, linearized_llama4
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(**dict(_LLAMA4, **kw)))
    model.save_pretrained(d)
    sd = bnb_nf4_serialized(linearized_llama4(dict(model.state_dict())), double_quant=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["quantization_config"] = dict(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16")
    (d / "config.json").write_text(json.dumps(conf))


def _gptq_llama(d: Path) -> None:
    """A tiny ``TheBloke/Llama-2-7B-GPTQ`` in ``d``: the tiny Llama's linears as a 4-bit GPTQ
    checkpoint (groups of 128, act order, checkpoint_format gptq: v1), the rest fp16, as the hub's."""
    import torch
    import transformers
    from harness import gptq_serialized
    from safetensors.torch import save_file
    conf, cls, extra = _HF["llama"]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, conf)(**{**_TINY, **extra}))
    model.save_pretrained(d)
    sd, _, qc = gptq_serialized({k: v.contiguous() for k, v in model.state_dict().items()}, bits=4, group=128)
    save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, d / "model.safetensors",
              metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(conf))


def _modelopt_nvfp4(src: Path, d: Path) -> None:
    """A tiny ``nvidia/...-NVFP4`` (ModelOpt) in ``d`` (beside its tokenizer) from the model in ``src``:
    its experts one tensor per expert (``experts.{j}.{gate,up,down}_proj.weight``), every ``*_proj``
    linear as NVFP4 (torchao's quantizer: uint8 ``weight``, ``weight_scale``, ``weight_scale_2``,
    ``input_scale``)."""
    import torch
    from safetensors.torch import load_file, save_file
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    for f in src.iterdir():              # (the tokenizer is d's own: the Instruct model's holds a template)
        if f.name != "model.safetensors" and not (d / f.name).exists():
            shutil.copy2(f, d / f.name)
    sd = load_file(src / "model.safetensors")
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack, pre = sd.pop(k), k.rsplit(".", 1)[0]
        for j, w in enumerate(stack):
            parts = {"gate_proj": w[:w.shape[0] // 2], "up_proj": w[w.shape[0] // 2:]} if k.endswith("gate_up_proj") \
                else {"down_proj": w}
            sd.update({f"{pre}.{j}.{name}.weight": t.contiguous() for name, t in parts.items()})
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd[k].float()
        t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max()))
        sd.update({k: t.qdata.view(torch.uint8).contiguous(), f"{k}_scale": t.scale.contiguous(),
                   f"{k}_scale_2": t.per_tensor_scale.reshape(()).float(),
                   k.removesuffix(".weight") + ".input_scale": torch.tensor(0.01)})
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((src / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (d / "config.json").write_text(json.dumps(conf))


def _experts_as_mxfp4(d: Path) -> None:
    """The experts' weights of the checkpoint in ``d`` replaced by MXFP4 blocks and scales (random
    codes, scales near 2**-5), as transformers' Mxfp4 quantizer writes them."""
    import torch
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = sd.pop(k).shape
        sd[f"{k}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8)
        sd[f"{k}_scales"] = torch.randint(120, 124, (experts, outputs, inputs // 32), generator=g, dtype=torch.uint8)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4"}
    (d / "config.json").write_text(json.dumps(conf))


def _messages(i: int, entry: dict) -> tuple[str, list[dict]]:
    """``(field, messages)`` of one conversation in the shape ``entry`` reads."""
    props = dict(entry.get("message_property_mappings") or {})
    role = props.get("role", entry.get("message_field_role", "role"))
    content = props.get("content", entry.get("message_field_content", "content"))
    roles = entry.get("roles") or {}
    sharegpt = role == "from"
    user = (roles.get("user") or ["human" if sharegpt else "user"])[0]
    assistant = (roles.get("assistant") or ["gpt" if sharegpt else "assistant"])[0]
    turns = [(user, f"What is {i} plus {i}?"), (assistant, f"{i} plus {i} is {2 * i}.")]
    return entry.get("field_messages", "messages"), [{role: r, content: c} for r, c in turns]


def _rows(entry: dict, n: int, rl: str | None = None) -> list[dict]:
    """``n`` local rows of ``entry``'s dataset type (``rl``: preference pairs of it)."""
    kind = str(entry.get("type") or "")
    out = []
    for i in range(n):
        if kind == "bradley_terry.chat_template":          # Axolotl's fields: system, input, chosen, rejected
            out.append({"system": "You add numbers." if i % 2 else "", "input": f"What is {i} plus {i}?",
                        "chosen": f"{i} plus {i} is {2 * i}.", "rejected": "I do not know."})
        elif kind == "stepwise_supervised":                 # TRL's: prompt, completions (steps), labels
            out.append({"prompt": f"What is {i} plus {i} plus 1?",
                        "completions": [f"{i} plus {i} is {2 * i}.", f"{2 * i} plus 1 is {2 * i + (i % 3)}."],
                        "labels": [True, i % 3 == 1]})
        elif rl and kind.startswith("chat_template"):       # a conversation and two replies
            field, msgs = _messages(i, entry)
            role, content = list(msgs[1])
            out.append({field: msgs[:1], entry.get("field_chosen", "chosen"): msgs[1],
                        entry.get("field_rejected", "rejected"): {role: msgs[1][role], content: "I do not know."}})
        elif kind.startswith("chat_template") or "field_messages" in entry:
            field, msgs = _messages(i, entry)
            out.append({field: msgs})
        elif kind == "ebft_pretrain.transform":           # Axolotl's example transform: question or text
            out.append({"text": f"def add_{i}(x):\n    return x + {i}\n"})
        elif kind == "ebft_strided_structured.transform":  # input (prompt), output (completion)
            out.append({"input": f"Write a function adding {i}.", "output": f"def add_{i}(x):\n    return x + {i}\n"})
        elif kind in ("completion", "pretrain"):
            field = entry.get("field" if kind == "completion" else "text_column") or "text"
            out.append({field: f"Counting on: {i}, {i + 1}, {i + 2}, {i + 3}."})
        else:                                   # alpaca and its variants, and any other type
            out.append({"instruction": f"Add {i} and {i}.", "input": "", "output": f"{2 * i}"})
    return out


def _image_rows(entry: dict, n: int, tmp: Path) -> list[dict]:
    """``n`` chat rows with an image each (HuggingFaceH4/llava-instruct-mix-vsft's layout: ``messages``
    whose user turn holds a bare ``{"type": "image"}``, the picture in an ``images`` column), the
    pictures tiny PNG files of a few sizes beside the data."""
    import numpy as np
    from PIL import Image
    field, _ = _messages(0, entry)
    rng = np.random.default_rng(0)
    names = []
    for k, (h, w) in enumerate(((40, 24), (20, 30), (64, 64))):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(tmp / f"image_{k}.png")
        names.append(f"image_{k}.png")
    return [{field: [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {i}?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": f"It shows {i}."}]}],
             "images": [names[i % len(names)]]} for i in range(n)]


def _stand_in_modules(cfg: dict, tmp: Path) -> None:
    """GRPO's user modules (``trl.reward_funcs``, a ``datasets`` type ``module.function``) as local
    stand-ins beside the edited config, as the user writes them: each reward the completion's
    length, each transform the row's instruction as a user turn and its output as ``answer``."""
    modules: dict[str, list[str]] = {}
    for name in (cfg.get("trl") or {}).get("reward_funcs") or []:
        mod, _, fn = str(name).rpartition(".")
        modules.setdefault(mod, []).append(
            f"def {fn}(prompts, completions, **kwargs):\n"
            f"    return [float(len(c if isinstance(c, str) else c[0]['content'])) for c in completions]\n")
    for e in cfg.get("datasets") or []:
        mod, _, fn = str(e.get("type") or "").rpartition(".")
        if mod and mod not in ("chatml", "chat_template", "llama3", "user_defined", "alpaca"):
            modules.setdefault(mod, []).append(
                f"def {fn}(cfg, **kwargs):\n    def transform(example, tokenizer=None):\n"
                f"        return {{'prompt': [{{'role': 'user', 'content': example['instruction']}}], "
                f"'answer': example['output']}}\n    return transform\n")
    for mod, code in modules.items():
        (tmp / f"{mod}.py").write_text("\n\n".join(code))


def edit(cfg: dict, tmp: Path, models: Path) -> tuple[dict, int]:
    """``(cfg edited in paths and sizes only, devices to simulate)``."""
    cfg = dict(cfg)
    mt = MODEL_TYPES.get(cfg.get("base_model"))
    if mt is not None:
        cfg["base_model"] = str(tiny_model(mt, models))
        for key in ("tokenizer_config", "base_model_config", "processor_config"):
            if cfg.get(key):
                cfg[key] = cfg["base_model"]
    share = cfg.get("val_set_size")
    # enough local rows that a small held-out share still holds a sequence (12.8 rows at least)
    rows = math.ceil(12.8 / share) if isinstance(share, float) and 0 < share < 0.1 else 128
    for key in ("datasets", "test_datasets", "pretraining_dataset"):
        entries = cfg.get(key)
        if not entries:
            continue
        entries = [dict(e) if isinstance(e, dict) else {"path": e} for e in
                   (entries if isinstance(entries, list) else [entries])]
        for i, e in enumerate(entries):
            path = tmp / f"{key}_{i}.jsonl"
            made = _image_rows(e, rows, tmp) if cfg.get("processor_type") else _rows(e, rows, cfg.get("rl"))
            path.write_text("".join(json.dumps(r) + "\n" for r in made))
            e["path"] = str(path)
            for hub in ("data_files", "name", "revision", "split"):     # the hub copy's selection
                e.pop(hub, None)
        cfg[key] = entries
    if str(cfg.get("rl")) in ("grpo", "gdpo"):
        _stand_in_modules(cfg, tmp)
    cfg["output_dir"] = str(tmp / "out")
    if cfg.get("dataset_prepared_path"):
        cfg["dataset_prepared_path"] = str(tmp / "prepared")
    cfg.update(sequence_len=256, micro_batch_size=1, gradient_accumulation_steps=1, max_steps=2,
               logging_steps=1)
    if cfg.get("max_packed_sequence_len"):
        cfg["max_packed_sequence_len"] = 256     # (Axolotl's old name of the packed length: a size)
    if isinstance(cfg.get("lisa_n_layers"), int):   # LISA's layers at a time and steps between draws: sizes
        cfg.update(lisa_n_layers=1, lisa_step_interval=1)    # (the tiny models have 2 layers, the run 2 steps)
    if isinstance(cfg.get("diffusion"), dict) and isinstance(cfg["diffusion"].get("mask_token_id"), int):
        # a token id of the real model's vocabulary (Llama 3's reserved special token 0): the tiny
        # model's last id instead, as base_model is the tiny model
        cfg["diffusion"] = {**cfg["diffusion"], "mask_token_id": _TINY["vocab_size"] - 1}
    if cfg.get("use_otel_metrics"):
        cfg["otel_metrics_port"] = 0         # an address: any free port (8000 may be taken on a shared machine)
    if cfg.get("use_swanlab"):
        cfg["swanlab_mode"] = "offline"      # no network here (a cloud run needs a login)
    if cfg.get("wandb_project"):
        cfg["wandb_mode"] = "offline"        # (the same for Weights & Biases)
    for key in ("warmup_steps", "save_steps", "eval_steps"):
        if isinstance(cfg.get(key), int) and cfg[key] > 1:
            cfg[key] = 1
    for key in ("eval_batch_size", "batch_size"):
        if cfg.get(key):
            cfg[key] = 1
    if isinstance(cfg.get("min_sample_len"), int) and cfg["min_sample_len"] > 2:
        cfg["min_sample_len"] = 2            # a size: the tiny rows are shorter than the config's
    devices = 1
    for key in _SIZE_KEYS:
        if isinstance(cfg.get(key), int) and cfg[key] > 1:
            cfg[key] = 2
            devices *= 2
    return cfg, max(devices, 2)


_KEY = re.compile(r"^'([\w.\[\]]+)' is not supported")
_KEY_VALUE = re.compile(r"^'([\w.]+): ([^']+)' is not supported")
_VALUE = re.compile(r"^(optimizer|lr_scheduler|activation_checkpointing): ")
_BAD_VALUE = re.compile(r"^([\w.]+): '([^']+)' is not")
_PLUGIN = re.compile(r"^plugins: '([^']+)' is not supported")
_UNKNOWN = re.compile(r"^unknown key '([^']+)'")
_VALUE_PROBLEM = re.compile(r"^(\w+): (\w+): ")          # "adapter: lora: LoRA: name the weights ..."
_TARGETS = re.compile(r"LoRA: target_modules \(lora_target_modules\) \[([^\]]*)\] match no parameter")
_UNFROZEN = re.compile(r"^unfrozen_parameters \[.*\] match no parameter")
_MODEL_TYPE = re.compile(r"model_type '([^']+)' is not supported")
_VISION_TOWER = re.compile(r"images of model_type '([^']+)' \(processor_type; vision tower '([^']+)'\) are not supported")
_HF_OPTION = re.compile(r"^HF \w+ config: (\w+)=(\S+) is not supported")   # a config.json option of the base model
_ALIASED = re.compile(r"^(\w+) \(\w+\) (\S+): ")      # "context_parallel_size (cp_size) 2: the Mamba2 layers' ..."


def reason(problem: str, cfg: dict) -> str:
    """The feature a problem message names: ``adapter: lora``, ``load_in_4bit``,
    ``optimizer: adamw_bnb_8bit``, ``model_type qwen3_moe``, ``plugin LigerPlugin``, ..."""
    if _UNFROZEN.match(problem):         # (patterns of the family's own tensor names: not matched yet)
        return "unfrozen_parameters"
    if m := _TARGETS.search(problem):    # (module names the model does not have: another modelling code's)
        return "lora_target_modules " + ", ".join(n.strip(" '") for n in m.group(1).split(","))
    if m := _KEY.match(problem):
        key = re.sub(r"\[\d+\]", "", m.group(1))          # datasets[0].x -> datasets.x
        value = cfg.get(key)
        return f"{key}: {value}" if isinstance(value, str) else key
    if m := _KEY_VALUE.match(problem):
        return f"{m.group(1)}: {m.group(2)}"
    if m := _VALUE.match(problem):
        key = m.group(1)
        return f"{key}: {cfg.get(key, cfg.get('gradient_checkpointing'))}"
    if m := _PLUGIN.match(problem):
        return f"plugin {m.group(1).rsplit('.', 1)[-1]}"
    if m := _BAD_VALUE.match(problem):
        return f"{m.group(1)}: {m.group(2)}"
    if m := _VALUE_PROBLEM.match(problem):
        return f"{m.group(1)}: {m.group(2)}"
    if m := _UNKNOWN.match(problem):
        return f"unknown key {m.group(1)}"
    if m := _HF_OPTION.match(problem):
        return f"config.json {m.group(1)}: {m.group(2)}"
    if m := _MODEL_TYPE.search(problem):
        return f"model_type {m.group(1)}"
    if m := _VISION_TOWER.search(problem):       # (a text decoder that loads, its vision tower not built yet)
        return f"processor_type: vision tower {m.group(2)} of {m.group(1)}"
    if m := _ALIASED.match(problem):
        return f"{m.group(1)} {m.group(2)}"
    return problem.split(";")[0][:100]


def classify(name: str, tmp: Path, models: Path) -> tuple[str | list[str], Path | None, int]:
    """``(ACCEPTED or the features refusing it, the edited config file, devices)`` of corpus
    config ``name``: its keys are checked (``TrainConfig.from_dict``) and its base model's
    architecture read, so that every refusing feature is listed."""
    from functional_pp.checkpoint import hf
    from functional_pp.config import ConfigError, TrainConfig
    raw = yaml.safe_load((CORPUS / name).read_text())
    if not raw.get("base_model"):
        return ["not a training config (no base_model)"], None, 0
    cfg, devices = edit(raw, tmp, models)
    reasons: list[str] = []
    try:
        TrainConfig.from_dict(cfg, name=Path(name).stem)
    except ConfigError as exc:
        reasons += [reason(p, raw) for p in exc.problems]
    if raw["base_model"] not in MODEL_TYPES:
        reasons.append(f"base_model {raw['base_model']} (architecture unknown to this test)")
    else:
        try:
            hf.config_from_hf(json.loads((Path(cfg["base_model"]) / "config.json").read_text()))
        except ValueError as exc:
            reasons.append(reason(str(exc), raw))
    if not reasons:                  # what needs the model's parameters: the adapters' targets
        from functional_pp.app.inputs import model_config
        from functional_pp.app.report import run_model
        train = TrainConfig.from_dict(cfg, name=Path(name).stem)
        try:
            run_model(train, model_config(train))
        except ConfigError as exc:
            reasons += [reason(p, raw) for p in exc.problems]
    if reasons:
        return sorted(set(reasons)), None, devices
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ACCEPTED, path, devices


def counts(table: dict[str, Any]) -> tuple[int, Counter]:
    """``(accepted configs, configs refused per feature kind)``: a kind is a reason's key
    (``adapter``, ``load_in_4bit``, ``model_type``, ...); a config counts once per kind."""
    kinds: Counter = Counter()
    for v in table.values():
        if v != ACCEPTED:
            kinds.update({re.split(r"[: ]", r, maxsplit=1)[0] for r in v})
    return sum(v == ACCEPTED for v in table.values()), kinds


def classify_all(tmp: Path) -> dict[str, Any]:
    """The classification of every corpus config (each edited in its own directory)."""
    models = tmp / "models"
    out = {}
    for i, name in enumerate(corpus_files()):
        d = tmp / f"c{i:03d}"
        d.mkdir(parents=True)
        out[name] = classify(name, d, models)[0]
    return out


def top_kinds(kinds: Counter, n: int = 8) -> list[tuple[str, int]]:
    """The ``n`` most frequent refusal kinds, ties by name (the README's row is the same
    whichever order the configs were classified in)."""
    return sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile
    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory() as t:
        table = classify_all(Path(t))
    EXPECTED.write_text("# written by `python tests/axolotl_corpus.py --write`: each corpus config ->\n"
                        "# accepted, or the features that refuse it\n"
                        + yaml.safe_dump(table, sort_keys=True, width=120))
    n, kinds = counts(table)
    readme = HERE.parent / "README.md"          # the counts README shows (test_readme_counts_are_the_tables)
    text = re.sub(r"Axolotl's example configs: \d+ of \d+ accepted",
                  f"Axolotl's example configs: {n} of {len(table)} accepted", readme.read_text())
    text = re.sub(r"refused by \(configs\): .*\n", "refused by (configs): "
                  + ", ".join(f"{v} `{k}`" for k, v in top_kinds(kinds)) + "\n", text)
    readme.write_text(text)
    print(f"{n} accepted of {len(table)}; refused by kind: {dict(kinds.most_common())}")
