"""A model's frozen base quantized for QLoRA (``load_in_4bit``) or ``load_in_8bit``: the linear
weights of the layers become :class:`~functional_pp.quant.weights.QuantizedWeight` leaves
(NF4 or int8, blocks along each weight's input features, or over the whole flattened weight where
those do not hold whole blocks: as bitsandbytes quantizes the Hugging Face weight); with
``experts=True`` (Axolotl's ``quantize_moe_experts``) the experts' stacked weights too, each stack
as bitsandbytes quantizes the stacked ``[experts, out, in]`` tensor; embeddings, the head, the
router and norms stay as they are (docs/quantization.md)."""
from __future__ import annotations

from typing import Any

import torch

from functional_pp.core.tree import Param, map_with_path
from functional_pp.models.pixtral import TOWERS
from functional_pp.quant.weights import (FLAT_BLOCKS, FLAT_SCALES, INT8_BLOCK, NF4_BLOCK, QuantizedWeight, flat_block_dim,
                                        flat_scale_name, quantize_int8, quantize_nf4)

__all__ = ["LINEAR_BLOCK_DIMS", "EXPERT_BLOCK_DIMS", "EXPERTS", "block_dim", "quantize_linear_weights", "quantized_decls", "component_decls", "KINDS", "ROW_SCALE",
           "FLAT_BLOCKS", "FLAT_SCALES", "flat_block_dim"]

#: the decoder's linear weights -> the dimension bitsandbytes' blocks run along (the innermost
#: input feature of the Hugging Face weight: o_proj's in_features are (heads head_dim))
LINEAR_BLOCK_DIMS = {"q_proj": "hidden", "k_proj": "hidden", "v_proj": "hidden",
                     "o_proj": ("head_dim", "v_dim", "v_head_dim"),
                     "gate_proj": "hidden", "up_proj": "hidden", "down_proj": "mlp",
                     # multi-head latent attention (models/mla.py; its o_proj's input is v_dim)
                     "q_a_proj": "hidden", "q_b_proj": "q_rank", "kv_a_proj_with_mqa": "hidden",
                     "kv_b_proj": "kv_rank",
                     # Gated DeltaNet (models/gated_deltanet.py; in_proj_q / k / v: the rows of HF's in_proj_qkv)
                     **{f"in_proj_{x}": "hidden" for x in "qkvzba"},
                     # Kimi Delta Attention (models/kimi_delta.py): the low-rank decay and output gates (b_proj: below)
                     "f_a_proj": "hidden", "f_b_proj": "gate_rank", "g_a_proj": "hidden", "g_b_proj": "gate_rank",
                     # Mamba2 (models/mamba2.py; z / x / B / C / dt: the rows of HF's in_proj)
                     **{f"{x}_proj": "hidden" for x in ("z", "x", "b", "c", "dt")},
                     # Mamba (v1) (models/mamba1.py: in_proj x and z, x_proj dt / B / C of the channels, dt_proj of
                     # the time step's rank, out_proj of the channels)
                     "in_proj": "hidden", "x_proj": ("hidden", "mamba_inner"), "dt_proj": ("hidden", "mamba_dt_rank"),
                     "out_proj": ("v_head_dim", "ssm_head_dim", "mamba_inner")}
#: the experts' stacked weights (models/moe.py: ``experts hidden mlp`` / ``experts mlp hidden``)
#: -> their input dimension; quantized with ``experts=True``, the :data:`EXPERTS` dimension first
EXPERT_BLOCK_DIMS = {"gate": "hidden", "up": "hidden", "down": "mlp"}
EXPERTS = "experts"
KINDS = ("nf4", "int8")
#: the name of ``absmax2``'s last dimension when the scales are double-quantized one block per
#: row (``absmax``'s last dimension shorter than 256): its size is 1, it is never split (each
#: device's part of a row uses the row's one scale), whatever splits the weight's last dimension
ROW_SCALE = "scale_row"


#: the subtrees left unquantized: a vision-language model's encoder and projector (models/pixtral.py), kept
#: frozen in the compute dtype under QLoRA (bitsandbytes would quantize their linears too)
UNQUANTIZED = tuple(f"{k}." for k in TOWERS)


def block_dim(name: str, dims: tuple[str, ...], table: dict | None = None) -> str | None:
    """The dimension of ``dims`` that the blocks of weight ``name`` run along (``table``, default
    :data:`LINEAR_BLOCK_DIMS`: a name or several, the first that ``dims`` has); None: not a
    quantized weight."""
    want = (LINEAR_BLOCK_DIMS if table is None else table).get(name)
    if want is None:
        return None
    candidates = (want,) if isinstance(want, str) else tuple(want)
    return next((d for d in candidates if d in dims), candidates[0])


