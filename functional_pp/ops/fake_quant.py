"""Quantization-aware training (Axolotl's ``qat:``, which is torchao's QAT): the linear weights
and their inputs fake-quantized in the forward, the gradient passing the rounding straight
through (docs/quantization.md "Quantization-aware training").

The numerics are torchao's for Axolotl's ``weight_dtype: int4`` with ``activation_dtype: int8``
(``Int4WeightFakeQuantizeConfig(group_size, activation_dtype=bfloat16)`` for the weights:
asymmetric 4-bit per group of ``group_size`` input features; ``IntxFakeQuantizeConfig(int8,
per_token, asymmetric)`` for each linear's input: 8-bit per token, scales outside autograd).
Every decoder linear weight and the LM head are fake-quantized (torchao's ``quantize_`` swaps
every ``nn.Linear``); the embedding, norms and router are not.

Mechanism: :func:`apply` wraps each linear weight of the parameter tree in a :class:`QatWeight`
(an einsum operand, as LoRA's): the einsum gathers the contracted dimensions whole (a group or a
token's row is never cut by a shard), fake-quantizes weight and input there and contracts; the
head goes through :func:`head_pair` under :func:`active` (the loss's own chunked head).
:func:`set_enabled` switches it off before ``fake_quant_after_n_steps``.

``weight_dtype: nvfp4`` with ``activation_dtype: nvfp4`` (torchao's
``NVFP4FakeQuantizeConfig`` with the per-tensor scale, which
``NVFP4DynamicActivationNVFP4WeightConfig`` prepares) is another dtype of the same mechanism:
weight and input each NVFP4-quantized and dequantized (:func:`fake_quant_nvfp4`: E2M1 values in
blocks of 16 contracted features with E4M3 scales, times one fp32 scale from the whole tensor's
largest magnitude: a max over every device's part), gradients straight through, as torchao's
backward computes them from the dequantized operands.

:func:`snap_nvfp4` is the same round trip for LoRA's merge-aware NVFP4 (``nvfp4_merge_aware``,
adapters/lora.py): the merged weight ``W + s A B`` snapped with the frozen base's per-tensor scale
(:func:`nvfp4_scale_of`), one per expert for expert stacks."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from functional_pp.core.runtime import per_thread
from functional_pp.core.tree import map_with_path
from functional_pp.ops.einsum import einsum, parse_pattern, register_operand
from functional_pp.ops.reduce import max as named_max
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named, make_named
from functional_pp.quant.fp4 import NVFP4_BLOCK, nvfp4_per_tensor_scale, nvfp4_round_trip

__all__ = ["QatConfig", "QatWeight", "set_enabled", "enabled", "apply", "adapt", "active", "head_pair", "fake_quant_int4_weight",
           "fake_quant_int8_tokens", "fake_quant_nvfp4", "snap_nvfp4", "nvfp4_scale_of", "LINEAR_WEIGHTS", "DTYPES"]

#: the decoder's linear weights (the names models/quantize.py quantizes, which are nn.Linear in
#: transformers) fake-quantized by QAT
LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                  "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


#: the (weight_dtype, activation_dtype) pairs built: torchao's Int8DynamicActivationInt4Weight and
#: NVFP4DynamicActivationNVFP4Weight (activation_dtype None: int4 weights alone)
DTYPES = (("int4", "int8"), ("nvfp4", "nvfp4"))


@dataclasses.dataclass(frozen=True)
class QatConfig:
    """Axolotl's ``qat:`` block: ``weight_dtype`` / ``activation_dtype`` (:data:`DTYPES`) /
    ``group_size`` / ``fake_quant_after_n_steps`` (steps up to it train without fake quantization)."""
    weight_dtype: str = "int4"
    activation_dtype: str | None = "int8"
    group_size: int = 32
    fake_quant_after_n_steps: int | None = None


_active = per_thread("ops.fake_quant")


class _Switch:
    """Whether fake quantization is on: one for the process (every device thread of a simulated
    run sets the same value at the same step boundary), a global whose attribute
    ``torch.compile``'s guards watch, so that a compiled step is compiled again when it flips."""
    on: bool = True


_SWITCH = _Switch()


def set_enabled(on: bool) -> None:
    """Turn fake quantization on or off for the next forwards (the training loop: off before
    ``fake_quant_after_n_steps``). Read when the loss is called, and kept in the weights it
    hands the model, so that a recomputation in backward matches its forward."""
    _SWITCH.on = bool(on)


def enabled() -> bool:
    return _SWITCH.on


