"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, transformers' DeepseekV4HyperConnection
and DeepseekV4HyperHead): the residual is ``hc`` parallel streams (``batch seq hc hidden``). Before a
block, a linear of the RMS-normed flattened streams gives ``pre`` (sigmoid), ``post`` (2 sigmoid)
and ``comb`` (a softmax, then Sinkhorn-Knopp steps towards a doubly-stochastic matrix); the block
reads the ``pre``-weighted sum of the streams and its output returns as
``post * out + comb^T streams``. The head collapses the streams before the final norm. Written
from the public ops: the layouts are the ops' (the weights' ``hidden`` gathered as any weight)."""
from __future__ import annotations

import torch

import functional_pp as fpp
from functional_pp import ops
from functional_pp.parallel.named import Named

__all__ = ["init", "head_init", "mix", "add_block", "head"]


def init(hidden: int, hc: int, dtype: torch.dtype = torch.float32) -> dict:
    """One hyper-connection's weights: ``fn`` (``hc_mix hc hidden``, the ``(2 + hc) hc`` mixing
    logits of the flattened streams), ``base`` (``hc_mix``) and ``scale`` (``hc_scale``: pre, post, comb)."""
    mix_n = (2 + hc) * hc
    return {"fn": fpp.param((mix_n, hc, hidden), "hc_mix hc hidden", dtype=dtype),
            "base": fpp.param((mix_n,), "hc_mix", init="zeros", dtype=dtype),
            "scale": fpp.param((3,), "hc_scale", init="ones", dtype=dtype)}


def head_init(hidden: int, hc: int, dtype: torch.dtype = torch.float32) -> dict:
    """The hyper-head's weights: ``fn`` (``hc_out hc hidden``), ``base`` (``hc_out``), ``scale`` (``hc_scale`` of 1)."""
    return {"fn": fpp.param((hc, hc, hidden), "hc_out hc hidden", dtype=dtype),
            "base": fpp.param((hc,), "hc_out", init="zeros", dtype=dtype),
            "scale": fpp.param((1,), "hc_scale", init="ones", dtype=dtype)}


def _sigmoid(x: Named) -> Named:
    return (ops.tanh(x * 0.5) + 1.0) * 0.5


def _logits(streams: Named, fn: Named, out: str, norm_eps: float) -> Named:
    """``fn`` applied to the streams flattened over ``hc hidden`` and RMS-normed (unweighted)."""
    normed = streams * ops.rsqrt(ops.mean(ops.square(streams), ("hc", "hidden")) + norm_eps)
    return ops.einsum(f"batch seq hc hidden, {out} hc hidden -> batch seq {out}", normed, fn)


def _scale(p: dict, i: int) -> Named:
    return ops.rename(ops.slice_dim(p["scale"], "hc_scale", i, i + 1), hc_scale="one")


def mix(p: dict, streams: Named, *, sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[Named, Named, Named]:
    """``(collapsed, post, comb)`` of ``streams`` (``batch seq hc hidden``): the block's input
    (``batch seq hidden``), ``post`` (``batch seq hc``) and ``comb`` (``batch seq hc hc_to``)."""
    hc = streams.size("hc")
    logits = _logits(streams, p["fn"], "hc_mix", norm_eps)
    parts = [(ops.slice_dim(logits, "hc_mix", a, b), ops.slice_dim(p["base"], "hc_mix", a, b))
             for a, b in ((0, hc), (hc, 2 * hc), (2 * hc, (2 + hc) * hc))]
    one = lambda x: ops.sum(x, "one")                                  # noqa: E731  (the scalar's size-1 dim)
    pre = ops.rename(_sigmoid(one(parts[0][0] * _scale(p, 0)) + parts[0][1]) + eps, hc_mix="hc")
    post = ops.rename(_sigmoid(one(parts[1][0] * _scale(p, 1)) + parts[1][1]) * 2.0, hc_mix="hc")
    comb = ops.split_dim(one(parts[2][0] * _scale(p, 2)) + parts[2][1], "hc_mix", {"hc": hc, "hc_to": hc})
    comb = ops.softmax(comb, "hc_to") + eps
    comb = comb / (ops.sum(comb, "hc") + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (ops.sum(comb, "hc_to") + eps)
        comb = comb / (ops.sum(comb, "hc") + eps)
    collapsed = ops.einsum("batch seq hc, batch seq hc hidden -> batch seq hidden", pre, streams)
    return collapsed, post, comb


def add_block(streams: Named, out: Named, post: Named, comb: Named) -> Named:
    """The streams after a block: ``post * out + comb^T streams`` (``batch seq hc hidden``)."""
    mixed = ops.einsum("batch seq hc hc_to, batch seq hc hidden -> batch seq hc_to hidden", comb, streams)
    return ops.rename(mixed, hc_to="hc") + ops.einsum("batch seq hc, batch seq hidden -> batch seq hc hidden",
                                                      post, out)


def head(p: dict, streams: Named, *, eps: float, norm_eps: float) -> Named:
    """The streams collapsed by the hyper-head (``batch seq hidden``), before the final norm."""
    logits = _logits(streams, p["fn"], "hc_out", norm_eps)
    pre = ops.rename(_sigmoid(ops.sum(logits * ops.rename(p["scale"], hc_scale="one"), "one") + p["base"]) + eps,
                     hc_out="hc")
    return ops.einsum("batch seq hc, batch seq hc hidden -> batch seq hidden", pre, streams)
