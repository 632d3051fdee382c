"""The Hugging Face Llama layout of :mod:`functional_pp.models.llama`: tensor names, the
transform of each tensor between HF's layout and ours, the rotary order, and ``config.json``
<-> :class:`~functional_pp.models.llama.Config`. Pure mapping, no file I/O: reading and
writing safetensors directories is :mod:`functional_pp.checkpoint.hf`.

The mapping is one table, :data:`LLAMA_TABLE`: HF tensor name pattern -> our tree path, and
the kind of transform between the two layouts. HF stores ``nn.Linear`` weights ``[out, in]``;
we store input-dimension first with heads and head_dim as separate dimensions:

    HF name (shape)                                       our path (shape)                  kind
    model.embed_tokens.weight               [V, H]        embed_tokens           [V, H]     copy
    model.layers.{i}.input_layernorm.weight [H]           layers.{i}.input_layernorm [H]    copy
    model.layers.{i}.self_attn.q_proj.weight [N*D, H]     layers.{i}.self_attn.q_proj [H, N, D]  heads_out
    model.layers.{i}.self_attn.k_proj.weight [K*D, H]     layers.{i}.self_attn.k_proj [H, K, D]  heads_out
    model.layers.{i}.self_attn.v_proj.weight [K*D, H]     layers.{i}.self_attn.v_proj [H, K, D]  heads_out
    model.layers.{i}.self_attn.o_proj.weight [H, N*D]     layers.{i}.self_attn.o_proj [N, D, H]  heads_in
    model.layers.{i}.post_attention_layernorm.weight [H]  layers.{i}.post_attention_layernorm   copy
    model.layers.{i}.mlp.gate_proj.weight   [F, H]        layers.{i}.mlp.gate_proj [H, F]   linear
    model.layers.{i}.mlp.up_proj.weight     [F, H]        layers.{i}.mlp.up_proj   [H, F]   linear
    model.layers.{i}.mlp.down_proj.weight   [H, F]        layers.{i}.mlp.down_proj [F, H]   linear
    model.norm.weight                       [H]           norm                   [H]        copy
    lm_head.weight (absent when tied)       [V, H]        lm_head                [H, V]     linear

and, where the config has them (``qkv_bias``, ``o_bias``, ``qk_norm``):

    model.layers.{i}.self_attn.q_proj.bias  [N*D]         layers.{i}.self_attn.q_bias [N, D]  bias_heads
    model.layers.{i}.self_attn.k_proj.bias  [K*D]         layers.{i}.self_attn.k_bias [K, D]  bias_heads
    model.layers.{i}.self_attn.v_proj.bias  [K*D]         layers.{i}.self_attn.v_bias [K, D]  bias_heads
    model.layers.{i}.self_attn.o_proj.bias  [H]           layers.{i}.self_attn.o_bias [H]     copy
    model.layers.{i}.self_attn.q_norm.weight [D]          layers.{i}.self_attn.q_norm [D]     copy
    model.layers.{i}.self_attn.k_norm.weight [D]          layers.{i}.self_attn.k_norm [D]     copy

The same names serve every family of :data:`MODEL_TYPES` (Mistral, Qwen2 and Qwen3 name their
tensors as Llama does; Phi-3 fuses q/k/v into ``self_attn.qkv_proj`` and gate/up into
``mlp.gate_up_proj``, split on import and fused on export along HF's rows, :data:`FUSED` /
:func:`file_name`); ``config.json`` is read and written per family.

Rotary convention: HF Llama q/k weights are already in the rotate-half order (HF's conversion
script permuted Meta's interleaved weights), which is what ``ops.rotary`` uses, so they map
without permutation. For Meta-format (interleaved) weights use :func:`permute_for_rotate_half`
(and :func:`unpermute_from_rotate_half` to go back).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from functional_pp.models import (afmoe_hf, dbrx_hf, deepseek_hf, falcon_h1_hf, gemma4_hf, gemma4_unified_hf,
                                  gemma4_vision_hf, glm4v_hf, gpt_oss_hf, granitemoehybrid_hf, internvl_hf, jamba_hf,
                                  kimi_delta, kimi_linear_hf, lfm2_vl_hf, llama4_hf, llama4_vision_hf, mamba2_hf,
                                  mamba_hf, nemotron_h_hf, paddleocr_vl_hf, pixtral_hf, qwen3_5_hf, qwen_vision_hf,
                                  remote_code_hf, score_head)
from functional_pp.models.hf_switches import PLAIN, SWITCHES, partial_rotary_factor, refusal
from functional_pp.models.llama import XIELU_BETA, XIELU_EPS, Config
from functional_pp.ops.rotary import LinearScaling, Llama3Scaling, LongRopeScaling, YarnScaling

__all__ = [
    "LLAMA_TABLE", "IGNORED_HF", "KINDS", "hf_name", "our_path", "hf_kind", "config_from_hf_dict",
    "config_to_hf", "permute_for_rotate_half", "unpermute_from_rotate_half", "UnsupportedHFConfig",
    "MODEL_TYPES", "ARCHITECTURES", "check_exportable", "FUSED", "file_name", "RENAMED", "MOE_BASE", "renamed",
    "HEAD_INTERLEAVED", "HEAD_GROUPED", "head_groups", "ALSO_READ", "also_read",
]


SWITCHES.update(remote_code_hf.SWITCHES)     # (Qwen (v1), MiMo: remote-code checkpoints as switches of the decoder)


class UnsupportedHFConfig(ValueError):
    """An HF setting (a model_type, a config option) the functional decoder does not implement."""


# --------------------------------------------------------------------------- the table
LLAMA_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed_tokens", "copy"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm", "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj", "heads_out"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj", "heads_out"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj", "heads_out"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj", "heads_in"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.self_attn.q_bias", "bias_heads"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.self_attn.k_bias", "bias_heads"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.self_attn.v_bias", "bias_heads"),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.self_attn.o_bias", "copy"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm", "copy"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm", "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm",
     "copy"),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.{i}.pre_feedforward_layernorm", "copy"),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.post_feedforward_layernorm", "copy"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj", "linear"),
    # biases (Phi-1/2): of the MLP's projections, of LayerNorms, of the LM head
    ("model.layers.{i}.mlp.gate_proj.bias", "layers.{i}.mlp.gate_bias", "copy"),
    ("model.layers.{i}.mlp.up_proj.bias", "layers.{i}.mlp.up_bias", "copy"),
    ("model.layers.{i}.mlp.down_proj.bias", "layers.{i}.mlp.down_bias", "copy"),
    # xIELU's two scalars (Apertus; HF [1], ours without dimensions)
    ("model.layers.{i}.mlp.act_fn.alpha_p", "layers.{i}.mlp.act_alpha_p", "scalar"),
    ("model.layers.{i}.mlp.act_fn.alpha_n", "layers.{i}.mlp.act_alpha_n", "scalar"),
    ("model.layers.{i}.input_layernorm.bias", "layers.{i}.input_layernorm_bias", "copy"),
    ("model.layers.{i}.post_attention_layernorm.bias", "layers.{i}.post_attention_layernorm_bias", "copy"),
    ("model.norm.bias", "norm_bias", "copy"),
    ("lm_head.bias", "lm_head_bias", "copy"),
    # a mixture of experts (models/moe.py): the router, the experts stacked along ``experts`` (in
    # the files one tensor per expert, ``mlp.experts.{j}.gate_proj.weight``, read and written as
    # the stacked name below by checkpoint/hf.py), a shared expert and its gate (Qwen2-MoE)
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router", "linear"),
    ("model.layers.{i}.mlp.experts.gate_proj.weight", "layers.{i}.mlp.gate", "experts_linear"),
    ("model.layers.{i}.mlp.experts.up_proj.weight", "layers.{i}.mlp.up", "experts_linear"),
    ("model.layers.{i}.mlp.experts.down_proj.weight", "layers.{i}.mlp.down", "experts_linear"),
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "layers.{i}.mlp.shared_expert.gate_proj", "linear"),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "layers.{i}.mlp.shared_expert.up_proj", "linear"),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "layers.{i}.mlp.shared_expert.down_proj", "linear"),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate", "row"),
    # Nemotron 3 Super: the experts' latent projections
    ("model.layers.{i}.mlp.fc1_latent_proj.weight", "layers.{i}.mlp.latent_in", "linear"),
    ("model.layers.{i}.mlp.fc2_latent_proj.weight", "layers.{i}.mlp.latent_out", "linear"),
    # gpt-oss: attention sinks, the router's bias, the experts' biases (its names: RENAMED / FUSED)
    ("model.layers.{i}.self_attn.sinks", "layers.{i}.self_attn.sinks", "copy"),
    # AFMoE: the attention's output gate (``attn_gate``)
    ("model.layers.{i}.self_attn.gate_proj.weight", "layers.{i}.self_attn.gate_proj", "heads_out"),
    ("model.layers.{i}.mlp.gate.bias", "layers.{i}.mlp.router_logit_bias", "copy"),
    ("model.layers.{i}.mlp.experts.gate_proj.bias", "layers.{i}.mlp.expert_gate_bias", "copy"),
    ("model.layers.{i}.mlp.experts.up_proj.bias", "layers.{i}.mlp.expert_up_bias", "copy"),
    ("model.layers.{i}.mlp.experts.down_proj.bias", "layers.{i}.mlp.expert_down_bias", "copy"),
    # LFM2's short convolution (models/short_conv.py): in_proj's rows the B, C and x gates in turn
    ("model.layers.{i}.conv.in_proj.weight", "layers.{i}.conv.in_proj", "heads_out"),
    ("model.layers.{i}.conv.conv.weight", "layers.{i}.conv.conv", "depthwise"),
    ("model.layers.{i}.conv.out_proj.weight", "layers.{i}.conv.out_proj", "linear"),
    ("model.norm.weight", "norm", "copy"),
    ("lm_head.weight", "lm_head", "linear"),
    # a score head (*ForSequenceClassification / *ForTokenClassification; models/score_head.py)
    ("score.weight", "score", "linear"),
    ("score.bias", "score_bias", "copy"),
    # learned absolute positions (GPT-2's wpe)
    ("model.embed_positions.weight", "embed_positions", "copy"),
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; models/mla.py) and a router's score
    # correction (DeepSeek-V3, GLM-4.5)
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.self_attn.q_a_proj", "linear"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.self_attn.q_a_layernorm", "copy"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.self_attn.q_b_proj", "heads_out"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.self_attn.kv_a_proj_with_mqa", "linear"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.self_attn.kv_a_layernorm", "copy"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.self_attn.kv_b_proj", "heads_out"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.router_bias", "copy"),
    # DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5; models/dsa.py)
    ("model.layers.{i}.self_attn.indexer.wq_b.weight", "layers.{i}.self_attn.indexer_wq_b", "heads_out"),
    ("model.layers.{i}.self_attn.indexer.wk.weight", "layers.{i}.self_attn.indexer_wk", "linear"),
    ("model.layers.{i}.self_attn.indexer.k_norm.weight", "layers.{i}.self_attn.indexer_k_norm", "copy"),
    ("model.layers.{i}.self_attn.indexer.k_norm.bias", "layers.{i}.self_attn.indexer_k_norm_bias", "copy"),
    ("model.layers.{i}.self_attn.indexer.weights_proj.weight", "layers.{i}.self_attn.indexer_weights_proj", "linear"),
    # Gemma 4: each layer's output scale (HF [1], ours without dimensions); 26B-A4B's experts beside the MLP:
    # the router's input scale and per-expert weight scales, the norms of the MLP's and the experts' outputs
    # and of the experts' input (the router and the experts' names: gemma4_hf.RENAMED)
    ("model.layers.{i}.layer_scalar", "layers.{i}.layer_scalar", "scalar"),
    ("model.layers.{i}.router.scale", "layers.{i}.mlp.router_scale", "copy"),
    ("model.layers.{i}.router.per_expert_scale", "layers.{i}.mlp.expert_scale", "copy"),
    ("model.layers.{i}.post_feedforward_layernorm_1.weight", "layers.{i}.post_feedforward_layernorm_1", "copy"),
    ("model.layers.{i}.pre_feedforward_layernorm_2.weight", "layers.{i}.pre_feedforward_layernorm_2", "copy"),
    ("model.layers.{i}.post_feedforward_layernorm_2.weight", "layers.{i}.post_feedforward_layernorm_2", "copy"),
    # Gemma 4 E2B / E4B's per-layer input embeddings (models/per_layer_inputs.py)
    ("model.embed_tokens_per_layer.weight", "embed_tokens_per_layer", "copy"),
    ("model.per_layer_model_projection.weight", "per_layer_model_projection", "linear"),
    ("model.per_layer_projection_norm.weight", "per_layer_projection_norm", "copy"),
    ("model.layers.{i}.per_layer_input_gate.weight", "layers.{i}.per_layer_input_gate", "linear"),
    ("model.layers.{i}.per_layer_projection.weight", "layers.{i}.per_layer_projection", "linear"),
    ("model.layers.{i}.post_per_layer_input_norm.weight", "layers.{i}.post_per_layer_input_norm", "copy"),
    # Gated DeltaNet (models/gated_deltanet.py; q / k / v fused in the files' in_proj_qkv and conv1d: FUSED)
    *((f"model.layers.{{i}}.linear_attn.in_proj_{x}.weight", f"layers.{{i}}.linear_attn.in_proj_{x}", "heads_out")
      for x in "qkvz"),
    *((f"model.layers.{{i}}.linear_attn.in_proj_{x}.weight", f"layers.{{i}}.linear_attn.in_proj_{x}", "linear")
      for x in "ba"),
    *((f"model.layers.{{i}}.linear_attn.conv_{x}.weight", f"layers.{{i}}.linear_attn.conv_{x}", "conv_taps")
      for x in "qkv"),
    ("model.layers.{i}.linear_attn.dt_bias", "layers.{i}.linear_attn.dt_bias", "copy"),
    ("model.layers.{i}.linear_attn.A_log", "layers.{i}.linear_attn.A_log", "copy"),
    ("model.layers.{i}.linear_attn.norm.weight", "layers.{i}.linear_attn.norm", "copy"),
    ("model.layers.{i}.linear_attn.out_proj.weight", "layers.{i}.linear_attn.out_proj", "heads_in"),
    # Kimi Delta Attention (models/kimi_delta.py; its files' names: kimi_linear_hf.RENAMED)
    *((f"model.layers.{{i}}.kda.{x}.weight", f"layers.{{i}}.kda.{x}", "heads_out")
      for x in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj")),
    *((f"model.layers.{{i}}.kda.{x}.weight", f"layers.{{i}}.kda.{x}", "linear")
      for x in ("f_a_proj", "g_a_proj", "b_proj")),
    *((f"model.layers.{{i}}.kda.conv_{x}.weight", f"layers.{{i}}.kda.conv_{x}", "conv_taps") for x in "qkv"),
    ("model.layers.{i}.kda.dt_bias", "layers.{i}.kda.dt_bias", "bias_heads"),
    ("model.layers.{i}.kda.A_log", "layers.{i}.kda.A_log", "heads_4d"),
    ("model.layers.{i}.kda.o_norm.weight", "layers.{i}.kda.o_norm", "copy"),
    ("model.layers.{i}.kda.o_proj.weight", "layers.{i}.kda.o_proj", "heads_in"),
    # a Mamba2 mixer (models/mamba2.py): in the files in_proj fuses z, x, B, C and dt along its rows and conv1d
    # x, B and C (mamba2_hf.FUSED); the parts' names here are the table's own
    *mamba2_hf.TABLE,
    # a vision-language model's Pixtral encoder and Mistral 3's projector (models/pixtral.py)
    *pixtral_hf.TABLE,
    # Qwen3.5's vision tower and patch merger (models/qwen_vision.py)
    *qwen_vision_hf.TABLE,
    # Gemma 4's vision tower and multimodal embedder (models/gemma4_vision.py)
    *gemma4_vision_hf.TABLE,
    # Llama 4's vision model and adapter MLP (models/llama4_vision.py; the projector: Pixtral's linear_1 row)
    *llama4_vision_hf.TABLE,
    # LFM2-VL's SigLIP2 tower and projector norm (models/lfm2_vl.py)
    *lfm2_vl_hf.TABLE,
    # InternVL's InternViT tower (models/internvl.py; its projector the rows above)
    *internvl_hf.TABLE,
    # Gemma 4 unified's encoder-free image embedder (models/gemma4_unified.py)
    *gemma4_unified_hf.TABLE,
    # GLM-4V's own tensors of its tower (models/glm4v_vision.py; the others are Qwen's rows, renamed)
    *glm4v_hf.TABLE,
    # a Mamba (v1) mixer (models/mamba1.py; Mamba, Jamba): our names under layers.{i}.mamba1, renamed per family
    *mamba_hf.TABLE,
)
"""``(HF name pattern, our path pattern, transform kind)``; ``{i}`` is the layer index."""

CONSTANTS: dict[str, tuple[tuple[str, float], ...]] = {
    "mlp.act_alpha_p": (("act_fn.beta", XIELU_BETA), ("act_fn.eps", XIELU_EPS))}
"""HF tensors that hold constants beside a parameter (xIELU's ``beta`` and ``eps`` buffers, saved
with its scalars): our path suffix -> (HF name beside the parameter's, value); export writes
them, import checks them (:func:`constants_of`)."""


def constants_of(path: str, model_type: str = "llama", cfg: Any = None) -> tuple[tuple[str, float], ...]:
    """The ``(HF name, value)`` of the constant tensors the files hold beside our parameter ``path``."""
    for suffix, consts in CONSTANTS.items():
        if path.endswith("." + suffix):
            base = renamed(path, model_type, cfg).rsplit(".", 1)[0].rsplit(".", 1)[0]
            return tuple((f"{base}.{name}", value) for name, value in consts)
    return ()


IGNORED_HF: tuple[str, ...] = (r"model\.rotary_emb\.inv_freq",
                                r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
                                r"transformer\.h\.\d+\.attn\.(masked_)?bias")     # (GPT-2's causal mask buffers)
"""HF tensors that carry no parameters (old checkpoints saved rotary buffers)."""


def _pattern(p: str) -> re.Pattern:
    return re.compile("^" + re.escape(p).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_TO_HF = [(_pattern(ours), hf, kind) for hf, ours, kind in LLAMA_TABLE]
_FROM_HF = [(_pattern(hf), ours, kind) for hf, ours, kind in LLAMA_TABLE]


def _lookup(name: str, table: list) -> tuple[str, str] | None:
    for pat, target, kind in table:
        m = pat.match(name)
        if m:
            return target.format(**m.groupdict()), kind
    return None


def hf_name(path: str) -> str | None:
    """Our tree path (``layers.0.self_attn.q_proj``) -> HF tensor name (``None``: unmapped).
    Usable as ``name_map`` for :func:`~functional_pp.checkpoint.consolidate`."""
    r = _lookup(path, _TO_HF)
    return r[0] if r else None


def our_path(name: str) -> str | None:
    """HF tensor name -> our tree path (``None``: unmapped)."""
    r = _lookup(name, _FROM_HF)
    return r[0] if r else None


# Phi-3 stores q, k and v as one tensor and gate and up as one: HF name of the fused tensor and
# the Llama names of its parts, in order along HF's output dimension (rows)
FUSED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "phi3": (("model.layers.{i}.self_attn.qkv_proj.weight",
              ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
               "model.layers.{i}.self_attn.v_proj.weight")),
             ("model.layers.{i}.mlp.gate_up_proj.weight",
              ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"))),
}
FUSED["gpt_neox"] = tuple(                   # (names after RENAMED: the layers under gpt_neox.)
    (f"gpt_neox.layers.{{i}}.attention.query_key_value.{t}",
     tuple(f"gpt_neox.layers.{{i}}.self_attn.{x}_proj.{t}" for x in "qkv")) for t in ("weight", "bias"))
FUSED["granitemoe"] = (("model.layers.{i}.block_sparse_moe.input_linear.weight",
                        ("model.layers.{i}.block_sparse_moe.experts.gate_proj.weight",
                         "model.layers.{i}.block_sparse_moe.experts.up_proj.weight")),)
FUSED["granitemoeshared"] = FUSED["granitemoe"] + (("model.layers.{i}.shared_mlp.input_linear.weight",
                                                    ("model.layers.{i}.shared_mlp.gate_proj.weight",
                                                     "model.layers.{i}.shared_mlp.up_proj.weight")),)
FUSED["falcon"] = tuple(                     # (names after RENAMED: the layers under transformer.h.)
    (f"transformer.h.{{i}}.self_attention.query_key_value.{t}",
     tuple(f"transformer.h.{{i}}.self_attention.{x}_proj.{t}" for x in "qkv")) for t in ("weight", "bias"))
FUSED["gpt_oss"] = tuple(          # gate and up alternate along the last dimension (gate_up_proj[..., ::2] is gate)
    (f"model.layers.{{i}}.mlp.experts.gate_up_proj{t}",
     tuple(f"model.layers.{{i}}.mlp.experts.{x}_proj.{w}" for x in ("gate", "up"))) for t, w in (("", "weight"),
                                                                                              ("_bias", "bias")))
FUSED["llama4_text"] = tuple(          # gate, then up, along the last dim (alone, or in its llama4 wrapper)
    (f"{pre}.layers.{{i}}.feed_forward.experts.gate_up_proj", (f"{pre}.layers.{{i}}.feed_forward.experts.gate_proj.weight",
                                                              f"{pre}.layers.{{i}}.feed_forward.experts.up_proj.weight"))
    for pre in ("model", "language_model.model"))
FUSED.update(gemma4_hf.FUSED)                # (26B-A4B: experts.gate_up_proj)
FUSED["mistral4"] = deepseek_hf.MISTRAL4_FUSED      # (Mistral Small 4: experts.gate_up_proj)
FUSED["glm"] = FUSED["glm4"] = (FUSED["phi3"][1],)      # (GLM-4: gate and up fused as Phi-3's, q/k/v apart)
FUSED["gpt2"] = tuple(                       # (names after RENAMED: q, k and v along c_attn's columns)
    (f"transformer.h.{{i}}.attn.c_attn.{t}", tuple(f"transformer.h.{{i}}.attn.{x}_proj.{t}" for x in "qkv"))
    for t in ("weight", "bias"))
FUSED.update(qwen3_5_hf.FUSED)               # (Qwen3.5: q / k / v in in_proj_qkv and in conv1d)
FUSED["qwen3_5"] = FUSED["qwen3_5"] + qwen_vision_hf.FUSED     # (its vision tower: q / k / v in attn.qkv)
FUSED[qwen_vision_hf.QWEN2_VL_TEXT] = FUSED.get(qwen_vision_hf.QWEN2_VL_TEXT, ()) + qwen_vision_hf.QWEN2_VL_FUSED
FUSED.update({mt: glm4v_hf.FUSED for mt in glm4v_hf.WRAPPERS})     # (GLM-4V's files: read by the wrapper, text_of)
FUSED["dbrx"] = (("transformer.blocks.{i}.norm_attn_norm.attn.Wqkv.weight",     # (names after RENAMED)
                  tuple(f"transformer.blocks.{{i}}.norm_attn_norm.attn.{x}_proj.weight" for x in "qkv")),)
FUSED["mpt"] = (("transformer.blocks.{i}.attn.Wqkv.weight",     # (names after RENAMED)
                 tuple(f"transformer.blocks.{{i}}.attn.{x}_proj.weight" for x in "qkv")),)
FUSED["nemotron_h"] = mamba2_hf.fused("backbone.layers.{i}.mixer")     # (names after RENAMED: in_proj, conv1d)
FUSED["falcon_h1"] = mamba2_hf.fused("model.layers.{i}.mamba")
FUSED.update(remote_code_hf.FUSED)           # (Qwen (v1): q / k / v in c_attn, weight and bias)
FUSED["granitemoehybrid"] = FUSED["granitemoeshared"] + granitemoehybrid_hf.FUSED + mamba2_hf.fused("model.layers.{i}.mamba")
_FUSED = {mt: [(fused, [_pattern(part) for part in parts]) for fused, parts in rows] for mt, rows in FUSED.items()}
HEAD_INTERLEAVED: frozenset[str] = frozenset({"gpt_neox", "falcon"})
# per model type, fused HF tensors (a pattern of the name) that hold their parts group by group, and the
# config field counting the groups (Qwen3-Next: in_proj_qkvz / in_proj_ba, one group per linear-attention key head)
HEAD_GROUPED: dict[str, tuple[tuple[str, str], ...]] = dict(qwen3_5_hf.HEAD_GROUPED)
# per model type, our path suffix -> transform kind where its files differ from the table's
_KIND_OVERRIDES: dict[str, dict[str, str]] = {
    **{mt: sw.kinds for mt, sw in SWITCHES.items()},
    "granitemoe": {"mlp.gate": "experts_tensor", "mlp.up": "experts_tensor", "mlp.down": "experts_tensor"}}
_KIND_OVERRIDES["granitemoeshared"] = _KIND_OVERRIDES["granitemoehybrid"] = _KIND_OVERRIDES["granitemoe"]
_KIND_OVERRIDES["gpt_oss"] = {"mlp.gate": "experts_alternating", "mlp.up": "experts_alternating", "mlp.down": "copy",
                              "mlp.expert_gate_bias": "alternating_rows", "mlp.expert_up_bias": "alternating_rows"}
_KIND_OVERRIDES["llama4_text"] = {"mlp.gate": "experts_columns", "mlp.up": "experts_columns", "mlp.down": "copy"}
_KIND_OVERRIDES["dbrx"] = {"mlp.gate": "experts_rows", "mlp.up": "experts_rows", "mlp.down": "experts_rows_in"}
_KIND_OVERRIDES.update(dict.fromkeys(gemma4_hf.ARCHITECTURES, gemma4_hf.KINDS))
_KIND_OVERRIDES["mistral4"] = deepseek_hf.MISTRAL4_KINDS
# (PaddleOCR-VL's ERNIE 4.5 decoder: its tower's patch convolution a Conv2d in the files)
_KIND_OVERRIDES[paddleocr_vl_hf.TEXT] = {**_KIND_OVERRIDES.get(paddleocr_vl_hf.TEXT, {}), **paddleocr_vl_hf.KINDS}
_KIND_OVERRIDES["olmoe"] = {"self_attn.q_norm": "bias_heads", "self_attn.k_norm": "bias_heads"}   # (over every head)
"""Model types whose fused tensors hold their parts k/v head by k/v head (GPT-NeoX's
``query_key_value``: the rows of head n are its q, then its k, then its v; Falcon's: the q heads
sharing a k/v head, then that k, then that v) rather than part after part."""


# Mixtral names its MoE MLP ``block_sparse_moe`` and the experts' projections w1 / w3 / w2
RENAMED: dict[str, tuple[tuple[str, str], ...]] = {
    # Phi-1/2: the output projection is ``dense``, the MLP ``fc1`` / ``fc2``, the final norm ``final_layernorm``
    "phi": ((r"\.self_attn\.o_proj\.", ".self_attn.dense."), (r"\.mlp\.up_proj\.", ".mlp.fc1."),
            (r"\.mlp\.down_proj\.", ".mlp.fc2."), (r"^model\.norm\.", "model.final_layernorm.")),
    # Granite MoE: the router a ``layer``, the experts one tensor each (gate and up fused: input_linear)
    "granitemoe": ((r"\.mlp\.gate\.weight$", ".block_sparse_moe.router.layer.weight"),
                   (r"\.mlp\.experts\.down_proj\.weight$", ".block_sparse_moe.output_linear.weight"),
                   (r"\.mlp\.experts\.", ".block_sparse_moe.experts.")),
    # GPT-J: transformer.h.{i}, attn, out_proj, ln_1, fc_in / fc_out, wte, ln_f
    "gptj": ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.h."),
             (r"\.self_attn\.o_proj\.", ".attn.out_proj."), (r"\.self_attn\.", ".attn."),
             (r"\.input_layernorm\.", ".ln_1."), (r"\.mlp\.up_proj\.", ".mlp.fc_in."),
             (r"\.mlp\.down_proj\.", ".mlp.fc_out."), (r"^model\.norm\.", "transformer.ln_f.")),
    # GPT-NeoX / Pythia: everything under gpt_neox., its own module names, the LM head embed_out
    "gpt_neox": ((r"^model\.embed_tokens\.", "gpt_neox.embed_in."), (r"^model\.layers\.", "gpt_neox.layers."),
                 (r"\.self_attn\.o_proj\.", ".attention.dense."), (r"\.mlp\.up_proj\.", ".mlp.dense_h_to_4h."),
                 (r"\.mlp\.down_proj\.", ".mlp.dense_4h_to_h."), (r"^model\.norm\.", "gpt_neox.final_layer_norm."),
                 (r"^lm_head\.weight$", "embed_out.weight")),
    # Apertus: the norms before attention and the MLP are attention_ / feedforward_layernorm
    "apertus": ((r"\.input_layernorm\.", ".attention_layernorm."),
                (r"\.post_attention_layernorm\.", ".feedforward_layernorm.")),
    # Hunyuan: the q/k norms are query_ / key_layernorm
    "hunyuan_v1_dense": ((r"\.self_attn\.q_norm\.", ".self_attn.query_layernorm."),
                         (r"\.self_attn\.k_norm\.", ".self_attn.key_layernorm.")),
    # Falcon: transformer.h.{i}, self_attention (dense), dense_h_to_4h / dense_4h_to_h, word_embeddings, ln_f
    "falcon": ((r"^model\.embed_tokens\.", "transformer.word_embeddings."), (r"^model\.layers\.", "transformer.h."),
               (r"\.self_attn\.o_proj\.", ".self_attention.dense."), (r"\.self_attn\.", ".self_attention."),
               (r"\.mlp\.up_proj\.", ".mlp.dense_h_to_4h."), (r"\.mlp\.down_proj\.", ".mlp.dense_4h_to_h."),
               (r"^model\.norm\.", "transformer.ln_f.")),
    "mixtral": ((r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
                (r"\.mlp\.experts\.gate_proj\.weight$", ".block_sparse_moe.experts.w1.weight"),
                (r"\.mlp\.experts\.up_proj\.weight$", ".block_sparse_moe.experts.w3.weight"),
                (r"\.mlp\.experts\.down_proj\.weight$", ".block_sparse_moe.experts.w2.weight")),
}
# GLM-4-0414: the norm after attention is post_self_attn_layernorm, the one before the MLP
# post_attention_layernorm, the one after it post_mlp_layernorm (applied in order: one name each)
RENAMED["glm4"] = ((r"\.post_attention_layernorm\.", ".post_self_attn_layernorm."),
                   (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
                   (r"\.post_feedforward_layernorm\.", ".post_mlp_layernorm."))
# GPT-2: transformer.h.{i}, attn.c_attn (fused) / c_proj, ln_1 / ln_2, mlp.c_fc / c_proj, wte, wpe, ln_f
RENAMED["gpt2"] = ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.embed_positions\.", "transformer.wpe."),
                   (r"^model\.layers\.", "transformer.h."), (r"\.self_attn\.o_proj\.", ".attn.c_proj."),
                   (r"\.self_attn\.", ".attn."), (r"\.input_layernorm\.", ".ln_1."),
                   (r"\.post_attention_layernorm\.", ".ln_2."), (r"\.mlp\.up_proj\.", ".mlp.c_fc."),
                   (r"\.mlp\.down_proj\.", ".mlp.c_proj."), (r"^model\.norm\.", "transformer.ln_f."))
# DBRX: transformer.blocks.{i}, norm_attn_norm (norm_1, attn.Wqkv fused, attn.out_proj, norm_2), ffn (router.layer,
# experts.mlp.w1 / v1 / w2), wte, norm_f
RENAMED["dbrx"] = ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.blocks."),
                   (r"\.input_layernorm\.", ".norm_attn_norm.norm_1."),
                   (r"\.post_attention_layernorm\.", ".norm_attn_norm.norm_2."),
                   (r"\.self_attn\.o_proj\.", ".norm_attn_norm.attn.out_proj."), (r"\.self_attn\.", ".norm_attn_norm.attn."),
                   (r"\.mlp\.gate\.weight$", ".ffn.router.layer.weight"),
                   (r"\.mlp\.experts\.gate_proj\.weight$", ".ffn.experts.mlp.w1"),
                   (r"\.mlp\.experts\.up_proj\.weight$", ".ffn.experts.mlp.v1"),
                   (r"\.mlp\.experts\.down_proj\.weight$", ".ffn.experts.mlp.w2"), (r"^model\.norm\.", "transformer.norm_f."))
RENAMED["lfm2"] = ((r"\.input_layernorm\.", ".operator_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
                   (r"^model\.norm\.", "model.embedding_norm."), (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
                   (r"\.self_attn\.q_norm\.", ".self_attn.q_layernorm."),
                   (r"\.self_attn\.k_norm\.", ".self_attn.k_layernorm."), (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
                   (r"\.mlp\.up_proj\.", ".feed_forward.w3."), (r"\.mlp\.down_proj\.", ".feed_forward.w2."))
# MPT: transformer.blocks.{i}, norm_1, attn.Wqkv (fused) / out_proj, norm_2, ffn.up_proj / down_proj, wte, norm_f
RENAMED["mpt"] = ((r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.blocks."),
                  (r"\.input_layernorm\.", ".norm_1."), (r"\.post_attention_layernorm\.", ".norm_2."),
                  (r"\.self_attn\.o_proj\.", ".attn.out_proj."), (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
                  (r"^model\.norm\.", "transformer.norm_f."))
RENAMED["starcoder2"] = ((r"\.mlp\.up_proj\.", ".mlp.c_fc."), (r"\.mlp\.down_proj\.", ".mlp.c_proj."))
RENAMED.update(dict.fromkeys(deepseek_hf.ARCHITECTURES, deepseek_hf.RENAMED))     # (mlp.shared_experts)
RENAMED["mistral4"] = deepseek_hf.MISTRAL4_RENAMED     # (and the experts as one tensor: experts.down_proj)
RENAMED["gpt_oss"] = (            # the router a Linear with a bias; the experts' tensors [E, in, out] as ours
    (r"\.mlp\.gate\.", ".mlp.router."), (r"\.mlp\.experts\.down_proj\.weight$", ".mlp.experts.down_proj"),
    (r"\.mlp\.experts\.down_proj\.bias$", ".mlp.experts.down_proj_bias"))
RENAMED["llama4_text"] = (        # the MLP is feed_forward, its router a Linear, the experts [E, in, out] as ours
    (r"\.mlp\.gate\.weight$", ".feed_forward.router.weight"),
    (r"\.mlp\.experts\.down_proj\.weight$", ".feed_forward.experts.down_proj"),
    (r"^(model\.layers\.\d+)\.mlp\.", r"\1.feed_forward."))      # (not the vision model's mlp)
RENAMED["llama4"] = RENAMED["llama4_text"] + ((r"^(model|lm_head)\.", r"language_model.\1."),)   # (the multimodal
# model's names, what an adapter of a run from its files names: its text model under language_model.)
RENAMED["nemotron_h"] = nemotron_h_hf.RENAMED     # (backbone., each layer's one norm and mixer)
RENAMED["afmoe"] = afmoe_hf.RENAMED      # (the router under mlp.router, pre_mlp / post_mlp norms, shared_experts)
RENAMED.update(gemma4_hf.RENAMED)      # (the multimodal Gemma 4's text decoder: model.language_model.)
RENAMED.update(qwen3_5_hf.RENAMED)     # (the multimodal Qwen3.5's text decoder: model.language_model.)
RENAMED["qwen3_5"] = RENAMED["qwen3_5"] + qwen_vision_hf.RENAMED     # (its vision tower: model.visual.)
RENAMED["gemma4"] = RENAMED["gemma4"] + gemma4_vision_hf.RENAMED       # (its vision tower: model.vision_tower.)
RENAMED["gemma4_unified"] = (RENAMED["gemma4_unified"] + gemma4_vision_hf.RENAMED   # (its embedder: model.embed_vision.)
                             + gemma4_unified_hf.RENAMED)
RENAMED[qwen_vision_hf.QWEN2_VL_TEXT] = (RENAMED.get(qwen_vision_hf.QWEN2_VL_TEXT, ())   # (Qwen2-VL's tower: visual.)
                                         + qwen_vision_hf.QWEN2_VL_RENAMED)
RENAMED.update({mt: RENAMED["glm4"] + glm4v_hf.RENAMED for mt in glm4v_hf.WRAPPERS})   # (GLM-4V's files by their
# own model_type: what a PEFT adapter of a glm4v base names, peft_dir)
MULTIMODAL: dict[str, str | None] = {"gemma3": "gemma3_text", "mistral3": None, "llama4": "llama4_text", "llava": "llama",
                                     lfm2_vl_hf.WRAPPER: lfm2_vl_hf.TEXT, internvl_hf.WRAPPER: internvl_hf.TEXT}
"""The multimodal ``model_type`` values whose text decoder (``text_config``; its own
``model_type``, or this default) imports as that family, ``Config.text_of`` naming the wrapper."""
_TOWERS = r"(model\.)?(vision_tower|vision_model|multi_modal_projector|audio_tower|embed_vision|embed_audio)\..*"
IGNORED_BY_TYPE: dict[str, tuple[str, ...]] = {**gemma4_hf.IGNORED, **qwen3_5_hf.IGNORED,
                                               **{mt: (_TOWERS,) for mt in MULTIMODAL},
                                               "nemotron_h": nemotron_h_hf.IGNORED,
                                               **{mt: (r"visual\..*",) for mt in qwen_vision_hf.TEXT_LAYOUT},
                                               paddleocr_vl_hf.WRAPPER: (r"(visual|mlp_AR)\..*",),
                                               **remote_code_hf.IGNORED,
                                               **{mt: glm4v_hf.IGNORED for mt in glm4v_hf.WRAPPERS}}
"""Per model type, HF tensors its text decoder does not read (a multimodal checkpoint's encoders)."""
RENAMED["granitemoeshared"] = RENAMED["granitemoe"] + (          # its shared expert: shared_mlp, gate and up fused
    (r"\.mlp\.shared_expert\.down_proj\.", ".shared_mlp.output_linear."), (r"\.mlp\.shared_expert\.", ".shared_mlp."))
RENAMED["granitemoehybrid"] = RENAMED["granitemoeshared"] + granitemoehybrid_hf.RENAMED
RENAMED["falcon_h1"] = falcon_h1_hf.RENAMED
RENAMED["mamba"] = mamba_hf.RENAMED
RENAMED["jamba"] = jamba_hf.RENAMED
RENAMED["kimi_linear"] = kimi_linear_hf.RENAMED     # (self_attn, block_sparse_moe, experts w1 / w3 / w2)
RENAMED.update(remote_code_hf.RENAMED)       # (Qwen (v1): transformer.h., c_attn, w1 / w2 / c_proj)
"""Per model type, (pattern, replacement) of the table's HF names in that family's files."""


MODULE_NAMES: dict[str, tuple[tuple[str, str], ...]] = {"nemotron_h": nemotron_h_hf.MODULE_NAMES,
                                                        "kimi_linear": kimi_linear_hf.MODULE_NAMES,
                                                        "gemma4_unified": gemma4_unified_hf.MODULE_NAMES}
"""Per model type, (pattern, replacement) from a tensor's name in the files to its module's name in
transformers' model, where they differ (its load-time renames: Nemotron-H's ``backbone.`` is ``model.``)."""


def module_renamed(path: str, model_type: str = "llama", cfg: Any = None) -> str | None:
    """The name in transformers' model (what peft names adapters by) of our tree path's tensor."""
    name = renamed(path, model_type, cfg)
    for pattern, repl in MODULE_NAMES.get(model_type, ()) if name is not None else ():
        name = re.sub(pattern, repl, name)
    if name is not None and getattr(cfg, "text_of", None) in qwen_vision_hf.TEXT_LAYOUT:   # (Qwen2-VL's modules)
        for pattern, repl in qwen_vision_hf.MODULE_NAMES:
            name = re.sub(pattern, repl, name)
    return name


def renamed(path: str, model_type: str = "llama", cfg: Any = None) -> str | None:
    """The HF tensor name of our tree path in the files of ``model_type``, before any fusing
    (:data:`RENAMED`: Mixtral's ``block_sparse_moe``, Phi's ``dense``, GPT-NeoX's ``gpt_neox.``;
    with ``cfg``, the renames that depend on it, ``Switches.renames``)."""
    name = hf_name(path)
    if name is None:
        return None
    more = SWITCHES[model_type].renames if model_type in SWITCHES else None
    for pattern, repl in RENAMED.get(model_type, ()) + (more(cfg) if more is not None else ()):
        name = re.sub(pattern, repl, name)
    wrapper = getattr(cfg, "text_of", None)
    if wrapper in WRAPPER_RENAMED:                        # (a wrapper whose files name its own layout)
        for pattern, repl in WRAPPER_RENAMED[wrapper]:
            name = re.sub(pattern, repl, name)
    elif wrapper and wrapper not in qwen_vision_hf.TEXT_LAYOUT:   # (a multimodal
        # checkpoint's text decoder, its files' layout; Qwen2-VL's files keep the text model's)
        name = re.sub(r"^(model|lm_head)\.", r"language_model.\1.", name)
    return name


WRAPPER_RENAMED: dict[str, tuple[tuple[str, str], ...]] = {lfm2_vl_hf.WRAPPER: lfm2_vl_hf.RENAMED,
                                                           **{mt: glm4v_hf.RENAMED for mt in glm4v_hf.WRAPPERS},
                                                           paddleocr_vl_hf.WRAPPER: paddleocr_vl_hf.RENAMED}
"""Per multimodal wrapper (``Config.text_of``), (pattern, replacement) of the text family's names
(after :data:`RENAMED`) to the wrapper's files' where they are not LLaVA's older layout
(``language_model.model.``): LFM2-VL's, GLM-4V's and PaddleOCR-VL's."""

ALSO_READ: dict[str, tuple[tuple[str, str], ...]] = {"kimi_linear": kimi_linear_hf.ALSO_READ,
                                                    "llava": pixtral_hf.ALSO_READ,
                                                    lfm2_vl_hf.WRAPPER: lfm2_vl_hf.ALSO_READ}
"""Per model type, (pattern, replacement) of a file name giving another name import reads the tensor
under where the files lack the first (transformers' own save of a family that differs from its
published checkpoint's)."""


def also_read(name: str, model_type: str = "llama", cfg: Any = None) -> list[str]:
    """The other names (:data:`ALSO_READ`) the tensor ``name`` of ``model_type``'s files (or of the
    multimodal wrapper ``cfg.text_of``'s) may be saved under."""
    rows = ALSO_READ.get(model_type, ()) + ALSO_READ.get(getattr(cfg, "text_of", None) or "", ())
    return [re.sub(pattern, repl, name) for pattern, repl in rows if re.search(pattern, name)]


def file_name(path: str, model_type: str = "llama", cfg: Any = None) -> tuple[str, int] | None:
    """``(HF tensor name in the files of model_type, part)`` of our tree path: the part's index
    along the rows of a fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``), else 0."""
    name = renamed(path, model_type, cfg)
    if name is None:
        return None
    for fused, parts in _FUSED.get(model_type, []) + _FUSED.get(getattr(cfg, "text_of", None) or "", []):
        for j, pat in enumerate(parts):
            m = pat.match(name)
            if m:
                return fused.format(**m.groupdict()), j
    return name, 0


def head_groups(name: str, cfg: Any) -> int | None:
    """How many groups of rows the fused HF tensor ``name`` holds its parts in, one after the other
    within each (:data:`HEAD_INTERLEAVED`: one per k/v head; :data:`HEAD_GROUPED`: its config field);
    None: the parts one after the other."""
    mt = getattr(cfg, "model_type", "llama")
    if mt in HEAD_INTERLEAVED:
        return cfg.kv_heads
    return next((getattr(cfg, field) for pattern, field in HEAD_GROUPED.get(mt, ()) if re.search(pattern, name)), None)


def hf_kind(path: str, model_type: str = "llama") -> str | None:
    """The transform kind (a key of :data:`KINDS`) of our tree path in the files of
    ``model_type`` (``None``: unmapped)."""
    r = _lookup(path, _TO_HF)
    if r is None:
        return None
    kinds = _KIND_OVERRIDES.get(model_type, {})
    return next((kind for suffix, kind in kinds.items() if path.endswith("." + suffix)), r[1])


# --------------------------------------------------------------------------- transforms
class _Kind:
    """How one tensor moves between our layout and HF's (shapes, whole tensors, slices)."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def to_hf(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def read(self, sl: Any, region: tuple[slice, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Our ``region`` (global coordinates of our tensor) from HF slice handle ``sl``."""
        raise NotImplementedError


class _Copy(_Kind):
    def hf_shape(self, shape):
        return tuple(shape)

    def to_hf(self, t):
        return t

    def read(self, sl, region, shape):
        return sl[region]


class _Linear(_Kind):                  # ours [in, out] = HF [out, in].T
    def hf_shape(self, shape):
        return (shape[1], shape[0])

    def to_hf(self, t):
        return t.T

    def read(self, sl, region, shape):
        return sl[region[1], region[0]].T


class _HeadsOut(_Kind):                # ours [H, N, D] = HF [N*D, H].T reshaped
    def hf_shape(self, shape):
        return (shape[1] * shape[2], shape[0])

    def to_hf(self, t):
        return t.reshape(t.shape[0], -1).T

    def read(self, sl, region, shape):
        rh, rn, rd = region
        D = shape[2]
        x = sl[rn.start * D:rn.stop * D, rh]                    # [n*D, h]
        x = x.reshape(rn.stop - rn.start, D, -1)[:, rd, :]
        return x.permute(2, 0, 1)


class _HeadsIn(_Kind):                 # ours [N, D, H] = HF [H, N*D].T reshaped
    def hf_shape(self, shape):
        return (shape[2], shape[0] * shape[1])

    def to_hf(self, t):
        return t.reshape(-1, t.shape[2]).T

    def read(self, sl, region, shape):
        rn, rd, rh = region
        D = shape[1]
        x = sl[rh, rn.start * D:rn.stop * D]                    # [h, n*D]
        x = x.reshape(-1, rn.stop - rn.start, D)[:, :, rd]
        return x.permute(1, 2, 0)


class _ConvHeadsOut(_HeadsOut):       # ours [H, N, D] = HF Conv1D [H, N*D] reshaped (GPT-2)
    row_axis = 1                       # (q, k and v follow each other along the columns of c_attn)

    def hf_shape(self, shape):
        return (shape[0], shape[1] * shape[2])

    def to_hf(self, t):
        return t.reshape(t.shape[0], -1)

    def read(self, sl, region, shape):
        rh, rn, rd = region
        D = shape[2]
        x = sl[rh, rn.start * D:rn.stop * D]                    # [h, n*D]
        return x.reshape(x.shape[0], rn.stop - rn.start, D)[:, :, rd]


class _ConvHeadsIn(_HeadsIn):         # ours [N, D, H] = HF Conv1D [N*D, H] reshaped (GPT-2)
    def hf_shape(self, shape):
        return (shape[0] * shape[1], shape[2])

    def to_hf(self, t):
        return t.reshape(-1, t.shape[2])

    def read(self, sl, region, shape):
        rn, rd, rh = region
        D = shape[1]
        x = sl[rn.start * D:rn.stop * D, rh]                    # [n*D, h]
        return x.reshape(rn.stop - rn.start, D, -1)[:, rd, :]


class _ExpertsRows(_Kind):             # ours [E, H, F] = HF [E*F, H]: each expert's [F, H] rows in turn (DBRX's w1, v1)
    def hf_shape(self, shape):
        return (shape[0] * shape[2], shape[1])

    def to_hf(self, t):
        return t.transpose(1, 2).reshape(-1, t.shape[1])

    def read(self, sl, region, shape):
        re_, rh, rf = region
        x = sl[re_.start * shape[2]:re_.stop * shape[2], rh]          # [e*F, h]
        return x.reshape(re_.stop - re_.start, shape[2], -1)[:, rf, :].transpose(1, 2)


class _ExpertsRowsIn(_Kind):           # ours [E, F, H] = HF [E*F, H] reshaped (DBRX's w2)
    def hf_shape(self, shape):
        return (shape[0] * shape[1], shape[2])

    def to_hf(self, t):
        return t.reshape(-1, t.shape[2])

    def read(self, sl, region, shape):
        re_, rf, rh = region
        x = sl[re_.start * shape[1]:re_.stop * shape[1], rh]          # [e*F, h]
        return x.reshape(re_.stop - re_.start, shape[1], -1)[:, rf, :]


class _BiasHeads(_Kind):              # ours [N, D] = HF [N*D] reshaped
    def hf_shape(self, shape):
        return (shape[0] * shape[1],)

    def to_hf(self, t):
        return t.reshape(-1)

    def read(self, sl, region, shape):
        rn, rd = region
        D = shape[1]
        return sl[rn.start * D:rn.stop * D].reshape(rn.stop - rn.start, D)[:, rd]


class _ExpertsLinear(_Kind):          # ours [E, in, out] = HF stacked [E, out, in] transposed per expert
    stacked = True                     # one HF tensor per expert in the files (checkpoint/hf.py)
    stacked_at = ".experts."           # (named ``...experts.{j}...`` there)
    row_axis = 1                       # parts of a fused tensor follow each other along HF's out (Granite MoE)

    def hf_shape(self, shape):
        return (shape[0], shape[2], shape[1])

    def to_hf(self, t):
        return t.transpose(1, 2)

    def read(self, sl, region, shape):
        re_, ra, rb = region
        return sl[re_, rb, ra].transpose(1, 2)


class _ExpertsTensor(_ExpertsLinear):   # the same, one tensor for all the experts in the files (Granite MoE)
    stacked = False


class _PerHead(_Copy):                 # ours [N, D] = HF one [D] tensor per head, ``...norms.{h}.weight`` (StableLM)
    stacked = True
    stacked_at = ".norms."


class _Scalar(_Kind):                  # ours [] = HF [1] (xIELU's scalars)
    def hf_shape(self, shape):
        return (1,)

    def to_hf(self, t):
        return t.reshape(1)

    def read(self, sl, region, shape):
        return sl[0:1].reshape(())


class _Heads4d(_Kind):                 # ours [H] = HF [1, 1, H, 1] (Kimi Delta Attention's A_log)
    def hf_shape(self, shape):
        return (1, 1, shape[0], 1)

    def to_hf(self, t):
        return t.reshape(1, 1, -1, 1)

    def read(self, sl, region, shape):
        return sl[0:1, 0:1, region[0], 0:1].reshape(-1)


class _Lead(_Kind):                    # ours = HF without its n leading 1-dims (InternViT's cls_token, positions)
    def __init__(self, n: int):
        self.n = n

    def hf_shape(self, shape):
        return (1,) * self.n + tuple(shape)

    def to_hf(self, t):
        return t.reshape((1,) * self.n + tuple(t.shape))

    def read(self, sl, region, shape):
        return sl[(slice(0, 1),) * self.n + tuple(region)][(0,) * self.n]


class _Row(_Kind):                     # ours [H] = HF [1, H] (a Linear to one output: a gate)
    def hf_shape(self, shape):
        return (1, shape[0])

    def to_hf(self, t):
        return t.unsqueeze(0)

    def read(self, sl, region, shape):
        return sl[0:1, region[0]][0]


class _Depthwise(_Kind):               # ours [C, K] = HF Conv1d(groups=C) [C, 1, K]
    def hf_shape(self, shape):
        return (shape[0], 1, shape[1])

    def to_hf(self, t):
        return t.unsqueeze(1)

    def read(self, sl, region, shape):
        return sl[region[0], 0:1, region[1]][:, 0, :]


class _Along(_Copy):
    """Ours as HF's, one part of a tensor whose parts follow each other along dimension
    ``row_axis`` (Llama 4's ``gate_up_proj``: gate, then up), or alternate there entry by entry
    (``alternating``: gpt-oss's, gate, up, gate, up, ...; checkpoint/hf.py)."""

    def __init__(self, row_axis: int, alternating: bool = False):
        self.row_axis, self.alternating = row_axis, alternating


class _Squeeze(_Kind):                 # ours = HF with a dimension of size 1 at ``axis`` (a Conv2d as a Conv3d of one frame)
    def __init__(self, axis: int):
        self.axis = axis

    def hf_shape(self, shape):
        return tuple(shape[:self.axis]) + tuple(shape[self.axis + 1:])

    def to_hf(self, t):
        return t.squeeze(self.axis)

    def read(self, sl, region, shape):
        return sl[tuple(region[:self.axis]) + tuple(region[self.axis + 1:])].unsqueeze(self.axis)


class _FlatOut(_Kind):                 # ours [in, A, B, ...] = HF [A*B*..., in].T reshaped (a Mamba2 projection)
    def hf_shape(self, shape):
        return (math.prod(shape[1:]), shape[0])

    def to_hf(self, t):
        return t.reshape(t.shape[0], -1).T

    def read(self, sl, region, shape):
        rin, r0, *rest = region
        inner = math.prod(shape[2:])
        x = sl[r0.start * inner:r0.stop * inner, rin].T
        return x.reshape(x.shape[0], r0.stop - r0.start, *shape[2:])[(slice(None), slice(None), *rest)]


class _FlatIn(_Kind):                  # ours [A, B, ..., out] = HF [out, A*B*...].T reshaped (Mamba2's out_proj)
    def hf_shape(self, shape):
        return (shape[-1], math.prod(shape[:-1]))

    def to_hf(self, t):
        return t.reshape(-1, t.shape[-1]).T

    def read(self, sl, region, shape):
        r0, *rest, rout = region
        inner = math.prod(shape[1:-1])
        x = sl[rout, r0.start * inner:r0.stop * inner].T
        return x.reshape(r0.stop - r0.start, *shape[1:-1], x.shape[-1])[(slice(None), *rest, slice(None))]


class _Flat(_Kind):                    # ours [A, B, ...] = HF [A*B*...] reshaped (Mamba2's A_log, D, norm)
    def hf_shape(self, shape):
        return (math.prod(shape),)

    def to_hf(self, t):
        return t.reshape(-1)

    def read(self, sl, region, shape):
        r0, *rest = region
        inner = math.prod(shape[1:])
        return sl[r0.start * inner:r0.stop * inner].reshape(r0.stop - r0.start, *shape[1:])[(slice(None), *rest)]


class _ConvTaps(_Kind):                # ours [A, B, ..., K] = HF [A*B*..., 1, K] (a depthwise nn.Conv1d's weight)
    def hf_shape(self, shape):
        return (math.prod(shape[:-1]), 1, shape[-1])

    def to_hf(self, t):
        return t.reshape(-1, 1, t.shape[-1])

    def read(self, sl, region, shape):
        r0, *rest, rk = region
        inner = math.prod(shape[1:-1])
        x = sl[r0.start * inner:r0.stop * inner, 0:1, rk][:, 0]
        return x.reshape(r0.stop - r0.start, *shape[1:-1], x.shape[-1])[(slice(None), *rest, slice(None))]


KINDS: dict[str, _Kind] = {"flat_out": _FlatOut(), "flat_in": _FlatIn(), "flat": _Flat(),
                           "copy": _Copy(), "linear": _Linear(), "heads_out": _HeadsOut(),
                           "heads_in": _HeadsIn(), "bias_heads": _BiasHeads(), "experts_linear": _ExpertsLinear(),
                           "experts_tensor": _ExpertsTensor(), "conv_heads_out": _ConvHeadsOut(),
                           "conv_heads_in": _ConvHeadsIn(), "experts_rows": _ExpertsRows(),
                           "experts_rows_in": _ExpertsRowsIn(), "row": _Row(), "scalar": _Scalar(),
                           "experts_alternating": _Along(2, alternating=True),
                           "alternating_rows": _Along(1, alternating=True), "experts_columns": _Along(2), "per_head": _PerHead(),
                           "depthwise": _Depthwise(), "conv_taps": _ConvTaps(), "heads_4d": _Heads4d(),
                           "lead_1": _Lead(1), "lead_2": _Lead(2), "squeeze_2": _Squeeze(2)}


# --------------------------------------------------------------------------- rotary
def _rotary_perm(n: int, head_dim: int | None, inverse: bool) -> torch.Tensor:
    D = head_dim or n
    if n % D or D % 2:
        raise ValueError(f"rotary permutation: dimension of size {n} is not a multiple of an even "
                         f"head_dim {D}")
    # rotate-half position j*D/2 + i holds interleaved position 2i + j
    one = torch.arange(D).reshape(D // 2, 2).T.reshape(-1)
    if inverse:
        one = torch.argsort(one)
    return (torch.arange(0, n, D)[:, None] + one[None, :]).reshape(-1)


def permute_for_rotate_half(w: torch.Tensor, dim: int = -1, head_dim: int | None = None) -> torch.Tensor:
    """Reorder dimension ``dim`` of a q/k weight (or activation) from Meta's interleaved rotary
    order (pairs ``(2i, 2i+1)``) to the rotate-half order (pairs ``(i, i + D/2)``) used by HF
    and ``ops.rotary``. ``dim`` is head_dim itself, or heads*head_dim flattened (as in Meta's
    ``[out, in]`` weights) when ``head_dim`` is given. Same as HF's ``permute`` in
    ``convert_llama_weights_to_hf.py``."""
    return w.index_select(dim, _rotary_perm(w.shape[dim], head_dim, False).to(w.device))


def unpermute_from_rotate_half(w: torch.Tensor, dim: int = -1, head_dim: int | None = None) -> torch.Tensor:
    """Inverse of :func:`permute_for_rotate_half` (rotate-half order -> Meta interleaved)."""
    return w.index_select(dim, _rotary_perm(w.shape[dim], head_dim, True).to(w.device))


# --------------------------------------------------------------------------- config
ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                 "granitemoe": "GraniteMoeForCausalLM",
                                 "granitemoeshared": "GraniteMoeSharedForCausalLM", "olmoe": "OlmoeForCausalLM",
                                 "gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM",
                                 "dbrx": "DbrxForCausalLM",
                                 **{mt: sw.architecture for mt, sw in SWITCHES.items()},
                                 **deepseek_hf.ARCHITECTURES, **gemma4_hf.ARCHITECTURES,
                                 **afmoe_hf.ARCHITECTURES, **qwen3_5_hf.ARCHITECTURES, **nemotron_h_hf.ARCHITECTURES,
                                 **granitemoehybrid_hf.ARCHITECTURES, **falcon_h1_hf.ARCHITECTURES,
                                 **kimi_linear_hf.ARCHITECTURES, **mamba_hf.ARCHITECTURES, **jamba_hf.ARCHITECTURES}
MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)
OWN_CONFIG = {"gpt_oss": gpt_oss_hf, "llama4_text": llama4_hf, "dbrx": dbrx_hf}
"""The families whose ``config.json`` a module of their own reads and writes around Llama's
(``llama_dict``, ``read``, ``NEED``, ``as_llama``, ``write``)."""
"""The ``config.json`` ``model_type`` values that import (and export) as this decoder."""

# transformers' config class defaults of the keys read below, per family (a config.json may
# leave out a key that equals its class default)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32, sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=128, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, sliding_window=None),
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, head_dim=256, sliding_window=4096,
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, head_dim=256, sliding_window=4096,
                        query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", sliding_window_pattern=6),
}
# Gemma 2's switches (llama.Config fields) and their values in every other family
_GEMMA2 = dict(mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True, sandwich_norms=True)
_NOT_GEMMA = dict(mlp_act="silu", norm_offset=0.0, scale_embeddings=False, sandwich_norms=False,
                  query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None, local_rope_theta=None)
