"""RMSNorm and LayerNorm over a named dimension, or over several at once (OLMo 2's q/k norms
span every head: ``dim=("heads", "head_dim")``), computed in float32."""
from __future__ import annotations

import torch

from functional_pp.ops import reduce as R
from functional_pp.ops.shape import the_one_dim
from functional_pp.parallel.named import Named, make_named, settle


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fused(t: torch.Tensor, i: tuple[int, ...], eps: float, center: bool) -> torch.Tensor:
    """Normalise ``t`` over its whole local dimensions ``i`` (in float32 for 16-bit blocks)."""
    wide = _wide(t.dtype)
    t32 = t if t.dtype == wide else t.to(wide)
    if center:
        t32 = t32 - t32.mean(dim=i, keepdim=True)
    out = t32 * torch.rsqrt(t32.pow(2).mean(dim=i, keepdim=True) + eps)
    return out if out.dtype == t.dtype else out.to(t.dtype)


def _normalize(x: Named, dims: tuple[str, ...], eps: float, center: bool) -> Named:
    if not isinstance(x, Named) or x._partial:     # (settle names an unnamed operand)
        x = settle(x)
    for dim in dims:
        if dim not in x._dims:
            x._check_dim(dim, "norm")
    i = tuple(x._dims.index(dim) for dim in dims)
    if not any(x._split[j] for j in i):     # the whole dimensions are local: one fused computation
        return make_named(_fused(x._data, i, eps, center), x._dims, x._split, x._vary, x._partial, x._sizes)
    xf = x.astype(_wide(x.data.dtype))
    if center:
        xf = xf - R.mean(xf, dims)
    out = xf * (R.mean(xf * xf, dims) + eps).map(torch.rsqrt)
    return out.astype(x.data.dtype)


def _norm_dim(op: str, weight: Named | None, dim: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if dim is not None:
        return (dim,) if isinstance(dim, str) else tuple(dim)
    if not isinstance(weight, Named):
        raise ValueError(f"{op}: name the normalised dimension (dim='...'); it is read from the weight "
                         f"only when a named weight is given")
    return (the_one_dim(op, "dim", weight.dims, "the weight's dimension"),)


def rms_norm(x: Named, weight: Named | None = None, dim: str | tuple[str, ...] | None = None,
             eps: float = 1e-6) -> Named:
    """x / rms(x) * weight over ``dim`` (by default the weight's one dimension; a tuple of
    dimensions normalises over all of them, split ones through a sum across devices); a weight
    split by the rules is gathered as needed."""
    dim = _norm_dim("rms_norm", weight, dim)
    y = _normalize(x, dim, eps, center=False)
    return y if weight is None else y * weight


def layer_norm(x: Named, weight: Named | None = None, bias: Named | None = None,
               dim: str | tuple[str, ...] | None = None, eps: float = 1e-5) -> Named:
    """(x - mean) / std * weight + bias over ``dim`` (by default the weight's one dimension, or
    the tuple of dimensions given)."""
    dim = _norm_dim("layer_norm", weight if weight is not None else bias, dim)
    y = _normalize(x, dim, eps, center=True)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias
