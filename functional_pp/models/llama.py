"""The Llama-style decoder as pure functions over a parameter pytree whose every dimension is
named: Llama 3 and, as configuration of the same code, the families that differ from it in a
few switches (docs/models.md, "Decoder families"): Mistral (sliding-window attention), Qwen2
(q/k/v biases), Qwen3 (per-head RMSNorm of q and k, explicit head_dim), Phi-3 (only its files
differ: fused projections), Gemma 2 (tanh-GELU GLU, 1 + w sandwich norms, scaled embedding,
soft-capped attention and logits) and Gemma 3 (q/k norms, a rope base for local layers), tied
embeddings; SmolLM3 (NoPE layers), Granite (multipliers), OLMo 2/3 (norms after each block, q/k
norms over every head), Cohere, Phi-1/2 and GPT-NeoX (attention and MLP in parallel, LayerNorm,
partial or interleaved rotary, biases), Apertus (xIELU), Hunyuan (q/k norms after the rotary)
and Falcon (multi-query; models/hf_switches.py); DeepSeek-V2/V3, GLM-4.5 and GLM-4.7-Flash
(multi-head latent attention, models/mla.py; grouped routing, shared experts;
models/deepseek_hf.py). ``Config.model_type`` names the
Hugging Face architecture a config is (and exports as).

Parameter names follow Hugging Face's Llama layout (``model.layers.N.self_attn.q_proj`` ->
``layers.N.self_attn.q_proj``); weights are stored input-dimension first with heads and
head_dim as separate dimensions (see ``functional_pp.models.llama_hf`` for the table)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

import torch

from functional_pp import ops
from functional_pp.core.tree import param
from functional_pp.models import (dropout_seeds, dsa, gated_deltanet, gemma4_unified, gemma4_vision, glm4v_vision,
                                   internvl, kimi_delta, kv_cache, lfm2_vl, llama4_vision, mamba1, mamba2, mla, moe,
                                   per_layer_inputs, pixtral, qwen_vision, recording, short_conv, temperature)
from functional_pp.ops import fake_quant
from functional_pp.ops.layer import layer as remat_layer
from functional_pp.ops.rotary import LinearScaling, Llama3Scaling, LongRopeScaling, ProportionalScaling, YarnScaling
from functional_pp.ops.experts import ACTIVATIONS
from functional_pp.parallel.named import Named, tied
from functional_pp.parallel.pipeline.stage import current_stage

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "conv", gated_deltanet.KIND, kimi_delta.KIND)
LAYER_BLOCKS = ("attention+mlp", "mamba2+mlp", "mamba2|attention+mlp", "attention", "mamba2", "mlp", "mamba1",
                "mamba1+mlp")
"""A layer's blocks (``Config.layer_blocks``), each after a norm of its own and added to the
residual stream: Llama's attention then MLP; a Mamba2 mixer (models/mamba2.py) where attention is;
a Mamba2 mixer and attention in parallel from one norm (Falcon-H1); or one block alone
(Nemotron-H's layers)."""


_SCALINGS = {"llama3": Llama3Scaling, "longrope": LongRopeScaling, "linear": LinearScaling, "yarn": YarnScaling,
             "proportional": ProportionalScaling}


def _scaling_from_dict(d: dict):
    """A rope scaling from a dict (``Config.to_dict``, YAML): its ``rope_type`` (default: by its
    fields, LongRoPE's factor lists, YaRN's beta_fast, else Llama 3's)."""
    d = dict(d)
    kind = d.pop("rope_type", None)
    if kind is None:
        kind = "longrope" if "short_factor" in d else "yarn" if "beta_fast" in d else "llama3"
    if kind not in _SCALINGS:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not one of {', '.join(_SCALINGS)}")
    return _SCALINGS[kind](**d)


def _scaling_to_dict(s) -> dict | None:
    if s is None:
        return None
    kind = next(k for k, c in _SCALINGS.items() if isinstance(s, c))
    return asdict(s) if kind == "llama3" else {"rope_type": kind, **asdict(s)}
# xIELU's initial a_p, a_n and its fixed beta and eps (transformers' XIELUActivation defaults)
XIELU_ALPHA_P, XIELU_ALPHA_N, XIELU_BETA, XIELU_EPS = 0.8, 0.8, 0.5, -1e-6
MLP_ACTS = ("silu", "gelu_tanh", "gelu", "relu2", "xielu")
EXPERT_ACTS = ACTIVATIONS
"""The experts' activations (ops/experts.py; ``mlp_gated=False``: experts not gated, Nemotron 3)."""
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class Config:
    vocab: int = 128256
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    mlp: int = 14336
    head_dim: int | None = None
    rope_theta: float = 500000.0
    rope_scaling: Llama3Scaling | LongRopeScaling | LinearScaling | YarnScaling | ProportionalScaling | None = field(
        default_factory=Llama3Scaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq: int = 8192
    # the LM head + cross-entropy over chunks of this many bytes of fp32 logits in ``loss``
    # (ops.linear_cross_entropy); None or 0: the whole logits at once (docs/compile.md, "Measurements")
    loss_chunk_bytes: int | None = None
    # ... or over this many chunks of each device's tokens (instead of loss_chunk_bytes)
    loss_chunks: int | None = None
    # the Hugging Face architecture this decoder is: llama | mistral | qwen2 | qwen3 | phi3 |
    # gemma2 | gemma3_text (what export writes; models/llama_hf.py checks that the switches
    # below are that family's)
    model_type: str = "llama"
    # biases of the q, k and v projections (Qwen2; Llama's attention_bias sets both)
    qkv_bias: bool = False
    # a bias of the output projection (Llama's attention_bias)
    o_bias: bool = False
    # RMSNorm over head_dim of each head of q and of k before the rotary (Qwen3)
    qk_norm: bool = False
    # sliding-window attention: a position sees the last ``sliding_window`` positions (itself
    # included) in the layers that ``layer_types`` marks "sliding_attention"; layer_types None:
    # every layer (Mistral). Qwen2/3's max_window_layers become layer_types on import.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma 2's switches: the MLP's gate activation (silu: SwiGLU; gelu_tanh: tanh-GELU GLU)
    mlp_act: str = "silu"
    # RMSNorm scales by (norm_offset + weight): Gemma stores w with 1 + w applied (weights start at 0)
    norm_offset: float = 0.0
    # the embedding times sqrt(hidden) (Gemma)
    scale_embeddings: bool = False
    # norms after attention and after the MLP too (Gemma 2: post_attention_layernorm is the
    # attention's output norm, pre/post_feedforward_layernorm surround the MLP)
    sandwich_norms: bool = False
    # attention scale 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head_dim) (Gemma 2)
    query_pre_attn_scalar: float | None = None
    # softcap * tanh(x / softcap) of the attention scores and of the final logits (Gemma 2)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # dropout in training (transformers' attention_dropout on the softmax probabilities; Seed-OSS's
    # residual_dropout on the attention's and the MLP's outputs; StarCoder 2's embedding_dropout on
    # the embedding's output): masks hashed from the global coordinates, the same on every layout
    # (models/dropout_seeds.py)
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    # False: attention sees every position of its document, before and after (bidirectional: the
    # masked-diffusion objective, models/diffusion_lm.py); True: causal
    causal: bool = True
    # the layers ``layer_types`` marks "conv" mix tokens by LFM2's short convolution of this many
    # positions (conv_L_cache; models/short_conv.py), not attention; also Mamba2's conv1d width (d_conv)
    conv_kernel: int = 3
    # MPT's ALiBi (alibi_bias_max): the attention scores plus a per-head slope times the key's
    # distance (ops.attention's alibi_max); no rotary then
    alibi_max: float | None = None
    # the rope base of the sliding-window layers (Gemma 3's local base); None: rope_theta
    local_rope_theta: float | None = None
    # mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE; models/moe.py, docs/experts.md): the
    # experts of each MoE layer (0: a dense MLP everywhere), each token's top_k, each expert's
    # intermediate size (None: mlp), renormalised top-k weights (Mixtral; Qwen's norm_topk_prob),
    # the router's scores (softmax; sigmoid: DeepSeek-V3), the auxiliary loss's coefficient
    # (router_aux_loss_coef), a shared expert's intermediate size (Qwen2-MoE; 0: none), the
    # layers with experts (None: all), the router z-loss's coefficient (ST-MoE's
    # router_z_loss_coef) and each expert's static capacity per sequence (capacity_factor:
    # None is dropless; a factor drops and counts the assignments past it, and compiles);
    # token_capacity: dropless routing with at most that many assignments per expert of one
    # device's tokens per forward (Axolotl's expert_parallel_token_capacity; None: no cap)
    experts: int = 0
    experts_top_k: int = 2
    moe_mlp: int | None = None
    norm_topk_prob: bool = False
    router_score: str = "softmax"
    router_aux_loss_coef: float = 0.0
    shared_expert_mlp: int = 0
    moe_layers: tuple[int, ...] | None = None
    router_z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    token_capacity: int | None = None
    # a shared expert's sigmoid gate (Qwen2-MoE: True); False: the shared expert adds as it is
    # (Granite MoE with shared experts, DeepSeek-V3, GLM-4.5)
    shared_expert_gate: bool = True
    # the experts' latent width (Nemotron 3 Super's moe_latent_size; 0: none): the routed experts
    # compute on latent_in(x) and their sum goes through latent_out, the router and the shared expert on x
    moe_latent: int = 0
    # NoPE layers: the layers whose attention has no rotary (SmolLM3's every 4th; None: all rotate)
    nope_layers: tuple[int, ...] | None = None
    # partial rotary: the share of head_dim that rotates (its first entries; Phi-1/2, GPT-NeoX)
    partial_rotary_factor: float = 1.0
    # the rotary's pairs are (2i, 2i + 1) of head_dim (Cohere), not (i, i + head_dim / 2)
    rotary_interleaved: bool = False
    # the multimodal rotary (M-RoPE: Qwen2-VL, Qwen3.5; rope_parameters' mrope_section): the rotating pairs per
    # position component (temporal, height, width), contiguous or mrope_interleaved (ops.rotary_sections); it
    # applies to batches with mrope_positions (images), text positions rotating as the plain rotary
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # norms before attention and before the MLP (False: OLMo 2, whose only norms are
    # sandwich_norms' after attention and after the MLP)
    pre_norms: bool = True
    # q/k norms over every head at once (OLMo 2: weights heads x head_dim), not per head
    qk_norm_heads: bool = False
    # q/k norms with a weight per head (heads x head_dim), each head normalised over head_dim (Command R+'s
    # use_qk_norm, StableLM's qk_layernorm)
    qk_norm_per_head: bool = False
    # Granite's multipliers: the embedding times embedding_multiplier, each residual branch
    # (attention, MLP) times residual_multiplier; the logits times logit_scale (Granite's
    # 1 / logits_scaling, Cohere's logit_scale)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    # attention and MLP in parallel from one input norm, x + attn(n(x)) + mlp(n(x)) (Cohere, Phi);
    # parallel_mlp_norm: the MLP from its own norm, x + attn(n1(x)) + mlp(n2(x)) (GPT-NeoX)
    parallel_block: bool = False
    parallel_mlp_norm: bool = False
    # the norms: rms (RMSNorm) or layer (LayerNorm: centred; Cohere's has no bias), with a bias (Phi)
    norm_kind: str = "rms"
    norm_bias: bool = False
    # the MLP: gated (act(gate) * up, then down) or not (Phi-1/2, Arcee: down(act(up))), biases of its
    # projections, and a bias of the LM head (Phi)
    mlp_gated: bool = True
    mlp_bias: bool = False
    lm_head_bias: bool = False
    # the q/k norms after the rotary instead of before it (Hunyuan)
    qk_norm_after_rotary: bool = False
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; models/mla.py): kv_lora_rank > 0 turns
    # it on: k and v from one latent of that rank (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj) plus a
    # rotary key part shared by every head; q through a latent of q_lora_rank (None: one projection);
    # each head's q/k of qk_nope_head_dim + qk_rope_head_dim entries (the rotary on the last ones) and
    # v of v_head_dim
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; models/dsa.py): index_topk > 0 adds the lightning
    # indexer to the latent attention (index_heads heads of index_head_dim; its rotary pairs interleaved
    # or halves): each query attends to its index_topk best-scored earlier keys only
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_rotary_interleaved: bool = True
    # grouped, scaled routing (DeepSeek-V2/V3, GLM-4.5; ops/experts.py): the experts in router_groups
    # groups, each token's experts from its router_topk_groups best groups (a group's score:
    # router_group_score, "top2_sum" of its two best scores or its "max"); router_bias: a per-expert
    # score correction that only chooses the experts (DeepSeek-V3's e_score_correction_bias, not trained);
    # the top-k weights times routed_scaling_factor
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: str = "top2_sum"
    router_bias: bool = False
    routed_scaling_factor: float = 1.0
    # attention sinks: a learned logit per head in each softmax's denominator (gpt-oss; ops.attention's sinks)
    attn_sinks: bool = False
    # the experts' biases: of the router's logits and after each expert's projections (gpt-oss)
    moe_bias: bool = False
    # the experts' clamped SwiGLU, g * sigmoid(alpha g) * (u + 1) of g = min(gate, limit),
    # u = clamp(up, -limit, limit) (gpt-oss's swiglu_limit / swiglu_alpha; None: plain SwiGLU)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # chunked attention: the layers ``layer_types`` marks "chunked_attention" see only their block
    # of ``attention_chunk`` positions (Llama 4's attention_chunk_size; ops.attention's chunk)
    attention_chunk: int | None = None
    # a weightless RMSNorm of q and k over head_dim after the rotary, in the rotating layers (Llama 4's use_qk_norm)
    qk_l2_norm: bool = False
    # attention temperature tuning: q times log1p(floor((pos + offset) / floor)) * scale + 1, in the NoPE
    # layers (Llama 4's attn_temperature_tuning, floor_scale, attn_scale, offset 1) or, with
    # attn_temperature_all_layers, in every layer after the rotary (Ministral 3's llama_4_scaling_beta over
    # original_max_position_embeddings, offset 0); None: off
    attn_temperature_floor: float | None = None
    attn_temperature_scale: float = 0.1
    attn_temperature_offset: float = 1.0
    attn_temperature_all_layers: bool = False
    # the routing weights scale each expert's input instead of its output (Llama 4; ops.experts' weights_on_input)
    experts_scale_input: bool = False
    # learned absolute positions (GPT-2): a table of max_seq rows (embed_positions) added to the token
    # embedding, and no rotary in any layer
    learned_positions: bool = False
    # q, k and v clamped to [-clip_qkv, clip_qkv] after their projections and q/k norms (DBRX's, OLMoE's
    # clip_qkv; None: no clamp)
    clip_qkv: float | None = None
    # Gemma 4: the full-attention layers' own head width and k/v heads (global_head_dim,
    # num_global_key_value_heads; None: head_dim, kv_heads), their v the k projection's output (k_eq_v:
    # attention_k_eq_v, no v_proj there), a weightless RMSNorm of v over head_dim (v_norm), and each layer's
    # output times a scalar of the files that is not trained (layer_scalar)
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    v_norm: bool = False
    layer_scalar: bool = False
    # an output gate of the attention: each head's output times sigmoid of its own projection of the layer's
    # input (``self_attn.gate_proj``, hidden -> heads x head_dim, no bias) before o_proj (AFMoE)
    attn_gate: bool = False
    # the same output gate fused into q_proj (Qwen3-Next, Qwen3.5): each head's 2 x head_dim outputs are its
    # query, then its gate (``self_attn.q_proj`` hidden -> heads x 2 head_dim)
    q_gate: bool = False
    # Gated DeltaNet, the token mixer of the layers ``layer_types`` marks "linear_attention" (Qwen3-Next,
    # Qwen3.5; models/gated_deltanet.py): its value heads, key heads, key and value head widths and the
    # causal convolution's taps (linear_num_value_heads, linear_num_key_heads, linear_key_head_dim,
    # linear_value_head_dim, linear_conv_kernel_dim); Kimi Delta Attention, the mixer of the layers marked
    # "kimi_delta_attention" (Kimi Linear; models/kimi_delta.py), reads linear_heads, linear_head_dim (its
    # q, k and v heads' width) and linear_conv_kernel
    linear_heads: int = 0
    linear_kv_heads: int = 0
    linear_head_dim: int = 128
    linear_v_head_dim: int = 128
    linear_conv_kernel: int = 4
    # Gemma 4 26B-A4B (enable_moe_block): the experts beside the dense MLP in every layer, the router scoring
    # the residual stream (models/moe.py's beside_mlp), the MLP's and the experts' outputs each normed
    # (post_feedforward_layernorm_1 / _2) and summed before post_feedforward_layernorm
    experts_beside_mlp: bool = False
    # Gemma 4 E2B / E4B's per-layer input embeddings (hidden_size_per_layer_input; 0: none): each token's
    # vector of this width per layer, from its own table and a projection of the embedding, added by each
    # layer through a gate after its MLP (models/per_layer_inputs.py)
    per_layer_input: int = 0
    # Gemma 4 E2B / E4B's k/v shared across layers (num_kv_shared_layers; 0: none): the last this many layers
    # attend to the keys and values of the last earlier layer of their own layer type and have no k/v
    # projections of their own (kv_source); double_wide_mlp: those layers' MLP twice mlp wide (use_double_wide_mlp)
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # the multimodal checkpoint (gemma3, mistral3) whose text decoder this is: its tensors under
    # model.language_model. (the vision tower's left aside); export writes the text decoder alone
    text_of: str | None = None
    # multi-token-prediction layers the files hold beside the decoder that its forward never calls (MiMo's
    # num_nextn_predict_layers, model.mtp_layers.N): not read, not trained, copied unchanged into an export
    mtp_layers: int = 0
    # Llama 4's experts in the files one nn.Linear per expert (Axolotl's llama4_linearized_experts:
    # feed_forward.experts.gate_projs.N / up_projs.N / down_projs.N): the same math, stacked here;
    # export writes them under those names
    experts_linearized: bool = False
    # a vision-language model's image encoder and projector (models/pixtral.py: Mistral 3's Pixtral tower;
    # models/qwen_vision.py: Qwen3-VL / Qwen3.5's; models/glm4v_vision.py: GLM-4V's; models/gemma4_vision.py:
    # Gemma 4's; models/llama4_vision.py: Llama 4's; models/lfm2_vl.py: LFM2-VL's SigLIP2; models/internvl.py:
    # InternViT; models/gemma4_unified.py: Gemma 4 unified's encoder-free embedder), its features written into
    # the embeddings at the image tokens of batches that carry images (None: text only)
    vision: ("pixtral.VisionConfig | qwen_vision.QwenVisionConfig | glm4v_vision.Glm4vVisionConfig | "
             "gemma4_vision.Gemma4VisionConfig | llama4_vision.Llama4VisionConfig | lfm2_vl.Lfm2VlConfig | "
             "internvl.InternVLConfig | gemma4_unified.UnifiedVisionConfig | None") = None
    # the tokens of one image attend to each other, before and after, in every layer (Gemma 4 unified's
    # use_bidirectional_attention: vision; ops.attention's groups from the batch's image_groups)
    image_groups_attend: bool = False
    # a score head in place of the LM head (models/score_head.py, docs/reward_models.md): "sequence"
    # scores each sequence at its last non-pad token (transformers' *ForSequenceClassification: reward
    # models), "token" every token (*ForTokenClassification: process reward models); ``score``
    # hidden -> num_labels, with a bias where score_bias (token classification's default);
    # pad_token_id the id the exported config names (transformers finds the last token by it)
    score_head: str | None = None
    num_labels: int = 1
    score_bias: bool = False
    pad_token_id: int | None = None
    # hybrids of attention and state-space layers: each layer's blocks (an entry of LAYER_BLOCKS; None:
    # attention+mlp in every layer) and the Mamba2 mixers' shape (models/mamba2.py: mamba_num_heads,
    # mamba_head_dim, n_groups, ssm_state_size, conv_kernel, chunk_size, time_step_limit (None: no limit),
    # use_conv_bias, use_bias)
    layer_blocks: tuple[str, ...] | None = None
    mamba_heads: int = 0
    mamba_head_dim: int = 64
    mamba_groups: int = 1
    ssm_state: int = 128               # (its conv1d's width: conv_kernel, above, as LFM2's)
    mamba_chunk: int = 128
    mamba_dt_limit: tuple[float, float] | None = None
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # Falcon-H1's muP multipliers: the Mamba2 mixer's input (ssm_in_multiplier), its projections z, x, B, C,
    # dt (ssm_multipliers; None: 1s), its output (ssm_out_multiplier), the attention's input and output
    # (attention_in / out_multiplier), the keys (key_multiplier), the MLP's gate before its activation and its
    # output (mlp_multipliers); the mixer's output norm (models/mamba2.py's NORMS: Falcon-H1's mamba_rms_norm
    # false is "none", its mamba_norm_before_gate "before_gate")
    mamba_in_multiplier: float = 1.0
    mamba_part_multipliers: tuple[float, ...] | None = None
    mamba_out_multiplier: float = 1.0
    mamba_norm: str = "gated"
    # the Mamba (v1) mixers of layer_blocks' mamba1 entries (models/mamba1.py: Mamba, Jamba): their channels
    # (intermediate_size; Jamba's mamba_expand x hidden_size), the time step's rank (time_step_rank,
    # mamba_dt_rank), Jamba's RMSNorms of dt, B and C; the state (ssm_state), the convolution (conv_kernel,
    # mamba_conv_bias) and the projections' biases (mamba_proj_bias) as Mamba2's
    mamba1_inner: int = 0
    mamba1_dt_rank: int = 0
    mamba1_dt_norms: bool = False
    attn_in_multiplier: float = 1.0
    attn_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0

    def __post_init__(self) -> None:
        self._check_blocks()
        if self.score_head not in (None, "sequence", "token"):
            raise ValueError(f"score_head: {self.score_head!r} is not one of sequence, token (or None: the LM head)")
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")
        if isinstance(self.rope_scaling, dict):          # from YAML / JSON: the kind by its fields
            object.__setattr__(self, "rope_scaling", _scaling_from_dict(self.rope_scaling))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types: unknown layer type(s) {bad}; known: {', '.join(LAYER_TYPES)}")
            if len(self.layer_types) != self.layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types marks sliding_attention layers but sliding_window is not set")
            if "chunked_attention" in self.layer_types and self.attention_chunk is None:
                raise ValueError("layer_types marks chunked_attention layers but attention_chunk is not set")
            if gated_deltanet.KIND in self.layer_types:
                gated_deltanet.check_config(self)
            if kimi_delta.KIND in self.layer_types:
                kimi_delta.check_config(self)
        if self.attention_chunk is not None and (isinstance(self.attention_chunk, bool) or not isinstance(
                self.attention_chunk, int) or self.attention_chunk < 1):
            raise ValueError(f"attention_chunk must be a positive integer or null, got {self.attention_chunk!r}")
        if self.attention_chunk is not None and self.sliding_window is not None:
            raise ValueError("attention_chunk with sliding_window is not supported (one kind of local layer)")
        if self.experts_scale_input and self.capacity_factor is not None:
            raise ValueError("experts_scale_input with capacity_factor is not supported: route dropless "
                             "(capacity_factor null)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"mlp_act: {self.mlp_act!r} is not one of {', '.join(MLP_ACTS)}")
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind: {self.norm_kind!r} is not one of {', '.join(NORM_KINDS)}")
        for key in ("moe_layers", "nope_layers"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.nope_layers is not None and not all(0 <= i < self.layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)}: layer indices must be in [0, {self.layers})")
        rot = self.partial_rotary_factor * self.dim_head
        if self.global_head_dim and self.partial_rotary_factor != 1:
            raise ValueError("partial_rotary_factor with global_head_dim is not supported (Gemma 4's full layers "
                             "rotate part of each head through rope_scaling: ProportionalScaling)")
        if not 0 < self.partial_rotary_factor <= 1 or int(rot) % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and rotate an "
                             f"even number of head_dim's {self.dim_head} entries (it rotates {int(rot)})")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("pre_norms=False needs sandwich_norms=True (OLMo 2: norms after attention and the "
                             "MLP); a layer without any norm is not a supported decoder")
        if self.norm_bias and self.norm_kind != "layer":
            raise ValueError("norm_bias=True needs norm_kind='layer' (an RMSNorm has no bias)")
        if self.lm_head_bias and self.tie_embeddings:
            raise ValueError("lm_head_bias=True with tie_embeddings=True is not supported (a tied head has no bias)")
        if self.experts and self.mlp_act not in EXPERT_ACTS:
            raise ValueError(f"mlp_act={self.mlp_act!r} with experts is not supported (the experts' activation: "
                             f"{', '.join(EXPERT_ACTS)})")
        if self.moe_latent and (not self.experts or self.experts_beside_mlp or self.mlp_bias):
            raise ValueError(f"moe_latent={self.moe_latent} needs experts > 0, without experts_beside_mlp or mlp_bias")
        if not self.mlp_gated and self.experts and (self.moe_bias or self.swiglu_limit is not None
                                                    or self.experts_beside_mlp):
            raise ValueError("mlp_gated=False (experts not gated: Nemotron 3) with moe_bias, swiglu_limit or "
                             "experts_beside_mlp is not supported (those options are of gated experts)")
        if self.mlp_act == "xielu" and self.mlp_gated:
            raise ValueError("mlp_act='xielu' needs mlp_gated=False (Apertus: down(xielu(up(x))), the activation's "
                             "two scalars per layer)")
        if (self.moe_bias or self.swiglu_limit is not None) and not self.experts:
            raise ValueError("moe_bias / swiglu_limit are options of the experts (gpt-oss); they need experts > 0")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be a positive number (or null), got {self.swiglu_limit!r}")
        if self.clip_qkv is not None and (isinstance(self.clip_qkv, bool) or not self.clip_qkv > 0):
            raise ValueError(f"clip_qkv must be a positive number (or null: no clamp), got {self.clip_qkv!r}")
        if self.attn_gate and self.kv_lora_rank:
            raise ValueError("attn_gate with latent attention (kv_lora_rank) is not supported")
        if self.q_gate and (self.attn_gate or self.kv_lora_rank):
            raise ValueError("q_gate (the output gate inside q_proj) with attn_gate (its own gate_proj) or latent "
                             "attention (kv_lora_rank) is not supported: choose one gate")
        if self.clip_qkv is not None and self.kv_lora_rank:
            raise ValueError("clip_qkv with latent attention (kv_lora_rank) is not supported")
        for key in ("global_head_dim", "global_kv_heads"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{key} must be a positive integer or null, got {v!r}")
        if (self.global_head_dim or self.global_kv_heads or self.k_eq_v) and self.kv_lora_rank:
            raise ValueError("global_head_dim / global_kv_heads / k_eq_v with latent attention (kv_lora_rank) is "
                             "not supported")
        if self.global_kv_heads is not None and self.heads % self.global_kv_heads:
            raise ValueError(f"global_kv_heads={self.global_kv_heads} must divide heads={self.heads}")
        if self.k_eq_v and (self.qkv_bias or self.clip_qkv is not None):
            raise ValueError("k_eq_v=True with qkv_bias or clip_qkv is not supported (Gemma 4 has neither)")
        if self.qk_norm_after_rotary and not self.qk_norm:
            raise ValueError("qk_norm_after_rotary=True needs qk_norm=True")
        if self.qk_norm_heads and not self.qk_norm:
            raise ValueError("qk_norm_heads=True needs qk_norm=True")
        if self.qk_norm_per_head and (not self.qk_norm or self.qk_norm_heads):
            raise ValueError("qk_norm_per_head=True needs qk_norm=True and qk_norm_heads=False (a weight per head, "
                             "each head normalised over head_dim)")
        if self.experts_beside_mlp and not (self.experts and self.sandwich_norms and self.pre_norms
                                            and self.moe_layers is None and self.mlp_gated):
            raise ValueError("experts_beside_mlp=True (Gemma 4's enable_moe_block) needs experts > 0 in every layer "
                             "(moe_layers null), sandwich_norms, pre_norms and a gated MLP")
        if isinstance(self.per_layer_input, bool) or not isinstance(self.per_layer_input, int) \
                or self.per_layer_input < 0:
            raise ValueError(f"per_layer_input must be a non-negative integer (0: no per-layer inputs), got "
                             f"{self.per_layer_input!r}")
        if self.per_layer_input and (self.parallel_block or self.mlp_act == "xielu"):
            raise ValueError("per_layer_input > 0 (Gemma 4's per-layer input embeddings) with parallel_block or "
                             "mlp_act='xielu' is not supported")
        if isinstance(self.kv_shared_layers, bool) or not isinstance(self.kv_shared_layers, int) \
                or not 0 <= self.kv_shared_layers < max(self.layers, 1):
            raise ValueError(f"kv_shared_layers must be an integer in [0, layers={self.layers}) (the last layers "
                             f"that reuse an earlier layer's keys and values), got {self.kv_shared_layers!r}")
        if self.kv_shared_layers and self.kv_lora_rank:
            raise ValueError("kv_shared_layers with latent attention (kv_lora_rank) is not supported")
        first_shared = self.layers - self.kv_shared_layers
        missing = sorted({self.layer_kind(i) for i in range(first_shared, self.layers)}
                         - {self.layer_kind(i) for i in range(first_shared)}) if self.kv_shared_layers else []
        if missing:
            raise ValueError(f"kv_shared_layers={self.kv_shared_layers}: the shared layers' type(s) {missing} have no "
                             f"earlier layer of that type to take keys and values from (layer_types "
                             f"{list(self.layer_types or [])}); share fewer layers")
        if self.double_wide_mlp and (not self.kv_shared_layers or self.experts):
            raise ValueError("double_wide_mlp=True needs kv_shared_layers > 0 (it widens the shared layers' MLP) "
                             "and no experts")
        if self.parallel_block and (self.sandwich_norms or self.experts):
            raise ValueError("parallel_block=True with sandwich_norms or experts is not supported")
        if self.parallel_mlp_norm and not self.parallel_block:
            raise ValueError("parallel_mlp_norm=True needs parallel_block=True")
        if self.capacity_factor is not None and (isinstance(self.capacity_factor, bool) or not isinstance(
                self.capacity_factor, (int, float)) or self.capacity_factor <= 0):
            raise ValueError(f"capacity_factor must be a positive number (or null: dropless), got "
                             f"{self.capacity_factor!r}")
        if self.token_capacity is not None and (isinstance(self.token_capacity, bool) or not isinstance(
                self.token_capacity, int) or self.token_capacity < 1 or self.capacity_factor is not None):
            raise ValueError(f"token_capacity must be a positive int (or null: no cap) with dropless routing "
                             f"(capacity_factor null), got token_capacity={self.token_capacity!r}, "
                             f"capacity_factor={self.capacity_factor!r}")
        if self.experts and not 1 <= self.experts_top_k <= self.experts:
            raise ValueError(f"experts_top_k={self.experts_top_k} must be between 1 and experts={self.experts}")
        if self.kv_lora_rank:
            mla.check_config(self)
        dsa.check_config(self)
        if self.experts and (self.router_groups < 1 or self.experts % self.router_groups
                             or not 1 <= self.router_topk_groups <= self.router_groups):
            raise ValueError(f"router_groups={self.router_groups} must divide experts={self.experts} and "
                             f"router_topk_groups={self.router_topk_groups} be between 1 and router_groups")
        if self.router_group_score not in ("top2_sum", "max"):
            raise ValueError(f"router_group_score: {self.router_group_score!r} is not one of top2_sum, max")
        for key in ("loss_chunk_bytes", "loss_chunks"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{key} must be a non-negative integer or null, got {v!r}")
        if self.loss_chunk_bytes and self.loss_chunks:
            raise ValueError(f"loss_chunk_bytes={self.loss_chunk_bytes} and loss_chunks={self.loss_chunks}: "
                             f"give one (bytes of fp32 logits per chunk, or the number of chunks)")
        chunked = "loss_chunk_bytes" if self.loss_chunk_bytes else "loss_chunks" if self.loss_chunks else None
        if (self.final_softcap or self.logit_scale != 1 or self.lm_head_bias) and chunked:
            raise ValueError(f"final_softcap with {chunked} (or logit_scale != 1 or lm_head_bias with it): "
                             f"the chunked head loss has no logit soft-capping, scale or bias; set {chunked} "
                             f"to null")
        if not self.causal:
            self._check_bidirectional()

    def _check_bidirectional(self) -> None:
        """Refuse what bidirectional attention (``causal=False``) cannot run: layers that mix tokens
        by a state carried forward (causal by construction), sliding windows and chunks (whose
        non-causal mask no oracle defines)."""
        why = recurrent_layers(self)
        local = [i for i in range(self.layers) if self.window(i) is not None or self.chunk(i) is not None]
        if local:
            why.append(f"sliding-window or chunked attention (layers {local})")
        if why:
            raise ValueError(f"bidirectional attention (causal=False, the diffusion objective) is not supported with "
                             f"{'; '.join(why)}; train this model with the causal objective")

    def _check_blocks(self) -> None:
        """Refuse (naming the field) ``layer_blocks`` / Mamba2 settings this decoder cannot run."""
        parallel = self.layer_blocks is not None and any("|" in b for b in self.layer_blocks)
        unused = [f"{k}={getattr(self, k)}" for k in ("attn_in_multiplier", "attn_out_multiplier", "mamba_out_multiplier")
                  if getattr(self, k) != 1 and not parallel]
        if unused:
            raise ValueError(f"{', '.join(unused)}: these multipliers act in layers of mamba2|attention+mlp blocks "
                             f"(Falcon-H1), which this config has none of; set them to 1")
        if self.experts and (self.mlp_gate_multiplier != 1 or self.mlp_down_multiplier != 1):
            raise ValueError("mlp_gate_multiplier / mlp_down_multiplier with experts is not supported (they scale "
                             "the dense MLP only); set them to 1")
        if self.layer_blocks is None:
            if self.mamba_heads:
                raise ValueError(f"mamba_heads={self.mamba_heads} needs layer_blocks naming the Mamba2 layers "
                                 f"(entries of {', '.join(LAYER_BLOCKS)})")
            return
        blocks = tuple(self.layer_blocks)
        object.__setattr__(self, "layer_blocks", blocks)
        for key in ("mamba_dt_limit", "mamba_part_multipliers"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))
        bad = sorted(set(blocks) - set(LAYER_BLOCKS))
        if bad:
            raise ValueError(f"layer_blocks: unknown entries {bad}; known: {', '.join(LAYER_BLOCKS)}")
        if len(blocks) != self.layers:
            raise ValueError(f"layer_blocks has {len(blocks)} entries for {self.layers} layers")
        if any("mamba2" in b for b in blocks):
            if self.mamba_heads < 1:
                raise ValueError("layer_blocks has mamba2 layers but mamba_heads is 0 (set mamba_num_heads)")
            self.mamba                               # (its own checks: groups dividing the heads, ...)
        if any("mamba1" in b for b in blocks):
            if self.mamba1_inner < 1 or self.mamba1_dt_rank < 1:
                raise ValueError(f"layer_blocks has mamba1 layers but mamba1_inner={self.mamba1_inner}, "
                                 f"mamba1_dt_rank={self.mamba1_dt_rank} (set intermediate_size and time_step_rank)")
            self.mamba1                              # (its own checks)
        other = [k for k, v in (("parallel_block", self.parallel_block),
                                ("sandwich_norms", self.sandwich_norms), ("per_layer_input", self.per_layer_input),
                                ("kv_shared_layers", self.kv_shared_layers), ("kv_lora_rank", self.kv_lora_rank),
                                ("pre_norms=False", not self.pre_norms)) if v]
        if other:
            raise ValueError(f"layer_blocks with {', '.join(other)} is not supported (a hybrid's layers are "
                             f"pre-norm blocks of attention, Mamba2 or a dense MLP)")

    @property
    def mamba(self) -> mamba2.Mamba2 | None:
        """The Mamba2 mixers' shape (None: no Mamba2 layers)."""
        if not self.mamba_heads:
            return None
        return mamba2.Mamba2(heads=self.mamba_heads, head_dim=self.mamba_head_dim, groups=self.mamba_groups,
                             state=self.ssm_state, conv_kernel=self.conv_kernel, chunk=self.mamba_chunk,
                             dt_limit=self.mamba_dt_limit or (0.0, math.inf), eps=self.norm_eps,
                             conv_bias=self.mamba_conv_bias, proj_bias=self.mamba_proj_bias,
                             in_scale=self.mamba_in_multiplier, part_scales=self.mamba_part_multipliers or (1.0,) * 5,
                             norm=self.mamba_norm)

    @property
    def mamba1(self) -> mamba1.Mamba1 | None:
        """The Mamba (v1) mixers' shape (None: no Mamba (v1) layers)."""
        if not self.mamba1_inner:
            return None
        return mamba1.Mamba1(inner=self.mamba1_inner, state=self.ssm_state, dt_rank=self.mamba1_dt_rank,
                             conv_kernel=self.conv_kernel, conv_bias=self.mamba_conv_bias,
                             proj_bias=self.mamba_proj_bias, dt_norms=self.mamba1_dt_norms, eps=self.norm_eps)

    def blocks(self, layer: int) -> tuple[str, ...]:
        """Layer ``layer``'s blocks in order (``("attention", "mlp")`` where ``layer_blocks`` is None)."""
        return tuple((self.layer_blocks[layer] if self.layer_blocks is not None else "attention+mlp").split("+"))

    def rotates(self, layer: int) -> bool:
        """Whether layer ``layer``'s attention applies the rotary (False: a NoPE layer, or learned positions)."""
        return (not self.learned_positions and self.alibi_max is None
                and (self.nope_layers is None or layer not in self.nope_layers))

    @property
    def rotary_dim(self) -> int | None:
        """The rotating entries of head_dim (None: all of them)."""
        return None if self.partial_rotary_factor == 1 else int(self.partial_rotary_factor * self.dim_head)

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of layer ``layer`` (None: no chunking)."""
        if self.attention_chunk is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk
        return None

    def window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` is a full-attention layer of Gemma 4's own widths (no window)."""
        return self.window(layer) is None

    def attn_shape(self, layer: int) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of layer ``layer`` (Gemma 4's full layers: their global ones)."""
        if self.is_global(layer):
            return self.global_kv_heads or self.kv_heads, self.global_head_dim or self.dim_head
        return self.kv_heads, self.dim_head

    def layer_kind(self, layer: int) -> str:
        """Layer ``layer``'s entry of ``layer_types`` (full_attention where there are none)."""
        return self.layer_types[layer] if self.layer_types is not None else "full_attention"

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer ``layer`` attends to when they are shared
        (``kv_shared_layers``, transformers' rule): for the last ``kv_shared_layers`` layers the last
        earlier layer of their type; that layer itself for it; None for the others (their own)."""
        if not self.kv_shared_layers:
            return None
        first = self.layers - self.kv_shared_layers
        kind = self.layer_kind(layer)
        src = max((j for j in range(first) if self.layer_kind(j) == kind), default=None)
        return src if layer >= first or layer == src else None

    def mlp_width(self, layer: int) -> int:
        """The dense MLP's intermediate size in layer ``layer`` (``double_wide_mlp``: twice in the shared layers)."""
        return 2 * self.mlp if self.double_wide_mlp and layer >= self.layers - self.kv_shared_layers else self.mlp

    def v_shared(self, layer: int) -> bool:
        """Whether layer ``layer``'s v is its k projection's output (Gemma 4's attention_k_eq_v, full layers)."""
        return self.k_eq_v and self.is_global(layer)

    @classmethod
    def tiny(cls, **kw) -> "Config":
        """A two-layer model for tests: byte vocabulary, GQA, small widths."""
        base = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, rope_theta=10000.0,
                    rope_scaling=None, norm_eps=1e-5, max_seq=512)
        return cls(**{**base, **kw})

    @classmethod
    def llama3_1b(cls, **kw) -> "Config":
        return cls(**{**dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192,
                             head_dim=64, tie_embeddings=True,
                             rope_scaling=Llama3Scaling(32.0, 1.0, 4.0, 8192), max_seq=131072), **kw})

    @classmethod
    def llama3_8b(cls, **kw) -> "Config":
        return cls(**{**dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336,
                             max_seq=131072), **kw})

    @classmethod
    def llama3_70b(cls, **kw) -> "Config":
        return cls(**{**dict(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, mlp=28672,
                             max_seq=131072), **kw})

    @classmethod
    def presets(cls) -> dict:
        """Preset name -> constructor taking field overrides: Llama 3's, then one or two sizes of
        each other family (their published config.json, as ``base_model`` would read it)."""
        table = {"tiny": cls.tiny, "1b": cls.llama3_1b, "8b": cls.llama3_8b, "70b": cls.llama3_70b}
        for name, fields in FAMILY_PRESETS.items():
            table[name] = functools.partial(_family_preset, cls, fields)
        return table

    @classmethod
    def preset(cls, name: str, **kw) -> "Config":
        table = cls.presets()
        if name not in table:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(table)}")
        return table[name](**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_scaling"] = _scaling_to_dict(self.rope_scaling)
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        for key in ("layer_blocks", "mamba_dt_limit", "mamba_part_multipliers"):
            d[key] = list(getattr(self, key)) if getattr(self, key) is not None else None
        for key in ("moe_layers", "nope_layers"):
            d[key] = list(getattr(self, key)) if getattr(self, key) is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        if isinstance(d.get("vision"), dict):
            d = {**d, "vision": vision_tower(d["vision"]["tower"]).VISION_CONFIG(**d["vision"])}
        if d.get("mrope_section") is not None:
            d = {**d, "mrope_section": tuple(d["mrope_section"])}
        return cls(**d)                              # __post_init__ reads rope_scaling


def _gemma(layers: int, every: int) -> dict:
    """Gemma's switches; every ``every``-th layer global, the others sliding."""
    return dict(mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
                tie_embeddings=True, rope_scaling=None, norm_eps=1e-6,
                layer_types=tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)))


def _deepseek(**kw) -> dict:
    """DeepSeek's latent attention (q/k heads of 128 + 64 rotated interleaved entries) and shared
    experts without a gate, with ``kw`` on top."""
    return dict(dict(qk_nope_head_dim=128, qk_rope_head_dim=64, rotary_interleaved=True, shared_expert_gate=False),
                **kw)


FAMILY_PRESETS: dict[str, dict] = {
    "mistral-7b": dict(model_type="mistral", vocab=32768, hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336,
                       rope_theta=1e6, rope_scaling=None, max_seq=32768),                       # v0.3
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864,
                         qkv_bias=True, tie_embeddings=True, rope_theta=1e6, rope_scaling=None, norm_eps=1e-6,
                         max_seq=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, mlp=18944,
                       qkv_bias=True, rope_theta=1e6, rope_scaling=None, norm_eps=1e-6, max_seq=131072),
    "qwen3-0.6b": dict(model_type="qwen3", vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                       mlp=3072, qk_norm=True, tie_embeddings=True, rope_theta=1e6, rope_scaling=None, norm_eps=1e-6,
                       max_seq=40960),
    "qwen3-8b": dict(model_type="qwen3", vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8,
                     mlp=12288, qk_norm=True, rope_theta=1e6, rope_scaling=None, norm_eps=1e-6, max_seq=40960),
    "phi3-mini": dict(model_type="phi3", vocab=32064, hidden=3072, layers=32, heads=32, kv_heads=32, mlp=8192,
                      rope_theta=10000.0, rope_scaling=None, sliding_window=2047, max_seq=4096),  # 4k-instruct
    "gemma2-2b": dict(model_type="gemma2", vocab=256000, hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256,
                      mlp=9216, query_pre_attn_scalar=256.0, attn_softcap=50.0, final_softcap=30.0,
                      sliding_window=4096, rope_theta=10000.0, max_seq=8192, **_gemma(26, 2)),
    "gemma3-1b": dict(model_type="gemma3_text", vocab=262144, hidden=1152, layers=26, heads=4, kv_heads=1,
                      head_dim=256, mlp=6912, qk_norm=True, query_pre_attn_scalar=256.0, sliding_window=512,
                      rope_theta=1e6, local_rope_theta=10000.0, max_seq=32768, **_gemma(26, 6)),
    "smollm3-3b": dict(model_type="smollm3", vocab=128256, hidden=2048, layers=36, heads=16, kv_heads=4, mlp=11008,
                       tie_embeddings=True, rope_theta=5e6, rope_scaling=None, norm_eps=1e-6, max_seq=65536,
                       nope_layers=tuple(range(3, 36, 4))),
    "granite3-8b": dict(model_type="granite", vocab=49155, hidden=4096, layers=40, heads=32, kv_heads=8, mlp=12800,
                        tie_embeddings=True, rope_theta=1e7, rope_scaling=None, norm_eps=1e-5, max_seq=131072,
                        embedding_multiplier=12.0, residual_multiplier=0.22, query_pre_attn_scalar=16384.0,
                        logit_scale=1 / 16),                                                   # 3.1
    "olmo2-7b": dict(model_type="olmo2", vocab=100352, hidden=4096, layers=32, heads=32, kv_heads=32, mlp=11008,
                     rope_theta=500000.0, rope_scaling=None, norm_eps=1e-6, max_seq=4096, pre_norms=False,
                     sandwich_norms=True, qk_norm=True, qk_norm_heads=True),                   # 1124
    "phi-2": dict(model_type="phi", vocab=51200, hidden=2560, layers=32, heads=32, kv_heads=32, mlp=10240,
                  rope_theta=10000.0, rope_scaling=None, max_seq=2048, partial_rotary_factor=0.4,
                  **dict(parallel_block=True, norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_bias=True,
                         mlp_act="gelu_tanh", lm_head_bias=True, qkv_bias=True, o_bias=True)),
    "pythia-1b": dict(model_type="gpt_neox", vocab=50304, hidden=2048, layers=16, heads=8, kv_heads=8, mlp=8192,
                      rope_theta=10000.0, rope_scaling=None, max_seq=2048, partial_rotary_factor=0.25,
                      **dict(parallel_block=True, parallel_mlp_norm=True, norm_kind="layer", norm_bias=True,
                             mlp_gated=False, mlp_bias=True, mlp_act="gelu", qkv_bias=True, o_bias=True)),
    # DeepSeek's latent attention and experts (their YaRN: the softmax scale times mscale_all_dim's
    # mscale squared, as query_pre_attn_scalar), GLM-4.5-Air, GLM-4.7-Flash
    "deepseek-v3": dict(model_type="deepseek_v3", vocab=129280, hidden=7168, layers=61, heads=128, kv_heads=128,
                        mlp=18432, rope_theta=10000.0, norm_eps=1e-6, max_seq=163840,
                        rope_scaling=YarnScaling(40.0, 4096, 32.0, 1.0, 1.0),
                        query_pre_attn_scalar=192 / (0.1 * math.log(40.0) + 1) ** 4, **_deepseek(
                            kv_lora_rank=512, q_lora_rank=1536, v_head_dim=128, experts=256, experts_top_k=8,
                            moe_mlp=2048, shared_expert_mlp=2048, moe_layers=tuple(range(3, 61)),
                            router_score="sigmoid", router_bias=True, router_groups=8, router_topk_groups=4,
                            norm_topk_prob=True, routed_scaling_factor=2.5)),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab=102400, hidden=2048, layers=27, heads=16, kv_heads=16,
                             mlp=10944, rope_theta=10000.0, norm_eps=1e-6, max_seq=163840,
                             rope_scaling=YarnScaling(40.0, 4096, 32.0, 1.0, 1.0),
                             query_pre_attn_scalar=192 / (0.1 * 0.707 * math.log(40.0) + 1) ** 4, **_deepseek(
                                 kv_lora_rank=512, q_lora_rank=None, v_head_dim=128, experts=64, experts_top_k=6,
                                 moe_mlp=1408, shared_expert_mlp=2816, moe_layers=tuple(range(1, 27)),
                                 router_group_score="max")),
    "glm-4.5-air": dict(model_type="glm4_moe", vocab=151552, hidden=4096, layers=46, heads=96, kv_heads=8, head_dim=128,
                        mlp=10944, rope_theta=1e6, rope_scaling=None, norm_eps=1e-5, max_seq=131072,
                        partial_rotary_factor=0.5, qkv_bias=True, experts=128, experts_top_k=8, moe_mlp=1408,
                        shared_expert_mlp=1408, shared_expert_gate=False, moe_layers=tuple(range(1, 46)),
                        router_score="sigmoid", router_bias=True, norm_topk_prob=True),
    "glm-4.7-flash": dict(model_type="glm4_moe_lite", vocab=154880, hidden=2048, layers=47, heads=20, kv_heads=20,
                          mlp=10240, rope_theta=1e6, rope_scaling=None, norm_eps=1e-5, max_seq=202752, **_deepseek(
                              kv_lora_rank=512, q_lora_rank=768, qk_nope_head_dim=192, v_head_dim=256, experts=64,
                              experts_top_k=4, moe_mlp=1536, shared_expert_mlp=1536, moe_layers=tuple(range(1, 47)),
                              router_score="sigmoid", router_bias=True, norm_topk_prob=True,
                              routed_scaling_factor=1.8)),
}
"""The published sizes of the other families, as presets (``model: {preset: qwen3-8b}``)."""


