"""The batched simulator's backend: collectives computed once over the device dimension of
:class:`DeviceStack` values (docs/simulation.md, "Batched simulation").

Device r of the mesh holds ``x.stacked[r]``; the mesh is row-major, so ``x.stacked`` viewed as
``(*mesh.shape, *block)`` has one dimension per mesh axis. A group along ``axes`` is then a set
of mesh dimensions: every collective moves those to the front (group index first-axis-major,
as docs/collectives.md orders a group), combines or exchanges the blocks there and moves them
back. Sums run left to right over the group, in the order and so with the rounding of the
threaded simulator (devices/sim.py). Every result is a fresh contiguous tensor.

Mechanism: Devices (batched simulator: its collectives).
"""
from __future__ import annotations

import torch

from functional_pp.core.mesh import Mesh
from functional_pp.devices.device_stack import DeviceStack, as_device_stack


class BatchedRank:
    """The ``rank`` of a batched run's context: there is no single running device, so code that
    asks for one integer rank (instead of ``axis_index`` values) is refused by name."""

    def _refuse(self, *_):
        raise RuntimeError(
            "batched simulation: this code asked for the running device's rank as one integer, but a "
            "batched run runs every device at once; use functional_pp.axis_index (a per-device value "
            "there) or functional_pp.per_device(fn), or launch(simulate=True) (one thread per device)")

    __index__ = __int__ = __lt__ = __le__ = __gt__ = __ge__ = __add__ = __radd__ = __mul__ = __rmul__ = \
        __floordiv__ = __mod__ = __sub__ = __rsub__ = _refuse

    def __eq__(self, other):
        # ``rank == 0`` would otherwise be silently False on every device (the lead device's
        # work skipped without a word): refused like the other integer uses
        if isinstance(other, int):
            self._refuse()
        return NotImplemented

    def __ne__(self, other):
        if isinstance(other, int):
            self._refuse()
        return NotImplemented

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return "<every device (batched)>"