_GEMMA = ("gemma2", "gemma3_text")


# the mixtures of experts: each is its dense family's decoder with the MLP of models/moe.py
MOE_BASE: dict[str, str] = {"mixtral": "mistral", "qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "granitemoe": "granite"}
MOE_BASE["granitemoeshared"] = "granite"       # (Granite MoE with a shared expert, added without a gate)
MOE_BASE["olmoe"] = "llama"                    # (OLMoE: Llama's layers with q/k norms over every head)
_TOPK_RENORMED = ("mixtral", "granitemoe", "granitemoeshared")      # top-k weights renormalised, every layer, experts of ``mlp``
_EVERY_LAYER = (*_TOPK_RENORMED, "olmoe")      # experts in every layer, of the intermediate size ``mlp``
# the attention switches a mixture of experts has beyond its dense family's
_MOE_ATTENTION: dict[str, dict[str, Any]] = {"olmoe": dict(qk_norm=True, qk_norm_heads=True)}
# their config classes' defaults where they differ from the dense family's
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
    "olmoe": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, router_aux_loss_coef=0.01),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001,
                             shared_intermediate_size=0),
    "mixtral": dict(sliding_window=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                    num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      router_aux_loss_coef=0.001, decoder_sparse_step=1),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                      router_aux_loss_coef=0.001, decoder_sparse_step=1, shared_expert_intermediate_size=5632),
}
_DENSE_MOE = dict(experts=0, moe_mlp=None, norm_topk_prob=False, router_score="softmax", router_aux_loss_coef=0.0,
                  router_z_loss_coef=0.0, capacity_factor=None, token_capacity=None,
                  shared_expert_mlp=0, moe_layers=None, shared_expert_gate=True)


