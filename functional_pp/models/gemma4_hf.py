"""Gemma 4's text decoder (``gemma4_text``: ``Gemma4ForCausalLM``; and the text decoder of the
multimodal ``gemma4``, ``Gemma4ForConditionalGeneration``, whose ``text_config`` it reads) as a
configuration of the one decoder (docs/models.md, "Decoder families"): Gemma 3's layer (tanh-GELU
GLU, sandwich norms, q/k norms, 5 sliding layers to 1 full, a rope per layer type, a scaled
embedding, tied embeddings) with Gemma 4's switches: norms that scale by ``w`` (not ``1 + w``),
a weightless RMSNorm of v (``v_norm``), no softmax scale (``query_pre_attn_scalar`` 1), the full
layers' own head width and k/v heads (``global_head_dim``, ``global_kv_heads``; transformers'
``per_layer_config``) with v their k projection's output (``k_eq_v``: ``attention_k_eq_v``) and
proportional rope (``ProportionalScaling``), each layer's output times a scalar of the files
(``layer_scalar``), the final logits soft-capped.

``config.json`` <-> :class:`~functional_pp.models.llama.Config` (:func:`config_from_hf`,
:func:`config_to_hf`, :func:`check_exportable`). Gemma 4 E2B / E4B's per-layer input embeddings
(``hidden_size_per_layer_input``) are ``Config.per_layer_input`` (models/per_layer_inputs.py; their
table's rows the vocabulary's: ``vocab_size_per_layer_input`` = ``vocab_size``). Their keys and values shared
across layers (``num_kv_shared_layers``) are ``Config.kv_shared_layers`` (``Config.kv_source``), the
shared layers' double-wide MLP ``Config.double_wide_mlp``. Refused by name: bidirectional attention,
attention biases and dropout. The experts beside the dense MLP (``enable_moe_block``: 26B-A4B) are
``Config.experts_beside_mlp`` (models/moe.py's ``beside_mlp``): the router ``router.proj`` with its
``router.scale`` and ``router.per_expert_scale``, the experts' ``experts.gate_up_proj`` (gate, then up,
along its rows) and ``experts.down_proj``, one tensor each for all the experts (:data:`RENAMED`,
:data:`FUSED`, :data:`KINDS`)."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.models import qwen3_5_hf
from functional_pp.models.llama import Config
from functional_pp.ops.rotary import ProportionalScaling

__all__ = ["ARCHITECTURES", "DEFAULTS", "config_from_hf", "config_to_hf", "check_exportable", "RENAMED",
           "IGNORED", "FIXED", "export_config", "FUSED", "KINDS"]

ARCHITECTURES: dict[str, str] = {"gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration",
                                 "gemma4_unified": "Gemma4UnifiedForConditionalGeneration"}
MULTIMODAL = ("gemma4", "gemma4_unified")
"""The multimodal ``model_type`` values whose ``text_config`` is the decoder (``model.language_model.``)."""

_MOE_NAMES = ((r"\.mlp\.gate\.weight$", ".router.proj.weight"),
              (r"\.mlp\.experts\.down_proj\.weight$", ".experts.down_proj"), (r"\.mlp\.experts\.", ".experts."))
RENAMED: dict[str, tuple[tuple[str, str], ...]] = {"gemma4_text": _MOE_NAMES,
                                                   **{mt: _MOE_NAMES + ((r"^model\.", "model.language_model."),)
                                                      for mt in MULTIMODAL}}
"""The experts' names in 26B-A4B's files (the router under ``router.``, the experts under
``experts.``, not ``mlp.``); the multimodal checkpoint's text decoder lives under ``model.language_model.``."""

FUSED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    mt: ((f"{pre}.layers.{{i}}.experts.gate_up_proj",
          (f"{pre}.layers.{{i}}.experts.gate_proj.weight", f"{pre}.layers.{{i}}.experts.up_proj.weight")),)
    for mt, pre in (("gemma4_text", "model"), *((mt, "model.language_model") for mt in MULTIMODAL))}
"""The experts' gate and up projections, one tensor ``[E, 2F, H]`` (gate, then up, along its rows)."""

KINDS: dict[str, str] = {"mlp.gate": "experts_tensor", "mlp.up": "experts_tensor", "mlp.down": "experts_tensor"}
"""The experts' tensors: ``[E, out, in]``, one tensor for all the experts."""