class _RoundSTE(torch.autograd.Function):
    """``round`` whose gradient is the identity (straight-through), as torchao's ``_Round``."""
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def fake_quant_int4_weight(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` ([out, in], groups of ``group_size`` along ``in``) as torchao's
    ``Int4WeightFakeQuantizer`` with bf16 activations computes it: 16 levels between each group's
    minimum and maximum (gradients reach them: its scales are in autograd), rounding straight through."""
    qmin, qmax, mid = 0, 15, 8
    g = w.to(torch.float32).view(w.shape[0], -1, group_size)
    hi = torch.amax(g, dim=-1, keepdim=True)
    lo = torch.amin(g, dim=-1, keepdim=True)
    scale = torch.clamp(hi - lo, min=1e-6) / qmax
    zero = lo + scale * mid
    q = _RoundSTE.apply((g - lo) / scale).clamp(qmin, qmax) - mid
    return (q * scale + zero).view(w.shape).to(w.dtype)


def fake_quant_int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([tokens, features]) as torchao's per-token asymmetric int8 ``IntxFakeQuantizer``:
    each row's range (with 0) in 256 levels; the scales and zero points outside autograd."""
    qmin, qmax = -128, 127
    xf = x
    with torch.no_grad():
        lo = torch.clamp(torch.amin(xf, dim=-1, keepdim=True), max=0)
        hi = torch.clamp(torch.amax(xf, dim=-1, keepdim=True), min=0)
        scale = torch.clamp((hi - lo) / float(qmax - qmin), min=torch.finfo(torch.float32).eps).to(torch.float32)
        zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    q = torch.clamp(_RoundSTE.apply(xf * (1.0 / scale)) + zero, qmin, qmax)
    return ((q - zero) * scale).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """``fake`` in the forward, the gradient reaching ``x`` unchanged (torchao's NVFP4 QAT: its
    backward multiplies by the other operand's dequantized values, nothing flows to the scales)."""
    @staticmethod
    def forward(ctx, x, fake):
        return fake

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quant_nvfp4(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ([rows, K], blocks of 16 along K) through NVFP4 and back (``quant.fp4.nvfp4_round_trip``,
    torchao's ``NVFP4Tensor.to_nvfp4(...).dequantize()``) with the gradient straight through."""
    with torch.no_grad():
        fake = nvfp4_round_trip(x.detach(), per_tensor_scale)
    return _StraightThrough.apply(x, fake)


def _per_tensor_scale(x: Named) -> torch.Tensor:
    """NVFP4's per-tensor scale of the whole ``x`` (every device's part: a max across the axes
    splitting it), outside autograd."""
    with torch.no_grad():
        amax = named_max(make_named(x.data.detach().abs(), x.dims, x.split, x.vary, x.partial, x._sizes))
    return nvfp4_per_tensor_scale(amax.data)


def _whole(x: Named, dims: Sequence[str]) -> Named:
    """``x`` with ``dims`` unsplit (gathered whole on every device) and no pending sum."""
    target = tuple(() if d in dims else s for d, s in zip(x.dims, x.split))
    return relayout(x, target, "qat")


def _as_rows(x: Named, dims: Sequence[str]) -> tuple[torch.Tensor, Callable[[torch.Tensor], Named]]:
    """``x``'s local data as [rows, features] (``dims`` flattened last, in ``x``'s order) and
    the function putting such a tensor back into ``x``'s shape and layout."""
    data = x.data
    cols = [x.dims.index(d) for d in x.dims if d in dims]
    rows = [i for i in range(len(x.dims)) if i not in cols]
    perm = rows + cols
    moved = data.permute(perm)
    shape = moved.shape
    flat = moved.reshape(math.prod(shape[:len(rows)]), math.prod(shape[len(rows):]))
    inverse = [perm.index(i) for i in range(len(perm))]

    def back(t: torch.Tensor) -> Named:
        return make_named(t.reshape(shape).permute(inverse), x.dims, x.split, x.vary, x.partial, x._sizes)
    return flat, back


def _fake_weight(w: Named, contracted: Sequence[str], cfg: QatConfig, where: str) -> Named:
    w = _whole(w, contracted)
    flat, back = _as_rows(w, contracted)
    group = NVFP4_BLOCK if cfg.weight_dtype == "nvfp4" else cfg.group_size
    if flat.shape[1] % group:
        sizes = {d: w._sizes[w.dims.index(d)] for d in contracted}
        raise ValueError(f"qat: {where}: {flat.shape[1]} input features ({sizes}) are not a multiple of "
                         f"qat.group_size {group} (torchao's groups): choose a group_size dividing it")
    if cfg.weight_dtype == "nvfp4":
        return back(fake_quant_nvfp4(flat, _per_tensor_scale(w)))
    return back(fake_quant_int4_weight(flat, group))


def _fake_input(x: Named, contracted: Sequence[str], cfg: QatConfig) -> Named:
    x = _whole(x, contracted)
    flat, back = _as_rows(x, contracted)
    if cfg.activation_dtype == "nvfp4":
        return back(fake_quant_nvfp4(flat, _per_tensor_scale(x)))
    return back(fake_quant_int8_tokens(flat))


def nvfp4_scale_of(base: Named, lead: Sequence[str] = ()) -> Named:
    """The fp32 NVFP4 per-tensor scale of the frozen ``base`` (torchao's ``per_tensor_amax_to_scale``
    of its largest magnitude: a max over every device's part), one per index of its ``lead``
    dimensions (a stack of experts: one per expert, as ModelOpt stores one tensor per expert);
    outside autograd."""
    with torch.no_grad():
        b = make_named(base.data.detach().abs(), base.dims, base.split, base.vary, base.partial, base._sizes)
        amax = named_max(b, [d for d in base.dims if d not in lead])
    return amax.replace(data=nvfp4_per_tensor_scale(amax.data))


def snap_nvfp4(w: Named, scale: Named, contracted: Sequence[str], where: str = "") -> Named:
    """``w`` (a weight whose ``contracted`` dimensions are its input features) quantized to NVFP4 and
    dequantized with the per-tensor ``scale`` (:func:`nvfp4_scale_of`: 0-dim, or over ``w``'s
    leading dimensions, e.g. ``experts``): blocks of 16 input features (gathered whole), fresh
    E4M3 block scales; the gradient straight through to ``w`` (Axolotl's ``nvfp4_merge_aware``).
    The result has ``w``'s layout (each device cuts its part of the gathered blocks)."""
    lead, layout = scale.dims, w.split
    if tuple(w.dims[:len(lead)]) != tuple(lead):
        raise ValueError(f"nvfp4_merge_aware: {where}: the per-tensor scales over {lead} must lead the weight's "
                         f"dimensions {w.dims}")
    w = _whole(w, contracted)
    scale = relayout(scale, tuple(w.split[:len(lead)]), "nvfp4_merge_aware")
    flat, back = _as_rows(w, contracted)
    if flat.shape[1] % NVFP4_BLOCK:
        sizes = {d: w._sizes[w.dims.index(d)] for d in contracted}
        raise ValueError(f"nvfp4_merge_aware: {where}: {flat.shape[1]} input features ({sizes}) are not a multiple "
                         f"of NVFP4's block of {NVFP4_BLOCK}: target only weights whose input features it divides")
    pts = scale.data.to(torch.float32).reshape(-1, 1)
    pts = pts.repeat_interleave(flat.shape[0] // pts.shape[0], dim=0) if lead else pts.reshape(())
    with torch.no_grad():
        fake = nvfp4_round_trip(flat.detach(), pts)
    return relayout(back(_StraightThrough.apply(flat, fake)), layout, "nvfp4_merge_aware")


class QatWeight(NamedTuple):
    """A linear weight as the model's einsum receives it under QAT: the einsum fake-quantizes it
    (groups along its contracted dimensions) and, with ``activations``, its other operand (per
    token), then contracts."""
    base: Named
    cfg: QatConfig
    on: bool = True
    name: str = ""

    def __named_einsum__(self, pattern: str, operands: Sequence[Any], i: int) -> Named:
        if len(operands) != 2:
            raise ValueError(f"qat: einsum {pattern!r} with a fake-quantized weight needs exactly two operands")
        if not self.on:
            return einsum(pattern, *[self.base if j == i else x for j, x in enumerate(operands)])
        ins, out = parse_pattern(pattern, 2)
        contracted = [d for d in ins[i] if d not in out]
        w = _fake_weight(self.base, contracted, self.cfg, self.name or pattern)
        x = operands[1 - i]
        if self.cfg.activation_dtype is not None:
            x = _fake_input(x, contracted, self.cfg)
        return einsum(pattern, *[w if j == i else x for j in range(2)])


register_operand(QatWeight, lambda pattern, operands, i: operands[i].__named_einsum__(pattern, operands, i))


def apply(params: Any, cfg: QatConfig, on: bool = True) -> Any:
    """``params`` with each decoder linear weight (:data:`LINEAR_WEIGHTS`) a :class:`QatWeight`."""
    def wrap(path: str, x: Any) -> Any:
        if isinstance(x, Named) and path.rpartition(".")[2] in LINEAR_WEIGHTS:
            return QatWeight(x, cfg, on, path)
        return x
    return map_with_path(wrap, params)


@contextlib.contextmanager
def active(cfg: QatConfig | None) -> Iterator[None]:
    """Within: :func:`head_pair` fake-quantizes the LM head and its input (this thread)."""
    before = getattr(_active, "cfg", None)
    _active.cfg = cfg
    try:
        yield
    finally:
        _active.cfg = before


def head_pair(x: Named, head: Named, contract: str = "hidden") -> tuple[Named, Named]:
    """``(x, head)`` fake-quantized as torchao's QAT does the LM head (an ``nn.Linear``) when QAT
    is active and on; else unchanged."""
    cfg = getattr(_active, "cfg", None)
    if cfg is None:
        return x, head
    w = _fake_weight(head, [contract], cfg, "lm_head")
    return (_fake_input(x, [contract], cfg) if cfg.activation_dtype is not None else x), w


def adapt(fn: Callable[..., Any], cfg: QatConfig) -> Callable[..., Any]:
    """``fn(params, ...)`` (a loss or forward) under QAT: the linear weights fake-quantized
    (:func:`apply`) and the head (:func:`active`)."""
    def qat(params: Any, *args: Any, **kwargs: Any) -> Any:
        on = enabled()
        with active(cfg if on else None):
            return fn(apply(params, cfg, on), *args, **kwargs)
    qat.__name__ = getattr(fn, "__name__", "qat")
    return qat
