"""Adam with 8-bit moments: bitsandbytes' blockwise dynamic quantization of the optimizer
state (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021), as a pure
transformation. Each step dequantizes a leaf's moments to fp32, makes Adam's update from them
(as :func:`functional_pp.optim.adam.scale_by_adam`) and stores the new moments quantized
again: the first with the signed dynamic map, the second with the unsigned one, one absmax
per block of the last dimension (docs/quantization.md "8-bit optimizer state").

Vectors (norms, biases) keep fp32 moments; bitsandbytes keeps every tensor under 4096 entries
in 32 bits, which is about the same set, but here the optimizer sees each device's shard, and a
rule by number of entries would change with the layout, a rule by rank does not. So does a
leaf whose last dimension neither is a multiple of the block nor smaller than it (one whose
last dimension is smaller than the block is quantized in blocks of one row)."""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from functional_pp.core.tree import Param
from functional_pp.optim.adam import check_adam_hyperparameters
from functional_pp.optim.base import FRESH, GradientTransformation, PyTree, new_count, transform, zeros_state
from functional_pp.quant.blockwise import dequantize_blockwise, quantize_blockwise
from functional_pp.quant.codebooks import dynamic_map

BLOCK = 256                # bitsandbytes' block of its 8-bit blockwise optimizers


class Quantized8(NamedTuple):
    """One moment of one parameter leaf, quantized: ``codes`` (uint8, the parameter's shape:
    sharded like it) and ``absmax`` (float32, the parameter's shape with its last dimension
    counted in blocks: ``(..., L // block)``, the same dimension names)."""

    codes: torch.Tensor
    absmax: torch.Tensor

    @property
    def block(self) -> int:
        return self.codes.shape[-1] // self.absmax.shape[-1]

    def param_specs(self, decl: Any) -> "Quantized8":
        """Checkpoint specs of this moment of the parameter declared by ``decl`` (global shape,
        dimension names): the codes like the parameter, the scales with the last dimension in
        blocks of this moment's block."""
        shape, dims = tuple(decl.shape), tuple(decl.dims)
        return Quantized8(Param(shape, dims, dtype=torch.uint8),
                          Param(shape[:-1] + (shape[-1] // self.block,), dims, dtype=torch.float32))


class ScaleByAdam8bitState(NamedTuple):
    """State of :func:`scale_by_adam_8bit`: ``count`` (0-dim int64) and the moments ``mu`` / ``nu``,
    trees mirroring the parameters whose leaves are :class:`Quantized8` (or fp32 tensors for
    leaves kept in 32 bits)."""

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    param_like_fields = ("mu", "nu")   # class attribute, not a field


def moment_block(shape: tuple[int, ...], block: int = BLOCK) -> int | None:
    """The block along the last dimension that 8-bit moments of a leaf of ``shape`` use, or None
    where the leaf keeps fp32 moments (fewer than two dimensions, an empty last dimension, or
    one above ``block`` that is not a multiple of it)."""
    if len(shape) < 2 or shape[-1] == 0:
        return None
    last = shape[-1]
    if last % block == 0:
        return block
    return last if last < block else None


def _zero_moment(p: torch.Tensor, block: int | None) -> Any:
    if block is None:
        return zeros_state(p)
    return Quantized8(torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                      torch.zeros((*p.shape[:-1], p.shape[-1] // block), dtype=torch.float32, device=p.device))


def _is_moment(x: Any) -> bool:
    return isinstance(x, Quantized8)


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       block: int = BLOCK) -> GradientTransformation:
    """Adam preconditioning ``mu_hat / (sqrt(nu_hat) + eps)`` with bias correction, as
    :func:`functional_pp.optim.scale_by_adam`, the moments stored 8-bit (bitsandbytes' blockwise
    dynamic quantization, ``block`` entries of the last dimension per scale): 2 bytes of state
    per parameter plus 8 per block, instead of 8. The update of a step is made from the new
    moments before they are quantized (as bitsandbytes' kernels do); updates come out fp32."""
    b1, b2, eps = check_adam_hyperparameters("scale_by_adam_8bit", b1, b2, eps)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"scale_by_adam_8bit: block={block!r} must be an integer >= 2 (bitsandbytes uses 256)")
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)

    def init(params: PyTree) -> ScaleByAdam8bitState:
        def zeros(p: torch.Tensor) -> Any:
            return _zero_moment(p, moment_block(tuple(p.shape), block) if p.is_floating_point()
                                else None)
        return ScaleByAdam8bitState(count=new_count(params), mu=optree.tree_map(zeros, params, none_is_leaf=False),
                                    nu=optree.tree_map(zeros, params, none_is_leaf=False))

    def update(updates: PyTree, state: ScaleByAdam8bitState, params: PyTree = None, **extra: Any):
        count = state.count + 1
        g_leaves, spec = optree.tree_flatten(updates, none_is_leaf=False)
        mu_leaves = optree.tree_flatten(state.mu, is_leaf=_is_moment, none_is_leaf=False)[0]
        nu_leaves = optree.tree_flatten(state.nu, is_leaf=_is_moment, none_is_leaf=False)[0]
        if not len(g_leaves) == len(mu_leaves) == len(nu_leaves):
            raise ValueError(f"scale_by_adam_8bit: {len(g_leaves)} updates for a state of {len(mu_leaves)} "
                             f"parameters; was the state made by init() of the same parameter tree?")
        out, mu, nu = [], [], []
        for g, m_q, v_q in zip(g_leaves, mu_leaves, nu_leaves):
            quantized = isinstance(m_q, Quantized8)
            m = dequantize_blockwise(m_q.codes, m_q.absmax, signed) if quantized else m_q
            v = dequantize_blockwise(v_q.codes, v_q.absmax, unsigned) if quantized else v_q
            g = g.to(m.dtype)
            c = count.to(device=m.device, dtype=m.dtype)
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            denom = torch.sqrt(v) / torch.sqrt(1.0 - torch.pow(b2, c)) + eps
            out.append(m / (1.0 - torch.pow(b1, c)) / denom)
            if quantized:
                blk = m_q.block
                m, v = Quantized8(*quantize_blockwise(m, signed, blk)), Quantized8(*quantize_blockwise(v, unsigned, blk))
            mu.append(m)
            nu.append(v)
        return optree.tree_unflatten(spec, out), ScaleByAdam8bitState(
            count=count, mu=optree.tree_unflatten(spec, mu), nu=optree.tree_unflatten(spec, nu))

    return transform(init, update, FRESH)


def state_bytes(state: PyTree) -> int:
    """Bytes of the tensors of an optimizer state (every leaf, counters included)."""
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(state, none_is_leaf=False)
               if isinstance(x, torch.Tensor))