IGNORED: dict[str, tuple[str, ...]] = {
    mt: (r"model\.(vision_tower|audio_tower|embed_vision|embed_audio|vision_embedder)\..*",) for mt in MULTIMODAL}
"""The tensors of the multimodal checkpoint that the text decoder does not read (its encoders)."""

DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0,
    sliding_window=512, final_logit_softcapping=None, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512)
"""``Gemma4TextConfig``'s defaults of the keys read here."""

UNIFIED_DEFAULTS: dict[str, Any] = dict(max_position_embeddings=262_144, sliding_window=1024,
                                        hidden_size_per_layer_input=0)
"""``Gemma4UnifiedTextConfig``'s defaults where they differ (it has no per-layer inputs)."""

_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

FIXED: dict[str, Any] = dict(mlp_act="gelu_tanh", norm_offset=0.0, scale_embeddings=True, sandwich_norms=True,
                             qk_norm=True, v_norm=True, query_pre_attn_scalar=1.0, layer_scalar=True,
                             attn_softcap=None)
"""The fields ``Gemma4ForCausalLM`` has one value of."""


def _refuse(where: str, what: str) -> None:
    raise ValueError(f"{where}: {what}")


def text_config(hf: dict) -> dict:
    """The ``gemma4_text`` config.json of a multimodal ``gemma4`` one (its ``text_config``)."""
    text = dict(hf.get("text_config") or {})
    for key in ("tie_word_embeddings",):          # (kept at the top level by some files)
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def config_from_hf(hf: dict, mt: str) -> Config:
    """``Config`` of a ``gemma4_text`` ``config.json`` (``gemma4``: of its ``text_config``);
    a ValueError names what the functional decoder does not do."""
    where = f"HF {mt} config"
    if mt in MULTIMODAL:
        hf = text_config(hf)

    defaults = {**DEFAULTS, **UNIFIED_DEFAULTS} if mt == "gemma4_unified" else DEFAULTS

    def get(key: str) -> Any:
        v = hf.get(key)
        return defaults.get(key) if v is None else v
    layers = int(get("num_hidden_layers"))
    ple = int(hf.get("hidden_size_per_layer_input", defaults["hidden_size_per_layer_input"]) or 0)
    pl_vocab = hf.get("vocab_size_per_layer_input")
    if ple and pl_vocab is not None and int(pl_vocab) != int(get("vocab_size")):
        _refuse(where, f"vocab_size_per_layer_input={pl_vocab} is not supported: the per-layer embedding's rows must "
                       f"be the vocabulary's (vocab_size={get('vocab_size')})")
    shared = int(get("num_kv_shared_layers"))
    if not 0 <= shared < layers:
        _refuse(where, f"num_kv_shared_layers={shared} is not supported: the layers sharing keys and values must be "
                       f"fewer than num_hidden_layers={layers} (at least one layer makes them)")
    moe = _experts(hf, get, where) if get("enable_moe_block") else {}
    # (Gemma4UnifiedTextConfig's default is "vision": an image's tokens attend to each other, in every layer)
    bidirectional = hf.get("use_bidirectional_attention", "vision" if mt == "gemma4_unified" else None)
    if bidirectional and (bidirectional != "vision" or mt != "gemma4_unified"):
        _refuse(where, f"use_bidirectional_attention={bidirectional!r} is not supported (causal attention only, "
                       f"but for gemma4_unified's 'vision': an image's tokens attending to each other)")
    if mt == "gemma4_unified" and (ple or get("enable_moe_block") or shared):
        _refuse(where, "hidden_size_per_layer_input, enable_moe_block and num_kv_shared_layers are not "
                       "Gemma4UnifiedTextConfig keys: give 0 / false")
    if get("attention_bias"):
        _refuse(where, "attention_bias=True is not supported (Gemma 4 has no attention biases)")
    if float(get("attention_dropout") or 0.0):
        _refuse(where, f"attention_dropout={hf['attention_dropout']!r} is not supported (set it to 0.0)")
    if get("hidden_activation") != "gelu_pytorch_tanh":
        _refuse(where, f"hidden_activation={get('hidden_activation')!r} is not supported (only "
                       f"'gelu_pytorch_tanh')")
    types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(layers)])
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        _refuse(where, f"layer_types {types} must be {layers} entries of sliding_attention / full_attention")
    types[-1] = "full_attention"                 # (as transformers: the last layer is always full)
    rope = hf.get("rope_parameters") or _ROPE
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        _refuse(where, f"rope type {local.get('rope_type')!r} of the sliding layers is not supported (only 'default')")
    kind = full.get("rope_type", "default")
    if kind == "proportional":
        scaling = ProportionalScaling(float(full.get("partial_rotary_factor", 1.0)), float(full.get("factor", 1.0)))
    elif kind == "default":
        scaling = None
    else:
        _refuse(where, f"rope type {kind!r} of the full layers is not supported (only 'proportional' and 'default')")
    head_dim, kv_heads = int(get("head_dim")), int(get("num_key_value_heads"))
    k_eq_v = bool(get("attention_k_eq_v"))
    full_layers = [i for i, t in enumerate(types) if t == "full_attention"]
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:                     # (transformers 5.25 writes the full layers' widths so)
        per_layer = {int(k): v for k, v in per_layer.items()}
        if sorted(per_layer) != full_layers:
            _refuse(where, f"per_layer_config names layers {sorted(per_layer)}; only the full layers {full_layers} "
                           f"may have their own widths")
        shapes = {(int(v.get("head_dim", head_dim)), int(v.get("num_key_value_heads", kv_heads)))
                  for v in per_layer.values()}
        if len(shapes) != 1:
            _refuse(where, f"per_layer_config gives the full layers different widths {sorted(shapes)}")
        global_dim, global_kv = shapes.pop() if shapes else (head_dim, kv_heads)
    else:
        global_dim = int(get("global_head_dim"))
        g = hf.get("num_global_key_value_heads")
        global_kv = int(g) if g is not None and k_eq_v else kv_heads
    window = get("sliding_window")
    cap = get("final_logit_softcapping")
    return Config(
        model_type=mt, vocab=int(get("vocab_size")), hidden=int(get("hidden_size")), layers=layers,
        heads=int(get("num_attention_heads")), kv_heads=kv_heads, mlp=int(get("intermediate_size")),
        head_dim=head_dim, rope_theta=float(full.get("rope_theta", 1_000_000.0)), rope_scaling=scaling,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)), norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
        max_seq=int(get("max_position_embeddings")),
        sliding_window=None if window is None or "sliding_attention" not in types else int(window),
        layer_types=tuple(types) if window is not None and "sliding_attention" in types else None,
        final_softcap=None if cap is None else float(cap), global_head_dim=global_dim,
        global_kv_heads=global_kv, k_eq_v=k_eq_v, per_layer_input=ple, kv_shared_layers=shared,
        double_wide_mlp=bool(get("use_double_wide_mlp")) and shared > 0, image_groups_attend=bool(bidirectional),
        **moe, **FIXED)


