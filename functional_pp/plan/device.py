"""One representative device for a dry-run: collectives return tensors of the right shape on
the meta device, without talking to anybody (docs/planning.md, "Representative device").

Every device of a mesh runs the same program on blocks of the same shapes (the rules only
accept sizes their mesh axes divide), so rank 0 sends, saves and holds what every device
does. The exceptions are listed in docs/planning.md: permutes that only some devices send
(none in the bundled ops) and code that branches on ``axis_index``."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import DeviceContext, current_context, thread_context


class MetaBackend:
    """Collectives of one device whose peers are imagined: outputs are meta tensors of the
    shape the real collective returns."""

    name = "meta"

    def all_reduce(self, x: torch.Tensor, op: str, group: tuple[int, ...]) -> torch.Tensor:
        return torch.empty_like(x, device="meta")

    def all_gather(self, x: torch.Tensor, dim: int, group: tuple[int, ...]) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] *= len(group)
        return x.new_empty(shape, device="meta")

    def reduce_scatter(self, x: torch.Tensor, dim: int, group: tuple[int, ...], op: str = "sum") -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] //= len(group)
        return x.new_empty(shape, device="meta")

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int,
                   group: tuple[int, ...]) -> torch.Tensor:
        shape = list(x.shape)
        shape[split_dim] //= len(group)
        shape[concat_dim] *= len(group)
        return x.new_empty(shape, device="meta")

    def permute(self, x: torch.Tensor, pairs, group: tuple[int, ...]) -> torch.Tensor:
        return torch.empty_like(x, device="meta")

    def all_to_all_v(self, x: torch.Tensor, send, recv, group: tuple[int, ...]) -> torch.Tensor:
        return x.new_empty((sum(recv), *x.shape[1:]), device="meta")

    def exchange_objects(self, obj, group: tuple[int, ...]) -> list:
        return [obj] * len(group)


@contextmanager
def representative_device(mesh: Mesh, rank: int = 0) -> Iterator[DeviceContext]:
    """Run the block as device ``rank`` of ``mesh`` with imagined peers (this thread only)."""
    if current_context(required=False) is not None:
        raise RuntimeError("plan.estimate cannot run inside functional_pp.launch: call it outside")
    with thread_context(DeviceContext(mesh, rank, MetaBackend(), simulated=True)) as ctx:
        yield ctx
