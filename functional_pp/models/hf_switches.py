"""The Hugging Face families that are the Llama decoder plus a few switches of
:class:`~functional_pp.models.llama.Config` (docs/models.md, "Decoder families"): SmolLM3 (NoPE
layers), Granite (embedding / residual / attention / logit multipliers), OLMo 2 and OLMo 3
(norms after each block only, q/k norms over every head; OLMo 3's sliding windows), Cohere and
Cohere 2 (attention and MLP in parallel, LayerNorm, interleaved rotary, a logit scale; Cohere
2's full layers without rotary), Phi-1/2, GPT-NeoX, StableLM and GPT-J (LayerNorms with
biases, partial rotary, GELU MLPs that are not gated, parallel blocks), Arcee (squared ReLU),
Seed-OSS (its own output bias), Apertus (xIELU, q/k norms), Hunyuan dense (q/k norms after the
rotary), Falcon (multi-query or grouped k/v, parallel or sequential layers, LayerNorms) and
Ministral 3 (Mistral with the queries scaled by position: attention temperature tuning in every layer)
and ERNIE 4.5 (interleaved rotary, one ``use_bias`` for every linear).

Per family, one :class:`Switches` record: its class, its config class's defaults, the fields
that have one value in the family, the fields ``config.json`` carries (read and written here),
and the tensors whose layout differs from Llama's. :mod:`functional_pp.models.llama_hf` reads
the keys every family shares and dispatches here for the rest. Also: the model types refused
by name (:data:`REFUSED`), with why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Switches", "SWITCHES", "PLAIN", "REFUSED", "refusal", "partial_rotary_factor", "position_scaling"]

PLAIN: dict[str, Any] = dict(learned_positions=False, clip_qkv=None, nope_layers=None, partial_rotary_factor=1.0, rotary_interleaved=False, pre_norms=True,
                             qk_norm_heads=False, qk_norm_per_head=False, embedding_multiplier=1.0, residual_multiplier=1.0, logit_scale=1.0,
                             parallel_block=False, parallel_mlp_norm=False, norm_kind="rms", norm_bias=False,
                             mlp_gated=True, mlp_bias=False, lm_head_bias=False, attn_gate=False, residual_dropout=0.0, embedding_dropout=0.0,
                             layer_blocks=None,
                             mamba_heads=0, mamba_in_multiplier=1.0, mamba_part_multipliers=None,
                             mamba_out_multiplier=1.0, mamba_norm="gated", attn_in_multiplier=1.0,
                             attn_out_multiplier=1.0, key_multiplier=1.0, mlp_gate_multiplier=1.0,
                             mlp_down_multiplier=1.0, mamba1_inner=0, mamba1_dt_rank=0, mamba1_dt_norms=False,
                             mtp_layers=0)
"""The switches' values in Llama (and in every family that does not name them)."""

Get = Callable[..., Any]          # a config.json key, or its class default


def dropout_rate(get: Get, where: str, key: str) -> float:
    """``config.json``'s dropout rate ``key`` (or the class default), checked to be in [0, 1)."""
    rate = float(get(key) or 0.0)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{where}: {key}={rate!r} must be in [0, 1)")
    return rate


@dataclass(frozen=True)
class Switches:
    """One family: ``read(hf, get, where)`` the Config fields it takes from ``config.json``
    (``get``: a key or the class default), ``write(cfg, out)`` its keys into an exported
    ``config.json``; ``fixed`` the fields with one value in the family, ``free`` those its
    ``config.json`` carries (any value; a ``fixed`` value may be a function of the config);
    ``kinds`` our path suffix -> transform kind where its files differ from Llama's layout."""
    architecture: str
    defaults: dict[str, Any]
    read: Callable[[dict, Get, str], dict]
    write: Callable[[Any, dict], None]
    fixed: dict[str, Any] = field(default_factory=dict)
    free: tuple[str, ...] = ()
    kinds: dict[str, str] = field(default_factory=dict)
    windows: bool = False           # sliding windows in config.json (read by llama_hf._window)
    hidden_act: str = "silu"        # the one hidden_act of config.json the family reads
    # config.json with the keys every family shares (hidden_size, ...) added from the family's own
    # (GPT-J's n_embd, ...), before anything is read
    prepare: Callable[[dict], dict] | None = None
    # tensor renames that depend on the config (Falcon's ``ln_attn`` / ``ln_mlp`` with two norms),
    # applied after ``llama_hf.RENAMED``'s
    renames: Callable[[Any], tuple[tuple[str, str], ...]] | None = None

    def need(self, cfg) -> dict[str, Any]:
        """The Config fields export requires of ``cfg`` for this class."""
        need = {k: v for k, v in PLAIN.items() if k not in self.free}
        need.update({k: v for k, v in dict(qkv_bias=cfg.o_bias, qk_norm=False).items() if k not in self.free})
        if not self.windows:
            need["sliding_window"] = None
        need.update({k: v(cfg) if callable(v) else v for k, v in self.fixed.items()})
        return need


# --------------------------------------------------------------------------- SmolLM3
def _smollm3_read(hf: dict, get: Get, where: str) -> dict:
    layers = int(hf["num_hidden_layers"])
    rope = hf.get("no_rope_layers")
    if rope is None:                      # SmolLM3Config: every no_rope_layer_interval-th layer has no rotary
        every = int(get("no_rope_layer_interval"))
        rope = [int((i + 1) % every != 0) for i in range(layers)]
    if len(rope) != layers:
        raise ValueError(f"{where}: no_rope_layers has {len(rope)} entries for {layers} layers")
    nope = tuple(i for i, r in enumerate(rope) if not r)
    return dict(nope_layers=nope or None)


def _smollm3_write(cfg, out: dict) -> None:
    types = [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)]
    out.update(no_rope_layers=[int(cfg.rotates(i)) for i in range(cfg.layers)],
               use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
               layer_types=types)