def _family_preset(cls, fields: dict, **kw) -> Config:
    out = {**fields, **kw}
    if "layers" in kw and "layer_types" not in kw and fields.get("layer_types"):    # fewer layers, same pattern
        every = next(i + 1 for i, t in enumerate(fields["layer_types"]) if t == "full_attention")
        out["layer_types"] = _gemma(kw["layers"], every)["layer_types"]
    if "layers" in kw and "nope_layers" not in kw and fields.get("nope_layers"):    # (SmolLM3's every 4th)
        every = fields["nope_layers"][0] + 1
        out["nope_layers"] = tuple(range(every - 1, kw["layers"], every)) or None
    return cls(**out)


def init(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """Parameter declarations (shapes, dimension names, initializers)."""
    D, std = cfg.dim_head, cfg.init_std
    out_std = std / (2 * cfg.layers) ** 0.5

    def w(shape, dims, s=std):
        return param(shape, dims, init="normal", scale=s, dtype=dtype)

    ones = "zeros" if cfg.norm_offset == 1.0 else "ones"      # the scale (offset + w) starts at 1

    def norm():
        return param((cfg.hidden,), "hidden", init=ones, dtype=dtype)

    def bias(size: int, dims: str):
        return param((size,), dims, init="zeros", dtype=dtype)

    def with_biases(tree: dict) -> dict:        # LayerNorm biases beside their weights (Phi)
        if cfg.norm_bias:
            tree.update({f"{k}_bias": bias(cfg.hidden, "hidden") for k, v in list(tree.items()) if k.endswith("norm")})
        return tree

    def attn(i):
        if cfg.kv_lora_rank:                        # multi-head latent attention (models/mla.py)
            return mla.init_attention(cfg, w, out_std)
        kv_heads, D = cfg.attn_shape(i)             # (Gemma 4's full layers: their own widths)
        a = {
            "q_proj": (w((cfg.hidden, cfg.heads, 2 * D), "hidden heads q_gate") if cfg.q_gate else
                       w((cfg.hidden, cfg.heads, D), "hidden heads head_dim")),
            "k_proj": w((cfg.hidden, kv_heads, D), "hidden kv_heads head_dim"),
            "v_proj": w((cfg.hidden, kv_heads, D), "hidden kv_heads head_dim"),
            # (meta in_dims: the leading dimensions a linear contracts; 1 where not given, docs/adapters.md)
            "o_proj": dataclasses.replace(w((cfg.heads, D, cfg.hidden), "heads head_dim hidden", out_std),
                                          meta={"in_dims": 2}),
        }
        if cfg.qkv_bias:
            a["q_bias"] = param((cfg.heads, D), "heads head_dim", init="zeros", dtype=dtype)
            a["k_bias"] = param((cfg.kv_heads, D), "kv_heads head_dim", init="zeros", dtype=dtype)
            a["v_bias"] = param((cfg.kv_heads, D), "kv_heads head_dim", init="zeros", dtype=dtype)
        if cfg.o_bias:
            a["o_bias"] = param((cfg.hidden,), "hidden", init="zeros", dtype=dtype)
        if cfg.qk_norm and (cfg.qk_norm_heads or cfg.qk_norm_per_head):   # over every head (OLMo 2) or per head
            a["q_norm"] = param((cfg.heads, D), "heads head_dim", init=ones, dtype=dtype)
            a["k_norm"] = param((cfg.kv_heads, D), "kv_heads head_dim", init=ones, dtype=dtype)
        elif cfg.qk_norm:
            a["q_norm"] = param((D,), "head_dim", init=ones, dtype=dtype)
            a["k_norm"] = param((D,), "head_dim", init=ones, dtype=dtype)
        if cfg.attn_sinks:
            a["sinks"] = w((cfg.heads,), "heads")
        if cfg.attn_gate:                           # (AFMoE: the attention's output gate)
            a["gate_proj"] = w((cfg.hidden, cfg.heads, D), "hidden heads head_dim")
        if cfg.v_shared(i):                         # (Gemma 4: v is the k projection's output)
            del a["v_proj"]
        if cfg.kv_source(i) not in (None, i):      # (Gemma 4 E2B / E4B: an earlier layer's k and v)
            for key in ("k_proj", "v_proj", "k_norm", "k_bias", "v_bias"):
                a.pop(key, None)
        return a

    def layer(i):
        width = cfg.mlp_width(i)
        kind = TOKEN_MIXERS.get(cfg.layer_kind(i))     # (layer_types: a token mixer in place of attention)
        mixer = {kind.key: kind.init(cfg, w, out_std, dtype)} if kind is not None else {"self_attn": attn(i)}
        p = {"input_layernorm": norm(), **mixer, "post_attention_layernorm": norm(),
             "mlp": {"gate_proj": w((cfg.hidden, width), "hidden mlp"),
                     "up_proj": w((cfg.hidden, width), "hidden mlp"),
                     "down_proj": w((width, cfg.hidden), "mlp hidden", out_std)}}
        if not cfg.mlp_gated:
            del p["mlp"]["gate_proj"]
        if cfg.mlp_bias:
            p["mlp"].update(up_bias=bias(cfg.mlp, "mlp"), down_bias=bias(cfg.hidden, "hidden"))
            if cfg.mlp_gated:                      # (ERNIE 4.5: the gate's bias too)
                p["mlp"]["gate_bias"] = bias(cfg.mlp, "mlp")
        if cfg.mlp_act == "xielu":                 # its two scalars, at transformers' initial values
            p["mlp"].update({f"act_alpha_{k}": param((), (), init="constant", scale=math.log(math.expm1(a)), dtype=dtype)
                             for k, a in (("p", XIELU_ALPHA_P), ("n", XIELU_ALPHA_N - XIELU_BETA))})
        if moe.is_moe_layer(cfg, i) and cfg.experts_beside_mlp:     # (Gemma 4: beside the dense MLP)
            p["mlp"].update(moe.init_mlp(cfg, w, out_std))
            p.update({k: norm() for k in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                                          "post_feedforward_layernorm_2")})
        elif moe.is_moe_layer(cfg, i):
            p["mlp"] = moe.init_mlp(cfg, w, out_std)
        if cfg.sandwich_norms:
            p["pre_feedforward_layernorm"] = norm()
            p["post_feedforward_layernorm"] = norm()
        if not cfg.pre_norms:                      # OLMo 2: only the norms after each block
            del p["input_layernorm"], p["pre_feedforward_layernorm"]
        if cfg.parallel_block and not cfg.parallel_mlp_norm:      # one input norm for attention and the MLP
            del p["post_attention_layernorm"]
        if cfg.per_layer_input:                    # (Gemma 4 E2B / E4B: models/per_layer_inputs.py)
            p.update(per_layer_inputs.init_layer(cfg, w, norm, out_std))
        if cfg.layer_scalar:                       # (Gemma 4: a fixed scalar of the files, 1 at init)
            p["layer_scalar"] = param((), (), init="ones", dtype=dtype)
        blocks = cfg.blocks(i)
        if blocks != ("attention", "mlp"):         # a hybrid's layer: its blocks, a norm before each
            q = {"input_layernorm": p["input_layernorm"]}
            if "attention" in blocks[0].split("|"):
                q["self_attn"] = p["self_attn"]
            if "mamba2" in blocks[0].split("|"):
                q["mamba"] = mamba2.init(cfg.mamba, cfg.hidden, dtype, std, out_std)
            if blocks[0] == "mamba1":
                q["mamba1"] = mamba1.init(cfg.mamba1, cfg.hidden, dtype, std, out_std)
            if len(blocks) == 2:
                q["post_attention_layernorm"] = p["post_attention_layernorm"]
            if blocks[-1] == "mlp":
                q["mlp"] = p["mlp"]
            p = q
        return with_biases(p)

    layers = [layer(i) for i in range(cfg.layers)]
    tree = with_biases({"embed_tokens": w((cfg.vocab, cfg.hidden), "vocab hidden"), "layers": layers, "norm": norm()})
    if cfg.per_layer_input:                        # (Gemma 4 E2B / E4B: the per-layer input tables)
        tree.update(per_layer_inputs.init_model(cfg, w, param, ones, dtype))
    if cfg.learned_positions:                      # (GPT-2: one row per position, "positions" replicated)
        tree["embed_positions"] = dataclasses.replace(w((cfg.max_seq, cfg.hidden), "positions hidden"),
                                                      meta={"embedding": True})     # (a table, not a linear)
    if cfg.score_head is not None:                  # a score head instead of the LM head (models/score_head.py)
        tree["score"] = w((cfg.hidden, cfg.num_labels), "hidden labels")
        if cfg.score_bias:
            tree["score_bias"] = bias(cfg.num_labels, "labels")
        return tree
    if cfg.vision is not None:                     # (a vision-language model: models/pixtral.py)
        tree.update(vision_tower(cfg.vision.tower).init(cfg.vision, cfg.hidden, dtype, std))
    if not cfg.tie_embeddings:
        tree["lm_head"] = w((cfg.hidden, cfg.vocab), "hidden vocab")
    if cfg.lm_head_bias:
        tree["lm_head_bias"] = bias(cfg.vocab, "vocab")
    return tree