def _class_defaults(mt: str) -> dict[str, Any]:
    """transformers' config class defaults of the keys read for the dense family ``mt``."""
    return _DEFAULTS[mt] if mt in _DEFAULTS else SWITCHES[mt].defaults


def _moe_config_from_hf(hf: dict, mt: str) -> Config:
    """A Mixtral / Qwen3-MoE / Qwen2-MoE ``config.json``: the dense family's config plus the
    experts (the auxiliary loss counts, as in transformers, only with output_router_logits)."""
    import dataclasses
    where = f"HF {mt} config"
    d = _MOE_DEFAULTS[mt]

    def get(key: str) -> Any:
        v = hf.get(key)
        return d.get(key) if v is None else v
    if float(hf.get("router_jitter_noise") or 0.0):
        raise UnsupportedHFConfig(f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} is not supported "
                                  f"(a deterministic router only; set it to 0.0)")
    dense = dict(hf, model_type=MOE_BASE[mt])
    if mt == "mixtral":
        dense.setdefault("sliding_window", None)
    if mt == "qwen3_moe" and hf.get("head_dim") is None:
        dense["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    if mt not in _TOPK_RENORMED and hf.get("use_sliding_window"):
        raise UnsupportedHFConfig(f"{where}: use_sliding_window=True is not supported for {mt}")
    for key in ("max_position_embeddings", "rms_norm_eps"):
        if hf.get(key) is None and key in d:
            dense[key] = d[key]
    if hf.get("clip_qkv") is not None and mt != "olmoe":
        raise UnsupportedHFConfig(f"{where}: clip_qkv={hf['clip_qkv']!r} is not supported (q, k and v clamped; "
                                  f"only clip_qkv=null)")
    clip = dict(clip_qkv=None if hf.get("clip_qkv") is None else float(hf["clip_qkv"])) if mt == "olmoe" else {}
    if mt == "qwen2_moe" and hf.get("qkv_bias") is False:
        raise UnsupportedHFConfig(f"{where}: qkv_bias=False is not supported (Qwen2-MoE has q/k/v biases)")
    cfg = config_from_hf_dict(dense)
    layers = cfg.layers
    # (Qwen3MoeConfig of transformers 5 writes num_local_experts, earlier ones num_experts)
    experts = int(get("num_local_experts") if mt in _TOPK_RENORMED else
                  hf.get("num_experts") or hf.get("num_local_experts") or d["num_experts"])
    moe_layers = None
    if mt not in _EVERY_LAYER:
        step, dense_only = int(get("decoder_sparse_step")), set(hf.get("mlp_only_layers") or ())
        chosen = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        moe_layers = None if len(chosen) == layers else chosen
    return dataclasses.replace(
        cfg, model_type=mt, experts=experts, experts_top_k=int(get("num_experts_per_tok")),
        moe_mlp=None if mt in _EVERY_LAYER else int(get("moe_intermediate_size")),
        norm_topk_prob=True if mt in _TOPK_RENORMED else bool(get("norm_topk_prob")),
        router_aux_loss_coef=float(get("router_aux_loss_coef")) if hf.get("output_router_logits") else 0.0,
        shared_expert_mlp=(int(get("shared_expert_intermediate_size")) if mt == "qwen2_moe" else
                           int(get("shared_intermediate_size")) if mt == "granitemoeshared" else 0),
        shared_expert_gate=mt != "granitemoeshared", moe_layers=moe_layers, **_MOE_ATTENTION.get(mt, {}), **clip)


def config_from_hf_dict(hf: dict) -> Config:
    """``llama.Config`` from the contents of an HF ``config.json`` (:func:`decoder_config_from_hf_dict`),
    with the score head its ``architectures`` name (``*ForSequenceClassification``,
    ``*ForTokenClassification``: models/score_head.py)."""
    import dataclasses
    cfg = decoder_config_from_hf_dict(hf)
    head = score_head.head_from_hf(hf)
    return dataclasses.replace(cfg, **head) if head else cfg


def decoder_config_from_hf_dict(hf: dict) -> Config:
    """``llama.Config`` from the contents of an HF ``config.json`` of any family of
    :data:`MODEL_TYPES` (dispatching on ``model_type``); accepts both ``rope_parameters``
    (transformers 5) and ``rope_theta``/``rope_scaling`` (4.x). A model type or a setting the
    functional decoder cannot reproduce raises :class:`UnsupportedHFConfig` naming it."""
    where = "HF config"
    mt = hf.get("model_type", "llama")
    if mt == "qwen2_vl":                       # (Qwen2-VL: a Qwen2 decoder under model., the multimodal rotary)
        return qwen_vision_hf.qwen2_vl_text(hf, config_from_hf_dict)
    if mt in glm4v_hf.WRAPPERS:                # (GLM-4V: a GLM-4-0414 decoder, the multimodal rotary)
        return glm4v_hf.text_config(hf, config_from_hf_dict)
    if mt == paddleocr_vl_hf.WRAPPER:          # (PaddleOCR-VL: ERNIE 4.5 with the rotate-half multimodal rotary)
        try:
            return paddleocr_vl_hf.text_config(hf, config_from_hf_dict)
        except UnsupportedHFConfig:
            raise
        except ValueError as exc:
            raise UnsupportedHFConfig(str(exc)) from exc
    if mt in MULTIMODAL:                       # (Gemma 3, Mistral 3, Llama 4: their text decoder)
        import dataclasses
        text = dict(hf.get("text_config") or {})
        if not text or (not text.get("model_type") and MULTIMODAL[mt] is None):
            missing = "no text_config" if not text else "a text_config without model_type"
            raise UnsupportedHFConfig(f"HF {mt} config: text_config={hf.get('text_config')!r} is not supported: "
                                      f"config.json has {missing}, so its text decoder's family and sizes are not "
                                      f"in it (transformers would build its class's default text decoder, not this "
                                      f"checkpoint's); give config.json's text_config as published, with its "
                                      f"model_type (Mistral 3's: mistral, ministral3 or mistral4)")
        text.setdefault("model_type", MULTIMODAL[mt])
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        if text["model_type"] not in ARCHITECTURES:
            raise UnsupportedHFConfig(f"{where}: {mt}'s text decoder: model_type {text['model_type']!r} is not "
                                      f"supported{refusal(text['model_type'])}")
        return dataclasses.replace(config_from_hf_dict(text), text_of=mt)
    if mt not in ARCHITECTURES:
        raise UnsupportedHFConfig(f"{where}: model_type {mt!r} is not supported{refusal(mt)}; supported model "
                                  f"types: {', '.join(MODEL_TYPES)}")
    if mt in MOE_BASE:
        return _moe_config_from_hf(hf, mt)
    # the families whose config.json a module of its own reads (DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash;
    # Falcon-H1: Mamba2 and attention in parallel; Granite 4: Granite's layers, Mamba2 or attention;
    # Nemotron-H: Mamba2, attention, MLP layers; Arcee AFMoE; Qwen3.5: Gated DeltaNet + gated
    # attention; Gemma 4's text decoder), each given what it reads with
    for module, *reads_with in ((deepseek_hf, _rope), (falcon_h1_hf, _rope), (granitemoehybrid_hf, config_from_hf_dict),
                                (nemotron_h_hf,), (mamba_hf,), (jamba_hf,), (afmoe_hf, _rope), (qwen3_5_hf, _rope),
                                (gemma4_hf,), (kimi_linear_hf,)):
        if mt in module.ARCHITECTURES:
            try:
                return module.config_from_hf(hf, mt, *reads_with)
            except UnsupportedHFConfig:
                raise
            except ValueError as exc:
                raise UnsupportedHFConfig(str(exc)) from exc
    if mt in OWN_CONFIG:                       # Llama's attention and norms, the rest its own
        import dataclasses
        own = OWN_CONFIG[mt]
        try:
            cfg = config_from_hf_dict(own.llama_dict(hf))
            return dataclasses.replace(cfg, **own.read(hf, cfg.layers))
        except UnsupportedHFConfig:
            raise
        except ValueError as exc:
            raise UnsupportedHFConfig(str(exc)) from exc
    if mt in SWITCHES and SWITCHES[mt].prepare is not None:       # (GPT-J's own key names)
        hf = SWITCHES[mt].prepare(hf)
    where = f"HF {mt} config"
    defaults = _class_defaults(mt)

    def get(key: str, default: Any = None) -> Any:
        v = hf.get(key)
        return v if v is not None else defaults.get(key, default)

    gemma = mt in _GEMMA
    if gemma:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or defaults["hidden_activation"]
        if act != "gelu_pytorch_tanh":
            raise UnsupportedHFConfig(f"{where}: hidden_activation={act!r} is not supported (the functional "
                                      f"decoder's Gemma 2 needs 'gelu_pytorch_tanh')")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedHFConfig(f"{where}: use_bidirectional_attention=True is not supported "
                                      f"(causal attention only)")
    act = SWITCHES[mt].hidden_act if mt in SWITCHES else "silu"
    checked = (("mlp_bias", False),) if mt not in SWITCHES or "mlp_bias" not in SWITCHES[mt].free else ()
    for key, ok in checked if gemma else (("hidden_act", act), *checked):
        if hf.get(key, ok) != ok:
            raise UnsupportedHFConfig(f"{where}: {key}={hf[key]!r} is not supported "
                                      f"(the functional decoder needs {ok!r})")
    attention_dropout = float(get("attention_dropout") or 0.0)       # (on the softmax probabilities, in training)
    if not 0.0 <= attention_dropout < 1.0:
        raise UnsupportedHFConfig(f"{where}: attention_dropout={attention_dropout!r} must be in [0, 1)")
    # (Phi's, GPT-J's and GPT-2's: residual / embedding dropout, read by hf_switches; Phi-3's resid_pdrop drops
    # the attention's and the MLP's outputs, its embd_pdrop transformers never applies)
    residual_dropout = float(get("resid_pdrop") or 0.0) if mt == "phi3" else 0.0
    if not 0.0 <= residual_dropout < 1.0:
        raise UnsupportedHFConfig(f"{where}: resid_pdrop={residual_dropout!r} must be in [0, 1)")
    for key in ("resid_pdrop", "embd_pdrop") if mt not in ("phi", "gptj", "gpt2") else ():
        if (mt, key) != ("phi3", "resid_pdrop") and float(hf.get(key) or 0.0) != 0.0:
            why = ("transformers' Phi3ForCausalLM never applies it" if mt == "phi3" else
                   "the functional decoder has no dropout there")
            raise UnsupportedHFConfig(f"{where}: {key}={hf[key]!r} is not supported ({why}; set it to 0.0)")
    local_theta = None
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if mt in ("gemma3_text", "olmo3"):     # a rope per layer type: global (full) and local (sliding) bases
        if "full_attention" in rope or "sliding_attention" in rope:
            rope, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        else:
            local = {}
        theta_default = float(hf.get("rope_theta") or (1_000_000.0 if mt == "gemma3_text" else 500_000.0))
        local_default = 10_000.0 if mt == "gemma3_text" else rope.get("rope_theta", theta_default)
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq") or local_default))
        if local.get("rope_type", local.get("type", "default")) not in ("default", None):
            raise UnsupportedHFConfig(f"{where}: rope type {local.get('rope_type', local.get('type'))!r} of "
                                      f"the sliding layers is not supported (only 'default')")
    else:
        theta_default = float(hf.get("rope_theta") or hf.get("rotary_emb_base") or 10000.0)     # (GPT-NeoX's old key)
    theta, scaling = _rope(rope, hf, where, theta_default, partial_ok="partial_rotary_factor" in (
        SWITCHES[mt].free if mt in SWITCHES else ()))
    bias = bool(hf.get("attention_bias", False))
    if mt in ("mistral", "phi3") and bias:
        raise UnsupportedHFConfig(f"{where}: attention_bias=True is not supported ({mt} has no biases)")
    qkv_bias, o_bias = (True, False) if mt == "qwen2" else (bias, bias)
    layers = int(hf["num_hidden_layers"])
    window, layer_types = _window(hf, mt, get, layers, where)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = get("head_dim")
    if head_dim is not None and int(head_dim) == hidden // heads:
        head_dim = None
    extra: dict[str, Any] = {}
    if mt in SWITCHES:
        try:
            fixed = {k: v for k, v in SWITCHES[mt].fixed.items() if not callable(v)}   # (the others: checks)
            extra = fixed | SWITCHES[mt].read(hf, get, where)
        except ValueError as exc:
            raise UnsupportedHFConfig(str(exc)) from exc
        if mt == "olmo3":
            extra["local_rope_theta"] = local_theta
    if gemma:
        caps = [get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")]
        caps = [None if k in hf and hf[k] is None else c for k, c in
                zip(("attn_logit_softcapping", "final_logit_softcapping"), caps)]
        extra = dict(_GEMMA2, query_pre_attn_scalar=float(get("query_pre_attn_scalar")), local_rope_theta=local_theta,
                     attn_softcap=None if caps[0] is None else float(caps[0]),
                     final_softcap=None if caps[1] is None else float(caps[1]))
    return Config(**{**dict(
        vocab=int(hf["vocab_size"]), hidden=hidden, layers=layers,
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
        mlp=int(hf["intermediate_size"]), head_dim=None if head_dim is None else int(head_dim),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        max_seq=int(get("max_position_embeddings")), model_type=mt, qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=mt in ("qwen3", "gemma3_text"), sliding_window=window, layer_types=layer_types,
        attention_dropout=attention_dropout, residual_dropout=residual_dropout), **extra})


def _rope(rope: dict, hf: dict, where: str, theta_default: float, partial_ok: bool = False):
    """(theta, scaling) of one rope parameters dict; an unsupported type is refused by name."""
    theta = float(rope.get("rope_theta", theta_default))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not partial_ok and partial_rotary_factor(hf) != 1.0:
        raise UnsupportedHFConfig(f"{where}: partial_rotary_factor != 1 is not supported for this model type")
    if rope_type in ("default", None):
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3Scaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope.get("original_max_position_embeddings",
                                               hf.get("max_position_embeddings", 8192))))
    if rope_type in ("longrope", "su"):            # transformers' _compute_longrope_parameters
        original = int(rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                       or hf.get("max_position_embeddings"))
        factor = rope.get("factor") or float(hf.get("max_position_embeddings") or original) / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return theta, LongRopeScaling(tuple(rope["short_factor"]), tuple(rope["long_factor"]), original,
                                      float(attention))
    if rope_type == "linear":
        return theta, LinearScaling(float(rope["factor"]))
    if rope_type == "yarn":                        # transformers' _compute_yarn_parameters
        original = int(rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                       or hf.get("max_position_embeddings"))
        factor = float(rope.get("factor") or float(hf["max_position_embeddings"]) / original)

        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        attention = rope.get("attention_factor")
        if attention is None:
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
        return theta, YarnScaling(factor, original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                                  float(attention), bool(rope.get("truncate", True)))
    raise UnsupportedHFConfig(f"{where}: rope type {rope_type!r} is not supported (only 'default', 'llama3', "
                              f"'longrope', 'linear' and 'yarn')")


