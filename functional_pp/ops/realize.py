"""A value computed once into a buffer that its users read, in a compiled step (docs/compile.md,
"The residual stream computed once").

Inductor inlines a pointwise value into each of its consumers unless it reads more than a few
buffers: in a whole-step graph the residual stream ``x + attn + mlp + ...`` of a decoder was
summed again inside every norm, forward and backward, from up to five layer outputs (and the
embedding gathered again), where plain torch's forward graph returns each sum for its backward
and so writes it once. ``realized(x)`` makes the compiler write ``x`` (and, in backward, its
gradient) once: a view of the whole value (``as_strided``), which inductor lowers by computing its
input into a buffer. The values are the same; eager steps are unchanged (no op at all)."""
from __future__ import annotations

import torch

from functional_pp._torch import is_tracing
from functional_pp.parallel.named import Named, make_named, settle


class _Realized(torch.autograd.Function):
    """Identity whose forward and backward take a view of the whole tensor: inductor computes
    the viewed value into a buffer rather than inlining it into each consumer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.as_strided(x.size(), x.stride())

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.as_strided(g.size(), g.stride())


def realized(x: Named) -> Named:
    """``x`` itself; in a compiled step, computed once into a buffer that every user reads (and
    its gradient likewise) instead of recomputed inside each user: for a value many kernels read,
    such as a decoder's residual stream."""
    if not isinstance(x, Named):       # (settle names an unnamed operand)
        x = settle(x)
    if not is_tracing():
        return x
    # a pending sum stays pending: this device's block of it is what is written once
    return make_named(_Realized.apply(x._data), x._dims, x._split, x._vary, x._partial, x._sizes)


def computed_once(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor's ``realized``: ``x`` itself eagerly; traced, a view of the whole of it,
    which inductor computes once into a buffer. For a scalar that many loops read, such as the
    update's write guard (docs/compile.md "The write guard computed once"): inlined, each loop
    recomputed it per vector of elements, from loads the C++ compiler cannot hoist past the loop's
    stores."""
    if not is_tracing():
        return x
    return x.as_strided(x.size(), x.stride())
