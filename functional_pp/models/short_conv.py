"""LFM2's short-convolution token mixer (transformers' ``Lfm2ShortConv``), a layer's mixer in
place of attention where ``layer_types`` says ``"conv"``: ``in_proj`` gives three gates B, C and
x per channel; the causal depthwise convolution of ``B * x`` over the last ``conv_kernel``
positions (``conv_L_cache``), times C, then ``out_proj``.

The channels (``conv``) split like the MLP's under tensor parallelism (``in_proj`` column-
parallel, ``out_proj`` row-parallel, the kernel's rows with them). The convolution reads the
``conv_kernel - 1`` positions before each one, so the sequence must be whole: a sequence split
over ``cp`` is refused by name, as is sampling with a key / value cache (its conv state is not
built)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from functional_pp import ops
from functional_pp.models import kv_cache
from functional_pp.parallel.named import Named


def init(hidden: int, kernel: int, w: Callable[..., Any], out_std: float) -> dict:
    """The mixer's declarations: ``in_proj`` (hidden -> B, C, x gates of ``conv`` channels), the
    depthwise kernel (``conv conv_kernel``) and ``out_proj``."""
    return {"in_proj": w((hidden, 3, hidden), "hidden conv_gates conv"),
            # (meta linear False: convolution taps, not a linear: no all-linear LoRA target, as peft's nn.Conv1d)
            "conv": dataclasses.replace(w((hidden, kernel), "conv conv_kernel"), meta={"linear": False}),
            "out_proj": dataclasses.replace(w((hidden, hidden), "conv hidden", out_std), meta={"in_dims": 1})}


def mixer(c: dict, h: Named, cfg: Any) -> Named:
    """The mixer of normed input ``h`` (batch seq hidden) -> batch res_seq hidden."""
    if kv_cache.active() is not None:
        raise ValueError("sampling with a key / value cache does not support LFM2's short-convolution layers "
                         "(layer_types 'conv': their conv state is not cached) yet")
    seq_split = h.split[h.dims.index("seq")]
    if seq_split:
        raise ValueError(f"LFM2's short-convolution layers (layer_types 'conv') need the whole sequence on each "
                         f"device (each position reads the {c['conv'].size('conv_kernel') - 1} before it); the "
                         f"sequence is split over {seq_split}: use cp_size 1 (context parallelism is not built for "
                         f"them)")
    gates = ops.einsum("batch seq hidden, hidden conv_gates conv -> batch seq conv_gates conv", h, c["in_proj"])
    b, gate_c, x = ops.unbind(gates, "conv_gates")
    y = gate_c * causal_depthwise_conv(b * x, c["conv"])
    return ops.rename(ops.einsum("batch seq conv, conv hidden -> batch seq hidden", y, c["out_proj"]), seq="res_seq")


def causal_depthwise_conv(x: Named, kernel: Named) -> Named:
    """``y[t, c] = sum_j kernel[c, j] * x[t - (K - 1) + j, c]`` (zeros before the first position):
    torch's ``Conv1d(groups=channels, padding=K - 1)`` cut to the sequence, as transformers."""
    K, S = kernel.size("conv_kernel"), x.size("seq")
    y = None
    for j in range(K):
        shift = K - 1 - j
        if shift >= S:
            continue
        moved = x if not shift else ops.concat(
            [ops.slice_dim(x, "seq", 0, shift) * 0.0, ops.slice_dim(x, "seq", 0, S - shift)], "seq")
        term = moved * ops.take(kernel, "conv_kernel", j)
        y = term if y is None else y + term
    return y
