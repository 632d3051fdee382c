"""Real devices through torch.distributed functional collectives (gloo on CPU, NCCL on CUDA).

Functional collectives are traced by ``torch.compile(fullgraph=True)``. Process groups are
created once per set of mesh axes; torch orders a group's ranks ascending, so results are
reordered where our group order (first axis major) differs.

Mechanism: Devices (real processes: torch.distributed, gloo or NCCL).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from functional_pp._torch import is_tracing
from functional_pp._torch.distributed import all_gather_single, funcol, reduce_scatter_single
from functional_pp.core.mesh import Mesh
from functional_pp.devices.slow_link import SlowLink
from functional_pp.devices.slow_link import from_env as slow_link_from_env


class DistBackend:
    """Backend of one torch.distributed rank."""

    name = "torch.distributed"

    def __init__(self, mesh: Mesh, rank: int, timeout: float | None = None):
        import datetime
        self.mesh = mesh
        self.rank = rank
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.link = slow_link_from_env()     # FPP_SLOW_LINK_MS: an artificially slow link (benchmarks)
        axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
        # Every rank creates every group in the same order (new_group is collective).
        for k in range(1, len(axes) + 1):
            for subset in itertools.combinations(axes, k):
                for g in mesh.groups(subset):
                    key = tuple(sorted(g))
                    if key not in self._groups:
                        self._groups[key] = dist.new_group(
                            list(key), timeout=None if timeout is None else datetime.timedelta(seconds=timeout))

    def _pg(self, group: tuple[int, ...]):
        return self._groups[tuple(sorted(group))]

    @staticmethod
    def _order(group: tuple[int, ...]) -> list[int]:
        """For each group index, its position in torch's ascending group."""
        srt = sorted(group)
        return [srt.index(r) for r in group]

    def _slow(self, kind: str, x, group) -> float | None:
        """With a slow link: when the collective of ``x`` issued now completes (else None)."""
        if self.link is None or is_tracing():
            return None
        return self.link.reserve(kind, x.numel(), len(group), x.element_size())

    def _sync(self, done_at: float | None, out):
        if done_at is not None:
            SlowLink.until(done_at)
        return out

    def all_reduce(self, x, op, group):
        done_at = self._slow("all_reduce", x, group)
        return self._sync(done_at, funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, self._pg(group))))

    def start_all_reduce(self, x, group):
        """Launch a sum all-reduce of the contiguous ``x`` in place, asynchronously; returns a
        function that waits and gives ``x`` back (gradient buckets, functional_pp.parallel.buckets.eager)."""
        done_at = self._slow("all_reduce", x, group)
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._pg(group), async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return self._sync(done_at, x)
        return wait

    def start_all_gather(self, x, group):
        """Launch an all-gather of ``x`` along dim 0, asynchronously; returns a function that
        waits and gives the blocks in group order (FSDP unit prefetch, functional_pp.parallel.fsdp.units)."""
        n = len(group)
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        done_at = self._slow("all_gather", x, group)
        work = dist.all_gather_into_tensor(out, x, group=self._pg(group), async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            self._sync(done_at, None)
            order = self._order(group)
            if order == sorted(order):
                return out
            parts = out.chunk(n, dim=0)
            return torch.cat([parts[p] for p in order], dim=0)
        return wait

    def start_reduce_scatter(self, x, group):
        """Launch a sum reduce-scatter of ``x`` along dim 0, asynchronously (``x`` holds the
        group's blocks in group order); returns a function that waits and gives this rank's
        block (FSDP units' gradients, functional_pp.parallel.fsdp.units)."""
        n = len(group)
        order = self._order(group)
        if order != sorted(order):        # torch's group is ascending: send the blocks in its order
            parts = x.chunk(n, dim=0)
            inv = [0] * n
            for i, p in enumerate(order):
                inv[p] = i
            x = torch.cat([parts[inv[p]] for p in range(n)], dim=0)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        done_at = self._slow("reduce_scatter", x, group)
        work = dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=self._pg(group), async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return self._sync(done_at, out)
        return wait

    def all_gather(self, x, dim, group):
        done_at = self._slow("all_gather", x, group)
        out = self._sync(done_at, funcol.wait_tensor(all_gather_single(x.contiguous(), dim, self._pg(group))))
        order = self._order(group)
        if order != sorted(order):
            parts = out.chunk(len(group), dim=dim)
            out = torch.cat([parts[p] for p in order], dim=dim)
        return out

    def reduce_scatter(self, x, dim, group, op="sum"):
        order = self._order(group)
        if order != sorted(order):
            parts = x.chunk(len(group), dim=dim)
            inv = [0] * len(order)
            for i, p in enumerate(order):
                inv[p] = i
            x = torch.cat([parts[inv[p]] for p in range(len(group))], dim=dim)
        done_at = self._slow("reduce_scatter", x, group)
        return self._sync(done_at, funcol.wait_tensor(reduce_scatter_single(x.contiguous(), op, dim, self._pg(group))))

    def all_to_all(self, x, split_dim, concat_dim, group):
        n = len(group)
        order = self._order(group)
        inv = [0] * n
        for i, p in enumerate(order):
            inv[p] = i
        # torch's all_to_all_single splits dim 0 among ascending ranks.
        parts = x.chunk(n, dim=split_dim)
        send = torch.stack([parts[inv[p]].contiguous() for p in range(n)])
        done_at = self._slow("all_to_all", send, group)
        recv = self._sync(done_at, funcol.wait_tensor(funcol.all_to_all_single(send, None, None, self._pg(group))))
        recv_parts = recv.unbind(0)
        return torch.cat([recv_parts[order[i]] for i in range(n)], dim=concat_dim)

    def all_to_all_v(self, x, send, recv, group):
        """Uneven all-to-all along dim 0: ``send[j]`` rows of ``x`` (in group order) go to group
        member j, ``recv[j]`` rows come from it; torch's ``all_to_all_single`` with split sizes,
        its ascending ranks mapped to our group order (expert parallelism, docs/experts.md)."""
        n = len(group)
        order = self._order(group)
        inv = [0] * n
        for i, p in enumerate(order):
            inv[p] = i
        parts = list(x.split(list(send), dim=0))
        payload = torch.cat([parts[inv[p]] for p in range(n)], dim=0).contiguous()
        send_sorted, recv_sorted = [int(send[inv[p]]) for p in range(n)], [int(recv[inv[p]]) for p in range(n)]
        done_at = self._slow("all_to_all", payload, group)
        out = self._sync(done_at, funcol.wait_tensor(funcol.all_to_all_single(payload, recv_sorted, send_sorted,
                                                                              self._pg(group))))
        got = out.split(recv_sorted, dim=0)
        return torch.cat([got[order[i]] for i in range(n)], dim=0)

    def permute(self, x, pairs, group):
        """Send ``x`` along ``pairs`` (group indices (source, destination)); a device that
        receives nothing gets zeros. One all-to-all of the flattened tensor whose split sizes
        are the element count towards this device's destination and from its source (zero
        elsewhere), so any shape, dim order and dtype travels and idle devices send nothing
        (see docs/real_processes.md)."""
        n = len(group)
        order = self._order(group)
        me = group.index(self.rank)
        flat = x.contiguous().reshape(-1)
        send = [0] * n
        recv = [0] * n
        for src, dst in pairs:
            if src == me:
                send[order[dst]] = flat.numel()
            if dst == me:
                recv[order[src]] = flat.numel()
        payload = flat if any(send) else flat[:0]     # the input must be exactly what is sent
        done_at = self._slow("permute", payload, group)
        out = self._sync(done_at, funcol.wait_tensor(funcol.all_to_all_single(payload, recv, send, self._pg(group))))
        if not any(recv):
            return torch.zeros_like(x)
        return out.reshape(x.shape)

    def exchange_objects(self, obj, group):
        """Every group member's ``obj`` in group order (only the group's ranks take part)."""
        if len(group) == 1:
            return [obj]
        whole = len(group) == dist.get_world_size()
        out = [None] * len(group)
        dist.all_gather_object(out, obj, group=None if whole else self._pg(group))
        return [out[p] for p in self._order(group)]