# --------------------------------------------------------------------------- Granite
def _granite_read(hf: dict, get: Get, where: str) -> dict:
    # transformers: embeddings x embedding_multiplier, each branch x residual_multiplier, scores x
    # attention_multiplier (the attention's scale: query_pre_attn_scalar = its -2nd power),
    # logits / logits_scaling
    return dict(embedding_multiplier=float(get("embedding_multiplier")),
                residual_multiplier=float(get("residual_multiplier")),
                query_pre_attn_scalar=float(get("attention_multiplier")) ** -2,
                logit_scale=1.0 / float(get("logits_scaling")))


def _granite_write(cfg, out: dict) -> None:
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.dim_head
    out.update(embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
               attention_multiplier=scalar ** -0.5, logits_scaling=1.0 / cfg.logit_scale)


# --------------------------------------------------------------------------- OLMo 2 / 3
def _no_fields(hf: dict, get: Get, where: str) -> dict:
    """A family whose config.json carries no switch of its own (its switches are ``fixed``)."""
    return {}


def _no_keys(cfg, out: dict) -> None:
    """A family whose config.json has no keys of its own to write."""


def _olmo3_write(cfg, out: dict) -> None:
    local = {"rope_type": "default", "rope_theta": float(cfg.local_rope_theta or cfg.rope_theta)}
    out.update(sliding_window=cfg.sliding_window,
               layer_types=[("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)],
               rope_parameters={"full_attention": out["rope_parameters"], "sliding_attention": local})


# OLMo 2's q/k norms span every head: HF [heads * head_dim], ours heads x head_dim
_OLMO = dict(fixed=dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_heads=True),
             kinds={"self_attn.q_norm": "bias_heads", "self_attn.k_norm": "bias_heads"})


# --------------------------------------------------------------------------- Cohere
def _cohere_read(hf: dict, get: Get, where: str) -> dict:
    # Command R+ (use_qk_norm): a bias-free LayerNorm of q and k with a weight per head, before the rotary
    qk = bool(hf.get("use_qk_norm"))
    return dict(logit_scale=float(get("logit_scale")), norm_eps=float(get("layer_norm_eps")), qk_norm=qk,
                qk_norm_per_head=qk)


def _cohere_write(cfg, out: dict) -> None:
    out.update(logit_scale=cfg.logit_scale, layer_norm_eps=out.pop("rms_norm_eps"), use_qk_norm=cfg.qk_norm)


def _cohere2_read(hf: dict, get: Get, where: str) -> dict:
    # Command R7B / Command A: 3 sliding layers to 1 full, the full ones without rotary (no q/k norms)
    if hf.get("use_qk_norm"):
        raise ValueError(f"{where}: use_qk_norm=True is not supported (Cohere2ForCausalLM has no q/k norms)")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                      for i in range(int(hf["num_hidden_layers"]))]
    return dict(_cohere_read(hf, get, where), nope_layers=tuple(i for i, t in enumerate(types)
                                                                if t == "full_attention") or None)