class BatchedBackend:
    """Collectives of a batched run over the mesh ``mesh`` (groups given as ``AxesGroup``)."""

    name = "batched"

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n = mesh.size
        self.sizes = [mesh.shape[a] for a in mesh.axis_names]
        # the device of the run's per-device values (the last ones ``per_device`` stacked; the
        # CPU before any): where values made without an input tensor (axis_index) are made
        self.device: torch.device | None = None

    # ------------------------------------------------------------ group-major layout
    def group_major(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """``x``'s stacked blocks as ``(G, R, *block)``: G = group index (first axis major),
        R = which group (the other mesh axes, in mesh order)."""
        s = as_device_stack(x, self.n).stacked
        block = s.shape[1:]
        pos = [self.mesh.axis_names.index(a) for a in axes]
        rest = [i for i in range(len(self.sizes)) if i not in pos]
        v = s.reshape(*self.sizes, *block).permute(*pos, *rest, *range(len(self.sizes), s.ndim - 1 + len(self.sizes)))
        g = 1
        for i in pos:
            g *= self.sizes[i]
        return v.reshape(g, self.n // g, *block)

    def from_group_major(self, y: torch.Tensor, axes: tuple[str, ...]) -> DeviceStack:
        """Inverse of :meth:`group_major`: ``(G, R, *block)`` back to a fresh ``DeviceStack``."""
        pos = [self.mesh.axis_names.index(a) for a in axes]
        rest = [i for i in range(len(self.sizes)) if i not in pos]
        order = pos + rest
        block = y.shape[2:]
        v = y.reshape(*[self.sizes[i] for i in order], *block)
        inverse = [order.index(i) for i in range(len(order))]
        v = v.permute(*inverse, *range(len(order), len(order) + len(block)))
        return DeviceStack(v.reshape(self.n, *block).contiguous())

    @staticmethod
    def _axes(group) -> tuple[str, ...]:
        axes = getattr(group, "axes", None)
        if axes is None:
            raise RuntimeError(f"batched simulation: a collective over the group of ranks {group} "
                               f"(a batched run names groups by mesh axes only)")
        return axes

    @staticmethod
    def _combine(g: torch.Tensor, op: str) -> torch.Tensor:
        """Left-to-right reduction of ``g``'s leading dimension (the threaded simulator's order)."""
        f = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
        out = f(g[0], g[1]) if len(g) > 1 else g[0].clone()
        for i in range(2, len(g)):
            out = f(out, g[i], out=out) if op != "sum" else out.add_(g[i])
        return out

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor, op: str, group) -> DeviceStack:
        axes = self._axes(group)
        g = self.group_major(x, axes)
        red = self._combine(g, op)
        return self.from_group_major(red.unsqueeze(0).expand_as(g), axes)

    def all_gather(self, x: torch.Tensor, dim: int, group) -> DeviceStack:
        axes = self._axes(group)
        g = self.group_major(x, axes)                      # G R *block
        whole = torch.cat(list(g), dim=dim + 1)            # R *block (dim grown G times)
        return self.from_group_major(whole.unsqueeze(0).expand(len(g), *whole.shape), axes)

    def reduce_scatter(self, x: torch.Tensor, dim: int, group, op: str = "sum") -> DeviceStack:
        axes = self._axes(group)
        g = self.group_major(x, axes)
        red = self._combine(g, op)                         # R *block
        return self.from_group_major(torch.stack(red.chunk(len(g), dim=dim + 1)), axes)

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int, group) -> DeviceStack:
        axes = self._axes(group)
        g = self.group_major(x, axes)                      # src R *block
        n = len(g)
        blocks = [list(src.chunk(n, dim=split_dim + 1)) for src in g]    # [src][dst]
        out = [torch.cat([blocks[src][dst] for src in range(n)], dim=concat_dim + 1) for dst in range(n)]
        return self.from_group_major(torch.stack(out), axes)

    def all_to_all_v(self, x: torch.Tensor, send, recv, group) -> DeviceStack:
        """Uneven blocks cannot be stacked: refused, naming the simulators that run it."""
        raise NotImplementedError("all_to_all_v: an uneven all-to-all (expert parallelism) does not run on the "
                                  "batched simulator, whose devices hold equal shapes; launch with "
                                  "simulate=True (threads) or processes=True")

    def permute(self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], group) -> DeviceStack:
        axes = self._axes(group)
        g = self.group_major(x, axes)
        out = torch.zeros_like(g)
        for src, dst in pairs:
            out[dst] = g[src]
        return self.from_group_major(out, axes)

    def local_chunk(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> DeviceStack:
        """Each device's own block ``axis_index(axes)`` of its ``x`` along ``dim``."""
        g = self.group_major(x, axes)
        n = len(g)
        return self.from_group_major(torch.stack([g[i].chunk(n, dim=dim + 1)[i] for i in range(n)]), axes)

    def pad_block(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> DeviceStack:
        """Transpose of :meth:`local_chunk`: each device's ``x`` placed at its block of a
        zero tensor ``group size`` times longer along ``dim``."""
        g = self.group_major(x, axes)
        n = len(g)
        out = torch.zeros(*g.shape[:dim + 2], g.shape[dim + 2] * n, *g.shape[dim + 3:], dtype=g.dtype,
                          device=g.device)
        size = g.shape[dim + 2]
        for i in range(n):
            out[i].narrow(dim + 1, i * size, size).copy_(g[i])
        return self.from_group_major(out, axes)

    def axis_index(self, axes: tuple[str, ...]) -> DeviceStack:
        """Every device's index along ``axes`` (int64, one 0-dim block per device)."""
        return DeviceStack(torch.tensor([self.mesh.axis_index(r, axes) for r in range(self.n)], dtype=torch.int64,
                                        device=self.device))

    def exchange_objects(self, obj, group) -> list:
        raise RuntimeError("batched simulation: exchanging Python objects between devices (a check of "
                           "replicated values) is not supported; use launch(simulate=True)")