# the model's dimension names, bound once for the ops that need several of them
attend = functools.partial(ops.attention, batch="batch", seq="seq", heads="heads", kv_heads="kv_heads",
                           head_dim="head_dim")
rotate = functools.partial(ops.rotary, head_dim="head_dim")


def vision_tower(name: str):
    """The module of vision tower ``name`` (``init``, ``with_images``, ``VISION_CONFIG``): one entry each."""
    towers = {**{name: pixtral for name in pixtral.VISION_TOWERS}, **{name: qwen_vision for name in qwen_vision.TOWERS},
              **{name: gemma4_vision for name in gemma4_vision.TOWERS},
              **{name: llama4_vision for name in llama4_vision.TOWERS},
              **{name: lfm2_vl for name in lfm2_vl.TOWERS}, **{name: internvl for name in internvl.TOWERS},
              **{name: gemma4_unified for name in gemma4_unified.TOWERS},
              **{name: glm4v_vision for name in glm4v_vision.TOWERS}}
    if name not in towers:
        raise ValueError(f"vision tower {name!r} is not supported; choose one of {sorted(towers)}")
    return towers[name]


def norm(x: Named, weight: Named, cfg: Config, bias: Named | None = None, over: str | None = None) -> Named:
    """RMSNorm (``cfg.norm_kind`` layer: LayerNorm, centred) over the weight's dimensions (all
    of them: OLMo 2's q/k norms span the heads; ``over``: that one only, a weight per head),
    scaled by ``cfg.norm_offset + weight``. With an
    offset (Gemma) 16-bit activations are scaled in float32 and rounded once, as transformers'
    ``(norm(x.float()) * (1 + w.float())).type_as(x)``; Llama's ``w * norm(x).to(dtype)`` otherwise."""
    dims = over or weight.dims
    if bias is not None:                                  # LayerNorm with a bias (Phi)
        return ops.layer_norm(x, weight + cfg.norm_offset if cfg.norm_offset else weight, bias, dim=dims,
                              eps=cfg.norm_eps)
    normalize = ops.layer_norm if cfg.norm_kind == "layer" else ops.rms_norm
    if not cfg.norm_offset:
        return normalize(x, weight, dim=dims, eps=cfg.norm_eps)
    dtype = x.data.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return normalize(x, weight + cfg.norm_offset, dim=dims, eps=cfg.norm_eps)
    wide = normalize(x.astype(torch.float32), dim=dims, eps=cfg.norm_eps)
    return (wide * (weight.astype(torch.float32) + cfg.norm_offset)).astype(dtype)