def _cohere2_write(cfg, out: dict) -> None:
    _cohere_write(cfg, out)
    out["use_qk_norm"] = False
    out.update(sliding_window=cfg.sliding_window,
               layer_types=[("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.layers)])


def _full_layers(cfg) -> tuple[int, ...] | None:
    """The layers without a window (Cohere 2's layers without rotary)."""
    return tuple(i for i in range(cfg.layers) if cfg.window(i) is None) or None


# --------------------------------------------------------------------------- Phi-1/2
def partial_rotary_factor(hf: dict, default: float = 1.0) -> float:
    """The share of head_dim that rotates, from ``rope_parameters`` or the top level."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or default)


def _phi_read(hf: dict, get: Get, where: str) -> dict:
    # (transformers, in training: resid_pdrop on the attention's and the MLP's outputs, embd_pdrop on the embedding)
    return dict(_phi_layer(hf, get, where), residual_dropout=dropout_rate(get, where, "resid_pdrop"),
                embedding_dropout=dropout_rate(get, where, "embd_pdrop"))


def _phi_layer(hf: dict, get: Get, where: str) -> dict:
    if hf.get("qk_layernorm"):
        raise ValueError(f"{where}: qk_layernorm=True (Phi's LayerNorm of q and k, with a bias, shared by the "
                         f"heads) is not supported yet")
    return _rotary_and_eps(hf, get)


def _rotary_and_eps(hf: dict, get: Get) -> dict:
    return dict(partial_rotary_factor=partial_rotary_factor(hf, get("partial_rotary_factor")),
                norm_eps=float(get("layer_norm_eps")))


def _phi_write(cfg, out: dict) -> None:
    out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    out.update(layer_norm_eps=out.pop("rms_norm_eps"), hidden_act="gelu_new", qk_layernorm=False,
               partial_rotary_factor=cfg.partial_rotary_factor, resid_pdrop=cfg.residual_dropout,
               embd_pdrop=cfg.embedding_dropout)
    out.pop("attention_bias", None)


# --------------------------------------------------------------------------- StableLM
def _stablelm_read(hf: dict, get: Get, where: str) -> dict:
    if float(hf.get("hidden_dropout") or 0.0):
        raise ValueError(f"{where}: hidden_dropout={hf['hidden_dropout']!r} is not supported: transformers' StableLM "
                         f"drops only the MLP's output, a site the functional decoder has no dropout at (its "
                         f"residual_dropout drops the attention's output too); set it to 0.0")
    # qk_layernorm: a bias-free LayerNorm of q and of k with a weight per head (Command R+'s), before the rotary
    qk = bool(hf.get("qk_layernorm"))
    return dict(_rotary_and_eps(hf, get), parallel_block=bool(get("use_parallel_residual")),
                qkv_bias=bool(get("use_qkv_bias")), qk_norm=qk, qk_norm_per_head=qk)


def _stablelm_write(cfg, out: dict) -> None:
    _phi_write(cfg, out)
    del out["resid_pdrop"], out["embd_pdrop"]
    out.update(hidden_act="silu", use_qkv_bias=cfg.qkv_bias, use_parallel_residual=cfg.parallel_block,
               hidden_dropout=0.0, qk_layernorm=cfg.qk_norm)


# --------------------------------------------------------------------------- GPT-NeoX
def _neox_read(hf: dict, get: Get, where: str) -> dict:
    parallel, bias = bool(get("use_parallel_residual")), bool(get("attention_bias"))
    # (transformers, in training: hidden_dropout on the attention's and the MLP's outputs and on the embedding)
    rate = dropout_rate(get, where, "hidden_dropout")
    return dict(partial_rotary_factor=partial_rotary_factor(hf, hf.get("rotary_pct") or get("partial_rotary_factor")),
                residual_dropout=rate, embedding_dropout=rate, norm_eps=float(get("layer_norm_eps")), parallel_block=parallel, parallel_mlp_norm=parallel,
                qkv_bias=bias, o_bias=bias)


def _neox_write(cfg, out: dict) -> None:
    _phi_write(cfg, out)
    del out["qk_layernorm"], out["resid_pdrop"], out["embd_pdrop"]
    out.update(hidden_act="gelu", use_parallel_residual=cfg.parallel_block, attention_bias=cfg.o_bias,
               rotary_pct=cfg.partial_rotary_factor, hidden_dropout=cfg.residual_dropout)


SWITCHES: dict[str, Switches] = {
    "smollm3": Switches("SmolLM3ForCausalLM", dict(rms_norm_eps=1e-6, max_position_embeddings=32768,
                                                   tie_word_embeddings=True, use_sliding_window=False,
                                                   sliding_window=None, no_rope_layer_interval=4, pad_token_id=128004),
                        _smollm3_read, _smollm3_write, free=("nope_layers",), windows=True),
    "granite": Switches("GraniteForCausalLM", dict(rms_norm_eps=1e-6, max_position_embeddings=2048,
                                                   embedding_multiplier=1.0, residual_multiplier=1.0,
                                                   attention_multiplier=1.0, logits_scaling=1.0),
                        _granite_read, _granite_write,
                        free=("embedding_multiplier", "residual_multiplier", "logit_scale")),
    "olmo2": Switches("Olmo2ForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=2048, pad_token_id=1),
                      _no_fields, _no_keys, **_OLMO),
    "olmo3": Switches("Olmo3ForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=2048, sliding_window=4096,
                                               pad_token_id=1),
                      _no_fields, _olmo3_write, windows=True, **_OLMO),
    "cohere": Switches("CohereForCausalLM", dict(layer_norm_eps=1e-5, max_position_embeddings=8192,
                                                 logit_scale=0.0625, tie_word_embeddings=True, pad_token_id=0),
                       _cohere_read, _cohere_write, free=("logit_scale", "qk_norm"),
                       fixed=dict(parallel_block=True, norm_kind="layer", rotary_interleaved=True,
                                  qk_norm_per_head=lambda cfg: cfg.qk_norm)),
    "phi": Switches("PhiForCausalLM", dict(layer_norm_eps=1e-5, max_position_embeddings=2048, partial_rotary_factor=0.5),
                    _phi_read, _phi_write, free=("partial_rotary_factor", "residual_dropout", "embedding_dropout"),
                    hidden_act="gelu_new",
                    fixed=dict(parallel_block=True, norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_bias=True,
                               mlp_act="gelu_tanh", lm_head_bias=True, qkv_bias=True, o_bias=True)),
    "gpt_neox": Switches("GPTNeoXForCausalLM", dict(layer_norm_eps=1e-5, max_position_embeddings=2048,
                                                    partial_rotary_factor=0.25, use_parallel_residual=True,
                                                    attention_bias=True),
                         _neox_read, _neox_write, free=("partial_rotary_factor", "parallel_block", "residual_dropout"),
                         hidden_act="gelu",
                         fixed=dict(norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_bias=True, mlp_act="gelu",
                                    embedding_dropout=lambda cfg: cfg.residual_dropout,
                                    parallel_mlp_norm=lambda cfg: cfg.parallel_block, qkv_bias=lambda cfg: cfg.o_bias,
                                    kv_heads=lambda cfg: cfg.heads)),
}

SWITCHES["cohere2"] = Switches(
    "Cohere2ForCausalLM", dict(SWITCHES["cohere"].defaults, sliding_window=4096), _cohere2_read, _cohere2_write,
    free=("logit_scale",), windows=True, fixed=dict(SWITCHES["cohere"].fixed, nope_layers=_full_layers))

SWITCHES["stablelm"] = Switches(
    "StableLmForCausalLM", dict(layer_norm_eps=1e-5, max_position_embeddings=4096, partial_rotary_factor=0.25,
                                use_qkv_bias=False, use_parallel_residual=False),
    _stablelm_read, _stablelm_write, free=("partial_rotary_factor", "parallel_block", "qkv_bias", "qk_norm"),
    fixed=dict(norm_kind="layer", norm_bias=True, o_bias=False, qk_norm_per_head=lambda cfg: cfg.qk_norm),
    # its q/k norms: one LayerNorm per head in the files (self_attn.q_layernorm.norms.{h}.weight)
    kinds={"self_attn.q_norm": "per_head", "self_attn.k_norm": "per_head"},
    renames=lambda cfg: ((r"\.self_attn\.q_norm\.weight$", ".self_attn.q_layernorm.norms.weight"),
                         (r"\.self_attn\.k_norm\.weight$", ".self_attn.k_layernorm.norms.weight")))

SWITCHES["arcee"] = Switches(          # Arcee AFM: Llama with an MLP that is not gated, of squared ReLU
    "ArceeForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=4096), _no_fields, _no_keys,
    hidden_act="relu2", fixed=dict(mlp_gated=False, mlp_act="relu2"))

def _gptj_prepare(hf: dict) -> dict:
    """GPT-J's config.json keys as the shared ones (GPTJConfig's defaults where left out)."""
    hidden, heads = int(hf.get("n_embd", 4096)), int(hf.get("n_head", 16))
    return dict(hf, hidden_size=hidden, num_hidden_layers=hf.get("n_layer", 28), num_attention_heads=heads,
                intermediate_size=hf.get("n_inner") or 4 * hidden, max_position_embeddings=hf.get("n_positions", 2048),
                layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), hidden_act=hf.get("activation_function", "gelu_new"),
                attention_dropout=hf.get("attn_pdrop"),
                partial_rotary_factor=(hf.get("rotary_dim") or hidden // heads) / (hidden // heads))


def _gptj_write(cfg, out: dict) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "max_position_embeddings", "rms_norm_eps", "hidden_act", "head_dim", "attention_dropout",
                "attention_bias", "rope_parameters", "rope_scaling", "rope_theta"):
        out.pop(key, None)
    out.update(n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads, n_inner=cfg.mlp, n_positions=cfg.max_seq,
               rotary_dim=cfg.rotary_dim or cfg.dim_head, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
               resid_pdrop=cfg.residual_dropout, embd_pdrop=cfg.embedding_dropout, attn_pdrop=cfg.attention_dropout)


SWITCHES["gptj"] = Switches(     # GPT-J: Phi's parallel block without attention biases, interleaved partial rotary
    "GPTJForCausalLM", dict(layer_norm_eps=1e-5), _phi_read, _gptj_write,
    free=("partial_rotary_factor", "residual_dropout", "embedding_dropout"),
    hidden_act="gelu_new", prepare=_gptj_prepare,
    fixed=dict(SWITCHES["phi"].fixed, qkv_bias=False, o_bias=False, rotary_interleaved=True, head_dim=None,
               kv_heads=lambda cfg: cfg.heads))

# --------------------------------------------------------------------------- Seed-OSS
def _seed_oss_read(hf: dict, get: Get, where: str) -> dict:
    # (residual_dropout on the attention's and the MLP's outputs, in training)
    return dict(qkv_bias=bool(get("attention_bias")), o_bias=bool(get("attention_out_bias")),
                residual_dropout=dropout_rate(get, where, "residual_dropout"))


def _seed_oss_write(cfg, out: dict) -> None:
    out.update(attention_bias=cfg.qkv_bias, attention_out_bias=cfg.o_bias, residual_dropout=cfg.residual_dropout)


SWITCHES["seed_oss"] = Switches(   # Seed-OSS: Llama with q/k/v biases (attention_bias) apart from the output's
    "SeedOssForCausalLM", dict(rms_norm_eps=1e-6, max_position_embeddings=524288, head_dim=128, attention_bias=True,
                               attention_out_bias=False, attention_dropout=0.1, residual_dropout=0.1, pad_token_id=1),
    _seed_oss_read, _seed_oss_write, free=("qkv_bias", "o_bias", "residual_dropout"))


# --------------------------------------------------------------------------- Apertus
def _apertus_prepare(hf: dict) -> dict:
    """ApertusConfig's rope (Llama 3 scaling, base 12e6) where config.json has none."""
    if hf.get("rope_parameters") or hf.get("rope_scaling") or hf.get("rope_theta"):
        return hf
    return dict(hf, rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0})


SWITCHES["apertus"] = Switches(    # Apertus: per-head q/k RMSNorms, an MLP that is not gated, of xIELU
    "ApertusForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=65536, pad_token_id=3), _no_fields, _no_keys,
    hidden_act="xielu", prepare=_apertus_prepare, fixed=dict(mlp_gated=False, mlp_act="xielu", qk_norm=True))


# --------------------------------------------------------------------------- Hunyuan (dense)
def _hunyuan_prepare(hf: dict) -> dict:
    """Hunyuan's NTK-alpha rope (``dynamic`` with an ``alpha``: a fixed larger base,
    ``theta * alpha ** (head_dim / (head_dim - 2))``, as transformers) as a plain rope of that base."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "dynamic" or not rope.get("alpha"):
        return hf
    dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0) * float(rope["alpha"]) ** (dim / (dim - 2))
    return dict(hf, rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None, rope_theta=theta)


SWITCHES["hunyuan_v1_dense"] = Switches(   # Hunyuan (dense): Llama with per-head q/k RMSNorms after the rotary
    "HunYuanDenseV1ForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=2048, pad_token_id=0),
    _no_fields, _no_keys, prepare=_hunyuan_prepare, fixed=dict(qk_norm=True, qk_norm_after_rotary=True))


# --------------------------------------------------------------------------- Falcon
def _falcon_prepare(hf: dict) -> dict:
    """Falcon's config.json keys as the shared ones (FalconConfig's defaults where left out):
    multi-query attention has one k/v head, the old layer without it one per head."""
    hidden, heads = int(hf.get("hidden_size") or hf.get("n_embed") or 4544), int(hf.get("num_attention_heads", 71))
    new = bool(hf.get("new_decoder_architecture"))
    kv = int(hf.get("num_kv_heads") or heads) if new else 1 if hf.get("multi_query", True) else heads
    out = dict(hf, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
               num_hidden_layers=hf.get("num_hidden_layers", 32), intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden,
               layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), hidden_act=hf.get("activation") or "gelu",
               attention_bias=bool(hf.get("bias")))
    out.pop("head_dim", None)
    return out


def _falcon_read(hf: dict, get: Get, where: str) -> dict:
    if hf.get("alibi"):
        raise ValueError(f"{where}: alibi=True (ALiBi position biases: Falcon-RW) is not supported; only the "
                         f"rotary Falcons")
    if float(hf.get("hidden_dropout") or 0.0):
        raise ValueError(f"{where}: hidden_dropout={hf['hidden_dropout']!r} is not supported: transformers' Falcon "
                         f"drops the MLP's output (with the attention's added, in parallel layers: one mask for both), "
                         f"not a site of the functional decoder; set it to 0.0")
    new, parallel = bool(hf.get("new_decoder_architecture")), bool(get("parallel_attn"))
    if not (new or parallel) and float(get("attention_dropout") or 0.0):
        raise ValueError(f"{where}: attention_dropout={get('attention_dropout')!r} with sequential layers "
                         f"(parallel_attn=False) is not supported: transformers' Falcon drops the attention's output "
                         f"at that rate too, apart from the MLP's; set it to 0.0 (or use parallel_attn=True)")
    norms = hf.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if (new and not parallel) or (not new and parallel and norms == 2):
        raise ValueError(f"{where}: new_decoder_architecture={new} with parallel_attn={parallel} and "
                         f"num_ln_in_parallel_attn={norms} is a layer transformers' Falcon cannot run either")
    bias = bool(hf.get("bias"))
    return dict(parallel_block=parallel, parallel_mlp_norm=parallel and norms == 2, qkv_bias=bias, o_bias=bias,
                mlp_bias=bias, norm_eps=float(get("layer_norm_eps")))


def _falcon_write(cfg, out: dict) -> None:
    for key in ("num_key_value_heads", "intermediate_size", "rms_norm_eps", "hidden_act", "head_dim",
                "attention_bias"):
        out.pop(key, None)
    mq = cfg.kv_heads == 1 and cfg.heads > 1 and not cfg.parallel_mlp_norm
    new = not mq and cfg.parallel_block and (cfg.parallel_mlp_norm or cfg.kv_heads != cfg.heads)
    out.update(new_decoder_architecture=new, multi_query=mq, parallel_attn=cfg.parallel_block,
               num_ln_in_parallel_attn=(2 if cfg.parallel_mlp_norm else 1) if cfg.parallel_block else None,
               num_kv_heads=cfg.kv_heads, ffn_hidden_size=cfg.mlp, layer_norm_epsilon=cfg.norm_eps, activation="gelu",
               bias=cfg.o_bias, alibi=False, hidden_dropout=0.0)


def _falcon_kv_heads(cfg) -> int:
    """The k/v heads a Falcon layer can have: one (multi-query), one per head (the old layer
    without multi-query), or any with the new decoder architecture (parallel, two norms or GQA)."""
    return cfg.kv_heads if cfg.kv_heads == 1 or cfg.parallel_block else cfg.heads


def _falcon_renames(cfg) -> tuple[tuple[str, str], ...]:
    """The two norms of the new decoder architecture are ``ln_attn`` / ``ln_mlp``."""
    if cfg is None or not cfg.parallel_mlp_norm:
        return ()
    return (r"\.input_layernorm\.", ".ln_attn."), (r"\.post_attention_layernorm\.", ".ln_mlp.")


SWITCHES["falcon"] = Switches(     # Falcon: LayerNorms, a GELU MLP not gated, q/k/v fused per k/v head
    "FalconForCausalLM", dict(layer_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=True,
                              parallel_attn=True),
    _falcon_read, _falcon_write, free=("parallel_block", "parallel_mlp_norm", "qkv_bias", "o_bias", "mlp_bias"),
    hidden_act="gelu", prepare=_falcon_prepare, renames=_falcon_renames,
    fixed=dict(norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_act="gelu", qkv_bias=lambda cfg: cfg.o_bias,
               mlp_bias=lambda cfg: cfg.o_bias, kv_heads=_falcon_kv_heads))

# --------------------------------------------------------------------------- Gemma (1)
def _gemma_prepare(hf: dict) -> dict:
    """Gemma 1's ``hidden_act: gelu`` (the published files' legacy value) is its tanh GELU, as
    transformers reads it; a ``hidden_activation`` key, where set, names the activation."""
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    return dict(hf, hidden_act="gelu_pytorch_tanh" if act in (None, "gelu") else act)


SWITCHES["gemma"] = Switches(      # Gemma (1): Gemma 2's switches without sandwich norms, windows or soft-caps
    "GemmaForCausalLM", dict(rms_norm_eps=1e-6, max_position_embeddings=8192, head_dim=256, tie_word_embeddings=True,
                             pad_token_id=0),
    _no_fields, _no_keys, hidden_act="gelu_pytorch_tanh", prepare=_gemma_prepare,
    fixed=dict(mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True))


# --------------------------------------------------------------------------- GLM-4 (glm, glm4)
def _glm_read(hf: dict, get: Get, where: str) -> dict:
    return dict(qkv_bias=bool(get("attention_bias")),
                partial_rotary_factor=partial_rotary_factor(hf, get("partial_rotary_factor")))


def _glm_write(cfg, out: dict) -> None:
    out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    out.update(attention_bias=cfg.qkv_bias, partial_rotary_factor=cfg.partial_rotary_factor)


_GLM = dict(defaults=dict(rms_norm_eps=1.5625e-07, max_position_embeddings=131072, head_dim=128, attention_bias=True,
                          partial_rotary_factor=0.5, pad_token_id=151329),
            read=_glm_read, write=_glm_write, free=("qkv_bias", "partial_rotary_factor"))
# GLM-4-9B (glm): Llama with q/k/v biases, the first half of each head rotating pairs (2i, 2i+1)
SWITCHES["glm"] = Switches("GlmForCausalLM", **_GLM, fixed=dict(rotary_interleaved=True, o_bias=False))
# GLM-4-0414 (glm4): GLM's layer with a norm after attention and after the MLP too (sandwich_norms)
SWITCHES["glm4"] = Switches("Glm4ForCausalLM", **_GLM,
                            fixed=dict(rotary_interleaved=True, o_bias=False, sandwich_norms=True))


# --------------------------------------------------------------------------- ERNIE 4.5 (dense)
def _ernie_read(hf: dict, get: Get, where: str) -> dict:
    bias = bool(get("use_bias"))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def _ernie_write(cfg, out: dict) -> None:
    out.pop("attention_bias", None)
    out["use_bias"] = cfg.o_bias


SWITCHES["ernie4_5"] = Switches(   # ERNIE 4.5 (0.3B): Llama rotating pairs (2i, 2i+1), one use_bias for every linear
    "Ernie4_5ForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=131072, head_dim=128, use_bias=False,
                                tie_word_embeddings=True, pad_token_id=0),
    _ernie_read, _ernie_write, free=("qkv_bias", "o_bias", "mlp_bias"),
    fixed=dict(rotary_interleaved=True, qkv_bias=lambda cfg: cfg.o_bias, mlp_bias=lambda cfg: cfg.o_bias))


# --------------------------------------------------------------------------- StarCoder 2
def _starcoder2_read(hf: dict, get: Get, where: str) -> dict:
    bias = bool(get("use_bias"))
    # (transformers, in training: residual_dropout on the attention's output after o_proj and on the
    # MLP's after c_proj, embedding_dropout on the token embedding)
    return dict(norm_eps=float(get("norm_epsilon")), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                residual_dropout=dropout_rate(get, where, "residual_dropout"),
                embedding_dropout=dropout_rate(get, where, "embedding_dropout"))


def _starcoder2_write(cfg, out: dict) -> None:
    out.pop("attention_bias", None)
    out.update(norm_epsilon=out.pop("rms_norm_eps"), use_bias=cfg.o_bias, sliding_window=cfg.sliding_window,
               residual_dropout=cfg.residual_dropout, embedding_dropout=cfg.embedding_dropout)


SWITCHES["starcoder2"] = Switches(   # StarCoder 2: LayerNorms, a tanh-GELU MLP not gated, biases, a window
    "Starcoder2ForCausalLM", dict(norm_epsilon=1e-5, max_position_embeddings=4096, use_bias=True,
                                  tie_word_embeddings=True, sliding_window=None, residual_dropout=0.0,
                                  embedding_dropout=0.0),
    _starcoder2_read, _starcoder2_write,
    free=("qkv_bias", "o_bias", "mlp_bias", "residual_dropout", "embedding_dropout"), windows=True,
    hidden_act="gelu_pytorch_tanh",
    fixed=dict(norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_act="gelu_tanh",
               qkv_bias=lambda cfg: cfg.o_bias, mlp_bias=lambda cfg: cfg.o_bias, layer_types=None))


# --------------------------------------------------------------------------- Nemotron
def _nemotron_read(hf: dict, get: Get, where: str) -> dict:
    return dict(norm_eps=float(get("norm_eps")), mlp_bias=bool(get("mlp_bias")),
                partial_rotary_factor=partial_rotary_factor(hf, get("partial_rotary_factor")))


def _nemotron_write(cfg, out: dict) -> None:
    out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    out.update(norm_eps=out.pop("rms_norm_eps"), partial_rotary_factor=cfg.partial_rotary_factor,
               mlp_bias=cfg.mlp_bias)


SWITCHES["nemotron"] = Switches(   # Nemotron (Minitron): LayerNorm1P (scale 1 + w, a bias), squared ReLU, partial rotary
    "NemotronForCausalLM", dict(norm_eps=1e-5, max_position_embeddings=4096, partial_rotary_factor=0.5,
                                mlp_bias=False),
    _nemotron_read, _nemotron_write, free=("partial_rotary_factor", "mlp_bias"), hidden_act="relu2",
    fixed=dict(norm_kind="layer", norm_bias=True, norm_offset=1.0, mlp_gated=False, mlp_act="relu2"))

# --------------------------------------------------------------------------- GPT-2
def _gpt2_prepare(hf: dict) -> dict:
    """GPT-2's config.json keys as the shared ones (GPT2Config's defaults where left out: its
    dropouts' 0.1, applied in training as transformers does)."""
    hidden = int(hf.get("n_embd", 768))
    heads = hf.get("n_head", 12)
    return dict(hf, hidden_size=hidden, num_hidden_layers=hf.get("n_layer", 12), num_attention_heads=heads,
                num_key_value_heads=heads,
                intermediate_size=hf.get("n_inner") or 4 * hidden, max_position_embeddings=hf.get("n_positions", 1024),
                layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), hidden_act=hf.get("activation_function", "gelu_new"),
                attention_dropout=hf.get("attn_pdrop", 0.1), resid_pdrop=hf.get("resid_pdrop", 0.1),
                embd_pdrop=hf.get("embd_pdrop", 0.1))


