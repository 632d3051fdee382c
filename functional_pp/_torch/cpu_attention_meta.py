"""The shapes-and-dtypes rule (meta kernel) of CPU flash attention, which inductor plans from.

``aten._scaled_dot_product_flash_attention_for_cpu`` returns the attention and its
``logsumexp``; the CPU kernel computes the ``logsumexp`` in the queries' computation dtype
(float64 for float64 queries). Up to torch 2.11 the meta kernel declared it float32 whatever
the queries: fake tensors, so compiled graphs, carried a float32 ``logsumexp`` while the kernel
gave a float64 one. Inductor then planned the backward's copy of it as float32 and the backward
kernel refused it ("expected scalar type Double but found Float": a float64 model's step
compiled by inductor). From torch 2.13 on (checked in 2.13.0 and 2.15.0) the meta kernel uses
the computation dtype.

:func:`correct_cpu_flash_attention_meta` (run at import) probes the capability
:func:`cpu_flash_attention_meta_matches_kernel` and, where it is missing, registers a meta
kernel that gives the ``logsumexp`` the dtype the CPU kernel gives, in the three places torch
looks one up (tests/_torch/test_cpu_attention_meta.py)."""
from __future__ import annotations

import functools

import torch

_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_LIBRARY: torch.library.Library | None = None


def _logsumexp_dtype(device: str) -> torch.dtype:
    q = torch.zeros(1, 1, 2, 8, dtype=torch.float64, device=device)
    return _OP(q, q, q)[1].dtype


@functools.cache
def cpu_flash_attention_meta_matches_kernel() -> bool:
    """Capability: whether the meta kernel of CPU flash attention gives float64 queries the
    ``logsumexp`` dtype the CPU kernel gives (False on torch 2.11). Probed once, on tiny
    tensors, before :func:`correct_cpu_flash_attention_meta` changes the answer."""
    return _logsumexp_dtype("meta") == _logsumexp_dtype("cpu")


def correct_cpu_flash_attention_meta() -> bool:
    """Where the capability is missing, register a meta kernel whose ``logsumexp`` has the
    kernel's dtype (torch's own meta kernel gives everything else). Returns whether it did."""
    global _LIBRARY
    if cpu_flash_attention_meta_matches_kernel() or _LIBRARY is not None:
        return _LIBRARY is not None
    from torch._meta_registrations import meta__scaled_dot_product_flash_attention_for_cpu as torch_meta
    kernel_dtype = _logsumexp_dtype("cpu")

    def meta(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        out, lse = torch_meta(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        if query.dtype == torch.float64 and lse.dtype != kernel_dtype:
            lse = torch.empty_strided(lse.size(), lse.stride(), dtype=kernel_dtype, device=lse.device)
        return out, lse

    _LIBRARY = torch.library.Library("aten", "IMPL", "Meta")
    _LIBRARY.impl(_OP, meta, allow_override=True)       # the dispatcher's Meta kernel (meta tensors)
    _OP.py_kernels[torch._C.DispatchKey.Meta] = meta    # the Python dispatcher's (AOT autograd's trace)
    _OP._dispatch_cache.clear()
    from torch._decomp import meta_table
    meta_table[_OP] = meta                              # what fake tensors look up
    return True
