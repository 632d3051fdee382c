"""DBRX's ``config.json`` as :class:`~functional_pp.models.llama.Config` and back: Llama's
decoder with LayerNorms without bias (``norm_kind: layer``), q/k/v clamped after their fused
projection (``clip_qkv``) and in every layer experts of ``ffn_hidden_size`` with a softmax
router whose top-k weights are renormalised (``moe_normalize_expert_weights: 1``). Its keys are
nested (``attn_config``, ``ffn_config``); its tensors' names and layouts are in
models/llama_hf.py (``RENAMED``, ``FUSED``: ``Wqkv``; the experts ``[E * F, H]``)."""
from __future__ import annotations

import dataclasses
from typing import Any

from functional_pp.models.llama import Config

__all__ = ["llama_dict", "read", "NEED", "as_llama", "write"]

_ATTN = dict(attn_pdrop=0.0, clip_qkv=None, kv_n_heads=1, rope_theta=10000.0)
_FFN = dict(ffn_act_fn={"name": "silu"}, ffn_hidden_size=3584, moe_num_experts=4, moe_top_k=1, moe_jitter_eps=None,
            moe_loss_weight=0.01, moe_normalize_expert_weights=1.0)
_TOP = dict(d_model=2048, n_heads=16, n_layers=24, max_seq_len=2048, vocab_size=32000, resid_pdrop=0.0, emb_pdrop=0.0,
            tie_word_embeddings=False, initializer_range=0.02)
"""``DbrxConfig`` / ``DbrxAttentionConfig`` / ``DbrxFFNConfig``'s defaults of the keys read here."""

# the fields a DBRX has, whatever its config.json
_FIXED = dict(norm_kind="layer", norm_bias=False, router_score="softmax", moe_layers=None, moe_mlp=None,
              shared_expert_mlp=0, router_z_loss_coef=0.0)
NEED: dict[str, Any] = dict(_FIXED, qkv_bias=False, o_bias=False, capacity_factor=None, norm_eps=1e-5,
                            head_dim=None)
"""The fields ``DbrxForCausalLM`` has one value of (export refuses others by name)."""


def _sub(hf: dict, key: str, defaults: dict) -> dict:
    """A nested config (``attn_config`` / ``ffn_config``) with its class's defaults."""
    return {**defaults, **{k: v for k, v in (hf.get(key) or {}).items() if v is not None or k == "clip_qkv"}}


def _top(hf: dict, key: str) -> Any:
    return hf.get(key) if hf.get(key) is not None else _TOP[key]


def llama_dict(hf: dict) -> dict:
    """The Llama ``config.json`` of a DBRX one's attention, norms and rope (read by Llama's
    reader); a ValueError names what the functional decoder cannot train as it is."""
    attn, ffn = _sub(hf, "attn_config", _ATTN), _sub(hf, "ffn_config", _FFN)
    for key, rate in (("attn_config.attn_pdrop", attn["attn_pdrop"]), ("resid_pdrop", _top(hf, "resid_pdrop")),
                      ("emb_pdrop", _top(hf, "emb_pdrop"))):
        if float(rate or 0.0):
            raise ValueError(f"HF dbrx config: {key}={rate!r} is not supported: the functional decoder has no dropout "
                             f"there; set it to 0.0 in config.json")
    act = (ffn["ffn_act_fn"] or {}).get("name", "silu")
    if act != "silu":
        raise ValueError(f"HF dbrx config: ffn_config.ffn_act_fn {act!r} is not supported (only silu)")
    if float(ffn["moe_jitter_eps"] or 0.0):
        raise ValueError(f"HF dbrx config: ffn_config.moe_jitter_eps={ffn['moe_jitter_eps']!r} is not supported (a "
                         f"deterministic router only; set it to null)")
    if ffn["moe_normalize_expert_weights"] not in (None, 1, 1.0):
        raise ValueError(f"HF dbrx config: ffn_config.moe_normalize_expert_weights="
                         f"{ffn['moe_normalize_expert_weights']!r} is not supported (only 1: the top-k weights "
                         f"renormalised, or null)")
    rope = hf.get("rope_parameters") or {"rope_type": "default"}
    return dict(model_type="llama", vocab_size=_top(hf, "vocab_size"), hidden_size=_top(hf, "d_model"),
                num_hidden_layers=_top(hf, "n_layers"), num_attention_heads=_top(hf, "n_heads"),
                num_key_value_heads=attn["kv_n_heads"], intermediate_size=ffn["ffn_hidden_size"],
                max_position_embeddings=_top(hf, "max_seq_len"), rms_norm_eps=1e-5,
                rope_parameters={**rope, "rope_theta": float(rope.get("rope_theta") or attn["rope_theta"])},
                tie_word_embeddings=_top(hf, "tie_word_embeddings"), initializer_range=_top(hf, "initializer_range"))


def read(hf: dict, layers: int) -> dict:
    """The Config fields of a DBRX ``config.json`` beyond Llama's (LayerNorms, clamps, experts)."""
    attn, ffn = _sub(hf, "attn_config", _ATTN), _sub(hf, "ffn_config", _FFN)
    clip = attn["clip_qkv"]
    return dict(_FIXED, model_type="dbrx", clip_qkv=None if clip is None else float(clip),
                experts=int(ffn["moe_num_experts"]), experts_top_k=int(ffn["moe_top_k"]),
                norm_topk_prob=ffn["moe_normalize_expert_weights"] is not None,
                router_aux_loss_coef=float(ffn["moe_loss_weight"]) if hf.get("output_router_logits") else 0.0)


def as_llama(cfg: Config) -> Config:
    """The Llama config of DBRX's attention (what Llama's export writes the same); a ValueError
    names a config that ``DbrxForCausalLM`` cannot hold."""
    if cfg.experts < 1:
        raise ValueError("export as 'dbrx': DbrxForCausalLM has experts in every layer (experts > 0)")
    return dataclasses.replace(cfg, model_type="llama", norm_kind="rms", clip_qkv=None, experts=0,
                               norm_topk_prob=False, router_aux_loss_coef=0.0)


def write(cfg: Config, out: dict) -> None:
    """DBRX's nested keys in place of the Llama ``config.json`` of :func:`as_llama`."""
    rope = out["rope_parameters"]
    for key in list(out):
        if key not in ("dtype", "torch_dtype", "use_cache"):
            del out[key]
    out.update(architectures=["DbrxForCausalLM"], model_type="dbrx", vocab_size=cfg.vocab, d_model=cfg.hidden,
               n_heads=cfg.heads, n_layers=cfg.layers, max_seq_len=cfg.max_seq, resid_pdrop=0.0, emb_pdrop=0.0,
               tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, rope_parameters=rope,
               output_router_logits=bool(cfg.router_aux_loss_coef),
               attn_config=dict(attn_pdrop=0.0, clip_qkv=cfg.clip_qkv, kv_n_heads=cfg.kv_heads,
                                rope_theta=float(cfg.rope_theta)),
               ffn_config=dict(ffn_act_fn={"name": "silu"}, ffn_hidden_size=cfg.mlp, moe_num_experts=cfg.experts,
                               moe_top_k=cfg.experts_top_k, moe_jitter_eps=None,
                               moe_loss_weight=cfg.router_aux_loss_coef or _FFN["moe_loss_weight"],
                               moe_normalize_expert_weights=1.0 if cfg.norm_topk_prob else None))
