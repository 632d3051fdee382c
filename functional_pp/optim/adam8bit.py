"""Adam with 8-bit moments: bitsandbytes' blockwise dynamic quantization of the optimizer
state (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021), as a pure
transformation; and with 4-bit moments (torchao's ``AdamW4bit``, Li et al., "Memory Efficient
Optimizers with 4-bit States", 2023): the same update, the first moment with the 4-bit signed
dynamic map, the second with the 16 levels ``1/16 .. 1`` (no zero), blocks of 128, two codes
a byte. Each step dequantizes a leaf's moments to fp32, makes Adam's update from them
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
from functional_pp.optim.adam import bias_correction, check_adam_hyperparameters
from functional_pp.optim.base import FRESH, GradientTransformation, PyTree, new_count, transform, zeros_state
from functional_pp.quant.blockwise import dequantize_blockwise, pack_4bit, quantize_blockwise, unpack_4bit
from functional_pp.quant.codebooks import dynamic_map

BLOCK = 256                # bitsandbytes' block of its 8-bit blockwise optimizers
BLOCK_4BIT = 128           # torchao's block of its 4-bit optimizers


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


class Quantized4(NamedTuple):
    """One moment of one parameter leaf in 4 bits: ``codes`` (uint8, two codes a byte along the
    last dimension, even position in the high nibble: ``(..., L // 2)``) and ``absmax`` (float32,
    ``(..., L // block)``), both with the parameter's dimension names (sharded like it)."""

    codes: torch.Tensor
    absmax: torch.Tensor

    @property
    def block(self) -> int:
        return 2 * self.codes.shape[-1] // self.absmax.shape[-1]

    def param_specs(self, decl: Any) -> "Quantized4":
        """Checkpoint specs (global shapes) of this moment of the parameter declared by ``decl``."""
        shape, dims = tuple(decl.shape), tuple(decl.dims)
        return Quantized4(Param(shape[:-1] + (shape[-1] // 2,), dims, dtype=torch.uint8),
                          Param(shape[:-1] + (shape[-1] // self.block,), dims, dtype=torch.float32))


class ScaleByAdam8bitState(NamedTuple):
    """State of :func:`scale_by_adam_8bit`: ``count`` (0-dim int64) and the moments ``mu`` / ``nu``,
    trees mirroring the parameters whose leaves are :class:`Quantized8` (:class:`Quantized4` for
    4-bit moments; fp32 tensors for leaves kept in 32 bits)."""

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    param_like_fields = ("mu", "nu")   # class attribute, not a field


def moment_block(shape: tuple[int, ...], block: int = BLOCK, bits: int = 8) -> int | None:
    """The block along the last dimension that low-bit moments of a leaf of ``shape`` use, or None
    where the leaf keeps fp32 moments (fewer than two dimensions, an empty last dimension, or
    one above ``block`` that is not a multiple of it; 4 bits: an odd one, codes go two a byte)."""
    if len(shape) < 2 or shape[-1] == 0 or (bits == 4 and shape[-1] % 2):
        return None
    last = shape[-1]
    if last % block == 0:
        return block
    return last if last < block else None


def _zero_moment(p: torch.Tensor, block: int | None, bits: int = 8) -> Any:
    if block is None:
        return zeros_state(p)
    absmax = torch.zeros((*p.shape[:-1], p.shape[-1] // block), dtype=torch.float32, device=p.device)
    if bits == 4:
        return Quantized4(torch.zeros((*p.shape[:-1], p.shape[-1] // 2), dtype=torch.uint8, device=p.device), absmax)
    return Quantized8(torch.zeros(p.shape, dtype=torch.uint8, device=p.device), absmax)


def _is_moment(x: Any) -> bool:
    return isinstance(x, (Quantized8, Quantized4))


def _dequantize(q: Any, table: torch.Tensor) -> torch.Tensor:
    if isinstance(q, Quantized4):
        return dequantize_blockwise(unpack_4bit(q.codes), q.absmax, table)
    return dequantize_blockwise(q.codes, q.absmax, table)


def _quantize(x: torch.Tensor, table: torch.Tensor, like: Any) -> Any:
    codes, absmax = quantize_blockwise(x, table, like.block)
    return Quantized4(pack_4bit(codes), absmax) if isinstance(like, Quantized4) else Quantized8(codes, absmax)


def unsigned_4bit_map() -> torch.Tensor:
    """torchao's 4-bit map of the second moment: the 16 levels ``1/16, 2/16, ..., 1`` (no zero)."""
    return torch.linspace(0, 1, 17)[1:]


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       block: int = BLOCK) -> GradientTransformation:
    """Adam preconditioning ``mu_hat / (sqrt(nu_hat) + eps)`` with bias correction, as
    :func:`functional_pp.optim.scale_by_adam`, the moments stored 8-bit (bitsandbytes' blockwise
    dynamic quantization, ``block`` entries of the last dimension per scale): 2 bytes of state
    per parameter plus 8 per block, instead of 8. The update of a step is made from the new
    moments before they are quantized (as bitsandbytes' kernels do); updates come out fp32."""
    return _scale_by_adam_lowbit("scale_by_adam_8bit", b1, b2, eps, block, 8)


def scale_by_adam_4bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       block: int = BLOCK_4BIT) -> GradientTransformation:
    """:func:`scale_by_adam_8bit` with torchao's 4-bit moments (``AdamW4bit``): the first moment
    with the signed dynamic map of 4 bits (3 exponent bits), the second with the levels
    ``1/16 .. 1``, ``block`` entries of the last dimension per scale (torchao: 128), two codes a
    byte: 1 byte of state per parameter plus 8 per block, instead of 8."""
    return _scale_by_adam_lowbit("scale_by_adam_4bit", b1, b2, eps, block, 4)


def _scale_by_adam_lowbit(name: str, b1: float, b2: float, eps: float, block: int,
                          bits: int) -> GradientTransformation:
    b1, b2, eps = check_adam_hyperparameters(name, b1, b2, eps)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or (bits == 4 and block % 2):
        raise ValueError(f"{name}: block={block!r} must be an {'even ' if bits == 4 else ''}integer >= 2 "
                         f"(bitsandbytes uses 256 for 8 bits, torchao 128 for 4)")
    if bits == 4:
        signed, unsigned = dynamic_map(signed=True, max_exponent_bits=3, total_bits=4), unsigned_4bit_map()
    else:
        signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)

    def init(params: PyTree) -> ScaleByAdam8bitState:
        def zeros(p: torch.Tensor) -> Any:
            return _zero_moment(p, moment_block(tuple(p.shape), block, bits) if p.is_floating_point()
                                else None, bits)
        return ScaleByAdam8bitState(count=new_count(params), mu=optree.tree_map(zeros, params, none_is_leaf=False),
                                    nu=optree.tree_map(zeros, params, none_is_leaf=False))

    def update(updates: PyTree, state: ScaleByAdam8bitState, params: PyTree = None, **extra: Any):
        count = state.count + 1
        g_leaves, spec = optree.tree_flatten(updates, none_is_leaf=False)
        mu_leaves = optree.tree_flatten(state.mu, is_leaf=_is_moment, none_is_leaf=False)[0]
        nu_leaves = optree.tree_flatten(state.nu, is_leaf=_is_moment, none_is_leaf=False)[0]
        if not len(g_leaves) == len(mu_leaves) == len(nu_leaves):
            raise ValueError(f"{name}: {len(g_leaves)} updates for a state of {len(mu_leaves)} "
                             f"parameters; was the state made by init() of the same parameter tree?")
        out, mu, nu = [], [], []
        for g, m_q, v_q in zip(g_leaves, mu_leaves, nu_leaves):
            quantized = _is_moment(m_q)
            m = _dequantize(m_q, signed) if quantized else m_q
            v = _dequantize(v_q, unsigned) if quantized else v_q
            g = g.to(m.dtype)
            c = count.to(device=m.device, dtype=m.dtype)
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            denom = torch.sqrt(v) / torch.sqrt(bias_correction(b2, c)) + eps
            out.append(m / bias_correction(b1, c) / denom)
            if quantized:
                m, v = _quantize(m, signed, m_q), _quantize(v, unsigned, v_q)
            mu.append(m)
            nu.append(v)
        return optree.tree_unflatten(spec, out), ScaleByAdam8bitState(
            count=count, mu=optree.tree_unflatten(spec, mu), nu=optree.tree_unflatten(spec, nu))

    return transform(init, update, FRESH)


def state_bytes(state: PyTree) -> int:
    """Bytes of the tensors of an optimizer state (every leaf, counters included)."""
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(state, none_is_leaf=False)
               if isinstance(x, torch.Tensor))