def norm_at(tree: dict, name: str, x: Named, cfg: Config) -> Named:
    """:func:`norm` of ``x`` by the norm ``tree[name]`` (and its ``<name>_bias``, if any)."""
    return norm(x, tree[name], cfg, tree.get(f"{name}_bias"))


def attention_input(p: dict, x: Named, cfg: Config) -> Named:
    """The attention's input of the residual stream ``x``: normed, the sequence whole."""
    h = norm_at(p, "input_layernorm", x, cfg) if cfg.pre_norms else x
    return ops.rename(h, res_seq="seq")                   # sequence parallelism: all-gather


def attention_block(p: dict, x: Named, pos: Named | None, cfg: Config, segments: Named | None = None,
                    window: int | None = None, chunk: int | None = None,
                    kv: tuple[Named, Named] | None = None, seed: int | None = None,
                    groups: Named | None = None, prefix: Named | None = None) -> Named:
    """The attention branch of a layer (``pos`` None: a NoPE layer, no rotary; ``kv``: the keys
    and values to attend to, :func:`_attention`; ``seed``: its dropout's, None: no dropout;
    ``groups``: ops.attention's bidirectional groups, an image's tokens; ``prefix``: its shared
    context of packed continuations)."""
    return _attention(p, attention_input(p, x, cfg), pos, cfg, segments, window, chunk, kv, seed, groups, prefix)


def _qk_norm(a: dict, role: str, x: Named, cfg: Config) -> Named:
    """The q or k norm (``role``): per head over head_dim (one weight for all, or one per head) or over every head."""
    return norm(x, a[f"{role}_norm"], cfg, over="head_dim" if cfg.qk_norm_per_head else None)


