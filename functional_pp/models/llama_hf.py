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

Rotary convention: HF Llama q/k weights are already in the rotate-half order (HF's conversion
script permuted Meta's interleaved weights), which is what ``ops.rotary`` uses, so they map
without permutation. For Meta-format (interleaved) weights use :func:`permute_for_rotate_half`
(and :func:`unpermute_from_rotate_half` to go back).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from functional_pp.models.llama import Config
from functional_pp.ops.rotary import Llama3Scaling

__all__ = [
    "LLAMA_TABLE", "IGNORED_HF", "KINDS", "hf_name", "our_path", "hf_kind", "config_from_hf_dict",
    "config_to_hf", "permute_for_rotate_half", "unpermute_from_rotate_half", "UnsupportedHFConfig",
]


class UnsupportedHFConfig(ValueError):
    """An HF Llama setting the functional Llama does not implement."""


# --------------------------------------------------------------------------- the table
LLAMA_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed_tokens", "copy"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm", "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj", "heads_out"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj", "heads_out"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj", "heads_out"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj", "heads_in"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm",
     "copy"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj", "linear"),
    ("model.norm.weight", "norm", "copy"),
    ("lm_head.weight", "lm_head", "linear"),
)
"""``(HF name pattern, our path pattern, transform kind)``; ``{i}`` is the layer index."""

IGNORED_HF: tuple[str, ...] = (r"model\.rotary_emb\.inv_freq",
                                r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
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


def hf_kind(path: str) -> str | None:
    """The transform kind (a key of :data:`KINDS`) of our tree path (``None``: unmapped)."""
    r = _lookup(path, _TO_HF)
    return r[1] if r else None


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


KINDS: dict[str, _Kind] = {"copy": _Copy(), "linear": _Linear(), "heads_out": _HeadsOut(),
                           "heads_in": _HeadsIn()}


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
def config_from_hf_dict(hf: dict) -> Config:
    """``llama.Config`` from the contents of an HF ``config.json``; accepts both
    ``rope_parameters`` (transformers 5) and ``rope_theta``/``rope_scaling`` (4.x). A setting
    the functional Llama cannot reproduce raises :class:`UnsupportedHFConfig`."""
    where = "HF config"
    if hf.get("model_type", "llama") != "llama":
        raise UnsupportedHFConfig(f"{where}: model_type is {hf['model_type']!r}, not 'llama'")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise UnsupportedHFConfig(f"{where}: {key}={hf[key]!r} is not supported "
                                          f"(the functional Llama needs {ok!r})")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise UnsupportedHFConfig(f"{where}: partial_rotary_factor != 1 is not supported")
    if rope_type in ("default", None):
        scaling = None
    elif rope_type == "llama3":
        scaling = Llama3Scaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope.get("original_max_position_embeddings",
                                               hf.get("max_position_embeddings", 8192))))
    else:
        raise UnsupportedHFConfig(f"{where}: rope type {rope_type!r} is not supported "
                                      f"(only 'default' and 'llama3')")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) == hidden // heads:
        head_dim = None
    return Config(
        vocab=int(hf["vocab_size"]), hidden=hidden, layers=int(hf["num_hidden_layers"]),
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
        mlp=int(hf["intermediate_size"]), head_dim=None if head_dim is None else int(head_dim),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        max_seq=int(hf.get("max_position_embeddings", 2048)))


def config_to_hf(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """HF ``config.json`` contents for ``cfg`` (readable by transformers 4.x and 5.x)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    s = cfg.rope_scaling
    if s is not None:
        rope = {"rope_type": "llama3", "rope_theta": float(cfg.rope_theta), "factor": float(s.factor),
                "low_freq_factor": float(s.low_freq_factor),
                "high_freq_factor": float(s.high_freq_factor),
                "original_max_position_embeddings": int(s.original_max_position)}
    dname = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "use_cache": True,
        "rope_parameters": rope,                                    # transformers 5
        "rope_theta": float(cfg.rope_theta),                        # transformers 4.x
        "rope_scaling": ({k: v for k, v in rope.items() if k != "rope_theta"} if s else None),
        "dtype": dname, "torch_dtype": dname,
    }