def _window(hf: dict, mt: str, get, layers: int, where: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers reads them for family ``mt``."""
    if mt == "llama" or (mt in SWITCHES and not SWITCHES[mt].windows):
        return None, None
    if mt in ("mistral", "phi3", "starcoder2", "ministral3"):   # every layer, when set (transformers ignores layer_types)
        w = hf.get("sliding_window", _class_defaults(mt)["sliding_window"])
        return (None if w is None else int(w)), None
    # an explicit null sliding_window is no window (a missing key: the class default)
    window = hf["sliding_window"] if "sliding_window" in hf else _class_defaults(mt).get("sliding_window")
    if mt in (*_GEMMA, "olmo3", "cohere2"):   # every n-th layer global, the others slide (Gemma 2: n = 2,
        w = window                            # Gemma 3: 6, OLMo 3 and Cohere 2: 4)
        n = {"gemma2": 2, "olmo3": 4, "cohere2": 4}.get(mt) or int(get("sliding_window_pattern"))
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % n else "full_attention"
                                          for i in range(layers)]
    else:
        w = window if get("use_sliding_window") else None
        types = hf.get("layer_types") or (["full_attention"] * layers if mt == "smollm3" else None)
    if types is None:
        first = int(get("max_window_layers"))
        types = ["sliding_attention" if w is not None and i >= first else "full_attention"
                 for i in range(layers)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise UnsupportedHFConfig(f"{where}: layer_types {bad} are not supported (only full_attention "
                                  f"and sliding_attention)")
    if len(types) != layers:
        raise UnsupportedHFConfig(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    if w is None or "sliding_attention" not in types:
        return None, None
    return int(w), (None if all(t == "sliding_attention" for t in types) else tuple(types))


def _check_moe_exportable(cfg: Config) -> Config:
    """The dense config a mixture of experts exports around, after refusing what its class
    cannot hold; a dense family with experts is refused too."""
    import dataclasses
    mt, where = cfg.model_type, f"export as {cfg.model_type!r}"
    if mt not in MOE_BASE:
        if cfg.experts:
            raise UnsupportedHFConfig(f"{where}: experts={cfg.experts} has no {ARCHITECTURES.get(mt, mt)} equivalent "
                                      f"(it needs experts=0); choose model_type mixtral, qwen3_moe or qwen2_moe")
        return cfg
    need = dict(router_score="softmax", shared_expert_gate=mt != "granitemoeshared",
                shared_expert_mlp=cfg.shared_expert_mlp if mt in ("qwen2_moe", "granitemoeshared") else 0)
    if mt in _TOPK_RENORMED:
        need.update(norm_topk_prob=True, moe_layers=None, moe_mlp=None)
    if mt in _EVERY_LAYER:
        need.update(moe_layers=None, moe_mlp=None, **_MOE_ATTENTION.get(mt, {}))
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise UnsupportedHFConfig(f"{where}: {key}={getattr(cfg, key)!r} has no {ARCHITECTURES[mt]} "
                                      f"equivalent (it needs {want!r}); choose another model_type")
    if not cfg.experts:
        raise UnsupportedHFConfig(f"{where}: experts=0 is a dense model; export it as {MOE_BASE[mt]!r}")
    base = {k: getattr(Config(), k) for k in _MOE_ATTENTION.get(mt, {})}     # (the dense family's attention)
    if mt == "olmoe":                          # (OLMoE's clamp, written by _moe_config_to_hf)
        base["clip_qkv"] = None
    return dataclasses.replace(cfg, model_type=MOE_BASE[mt], **_DENSE_MOE, **base)


def check_exportable(cfg: Config) -> None:
    """Refuse (naming the option) a config that its ``model_type``'s HF class cannot hold."""
    if cfg.text_of == paddleocr_vl_hf.WRAPPER and cfg.vision is not None:    # (its multimodal class rotates halves
        import dataclasses                                          # where Ernie4_5ForCausalLM rotates pairs)
        cfg = dataclasses.replace(cfg, rotary_interleaved=True)
    mt, where = cfg.model_type, f"export as {cfg.model_type!r}"
    if mt not in ARCHITECTURES:
        raise UnsupportedHFConfig(f"{where}: model_type {mt!r} is not supported; supported model types: "
                                  f"{', '.join(MODEL_TYPES)}")
    if cfg.experts_linearized and mt != "llama4_text":
        raise UnsupportedHFConfig(f"{where}: experts_linearized=True (Axolotl's linearized Llama 4 experts) has no "
                                  f"{ARCHITECTURES[mt]} equivalent; export as 'llama4_text'")
    if "conv" in (cfg.layer_types or ()) and mt != "lfm2":
        raise UnsupportedHFConfig(f"{where}: layer_types with 'conv' layers (LFM2's short convolution) have no "
                                  f"{ARCHITECTURES[mt]} equivalent; export as 'lfm2'")
    if mt not in qwen3_5_hf.ARCHITECTURES and (cfg.q_gate or "linear_attention" in (cfg.layer_types or ())):
        raise UnsupportedHFConfig(f"{where}: q_gate={cfg.q_gate}, layer_types={list(cfg.layer_types or [])} (Gated "
                                  f"DeltaNet layers, the gate in q_proj) have no {ARCHITECTURES[mt]} equivalent; "
                                  f"choose model_type {' or '.join(qwen3_5_hf.ARCHITECTURES)}")
    if mt not in kimi_linear_hf.ARCHITECTURES and kimi_delta.KIND in (cfg.layer_types or ()):
        raise UnsupportedHFConfig(f"{where}: layer_types={list(cfg.layer_types)} (Kimi Delta Attention layers) have no "
                                  f"{ARCHITECTURES[mt]} equivalent; choose model_type kimi_linear")
    if mt in granitemoehybrid_hf.ARCHITECTURES:
        return granitemoehybrid_hf.check_exportable(cfg, check_exportable, UnsupportedHFConfig)
    if mt in OWN_CONFIG:
        _refuse_unless(cfg, OWN_CONFIG[mt].NEED, where)
        try:
            return check_exportable(OWN_CONFIG[mt].as_llama(cfg))
        except ValueError as exc:
            raise UnsupportedHFConfig(str(exc)) from exc
    theirs = dict(attn_sinks=False, moe_bias=False, swiglu_limit=None, attention_chunk=None, qk_l2_norm=False,
                  attn_temperature_floor=None, experts_scale_input=False)     # (those families' only)
    free = SWITCHES[mt].free if mt in SWITCHES else deepseek_hf.FREE.get(mt, ())    # (checked by the family)
    _refuse_unless(cfg, {k: v for k, v in theirs.items() if k not in free}, where)
    if mt in gemma4_hf.ARCHITECTURES:
        return gemma4_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    _refuse_unless(cfg, dict(global_head_dim=None, global_kv_heads=None, k_eq_v=False, v_norm=False,
                             layer_scalar=False, experts_beside_mlp=False, per_layer_input=0,
                             kv_shared_layers=0, double_wide_mlp=False), where)   # (Gemma 4's only)
    if mt in deepseek_hf.ARCHITECTURES:
        return deepseek_hf.check_exportable(cfg, {**PLAIN, **_NOT_GEMMA}, UnsupportedHFConfig)
    if mt in kimi_linear_hf.ARCHITECTURES:
        return kimi_linear_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in afmoe_hf.ARCHITECTURES:
        return afmoe_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in qwen3_5_hf.ARCHITECTURES:
        return qwen3_5_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in nemotron_h_hf.ARCHITECTURES:
        return nemotron_h_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in falcon_h1_hf.ARCHITECTURES:
        return falcon_h1_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in mamba_hf.ARCHITECTURES:
        return mamba_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if mt in jamba_hf.ARCHITECTURES:
        return jamba_hf.check_exportable(cfg, PLAIN, UnsupportedHFConfig)
    if cfg.kv_lora_rank:
        raise UnsupportedHFConfig(f"{where}: kv_lora_rank={cfg.kv_lora_rank} (latent attention) has no "
                                  f"{ARCHITECTURES[mt]} equivalent; choose model_type "
                                  f"{', '.join(deepseek_hf.LATENT)}")
    dense = _check_moe_exportable(cfg)
    if dense is not cfg:
        return check_exportable(dense)
    if mt in SWITCHES:
        need = {**_NOT_GEMMA, **SWITCHES[mt].need(cfg)}
        if mt == "granite":
            del need["query_pre_attn_scalar"]
        if mt == "olmo3":
            del need["local_rope_theta"]
        return _refuse_unless(cfg, need, where)
    need: dict[str, Any] = {"llama": dict(qkv_bias=cfg.o_bias, qk_norm=False, sliding_window=None),
                            "mistral": dict(qkv_bias=False, o_bias=False, qk_norm=False, layer_types=None),
                            "qwen2": dict(qkv_bias=True, o_bias=False, qk_norm=False),
                            "qwen3": dict(qkv_bias=cfg.o_bias, qk_norm=True),
                            "phi3": dict(qkv_bias=False, o_bias=False, qk_norm=False, layer_types=None,
                                         residual_dropout=cfg.residual_dropout),
                            "gemma2": dict(qkv_bias=cfg.o_bias, qk_norm=False, local_rope_theta=None, **_GEMMA2),
                            "gemma3_text": dict(qkv_bias=cfg.o_bias, qk_norm=True, **_GEMMA2)}[mt]
    if mt in _GEMMA:
        if cfg.query_pre_attn_scalar is None:
            raise UnsupportedHFConfig(f"{where}: query_pre_attn_scalar=None has no {ARCHITECTURES[mt]} "
                                      f"equivalent (set it, e.g. to head_dim)")
    else:
        need.update(_NOT_GEMMA)
    _refuse_unless(cfg, {**PLAIN, **need}, where)


def _refuse_unless(cfg: Config, need: dict[str, Any], where: str) -> None:
    """Refuse (naming the field) a config whose fields differ from ``need``."""
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise UnsupportedHFConfig(f"{where}: {key}={getattr(cfg, key)!r} has no {ARCHITECTURES[cfg.model_type]} "
                                      f"equivalent (it needs {want!r}); choose another model_type")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """HF ``config.json`` contents for ``cfg`` (:func:`decoder_config_to_hf`): its multimodal class's
    where it has a vision tower (:func:`vision_hf_of`), else its score head's class where it has one
    (models/score_head.py)."""
    module = vision_hf_of(cfg)
    if module is not None:
        return module.config_to_hf(cfg, lambda text: decoder_config_to_hf(text, dtype))
    return score_head.head_to_hf(cfg, decoder_config_to_hf(cfg, dtype))


def decoder_config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """HF ``config.json`` contents for ``cfg``, as its ``model_type``'s class (readable by
    transformers 4.x and 5.x); :func:`check_exportable` refuses a config that class cannot hold."""
    check_exportable(cfg)
    if cfg.model_type in deepseek_hf.ARCHITECTURES:
        return deepseek_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in gemma4_hf.ARCHITECTURES:
        return gemma4_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in afmoe_hf.ARCHITECTURES:
        return afmoe_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in qwen3_5_hf.ARCHITECTURES:
        return qwen3_5_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in nemotron_h_hf.ARCHITECTURES:
        return nemotron_h_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in granitemoehybrid_hf.ARCHITECTURES:
        return granitemoehybrid_hf.config_to_hf(cfg, decoder_config_to_hf, dtype)
    if cfg.model_type in falcon_h1_hf.ARCHITECTURES:
        return falcon_h1_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in mamba_hf.ARCHITECTURES:
        return mamba_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in jamba_hf.ARCHITECTURES:
        return jamba_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in kimi_linear_hf.ARCHITECTURES:
        return kimi_linear_hf.config_to_hf(cfg, dtype)
    if cfg.model_type in MOE_BASE:
        return _moe_config_to_hf(cfg, dtype)
    if cfg.model_type in OWN_CONFIG:
        out = config_to_hf(OWN_CONFIG[cfg.model_type].as_llama(cfg), dtype)
        OWN_CONFIG[cfg.model_type].write(cfg, out)
        return out
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    s = cfg.rope_scaling
    if isinstance(s, LongRopeScaling):
        rope = {"rope_type": "longrope", "rope_theta": float(cfg.rope_theta), "short_factor": list(s.short_factor),
                "long_factor": list(s.long_factor), "original_max_position_embeddings": s.original_max_position,
                "attention_factor": s.attention_factor}
    elif isinstance(s, LinearScaling):
        rope = {"rope_type": "linear", "rope_theta": float(cfg.rope_theta), "factor": float(s.factor)}
    elif isinstance(s, YarnScaling):
        rope = {"rope_type": "yarn", "rope_theta": float(cfg.rope_theta), "factor": float(s.factor),
                "original_max_position_embeddings": s.original_max_position, "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow, "attention_factor": s.attention_factor, "truncate": s.truncate}
    elif s is not None:
        rope = {"rope_type": "llama3", "rope_theta": float(cfg.rope_theta), "factor": float(s.factor),
                "low_freq_factor": float(s.low_freq_factor),
                "high_freq_factor": float(s.high_freq_factor),
                "original_max_position_embeddings": int(s.original_max_position)}
    dname = str(dtype).removeprefix("torch.")
    mt = cfg.model_type
    out = {
        "architectures": [ARCHITECTURES[mt]], "model_type": mt,
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attention_dropout, "use_cache": True,
        "rope_parameters": rope,                                    # transformers 5
        "rope_theta": float(cfg.rope_theta),                        # transformers 4.x
        "rope_scaling": (None if s is None else
                         {"type": "longrope", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
                         if isinstance(s, LongRopeScaling) else {k: v for k, v in rope.items() if k != "rope_theta"}),
        "dtype": dname, "torch_dtype": dname,
    }
    if mt in ("llama", "qwen3", *_GEMMA, *SWITCHES):
        out["attention_bias"] = cfg.o_bias
    if mt in SWITCHES:
        out["hidden_act"] = SWITCHES[mt].hidden_act
        SWITCHES[mt].write(cfg, out)
        pad = SWITCHES[mt].defaults.get("pad_token_id")     # the class's pad id, where the vocabulary holds it
        out["pad_token_id"] = pad if pad is not None and pad < cfg.vocab else None
    if mt == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": float(cfg.local_rope_theta or cfg.rope_theta)}
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"], use_bidirectional_attention=False)
    if mt in _GEMMA:
        types = [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)]
        del out["hidden_act"]
        scalar = cfg.query_pre_attn_scalar        # an int in Gemma2Config (strictly checked)
        out.update(hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                   sliding_window=cfg.sliding_window, layer_types=types)
    if mt == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    if mt in ("mistral", "phi3"):
        out["sliding_window"] = cfg.sliding_window
    if mt == "phi3":
        # Phi3Config's pad_token_id defaults to 32000, which an embedding of fewer rows cannot hold
        out.update(resid_pdrop=cfg.residual_dropout, embd_pdrop=0.0,
                   original_max_position_embeddings=(s.original_max_position if isinstance(s, LongRopeScaling)
                                                     else cfg.max_seq),
                   pad_token_id=32000 if cfg.vocab > 32000 else None)
    if mt in ("qwen2", "qwen3"):
        types = [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)]
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=(types.index("sliding_attention") if "sliding_attention" in types
                                      else cfg.layers), layer_types=types)
    return out


