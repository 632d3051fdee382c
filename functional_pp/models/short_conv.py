"""LFM2's short-convolution token mixer (transformers' ``Lfm2ShortConv``), a layer's mixer in
place of attention where ``layer_types`` says ``"conv"``: ``in_proj`` gives three gates B, C and
x per channel; the causal depthwise convolution of ``B * x`` over the last ``conv_kernel``
positions (``conv_L_cache``), times C, then ``out_proj``.

The channels (``conv``) split like the MLP's under tensor parallelism (``in_proj`` column-
parallel, ``out_proj`` row-parallel, the kernel's rows with them). The convolution reads the
``conv_kernel - 1`` positions before each one (``ops.linear_attention.causal_conv1d``): a sequence
split over ``cp`` hands them from block to block (ops/sequence_chain.py), packed rows (``segments``)
read none of another document. Sampling with a key / value cache is refused by name (its conv
state is not built)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from functional_pp import ops
from functional_pp.models import kv_cache
from functional_pp.ops.linear_attention import causal_conv1d
from functional_pp.parallel.named import Named


def init(hidden: int, kernel: int, w: Callable[..., Any], out_std: float) -> dict:
    """The mixer's declarations: ``in_proj`` (hidden -> B, C, x gates of ``conv`` channels), the
    depthwise kernel (``conv conv_kernel``) and ``out_proj``."""
    return {"in_proj": w((hidden, 3, hidden), "hidden conv_gates conv"),
            # (meta linear False: convolution taps, not a linear: no all-linear LoRA target, as peft's nn.Conv1d)
            "conv": dataclasses.replace(w((hidden, kernel), "conv conv_kernel"), meta={"linear": False}),
            "out_proj": dataclasses.replace(w((hidden, hidden), "conv hidden", out_std), meta={"in_dims": 1})}


def mixer(c: dict, h: Named, cfg: Any, segments: Named | None = None) -> Named:
    """The mixer of normed input ``h`` (batch seq hidden) -> batch res_seq hidden; ``segments``
    (packed documents): no tap reads another document."""
    if kv_cache.active() is not None:
        raise ValueError("sampling with a key / value cache does not support LFM2's short-convolution layers "
                         "(layer_types 'conv': their conv state is not cached) yet")
    gates = ops.einsum("batch seq hidden, hidden conv_gates conv -> batch seq conv_gates conv", h, c["in_proj"])
    b, gate_c, x = ops.unbind(gates, "conv_gates")
    y = gate_c * causal_conv1d(b * x, c["conv"], seq="seq", kernel="conv_kernel", segments=segments)
    return ops.rename(ops.einsum("batch seq conv, conv hidden -> batch seq hidden", y, c["out_proj"]), seq="res_seq")