def _gpt2_read(hf: dict, get: Get, where: str) -> dict:
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if hf.get(key, ok) != ok:
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported (only {key}={ok!r})")
    # (transformers, in training: resid_pdrop on the attention's and the MLP's outputs, embd_pdrop on the
    # token embedding plus the positions')
    return dict(norm_eps=float(get("layer_norm_eps")), residual_dropout=dropout_rate(get, where, "resid_pdrop"),
                embedding_dropout=dropout_rate(get, where, "embd_pdrop"))


def _gpt2_write(cfg, out: dict) -> None:
    _gptj_write(cfg, out)
    del out["rotary_dim"]
    out.update(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
               add_cross_attention=False)


SWITCHES["gpt2"] = Switches(       # GPT-2 (Cerebras-GPT): learned positions, LayerNorms, biases, Conv1D weights
    "GPT2LMHeadModel", dict(layer_norm_eps=1e-5, tie_word_embeddings=True), _gpt2_read, _gpt2_write,
    hidden_act="gelu_new", prepare=_gpt2_prepare, free=("residual_dropout", "embedding_dropout"),
    kinds={"self_attn.q_proj": "conv_heads_out", "self_attn.k_proj": "conv_heads_out",
           "self_attn.v_proj": "conv_heads_out", "self_attn.o_proj": "conv_heads_in", "mlp.up_proj": "copy",
           "mlp.down_proj": "copy"},
    fixed=dict(learned_positions=True, norm_kind="layer", norm_bias=True, mlp_gated=False, mlp_bias=True,
               mlp_act="gelu_tanh", qkv_bias=True, o_bias=True, head_dim=None, kv_heads=lambda cfg: cfg.heads))