def _moe_config_to_hf(cfg: Config, dtype: torch.dtype) -> dict:
    """A mixture of experts' ``config.json``: its dense family's, with the experts' keys."""
    mt = cfg.model_type
    out = config_to_hf(_check_moe_exportable(cfg), dtype)
    out.update(architectures=[ARCHITECTURES[mt]], model_type=mt, num_experts_per_tok=cfg.experts_top_k,
               router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=bool(cfg.router_aux_loss_coef))
    if mt in _TOPK_RENORMED:
        out.update(num_local_experts=cfg.experts, router_jitter_noise=0.0)
        if mt == "granitemoeshared":
            out["shared_intermediate_size"] = cfg.shared_expert_mlp
        return out
    if mt == "olmoe":
        out.update(num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk_prob, clip_qkv=cfg.clip_qkv)
        return out
    moe = [i for i in range(cfg.layers) if cfg.moe_layers is None or i in cfg.moe_layers]
    out.update(num_experts=cfg.experts, num_local_experts=cfg.experts, moe_intermediate_size=cfg.moe_mlp or cfg.mlp,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(cfg.layers) if i not in moe], use_sliding_window=False,
               sliding_window=None)
    out.pop("layer_types", None)
    if mt == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_mlp, qkv_bias=True)
    return out


