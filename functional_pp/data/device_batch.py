"""One device's block of a global ``[batch, seq]`` batch, read off the mesh and the rules: the
data-parallel rank and size are this device's index along the mesh axes the ``batch``
dimension is split over, the context-parallel ones along the axes of ``seq``, and the rules say
whether ``seq`` is load-balanced (docs/data.md, "Each device's batch"). The one place that
turns a layout into loader arguments; the training loop, the examples and the tests use it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_context
from functional_pp.data.loader import shard_batch

__all__ = ["BatchShard", "batch_shard"]


@dataclass(frozen=True)
class BatchShard:
    """Where one device's block of the global batch lies (rows of ``batch``, part of ``seq``)."""

    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    balanced: bool                 # ``seq`` split in 2 x cp_size load-balanced chunks

    def loader_args(self) -> dict:
        """Keyword arguments of :class:`~functional_pp.data.DataLoader` for this device."""
        return dict(dp_rank=self.dp_rank, dp_size=self.dp_size, cp_rank=self.cp_rank,
                    cp_size=self.cp_size, cp_balanced=self.balanced)

    @property
    def seq_multiple(self) -> int:
        """What a row's length must divide by for this split of its sequence (``cp_size``, in
        ``2 x cp_size`` chunks when load-balanced)."""
        return self.cp_size * (2 if self.balanced else 1)

    def cut(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This device's block of a full batch of ``[B, S, ...]`` tensors."""
        return shard_batch(batch, self.dp_rank, self.dp_size, self.cp_rank, self.cp_size, self.balanced)


def batch_shard(mesh: Mesh, rules: Rules, rank: int | None = None, *,
                dims: tuple[str, str] = ("batch", "seq")) -> BatchShard:
    """The block of ``rank`` (default: the running device, inside :func:`functional_pp.launch`)
    of a batch whose dimensions are named ``dims`` (batch dimension, sequence dimension)."""
    if rank is None:
        rank = current_context().rank
    if not 0 <= rank < mesh.size:
        raise ValueError(f"batch_shard: rank {rank} is not a device of the mesh {dict(mesh.shape)} "
                         f"(ranks 0..{mesh.size - 1})")
    batch_axes, seq_axes = rules.resolve(dims, None, mesh, name="batch")
    return BatchShard(dp_rank=mesh.axis_index(rank, batch_axes), dp_size=mesh.axis_size(batch_axes),
                      cp_rank=mesh.axis_index(rank, seq_axes), cp_size=mesh.axis_size(seq_axes),
                      balanced=bool(seq_axes) and rules.splits_balanced(dims[1], seq_axes))   # the rules own the order