# --------------------------------------------------------------------------- Ministral 3
_MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                        beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)


def _ministral3_prepare(hf: dict) -> dict:
    """Ministral3Config's rope (YaRN with Llama 4's attention scaling) where config.json has none."""
    if hf.get("rope_parameters") or hf.get("rope_scaling"):
        return hf
    return dict(hf, rope_parameters=dict(_MINISTRAL3_ROPE, max_position_embeddings=hf.get("max_position_embeddings",
                                                                                            262144)))


def position_scaling(hf: dict, where: str) -> dict:
    """The ``Config`` fields of Llama 4's attention scaling by position that Ministral 3 and Mistral
    Small 4 apply in every layer (transformers' ``get_llama_4_attn_scale``: q times
    ``1 + beta * log(1 + floor(pos / original_max_position_embeddings))`` after the rotary), from
    ``rope_parameters``; refused by name without them."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    beta, floor = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta is None or not floor:
        raise ValueError(f"{where}: rope_parameters needs llama_4_scaling_beta and original_max_position_embeddings "
                         f"(the attention scaling by position), got {rope!r}")
    return dict(attn_temperature_floor=float(floor), attn_temperature_scale=float(beta), attn_temperature_offset=0.0,
                attn_temperature_all_layers=True)


def _ministral3_read(hf: dict, get: Get, where: str) -> dict:
    return position_scaling(hf, where)


def _ministral3_write(cfg, out: dict) -> None:
    out.pop("attention_bias", None)
    floor = cfg.attn_temperature_floor
    extra = dict(llama_4_scaling_beta=cfg.attn_temperature_scale,
                 original_max_position_embeddings=int(floor) if float(floor).is_integer() else floor)
    out["rope_parameters"].update(extra)
    out["rope_scaling"] = dict(out["rope_scaling"] or {"rope_type": "default"}, **extra)
    out["sliding_window"] = cfg.sliding_window


def _ministral3_floor(cfg) -> float:
    """The scaling's period export can write: YaRN's original_max_position_embeddings (one key in
    rope_parameters for both), else the config's own (None: none to write, max_seq asked for)."""
    original = getattr(cfg.rope_scaling, "original_max_position", None)
    return float(original) if original is not None else cfg.attn_temperature_floor or float(cfg.max_seq)