def _experts(hf: dict, get, where: str) -> dict[str, Any]:
    """The ``Config`` fields of 26B-A4B's experts beside the MLP (``enable_moe_block``)."""
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(k)]
    if missing:
        _refuse(where, f"enable_moe_block=True needs {', '.join(missing)} (the experts' number, each token's top-k "
                       f"and their intermediate size)")
    return dict(experts=int(hf["num_experts"]), experts_top_k=int(hf["top_k_experts"]),
                moe_mlp=int(hf["moe_intermediate_size"]), norm_topk_prob=True, experts_beside_mlp=True)


def export_config(cfg: Config) -> Config:
    """The config export writes: a multimodal ``gemma4``'s text decoder as ``gemma4_text``
    (``Gemma4ForCausalLM``), a multimodal Gemma 3's or Mistral 3's (``Config.text_of``) as its text
    family's class (the vision and audio encoders are not trained or written here); one read with its
    vision side (``Config.vision``: Mistral 3, Pixtral 12B, LLaVA, Qwen3.5, Qwen2-VL) as its multimodal class."""
    import dataclasses
    if cfg.text_of is not None and cfg.vision is None:    # (Gemma 3, Mistral 3: their text decoder's own class;
        cfg = dataclasses.replace(cfg, text_of=None)       # with its vision side: the multimodal class)
    if cfg.vision is not None:                              # (Qwen3.5 with its tower: its multimodal class)
        return cfg
    text = {"gemma4": "gemma4_text", "gemma4_unified": "gemma4_text",
            **qwen3_5_hf.TEXT_TYPES}.get(cfg.model_type)    # (and the multimodal Qwen3.5's)
    return dataclasses.replace(cfg, model_type=text, image_groups_attend=False) if text else cfg


