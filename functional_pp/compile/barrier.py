"""A fusion barrier for compiled steps (docs/compile.md, "bf16 gradients and inductor").

Inductor fuses the whole optimizer update into one CPU kernel together with the last
gradient computations. With 16-bit compute and a weight used twice in different layouts
(tied embeddings: the embedding's rows and the output head's columns), the gradient of the
transposed use is read there as 32x32 bf16 tiles, and in that fused kernel the tiles come
out partly uninitialised: embed_tokens and its optimizer state turn NaN after one step while
the loss and the gradient norm (computed in other kernels) are finite. Materialising the
gradients of the parameters the forward declared tied (``functional_pp.tied``) through an
opaque op keeps their gradient arithmetic out of the optimizer's kernel (the other
gradients fuse into it: no copy, no launch of their own).
"""
from __future__ import annotations

import torch


@torch.library.custom_op("fpp::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_materialize.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, g):
    return g


_materialize.register_autograd(_backward)


def materialize(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a fresh tensor that a compiler cannot fuse with its consumers."""
    return torch.ops.fpp.materialize(x)