def component_decls(q: QuantizedWeight, decl: Any, block_dim: int | None = None, lead: int = 0) -> QuantizedWeight:
    """Declarations of the components of ``q`` (made from the full weight declared by ``decl``):
    each with the weight's dimension names and its own global shape and dtype; the 0-dim offset
    of double quantization replicated, and so is the last dimension of ``absmax2`` when it holds
    one scale per row (:data:`ROW_SCALE`). A flat ``q`` (its ``block_dim`` given): the codes with
    the weight's names, the 1-D scales named :data:`FLAT_BLOCKS` + the block dimension's name and
    :data:`FLAT_SCALES` (replicated); a stack's scales name its ``lead`` batch dimensions too."""
    dims = tuple(decl.dims)
    if q.flat:
        if block_dim is None:
            raise ValueError("component_decls: a flat quantized weight needs its block_dim")
        flat_names = (dims, (flat_scale_name(dims[block_dim], dims[:lead]),), (FLAT_SCALES,), ())
        return QuantizedWeight(*(None if c is None else Param(tuple(c.shape), n, dtype=c.dtype, init="zeros")
                                 for c, n in zip(q, flat_names)))
    row = q.absmax2 is not None and q.absmax2.shape[-1] == 1 and q.absmax.shape[-1] > 1

    def names(i: int, c: torch.Tensor) -> tuple[str, ...]:
        if not c.ndim:
            return ()
        return dims[:-1] + (ROW_SCALE,) if i == 2 and row else dims
    return QuantizedWeight(*(None if c is None else
                             Param(tuple(c.shape), names(i, c), dtype=c.dtype, init="zeros")
                             for i, c in enumerate(q)))


def quantize_linear_weights(params: Any, decls: Any, kind: str = "nf4", *, double_quant: bool = True,
                            block: int | None = None,
                            block_dims: dict[str, str] | None = None, experts: bool = False) -> tuple[Any, Any]:
    """``(params, decls)`` with each leaf whose last path key is in ``block_dims`` (default
    :data:`LINEAR_BLOCK_DIMS`; with ``experts`` also :data:`EXPERT_BLOCK_DIMS`, the stacks in the
    flat form over their ``[experts, out, in]`` order) replaced by its quantization (``kind``: ``nf4`` with
    ``double_quant`` as ``bnb_4bit_use_double_quant``, or ``int8``) and its declaration by the
    components' (:func:`component_decls`). ``params`` are full (unsharded) tensors, e.g. a
    Hugging Face checkpoint loaded into the model's tree; shard the result with the returned
    declarations. A weight whose block dimension holds whole blocks takes the blocked form
    (sharded as the weight); any other the flat form, bitsandbytes' layout for every shape
    (quant/weights.py; its codes sharded as the weight, its scales replicated)."""
    if kind not in KINDS:
        raise ValueError(f"quantize_linear_weights: kind={kind!r}: choose one of {', '.join(KINDS)}")
    table = dict(LINEAR_BLOCK_DIMS if block_dims is None else block_dims)
    if experts:
        table.update(EXPERT_BLOCK_DIMS)
    size = block or (NF4_BLOCK if kind == "nf4" else INT8_BLOCK)
    out_decls: dict[str, Any] = {}

    def one(path: str, x: torch.Tensor, d: Any):
        name = path.rsplit(".", 1)[-1]
        if name not in table or path.startswith(UNQUANTIZED):
            out_decls[path] = d
            return x
        dims = tuple(d.dims)
        along = block_dim(name, dims, table)
        if along not in dims:
            raise ValueError(f"{path}: block dimension {along!r} is not one of its dimensions {dims}")
        dim = dims.index(along)
        lead = 0
        if experts and name in EXPERT_BLOCK_DIMS:
            if dims[0] != EXPERTS:
                raise ValueError(f"{path}: an expert weight's first dimension must be {EXPERTS!r}, not {dims}")
            lead = 1
        try:
            q = (quantize_nf4(x, dim, block=size, double_quant=double_quant, lead=lead) if kind == "nf4"
                 else quantize_int8(x, dim, block=size, lead=lead))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        out_decls[path] = component_decls(q, d, dim, lead)
        return q

    quantized = map_with_path(one, params, decls)
    new_decls = map_with_path(lambda p, x, d: out_decls[p], params, decls)
    return quantized, new_decls


def quantized_decls(decls: Any, kind: str = "nf4", *, double_quant: bool = True, block: int | None = None,
                    block_dims: dict[str, str] | None = None, experts: bool = False) -> Any:
    """The declarations :func:`quantize_linear_weights` returns for weights declared by ``decls``
    (computed on the meta device: no weight is made)."""
    meta = map_with_path(lambda p, d: torch.empty(d.shape, dtype=d.dtype, device="meta"), decls)
    return quantize_linear_weights(meta, decls, kind, double_quant=double_quant, block=block,
                                   block_dims=block_dims, experts=experts)[1]