def check_exportable(cfg: Config, plain: dict[str, Any], error: type = ValueError) -> None:
    """Refuse (``error``, naming the field) a config ``Gemma4ForCausalLM`` cannot hold; ``plain``:
    the switches' values in Llama."""
    where, arch = f"export as {cfg.model_type!r}", ARCHITECTURES["gemma4_text"]
    if cfg.model_type == "gemma4_unified":
        arch = ARCHITECTURES["gemma4_unified"]
        for key in ("per_layer_input", "kv_shared_layers", "experts"):
            if getattr(cfg, key):
                raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs 0); choose "
                            f"model_type gemma4")
    need = {**plain, **FIXED, "qkv_bias": False, "o_bias": False, "kv_lora_rank": 0, "tie_embeddings": True}
    if cfg.experts_beside_mlp:                    # (26B-A4B: its routing, nothing else of the MoE options)
        need.update(norm_topk_prob=True, router_score="softmax", shared_expert_mlp=0, moe_layers=None,
                    router_aux_loss_coef=0.0, router_z_loss_coef=0.0, capacity_factor=None, router_groups=1,
                    router_bias=False, routed_scaling_factor=1.0, moe_bias=False, swiglu_limit=None,
                    experts_scale_input=False)
    else:
        need["experts"] = 0
    for key in ("local_rope_theta", "final_softcap", "partial_rotary_factor"):
        need.pop(key, None)
    need["partial_rotary_factor"] = 1.0
    for key, want in need.items():
        if getattr(cfg, key) != want:
            raise error(f"{where}: {key}={getattr(cfg, key)!r} has no {arch} equivalent (it needs {want!r}); "
                        f"choose another model_type")
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, ProportionalScaling):
        raise error(f"{where}: rope_scaling {type(cfg.rope_scaling).__name__} has no {arch} equivalent (only "
                    f"proportional rope, or none)")
    if cfg.sliding_window is not None and (cfg.layer_types is None or cfg.layer_types[-1] != "full_attention"):
        raise error(f"{where}: layer_types {cfg.layer_types} has no {arch} equivalent (its last layer is "
                    f"always full_attention)")


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """The ``Gemma4ForCausalLM`` ``config.json`` of ``cfg`` (checked by :func:`check_exportable` before)."""
    dname = str(dtype).removeprefix("torch.")
    types = [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if isinstance(cfg.rope_scaling, ProportionalScaling):
        full.update(rope_type="proportional", partial_rotary_factor=cfg.rope_scaling.partial_rotary_factor)
        if cfg.rope_scaling.factor != 1.0:
            full["factor"] = cfg.rope_scaling.factor
    local = {"rope_type": "default", "rope_theta": float(cfg.local_rope_theta or cfg.rope_theta)}
    kv, dim = cfg.attn_shape(cfg.layers - 1)
    return {
        "architectures": [ARCHITECTURES["gemma4_text"]], "model_type": "gemma4_text", "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.max_seq,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
        "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "sliding_window": cfg.sliding_window or cfg.max_seq, "layer_types": types,
        "final_logit_softcapping": cfg.final_softcap, "use_bidirectional_attention": None,
        "hidden_size_per_layer_input": cfg.per_layer_input,
        "vocab_size_per_layer_input": cfg.vocab, "attention_k_eq_v": cfg.k_eq_v, "num_kv_shared_layers": cfg.kv_shared_layers,
        "enable_moe_block": bool(cfg.experts_beside_mlp), "use_double_wide_mlp": cfg.double_wide_mlp,
        "num_experts": cfg.experts or None, "top_k_experts": cfg.experts_top_k if cfg.experts else None,
        "moe_intermediate_size": (cfg.moe_mlp or cfg.mlp) if cfg.experts else None, "global_head_dim": dim, "num_global_key_value_heads": kv,
        "per_layer_config": {str(i): {"head_dim": dim, "num_key_value_heads": kv}
                             for i, t in enumerate(types) if t == "full_attention"},
        "dtype": dname, "torch_dtype": dname}