def _prepared(a: dict, role: str, x: Named, pos: Named | None, cfg: Config, window: int | None) -> Named:
    """q, k or v (``role``) from its projection to the attention's input: v's norm (Gemma 4), the
    biases, the q/k norms, the clamp, the rotary (``pos`` None: none), the norms after it, the
    queries' temperature; each step acts on one of them alone."""
    if role == "v" and cfg.v_norm:                        # (Gemma 4: weightless, over head_dim, 16 bits in float32)
        wide = torch.float32 if x.data.dtype in (torch.float16, torch.bfloat16) else x.data.dtype
        x = ops.rms_norm(x.astype(wide), dim="head_dim", eps=cfg.norm_eps).astype(x.data.dtype)
    if cfg.qkv_bias:
        x = x + a[f"{role}_bias"]
    if role == "k" and cfg.key_multiplier != 1:          # (Falcon-H1: the keys times key_multiplier)
        x = x * cfg.key_multiplier
    if role != "v" and cfg.qk_norm and not cfg.qk_norm_after_rotary:     # per head, over head_dim
        x = _qk_norm(a, role, x, cfg)
    if cfg.clip_qkv is not None:       # (DBRX, OLMoE after its q/k norms: each entry clamped, its gradient 0 outside)
        c = cfg.clip_qkv
        x = x.map(lambda t: t.clamp(-c, c))
    if role == "v":
        return x
    if window is not None and cfg.local_rope_theta is not None:      # a local layer's own rope (Gemma 3)
        theta, scaling = cfg.local_rope_theta, None
    else:
        theta, scaling = cfg.rope_theta, cfg.rope_scaling
    if pos is not None:
        sections = (ops.mrope_sections(cfg.mrope_section, cfg.mrope_interleaved, (cfg.rotary_dim or cfg.dim_head) // 2)
                    if cfg.mrope_section is not None and "mrope" in pos.dims else None)
        x = rotate(x, pos, theta=theta, scaling=scaling, rotary_dim=cfg.rotary_dim, interleaved=cfg.rotary_interleaved,
                   sections=sections)
    if cfg.qk_norm_after_rotary:                          # (Hunyuan)
        x = _qk_norm(a, role, x, cfg)
    if cfg.qk_l2_norm and pos is not None:               # (Llama 4: weightless, the rotating layers)
        x = ops.rms_norm(x.astype(torch.float32), dim="head_dim", eps=cfg.norm_eps).astype(x.data.dtype)
    if role == "q" and temperature.applies(cfg, pos):    # (Llama 4's NoPE layers; Ministral 3's every layer)
        x = temperature.scale_queries(x, pos, cfg)
    return x


def keys_values(a: dict, h: Named, pos: Named | None, cfg: Config, window: int | None) -> tuple[Named, Named]:
    """The keys and values (``batch seq kv_heads head_dim``) of the attention ``a`` of normed input
    ``h``, as attention reads them (:func:`_prepared`)."""
    return _prepared_kv(a, _kv_projections(a, h), pos, cfg, window)


def _kv_projections(a: dict, h: Named) -> tuple[Named, Named]:
    k = ops.einsum("batch seq hidden, hidden kv_heads head_dim -> batch seq kv_heads head_dim", h, a["k_proj"])
    v = (ops.einsum("batch seq hidden, hidden kv_heads head_dim -> batch seq kv_heads head_dim", h, a["v_proj"])
         if "v_proj" in a else k)                        # (Gemma 4's k_eq_v layers: v is k's projection)
    return k, v


def _prepared_kv(a: dict, kv: tuple[Named, Named], pos: Named | None, cfg: Config,
                 window: int | None) -> tuple[Named, Named]:
    return _prepared(a, "k", kv[0], pos, cfg, window), _prepared(a, "v", kv[1], pos, cfg, window)


def _attention(p: dict, h: Named, pos: Named | None, cfg: Config, segments: Named | None,
               window: int | None, chunk: int | None = None, kv: tuple[Named, Named] | None = None,
               seed: int | None = None, groups: Named | None = None, prefix: Named | None = None) -> Named:
    """The attention of normed input ``h``; ``kv``: the keys and values to attend to (an earlier
    layer's, ``cfg.kv_shared_layers``) instead of this layer's own; ``seed``: the layer's dropout
    seed (None: no dropout, :mod:`functional_pp.models.dropout_seeds`); ``prefix``: each query's
    shared context (ops.attention's, continuations packed after it)."""
    a = p["self_attn"]
    if cfg.kv_lora_rank:                                  # multi-head latent attention (models/mla.py)
        if prefix is not None:
            raise ValueError("continuations packed after a shared context (attention prefix) with latent attention "
                             "(kv_lora_rank) are not supported")
        if seed is not None and cfg.attention_dropout:
            raise ValueError(f"attention_dropout={cfg.attention_dropout} with latent attention (kv_lora_rank) is "
                             f"not supported; set it to 0.0")
        if groups is not None:
            raise ValueError("bidirectional image groups (image_groups_attend) with latent attention (kv_lora_rank) "
                             "is not supported")
        return mla.attention(a, h, pos, cfg, segments, window)
    if cfg.q_gate:                                        # (Qwen3.5: each head's query, then its gate)
        qg = ops.einsum("batch seq hidden, hidden heads q_gate -> batch seq heads q_gate", h, a["q_proj"])
        D = qg.size("q_gate") // 2
        q, gate = (ops.slice_dim(qg, "q_gate", at, at + D, into="head_dim") for at in (0, D))
    else:
        q = ops.einsum("batch seq hidden, hidden heads head_dim -> batch seq heads head_dim", h, a["q_proj"])
    own = _kv_projections(a, h) if kv is None else None   # (every projection before the elementwise work:
    q = _prepared(a, "q", q, pos, cfg, window)            # a compiler fuses q's and k's rotary as one)
    k, v = _prepared_kv(a, own, pos, cfg, window) if kv is None else kv
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    causal, cache, kv_segments = cfg.causal, kv_cache.active(), None
    if cache is not None:                                 # sampling: the cached keys first (kv_cache.py)
        k, v, causal, segments, kv_segments, window = cache.extend(k, v, segments, window)
    if cfg.alibi_max is not None and cache is not None and cache.capacity is not None:
        raise ValueError("sampling with a static key / value cache (generate(compile=...)) does not support ALiBi "
                         "(MPT's alibi_bias_max) yet: its keys are not the last positions; sample without compile")
    if prefix is not None and cache is not None:
        raise ValueError("sampling with a key / value cache does not take a shared-context prefix (packed "
                         "continuations are scored, not sampled)")
    if groups is not None and cache is not None:
        raise ValueError("sampling with a key / value cache does not support image_groups_attend (an image's tokens "
                         "attending to each other, Gemma 4 unified) yet: give text prompts")
    if chunk is not None and cache is not None:
        raise ValueError(f"sampling with a key / value cache does not support chunked attention yet (this model's "
                         f"layers attend within chunks of {chunk} tokens)")
    extra = {} if seed is None or not cfg.attention_dropout else dict(
        dropout=cfg.attention_dropout, dropout_seed=seed + dropout_seeds.ATTENTION)
    if cfg.alibi_max is not None:                         # (MPT)
        extra["alibi_max"] = cfg.alibi_max
    if groups is not None:                                # (an image's tokens see each other: Gemma 4 unified)
        extra["groups"] = groups
    if prefix is not None:                                # (packed continuations: their shared context)
        extra["prefix"] = prefix
    o = attend(q, k, v, causal=causal, segments=segments, window=window, scale=scale, softcap=cfg.attn_softcap,
               sinks=a.get("sinks"), chunk=chunk, kv_segments=kv_segments, **extra)
    if cfg.attn_gate:                                     # (AFMoE: o times sigmoid(h gate_proj), per entry)
        g = ops.einsum("batch seq hidden, hidden heads head_dim -> batch seq heads head_dim", h, a["gate_proj"])
        o = o * ((ops.tanh(g * 0.5) + 1.0) * 0.5)         # sigmoid(g), exactly as the identity
    if cfg.q_gate:
        o = o * ((ops.tanh(gate * 0.5) + 1.0) * 0.5)
    out = ops.einsum("batch seq heads head_dim, heads head_dim hidden -> batch seq hidden", o, a["o_proj"])
    out = ops.rename(out, seq="res_seq")                  # sequence parallelism: reduce-scatter
    if cfg.o_bias:                                        # (after the TP partial sums are combined)
        out = out + a["o_bias"]
    out = _dropped(out, cfg, seed, dropout_seeds.ATTENTION_OUT)
    return norm_at(p, "post_attention_layernorm", out, cfg) if cfg.sandwich_norms else out


def _dropped(out: Named, cfg: Config, seed: int | None, site: int) -> Named:
    """A branch's output under ``cfg.residual_dropout`` in training (Seed-OSS), the layout-free mask."""
    if seed is None or not cfg.residual_dropout:
        return out
    return ops.dropout(out, cfg.residual_dropout, seed + site)


class TokenMixer(NamedTuple):
    """A layer kind (``layer_types``) whose tokens mix by another op than attention: its parameters
    held under ``key`` in place of ``self_attn`` (HF's name), declared by ``init(cfg, w, out_std,
    dtype)``; ``mix(params, normed input, cfg, segments)`` -> ``batch res_seq hidden``; ``what`` it
    is, for messages. Each keeps a state along the sequence (handed from block to block where the
    sequence is split over cp: ops/sequence_chain.py) that the key / value cache does not hold
    (:func:`recurrent_layers`)."""
    key: str
    init: Callable[..., dict]
    mix: Callable[..., Named]
    what: str


TOKEN_MIXERS: dict[str, TokenMixer] = {
    "conv": TokenMixer("conv", lambda cfg, w, out_std, dtype: short_conv.init(cfg.hidden, cfg.conv_kernel, w, out_std),
                       short_conv.mixer, "LFM2's short convolution"),
    gated_deltanet.KIND: TokenMixer(
        "linear_attn", gated_deltanet.init_layer,
        lambda a, h, cfg, segments: ops.rename(gated_deltanet.mixer(a, h, cfg, segments), seq="res_seq"),
        "Gated DeltaNet"),
    kimi_delta.KIND: TokenMixer(
        "kda", kimi_delta.init_layer,
        lambda a, h, cfg, segments: ops.rename(kimi_delta.mixer(a, h, cfg, segments), seq="res_seq"),
        "Kimi Delta Attention")}
"""``layer_types`` entries -> their :class:`TokenMixer` (models/short_conv.py, models/gated_deltanet.py,
models/kimi_delta.py);
Mamba2 mixers are blocks of ``layer_blocks`` instead (:func:`mamba_block`)."""

_ACTS = {"silu": ops.silu, "gelu_tanh": lambda x: ops.gelu(x, approximate="tanh"), "gelu": ops.gelu,
         "relu2": lambda x: ops.square(ops.relu(x))}             # (Arcee's squared ReLU)
_GATES = {"silu": ops.swiglu, **{k: lambda gate, up, act=act: act(gate) * up for k, act in _ACTS.items() if k != "silu"}}


def mlp_block(p: dict, x: Named, cfg: Config, seed: int | None = None) -> Named:
    # Llama's post_attention_layernorm is the MLP's input norm; with sandwich norms (Gemma 2)
    # that is pre_feedforward_layernorm and post_attention_layernorm normed the attention's output
    h = norm_at(p, "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm", x, cfg) \
        if cfg.pre_norms else x
    beside = ops.rename(x, res_seq="seq") if cfg.experts_beside_mlp else None    # (Gemma 4's router reads x)
    return _mlp(p, ops.rename(h, res_seq="seq"), cfg, beside, seed)


def _mlp(p: dict, h: Named, cfg: Config, x: Named | None = None, seed: int | None = None) -> Named:
    """The MLP branch of normed ``h``; with ``cfg.experts_beside_mlp`` (Gemma 4) plus the experts of
    the residual stream ``x``; ``seed``: the layer's dropout seed (``cfg.residual_dropout``)."""
    m = p["mlp"]
    if "router" in m and not cfg.experts_beside_mlp:      # a mixture of experts (models/moe.py)
        out = ops.rename(moe.mlp_block(m, h, cfg), seq="res_seq")
        return norm_at(p, "post_feedforward_layernorm", out, cfg) if cfg.sandwich_norms else out
    up = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, m["up_proj"])
    if "up_bias" in m:
        up = up + m["up_bias"]
    if cfg.mlp_gated:
        gate = ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", h, m["gate_proj"])
        if "gate_bias" in m:
            gate = gate + m["gate_bias"]
        act = _GATES[cfg.mlp_act](gate if cfg.mlp_gate_multiplier == 1 else gate * cfg.mlp_gate_multiplier, up)
    elif cfg.mlp_act == "xielu":                          # Apertus: its two scalars per layer
        act = ops.xielu(up, m["act_alpha_p"], m["act_alpha_n"], beta=XIELU_BETA, eps=XIELU_EPS)
    else:                                                 # Phi-1/2: down(act(up(x)))
        act = _ACTS[cfg.mlp_act](up)
    out = ops.rename(ops.einsum("batch seq mlp, mlp hidden -> batch seq hidden", act, m["down_proj"]), seq="res_seq")
    if cfg.mlp_down_multiplier != 1:                      # (Falcon-H1)
        out = out * cfg.mlp_down_multiplier
    if "down_bias" in m:                                  # (after the TP partial sums are combined)
        out = out + m["down_bias"]
    out = _dropped(out, cfg, seed, dropout_seeds.MLP_OUT)
    if "router" in m:                                     # (Gemma 4: each output normed, then their sum)
        beside = moe.beside_mlp(m, x, cfg, lambda name, v: norm_at(p, name, v, cfg))
        out = norm_at(p, "post_feedforward_layernorm_1", out, cfg) + beside
    return norm_at(p, "post_feedforward_layernorm", out, cfg) if cfg.sandwich_norms else out