SWITCHES["ministral3"] = Switches(   # Ministral 3: Mistral with the queries scaled by position (every layer)
    "Ministral3ForCausalLM", dict(rms_norm_eps=1e-5, max_position_embeddings=262144, head_dim=128,
                                  sliding_window=None, pad_token_id=11),
    _ministral3_read, _ministral3_write, free=("attn_temperature_floor", "attn_temperature_scale"), windows=True,
    prepare=_ministral3_prepare,
    fixed=dict(attn_temperature_offset=0.0, attn_temperature_all_layers=True, qkv_bias=False, o_bias=False,
               layer_types=None, attn_temperature_floor=_ministral3_floor))

# --------------------------------------------------------------------------- MPT
def _mpt_attn(hf: dict) -> dict:
    """MPT's ``attn_config`` with MptAttentionConfig's defaults where left out."""
    return {"attn_pdrop": 0.0, "clip_qkv": None, "softmax_scale": None, "qk_ln": False, "alibi": True,
            "alibi_bias_max": 8, **(hf.get("attn_config") or {})}


def _mpt_prepare(hf: dict) -> dict:
    """MPT's config.json keys as the shared ones (MptConfig's defaults where left out); its MLP is
    4 x d_model in transformers' MptMLP whatever ``expansion_ratio`` says (checked in the read)."""
    hidden, heads = int(hf.get("d_model", 2048)), int(hf.get("n_heads", 16))
    rate = _mpt_attn(hf)["attn_pdrop"]
    return dict(hf, hidden_size=hidden, num_hidden_layers=hf.get("n_layers", 24), num_attention_heads=heads,
                num_key_value_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=hf.get("max_seq_len", 2048),
                hidden_act="gelu", attention_dropout=rate, rope_theta=10000.0)


