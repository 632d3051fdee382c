"""Functional collectives (``torch.distributed._functional_collectives``): the traceable
collectives the process backend issues, so ``torch.compile`` sees them as graph nodes.

The all-gather and reduce-scatter along a dimension are ``all_gather_single`` and
``reduce_scatter_single`` from torch 2.13 on (which deprecates the older names with a
FutureWarning); torch 2.11 and 2.12 have the same functions, with the same arguments, as
``all_gather_tensor`` and ``reduce_scatter_tensor`` only (:func:`has_single_collectives`;
tests/_torch/test_distributed.py). There, an all-gather along another dimension than the first
gathers along the first and concatenates the blocks itself: torch 2.11's dynamo refuses to
trace the helper ``all_gather_tensor`` uses for it (``torch._utils._maybe_view_chunk_cat``,
marked as skipped)."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["funcol", "has_single_collectives", "all_gather_single", "reduce_scatter_single"]


def has_single_collectives() -> bool:
    """Capability: whether funcol names its dimension-wise all-gather / reduce-scatter
    ``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13 on)."""
    return hasattr(funcol, "all_gather_single") and hasattr(funcol, "reduce_scatter_single")


if has_single_collectives():
    #: ``all_gather_single(x, gather_dim, group)``: the blocks of every rank, concatenated along ``gather_dim``
    all_gather_single = funcol.all_gather_single
    #: ``reduce_scatter_single(x, op, scatter_dim, group)``: the reduction's block of this rank
    reduce_scatter_single = funcol.reduce_scatter_single
else:
    def all_gather_single(x: torch.Tensor, gather_dim: int, group, tag: str = "") -> torch.Tensor:
        out = funcol.all_gather_tensor(x, 0, group, tag)
        if gather_dim == 0:
            return out
        n = out.shape[0] // x.shape[0] if x.shape[0] else dist.get_world_size(group)
        return torch.cat(torch.chunk(funcol.wait_tensor(out), n, dim=0), dim=gather_dim)

    reduce_scatter_single = funcol.reduce_scatter_tensor