@remat_layer
def layer(p: dict, x: Named, pos: Named | None, cfg: Config, segments: Named | None = None,
          window: int | None = None, chunk: int | None = None, per_layer: Named | None = None,
          kv: tuple[Named, Named] | None = None, seed: int | None = None, groups: Named | None = None,
          prefix: Named | None = None) -> Named:
    """One decoder layer (``window``: its sliding attention window, ``cfg.window(i)``; ``pos``
    None: a NoPE layer; ``per_layer``: its per-layer input, ``cfg.per_layer_input``; ``kv``: the
    keys and values it attends to, ``cfg.kv_source(i)``'s, else its own; ``seed``: its dropout seed,
    ``dropout_seeds.site_seed``, None: none; ``groups``: the attention's bidirectional groups of
    tokens, ``cfg.image_groups_attend``; ``prefix``: each query's shared context, ops.attention's);
    recomputed in backward under ``train_step(remat=True)``. The residual
    stream is computed once per sum in a compiled step (``ops.realized``; docs/compile.md).
    ``cfg.parallel_block``: attention and the MLP read the same normed input (Cohere, Phi), or
    each its own norm of it (``parallel_mlp_norm``: GPT-NeoX)."""
    if "mamba" in p or (cfg.layer_blocks is not None and ("self_attn" not in p or "mlp" not in p)):   # (cfg.layer_blocks)
        return _blocks_layer(p, x, pos, cfg, segments, window, chunk, kv, groups, prefix)
    if cfg.parallel_block:
        h = ops.rename(norm_at(p, "input_layernorm", x, cfg), res_seq="seq")
        h_mlp = ops.rename(norm_at(p, "post_attention_layernorm", x, cfg), res_seq="seq") if cfg.parallel_mlp_norm else h
        return ops.realized(x + _residual(_attention(p, h, pos, cfg, segments, window, chunk, kv, seed, groups,
                                                     prefix) + _mlp(p, h_mlp, cfg, None, seed), cfg))
    x = ops.realized(x + _residual(mixer_block(p, x, pos, cfg, segments, window, chunk, kv, seed, groups, prefix),
                                   cfg))
    x = ops.realized(x + _residual(mlp_block(p, x, cfg, seed), cfg))
    if per_layer is not None:                # (Gemma 4 E2B / E4B: models/per_layer_inputs.py)
        x = ops.realized(x + per_layer_inputs.branch(p, x, per_layer, _ACTS[cfg.mlp_act],
                                                     lambda t, name, v: norm_at(t, name, v, cfg)))
    if cfg.layer_scalar:                     # (Gemma 4: a scalar of the files, not trained: its gradient 0)
        x = x * p["layer_scalar"].map(lambda t: t.detach() + 0 * t)
    return x


def mixer_block(p: dict, x: Named, pos: Named | None, cfg: Config, segments: Named | None = None,
                window: int | None = None, chunk: int | None = None, kv: tuple[Named, Named] | None = None,
                seed: int | None = None, groups: Named | None = None, prefix: Named | None = None) -> Named:
    """The token-mixing branch of a layer: the :data:`TOKEN_MIXERS` entry its parameters hold
    (``layer_types`` chose it at init), else attention; either reads the normed input, its sequence
    whole (sequence parallelism: gathered, then reduce-scattered)."""
    mixer = next((m for m in TOKEN_MIXERS.values() if m.key in p), None)
    if mixer is not None:
        if groups is not None:
            raise ValueError(f"bidirectional image groups (image_groups_attend) with {mixer.what} layers is not "
                             f"supported (their state runs forward only)")
        _refuse_prefix(prefix, mixer.what)
        return mixer.mix(p[mixer.key], attention_input(p, x, cfg), cfg, segments)
    return attention_block(p, x, pos, cfg, segments, window, chunk, kv, seed, groups, prefix)


def _blocks_layer(p: dict, x: Named, pos: Named | None, cfg: Config, segments: Named | None,
                  window: int | None, chunk: int | None, kv: tuple[Named, Named] | None,
                  groups: Named | None = None, prefix: Named | None = None) -> Named:
    """A layer of ``cfg.layer_blocks`` other than attention + MLP: its token mixer (attention,
    Mamba2, or both in parallel from one norm, each times its multipliers) and / or its MLP, each
    after its norm (the first block's ``input_layernorm``), added to the residual stream."""
    if groups is not None and ("mamba" in p or "mamba1" in p):
        raise ValueError("bidirectional image groups (image_groups_attend) with Mamba layers is not supported (their "
                         "state runs forward only)")
    if "mamba" in p or "mamba1" in p:
        _refuse_prefix(prefix, "Mamba")
    if "self_attn" in p and "mamba" in p:      # in parallel from one norm, each times its multipliers (Falcon-H1)
        h = attention_input(p, x, cfg)
        a = _attention(p, h if cfg.attn_in_multiplier == 1 else h * cfg.attn_in_multiplier, pos, cfg, segments,
                       window, chunk, kv, None, None, prefix)
        m = ops.rename(mamba2.mixer(p["mamba"], h, cfg.mamba, segments), seq="res_seq")
        a = a if cfg.attn_out_multiplier == 1 else a * cfg.attn_out_multiplier
        x = ops.realized(x + _residual(a + (m if cfg.mamba_out_multiplier == 1 else m * cfg.mamba_out_multiplier), cfg))
    elif "self_attn" in p:
        x = ops.realized(x + _residual(attention_block(p, x, pos, cfg, segments, window, chunk, kv, None, groups,
                                                       prefix), cfg))
    elif "mamba" in p:
        x = ops.realized(x + _residual(mamba_block(p, x, cfg, segments), cfg))
    elif "mamba1" in p:                         # (Mamba, Jamba: models/mamba1.py)
        h = attention_input(p, x, cfg)
        x = ops.realized(x + _residual(ops.rename(mamba1.mixer(p["mamba1"], h, cfg.mamba1, segments), seq="res_seq"),
                                       cfg))
    if "mlp" in p:
        h = norm_at(p, "post_attention_layernorm" if "post_attention_layernorm" in p else "input_layernorm", x, cfg)
        x = ops.realized(x + _residual(_mlp(p, ops.rename(h, res_seq="seq"), cfg), cfg))
    return x


def _refuse_prefix(prefix: Named | None, what: str) -> None:
    """Refuse a shared-context prefix (continuations packed after their context) on a recurrent layer."""
    if prefix is not None:
        raise ValueError(f"continuations packed after a shared context (attention prefix) with {what} layers are not "
                         f"supported (their state runs through the row in order); score them one row each")


def mamba_block(p: dict, x: Named, cfg: Config, segments: Named | None = None) -> Named:
    """The Mamba2 branch of a layer (models/mamba2.py): the normed residual stream, its sequence
    whole (sequence parallelism gathers it as for attention), through the mixer; ``segments``:
    each packed document's state its own."""
    return ops.rename(mamba2.mixer(p["mamba"], attention_input(p, x, cfg), cfg.mamba, segments), seq="res_seq")


def _residual(branch: Named, cfg: Config) -> Named:
    """A residual branch times Granite's ``residual_multiplier``."""
    return branch if cfg.residual_multiplier == 1 else branch * cfg.residual_multiplier


def hidden_states(params: dict, tokens: Named, cfg: Config, layer_fn=None, segments: Named | None = None,
                  emb: Named | None = None, images: dict | None = None, position_ids: Named | None = None,
                  prefix: Named | None = None) -> Named:
    """The final normed hidden states (batch seq hidden), the LM head's input; ``emb`` the
    embedding to use (:func:`embedding`, passed so a tied one is one value for both uses);
    ``images`` a batch's image entries (``pixtral.image_inputs``), written at the image tokens;
    ``position_ids`` (batch seq) each token's rotary position where it is not its row index,
    ``prefix`` (batch seq, with ``segments``) each query's shared context (ops.attention's):
    continuations packed after the context they share (preference/ebft_layout.py)."""
    layer_fn = layer if layer_fn is None else layer_fn
    pos = ops.positions("seq", tokens.size("seq"), device=tokens.data.device)
    cache = kv_cache.active()
    _refuse_unshared(cfg, cache)
    if position_ids is not None:
        if cache is not None or cfg.learned_positions:
            raise ValueError("position_ids (each token's own position) with " + (
                "a key / value cache (sampling)" if cache is not None else "learned positions (GPT-2's table)")
                + " is not supported")
        pos = ops.transpose(position_ids, "seq", "batch")
    if cache is not None:                                 # sampling: positions after the cached tokens
        pos = cache.start(pos, tokens.size("seq"))
    forward = dropout_seeds.forward_seed(cfg.attention_dropout, cfg.residual_dropout, cache is not None,
                                         cfg.embedding_dropout)
    x = ops.embed(embedding(params, cfg) if emb is None else emb, tokens)
    if cfg.learned_positions:                        # GPT-2: the rows of each token's position
        last = cache.end(tokens.size("seq")) if cache is not None else tokens.size("seq")
        if last > cfg.max_seq:
            raise ValueError(f"learned_positions: position {last - 1} is past the position table's max_seq="
                             f"{cfg.max_seq} rows (max_position_embeddings); shorten the sequence (sequence_len)")
        x = x + ops.embed(params["embed_positions"], pos)
    if cfg.scale_embeddings:        # sqrt(hidden) rounded to the activations' dtype, as transformers
        x = x * torch.tensor(cfg.hidden ** 0.5, dtype=x.data.dtype).item()
    if cfg.embedding_multiplier != 1:                # Granite
        x = x * cfg.embedding_multiplier
    groups = None                                    # (cfg.image_groups_attend: each image's tokens, a group)
    if images is not None:                           # a vision-language model: image features at the image tokens
        if cfg.vision is None:
            raise ValueError("the batch carries images but the model has no vision encoder (Config.vision; a "
                             "text-only checkpoint): give a vision-language base_model or drop the images")
        x = vision_tower(cfg.vision.tower).with_images(params, x, images, cfg.vision)
        groups = image_groups(images, cfg)
        if cfg.mrope_section is not None and "mrope_positions" in images:   # (M-RoPE: the images' 3D positions)
            if cache is not None:
                raise ValueError("sampling with images under the multimodal rotary (mrope_section) is not supported "
                                 "yet: give text prompts")
            pos = ops.transpose(images["mrope_positions"], "seq", "batch", "mrope")
    per_layer = (per_layer_inputs.inputs(params, tokens, x, cfg, lambda v, w: norm(v, w, cfg))
                 if cfg.per_layer_input else None)          # (Gemma 4 E2B / E4B: each layer's own input)
    if forward is not None and cfg.embedding_dropout:
        x = ops.dropout(x, cfg.embedding_dropout, dropout_seeds.site_seed(forward, 0, dropout_seeds.EMBEDDING))
    x = ops.rename(ops.realized(x), seq="res_seq")
    shared: dict[int, tuple[Named, Named]] = {}           # (cfg.kv_shared_layers: the kept keys and values)
    for i, p in enumerate(params["layers"]):
        window, chunk, src = cfg.window(i), cfg.chunk(i), cfg.kv_source(i)
        at = pos if cfg.rotates(i) else None
        if src == i:                 # the keys and values the later layers reuse: made here, passed in as data
            shared[i] = keys_values(p["self_attn"], attention_input(p, x, cfg), at, cfg, window)
        kv = shared[src] if src is not None else None
        extra = [segments, window, chunk, None if per_layer is None else per_layer[i], kv,
                 dropout_seeds.site_seed(forward, i, 0) if forward is not None else None, groups, prefix]
        while extra and extra[-1] is None:           # (the layer's defaults: only the arguments it is given)
            extra.pop()
        x = layer_fn(p, x, at, cfg, *extra)
    x = norm_at(params, "norm", x, cfg)
    if cache is not None:
        cache.finish()
    return ops.rename(x, res_seq="seq")


def layer_states(params: dict, tokens: Named, cfg: Config, layers: list[int] | tuple[int, ...],
                 layer_fn=None, segments: Named | None = None, position_ids: Named | None = None,
                 prefix: Named | None = None) -> list[Named]:
    """The hidden states after each of ``layers`` layers (batch seq hidden), as transformers'
    ``output_hidden_states=True`` gives ``hidden_states[i]``: 0 the embeddings, ``i`` the residual
    stream after layer ``i``, ``n_layers`` the final normed states. Recorded by wrapping the
    layer function (:class:`~functional_pp.models.recording.LayerRecorder`), in one forward
    (``segments``, ``position_ids``, ``prefix``: :func:`hidden_states`'s)."""
    n = len(params["layers"])
    bad = [i for i in layers if not 0 <= i <= n]
    if bad:
        raise ValueError(f"layer_states: layers {bad} are outside 0..{n} (0: the embeddings, {n}: the last "
                         f"layer's normed output); this model has {n} layers")
    rec = recording.LayerRecorder(layer if layer_fn is None else layer_fn)
    last = hidden_states(params, tokens, cfg, rec, segments, position_ids=position_ids, prefix=prefix)
    return [last if i == n else ops.rename(rec.states[i], res_seq="seq") for i in layers]


def image_groups(images: dict, cfg: Config) -> Named | None:
    """The bidirectional groups of a batch with images (``image_groups``: the run of image tokens
    each token is in, -1 elsewhere) where ``cfg.image_groups_attend``; else None."""
    if not cfg.image_groups_attend:
        return None
    if "image_groups" not in images:
        raise ValueError("image_groups_attend (Gemma 4 unified: an image's tokens attend to each other) needs the "
                         "batch's image_groups (data/images.py's image_batch(..., groups=True) makes them)")
    return images["image_groups"]