def _mpt_read(hf: dict, get: Get, where: str) -> dict:
    attn = _mpt_attn(hf)
    for key, ok in (("clip_qkv", None), ("softmax_scale", None), ("qk_ln", False), ("alibi", True)):
        if attn[key] != ok:
            raise ValueError(f"{where}: attn_config.{key}={attn[key]!r} is not supported (only {ok!r})")
    for key, ok in (("no_bias", True), ("logit_scale", None), ("expansion_ratio", 4)):
        if hf.get(key, ok) != ok:
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported (only {ok!r}: transformers' MptForCausalLM)")
    rate = float(attn["attn_pdrop"] or 0.0)      # (transformers: on the probabilities, the attention's and the MLP's outputs)
    return dict(norm_eps=float(get("layer_norm_epsilon")), alibi_max=float(attn["alibi_bias_max"]),
                residual_dropout=rate, nope_layers=None)


def _mpt_write(cfg, out: dict) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "max_position_embeddings", "rms_norm_eps", "hidden_act", "head_dim", "attention_dropout",
                "attention_bias", "rope_parameters", "rope_scaling", "rope_theta"):
        out.pop(key, None)
    out.update(d_model=cfg.hidden, n_heads=cfg.heads, n_layers=cfg.layers, expansion_ratio=4, max_seq_len=cfg.max_seq,
               layer_norm_epsilon=cfg.norm_eps, no_bias=True, logit_scale=None, resid_pdrop=0, emb_pdrop=0,
               # (transformers 5.25 types attn_pdrop and alibi_bias_max as ints: whole numbers written so)
               attn_config={"attn_pdrop": cfg.attention_dropout or 0, "clip_qkv": None, "softmax_scale": None,
                            "qk_ln": False, "alibi": True,
                            "alibi_bias_max": int(cfg.alibi_max) if float(cfg.alibi_max).is_integer() else cfg.alibi_max})