VISION_HF = (qwen_vision_hf, glm4v_hf, gemma4_vision_hf, gemma4_unified_hf, llama4_vision_hf, lfm2_vl_hf,
             internvl_hf, paddleocr_vl_hf)
"""The modules of the vision families with their own multimodal ``config.json``, one row each: the
wrapper ``model_type`` they hold (``WRAPPERS``), their reader (``vision_from_hf(hf)``: the tower's
config) and their writer (``config_to_hf(cfg, write)``: the multimodal config around ``write``'s of
the text decoder); every other one is Pixtral's or CLIP's (pixtral_hf)."""


def vision_hf_of(cfg: Config):
    """The module (a row of :data:`VISION_HF`, or pixtral_hf for another ``text_of``) that writes the
    multimodal ``config.json`` of ``cfg``; None for a config without a vision tower or a wrapper."""
    if cfg.vision is None:
        return None
    wrapper = cfg.text_of or cfg.model_type
    return next((m for m in VISION_HF if wrapper in m.WRAPPERS), pixtral_hf if cfg.text_of else None)


def vision_from_hf(hf: dict):
    """The vision tower config (models/pixtral.py's or its own tower's: :data:`VISION_HF`) of a multimodal
    ``config.json``, by its ``model_type``; a ValueError names what is not reproduced."""
    for module in VISION_HF:
        if hf.get("model_type") in module.WRAPPERS:
            return module.vision_from_hf(hf)
    return pixtral_hf.vision_from_hf(hf)