def _refuse_unshared(cfg: Config, cache) -> None:
    """Refuse what Gemma 4 E2B / E4B's inputs shared between layers cannot run yet: a pipeline (the
    per-layer inputs and shared keys and values would cross its stages) and a key / value cache."""
    what = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("per_layer_input", "kv_shared_layers") if getattr(cfg, k))
    if what and current_stage() is not None:
        raise ValueError(f"pipeline parallelism (pp) with {what} (Gemma 4 E2B / E4B: per-layer inputs and keys / "
                         f"values shared across layers) is not supported yet; use FSDP, TP or CP (pp_size 1)")
    if (cfg.mamba_heads or cfg.mamba1_inner) and cache is not None:
        which = "Mamba2" if cfg.mamba_heads else "Mamba (v1)"
        raise ValueError(f"sampling (generate) with {which} layers is not supported yet: it needs their recurrent "
                         f"state and convolution window cached beside the keys and values")
    if cfg.kv_shared_layers and cache is not None:
        raise ValueError(f"sampling with a key / value cache does not support kv_shared_layers="
                         f"{cfg.kv_shared_layers} (keys and values shared across layers) yet")


def embedding(params: dict, cfg: Config) -> Named:
    """The embedding table, marked tied when it is also the LM head."""
    return tied(params["embed_tokens"]) if cfg.tie_embeddings else params["embed_tokens"]


def _trunk_and_head(params: dict, tokens: Named, cfg: Config, layer_fn, segments,
                    images: dict | None = None, **layout: Named | None) -> tuple[Named, Named]:
    emb = embedding(params, cfg)
    x = hidden_states(params, tokens, cfg, layer_fn, segments, emb, images, **layout)
    return x, (emb if cfg.tie_embeddings else params["lm_head"])


def forward(params: dict, tokens: Named, cfg: Config, layer_fn=None, segments: Named | None = None,
            images: dict | None = None, position_ids: Named | None = None, prefix: Named | None = None) -> Named:
    """Logits (batch seq vocab) for integer ``tokens`` (batch seq); ``segments`` (batch seq,
    document ids of packed rows) keeps attention inside each document; ``images`` (a
    vision-language model) the batch's image entries (``pixtral.image_inputs``);
    ``position_ids`` and ``prefix``: :func:`hidden_states`'s."""
    x, head = fake_quant.head_pair(*_trunk_and_head(params, tokens, cfg, layer_fn, segments, images,
                                                    position_ids=position_ids, prefix=prefix))
    return _capped(ops.einsum("batch seq hidden, hidden vocab -> batch seq vocab", x, head), cfg, params)


def _capped(logits: Named, cfg: Config, params: dict) -> Named:
    """The logits plus the LM head's bias (Phi), times ``cfg.logit_scale`` (Granite, Cohere), then
    Gemma 2's final soft-capping, ``c * tanh(logits / c)``."""
    if cfg.lm_head_bias:
        logits = logits + params["lm_head_bias"]
    if cfg.logit_scale != 1:
        logits = logits * cfg.logit_scale
    c = cfg.final_softcap
    return logits if not c else ops.tanh(logits * (1.0 / c)) * c


def loss(params: dict, batch: dict, cfg: Config, layer_fn=None) -> Named:
    """Mean next-token cross-entropy; ``batch`` holds named ``tokens`` and ``labels`` (and
    ``segments`` for packed documents). With ``cfg.loss_chunk_bytes`` or ``cfg.loss_chunks``
    the head and the loss run over chunks of tokens (``ops.linear_cross_entropy``), no full logits."""
    with moe.collect() if cfg.experts else contextlib.nullcontext([]) as stats:
        x, head = _trunk_and_head(params, batch["tokens"], cfg, layer_fn, batch.get("segments"),
                                  pixtral.image_inputs(batch))
    x, head = fake_quant.head_pair(x, head)         # (under QAT: the head is a linear too)
    if not (cfg.loss_chunk_bytes or cfg.loss_chunks):
        logits = ops.einsum("batch seq hidden, hidden vocab -> batch seq vocab", x, head)
        out = ops.cross_entropy(_capped(logits, cfg, params), batch["labels"])
    else:
        out = ops.linear_cross_entropy(x, head, batch["labels"], chunk_bytes=cfg.loss_chunk_bytes,
                                       chunks=cfg.loss_chunks)
    extra = moe.router_losses(stats, cfg)       # the load-balancing loss (Switch, Mixtral), the z-loss
    return out if extra is None else out + extra


def default_rules(tp: bool = True, fsdp: bool = True, sequence_parallel: bool = False):
    """Rules for Accelerate-style meshes: batch over dp_replicate x dp_shard, seq over cp
    (load-balanced for causal attention; the residual stream's res_seq inherits it),
    heads/kv_heads/mlp/vocab (and Mamba2's heads) over tp, FSDP over dp_shard x cp along hidden."""
    from functional_pp.core.layout import Rules, balanced, inherit
    rules = dict(batch=("dp_replicate", "dp_shard"), seq=balanced("cp"), res_seq=inherit("seq"))
    if tp:
        rules.update(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", conv="tp", conv_gates=None, conv_kernel=None,
                     ssm_group_heads="tp", ssm_groups=None, mamba_inner="tp")   # (Mamba2: each group's heads, whatever n_groups, even 1;
                                                              # ssm_groups="tp" where it divides)
    if fsdp:
        rules["hidden"] = ("dp_shard", "cp")
    if sequence_parallel:
        rules["res_seq"] = inherit("seq", "tp")
    return Rules(rules).as_defaults()     # (names of many models: never questioned by Rules.check_used)


def flops_per_token(cfg: Config, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), attention included."""
    D = cfg.dim_head
    proj = 2 * cfg.hidden * (cfg.heads * D + 2 * cfg.kv_heads * D + cfg.heads * D * (2 if cfg.attn_gate or cfg.q_gate
                                                                                        else 1))
    attn = 2 * 2 * seq * cfg.heads * D / 2      # causal: half of QK^T and AV

    def mlp(i: int) -> float:                   # a MoE layer: the router and the top-k active experts
        dense = 2 * (3 if cfg.mlp_gated else 2) * cfg.hidden * cfg.mlp_width(i)
        if not moe.is_moe_layer(cfg, i):
            return dense
        mats = 3 if cfg.mlp_gated else 2
        width = cfg.moe_latent or cfg.hidden      # (the routed experts' input width; latent: its two projections)
        return (dense * cfg.experts_beside_mlp + 2 * cfg.hidden * (cfg.experts + mats * cfg.shared_expert_mlp
                                                                    + (1 if cfg.shared_expert_mlp and cfg.shared_expert_gate else 0))
                + 2 * mats * width * cfg.experts_top_k * (cfg.moe_mlp or cfg.mlp)
                + (2 * 2 * cfg.hidden * cfg.moe_latent if cfg.moe_latent else 0))
    if cfg.kv_lora_rank:                        # latent attention: its projections, its head widths
        proj = mla.projection_flops(cfg)
        attn = 2 * seq * cfg.heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
    # Gemma 4 E2B / E4B's per-layer inputs: the projection of the embedding, each layer's gate and projection
    ple = 6 * cfg.hidden * cfg.per_layer_input * cfg.layers
    if cfg.layer_blocks is not None:            # a hybrid: each layer's blocks (Mamba2's: models/mamba2.py)
        block = {"attention": lambda i: proj + attn, "mlp": mlp,
                 "mamba2": lambda i: mamba2.flops_per_token(cfg.mamba, cfg.hidden),
                 "mamba1": lambda i: mamba1.flops_per_token(cfg.mamba1, cfg.hidden)}
        return 3.0 * (sum(block[k](i) for i in range(cfg.layers) for b in cfg.blocks(i) for k in b.split("|"))
                      + 2 * cfg.hidden * cfg.vocab + ple)
    if cfg.global_head_dim or cfg.global_kv_heads or cfg.k_eq_v or cfg.kv_shared_layers:   # (Gemma 4's own widths)
        def proj_attn(i: int) -> float:
            kv, d = cfg.attn_shape(i)
            own = 0 if cfg.kv_source(i) not in (None, i) else 1 if cfg.v_shared(i) else 2    # (shared: no k/v)
            return 2 * cfg.hidden * (2 * cfg.heads * d + own * kv * d) + 2 * 2 * seq * cfg.heads * d / 2
        return 3.0 * (sum(proj_attn(i) + mlp(i) for i in range(cfg.layers)) + 2 * cfg.hidden * cfg.vocab + ple)
    def mixer(i: int) -> float:                 # the token mixer: LFM2's short convolution (in_proj, the kernel,
        if cfg.layer_kind(i) == "conv":         # out_proj), Gated DeltaNet, or attention
            return 2 * cfg.hidden * (4 * cfg.hidden + cfg.conv_kernel)
        if cfg.layer_kind(i) == gated_deltanet.KIND:
            return gated_deltanet.flops(cfg, seq)
        if cfg.layer_kind(i) == kimi_delta.KIND:
            return kimi_delta.flops(cfg, seq)
        return proj + attn
    fwd = sum(mixer(i) + mlp(i) for i in range(cfg.layers)) + 2 * cfg.hidden * cfg.vocab + ple
    return 3.0 * fwd


def pipeline_ends(cfg: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The parameters only the first pipeline stage holds (the embedding) and only the last
    (final norm and LM head; a tied embedding is in both, so every stage holds it); GPT-2's table
    of positions is the first stage's too."""
    last = ("norm", "embed_tokens" if cfg.tie_embeddings else "lm_head")
    return ("embed_tokens",) + (("embed_positions",) if cfg.learned_positions else ()) + (
        per_layer_inputs.MODEL_PARAMS if cfg.per_layer_input else ()), last + (("norm_bias",) if cfg.norm_bias else ()) + (
        ("lm_head_bias",) if cfg.lm_head_bias else ())


def serial_under_cp(cfg: Config) -> str | None:
    """The layers that are a recurrence or a convolution along the sequence (:func:`recurrent_layers`),
    whose blocks run device after device under context parallelism (ops/sequence_chain.py); None where
    every layer is attention."""
    why = recurrent_layers(cfg)
    return f"{'; '.join(why)}: a recurrence along the sequence" if why else None


#: the layer kinds (``layer_types``) whose state the key / value cache does not hold, and what they are


def recurrent_layers(cfg: Config) -> list[str]:
    """The layers that mix tokens by a state carried along the sequence (``layer_types``'
    :data:`TOKEN_MIXERS`, ``layer_blocks``' Mamba2 mixers), one phrase per kind: a state the key /
    value cache does not hold, handed from block to block where the sequence is split (context
    parallelism)."""
    why = []
    for kind, mixer in TOKEN_MIXERS.items():
        layers = [i for i in range(cfg.layers) if cfg.layer_kind(i) == kind]
        if layers:
            why.append(f"layers {layers} are {kind} ({mixer.what})")
    scans = [i for i in range(cfg.layers) if any("mamba2" in b for b in cfg.blocks(i))]
    if scans:
        why.append(f"layers {scans} hold Mamba2 mixers (layer_blocks)")
    scans = [i for i in range(cfg.layers) if cfg.blocks(i)[0] == "mamba1"]
    if scans:
        why.append(f"layers {scans} hold Mamba (v1) mixers (layer_blocks)")
    return why


def uncached_layers(cfg: Config) -> str | None:
    """Why the model cannot sample with a key / value cache (generation, GRPO's rollouts): the
    layers whose kind keeps a state the cache does not hold (:data:`TOKEN_MIXERS`), or keys and
    values shared across layers (``kv_shared_layers``); None where every layer can use it."""
    why = recurrent_layers(cfg)
    if cfg.kv_shared_layers:
        why.append(f"kv_shared_layers={cfg.kv_shared_layers} (keys and values shared across layers)")
    return "; ".join(why) or None


def prefix_refusal(cfg: Config) -> str | None:
    """Why the model cannot score continuations packed after their shared context (attention's
    ``prefix`` with ``position_ids``: EBFT's block-parallel rows): recurrent layers (their state
    runs through the row in order), masks measured in row indices (sliding windows, chunks,
    ALiBi), latent attention, learned absolute positions; None where it can."""
    why = recurrent_layers(cfg)
    for what, layers in (("sliding-window attention", [i for i in range(cfg.layers) if cfg.window(i)]),
                         ("chunked attention", [i for i in range(cfg.layers) if cfg.chunk(i)])):
        if layers:
            why.append(f"layers {layers} have {what} (it measures row indices, not positions)")
    for field, what in (("alibi_max", "ALiBi"), ("kv_lora_rank", "latent attention"),
                        ("learned_positions", "learned absolute positions")):
        if getattr(cfg, field):
            why.append(f"{field}={getattr(cfg, field)} ({what})")
    return "; ".join(why) or None


def activations(cfg: Config, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
    """The residual stream's layouts (global sizes) that must split evenly on the mesh: the
    sequence gathered for attention and the MLP, and split again (sequence parallelism)."""
    return {"batch seq hidden": (batch, seq, cfg.hidden), "batch res_seq hidden": (batch, seq, cfg.hidden)}