SWITCHES["mpt"] = Switches(        # MPT (Replit code): ALiBi, bias-free LayerNorms, q/k/v fused in Wqkv, GELU MLP
    "MptForCausalLM", dict(layer_norm_epsilon=1e-5, tie_word_embeddings=True), _mpt_read, _mpt_write,
    hidden_act="gelu", prepare=_mpt_prepare, free=("residual_dropout",),
    fixed=dict(norm_kind="layer", norm_bias=False, mlp_gated=False, mlp_act="gelu", qkv_bias=False, o_bias=False,
               head_dim=None, kv_heads=lambda cfg: cfg.heads, mlp=lambda cfg: 4 * cfg.hidden,
               residual_dropout=lambda cfg: cfg.attention_dropout, tie_embeddings=True))

# --------------------------------------------------------------------------- LFM2
def _lfm2_prepare(hf: dict) -> dict:
    """LFM2's config.json keys as the shared ones: ``norm_eps``, its layer types kept apart (read
    by :func:`_lfm2_read`), Lfm2Config's rope base where none is given."""
    out = dict(hf, rms_norm_eps=hf.get("norm_eps", 1e-5), lfm2_layer_types=hf.get("layer_types"), layer_types=None)
    if not hf.get("rope_parameters") and not hf.get("rope_theta"):
        out["rope_theta"] = 1_000_000.0
    return out


def _lfm2_read(hf: dict, get: Get, where: str) -> dict:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("lfm2_layer_types")
    if types is None:                    # Lfm2Config: full_attn_idxs (default every layer) attend, the others convolve
        full = hf.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(layers)]
    bad = sorted(set(types) - {"full_attention", "conv"})
    if bad or len(types) != layers:
        raise ValueError(f"{where}: layer_types {list(types)} must be {layers} entries of 'full_attention' or 'conv'")
    if get("conv_bias"):
        raise ValueError(f"{where}: conv_bias=True is not supported (LFM2's convolution and projections without "
                         f"biases only)")
    mlp = int(hf["intermediate_size"])
    if get("block_auto_adjust_ff_dim"):          # transformers' Lfm2MLP: 2/3, times the multiplier, rounded up
        mlp = int(2 * mlp / 3)
        if get("block_ffn_dim_multiplier") is not None:
            multiple = int(get("block_multiple_of"))
            mlp = multiple * ((int(float(get("block_ffn_dim_multiplier")) * mlp) + multiple - 1) // multiple)
    return dict(layer_types=tuple(types), conv_kernel=int(get("conv_L_cache")), mlp=mlp)


def _lfm2_write(cfg, out: dict) -> None:
    out.pop("rms_norm_eps", None)
    out.update(norm_eps=cfg.norm_eps, layer_types=list(cfg.layer_types or ["full_attention"] * cfg.layers),
               conv_L_cache=cfg.conv_kernel, conv_bias=False, block_auto_adjust_ff_dim=False)


SWITCHES["lfm2"] = Switches(       # LFM2: short-convolution layers (models/short_conv.py) between attention layers
    "Lfm2ForCausalLM", dict(norm_eps=1e-5, max_position_embeddings=128000, tie_word_embeddings=True, conv_L_cache=3,
                            conv_bias=False, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                            block_auto_adjust_ff_dim=True),
    _lfm2_read, _lfm2_write, fixed=dict(qk_norm=True, qkv_bias=False, o_bias=False), prepare=_lfm2_prepare,
    free=("layer_types", "conv_kernel"))

_HYBRID = "a hybrid of attention and state-space or linear-attention layers, a different kind of layer this decoder does not have"
REFUSED: dict[str, str] = {
    **{mt: f"{name} is {_HYBRID}" for mt, name in (
        ("lfm2_moe", "LFM2-MoE"), ("olmo_hybrid", "OLMo hybrid"))},
    **{mt: ("Gemma 3n: its layers carry per-layer input embeddings, AltUp and LAuReL blocks and k/v shared "
            "across layers, which are not switches of this decoder (issue 40)") for mt in ("gemma3n_text", "gemma3n")},
    "deepseek_v4": (
        "DeepSeek-V4: not built yet (issue 47), as it adds to DeepSeek-V3 what this decoder does not have: "
        "its layers on hyper-connection streams (hc_mult residual streams mixed by Sinkhorn-projected matrices, "
        "collapsed by a hyper-head; their mixing itself is models/hyper_connections.py), compressed key/value "
        "entries appended to the attention (HCA: softmax-gated pooling of compress_rates windows, CSA: overlapping "
        "windows whose entries a lightning indexer keeps by top index_topk per query), single-head shared key/value "
        "attention with its rotary undone on the output and a grouped low-rank output projection (o_groups, "
        "o_lora_rank), and the token ids passed to its hash-routed MoE layers (mlp_layer_types hash_moe: experts "
        "from tid2eid[input_ids]; its routing itself, sqrtsoftplus scores and the given experts, is ops.experts')"),
}
"""``model_type`` -> why it is refused (named in the error before any work)."""


def refusal(mt: str) -> str:
    """``" (<why>)"`` for a model type refused by name, else ``""``."""
    return f" ({REFUSED[mt]})" if mt in REFUSED else ""
