"""The training loop's view of the devices it runs for (docs/simulation.md, "The training loop
on the batched simulator"). The questions whose answer depends on the kind of device
(:func:`is_lead`, :func:`agree_to_stop`, :func:`lead_value`, :func:`runs_all_devices`) are
answered by ``devices/mesh_view.py``; this module gathers them with the loader and the save.

Under the threaded simulator and torchrun the loop's device function runs once per device,
each with its integer rank; under the batched simulator (``launch(simulate="batched")``) it
runs once for all devices, and the Python of the loop is the host of every one of them. The
loop asks this module instead of reading the rank:

- :func:`is_lead`: whether this code speaks for rank 0 (prints, logs, writes reports);
- :func:`agree_to_stop`: every device stops at the same step boundary;
- :func:`lead_value`: a value read as rank 0 reads it (a saved RNG state);
- :func:`device_loader`: this device's data loader, or one loader per device whose batches are
  stacked (:class:`StackedLoader`);
- :func:`save_on_devices`: a checkpoint save, on one thread per device in a batched run.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch

from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_rank
from functional_pp.devices.device_threads import on_device_threads
# what differs between a rank and a batched run is answered in devices/ (the simulator seam)
from functional_pp.devices.mesh_view import agree_to_stop, is_lead, lead_value, per_device, runs_all_devices

__all__ = ["runs_all_devices", "is_lead", "agree_to_stop", "lead_value", "device_loader",
           "StackedLoader", "save_on_devices"]


class StackedLoader:
    """One data loader per device of a batched run, read together: each batch is every
    device's own batch stacked (:func:`functional_pp.per_device`). The loaders move in
    lockstep, so the position (``state_dict``, ``step``, ``epoch``) is device 0's."""

    def __init__(self, loaders: list):
        self.loaders = loaders

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return per_device(lambda: next(self.loaders[current_rank()]))

    def batch(self, step: int, **kw: Any) -> dict[str, torch.Tensor]:
        """Batch ``step`` of every device, stacked (``kw``: :meth:`DataLoader.batch`'s)."""
        return per_device(lambda: self.loaders[current_rank()].batch(step, **kw))

    def state_dict(self) -> dict[str, Any]:
        return self.loaders[0].state_dict()

    def load_state_dict(self, state: Mapping[str, Any], check_tokens: bool = True) -> None:
        for loader in self.loaders:
            loader.load_state_dict(state, check_tokens)

    def __len__(self) -> int:
        return len(self.loaders[0])

    def __getattr__(self, name: str) -> Any:     # step, epoch, num_windows, global_batch_size...
        if name == "loaders":
            raise AttributeError(name)
        return getattr(self.loaders[0], name)


def device_loader(build: Callable[[dict], Any], mesh: Mesh, rules: Rules):
    """``build(loader_args)`` for this device's block of the batch (``batch_shard``'s
    ``loader_args``); in a batched run a :class:`StackedLoader` of one per device."""
    from functional_pp.data import batch_shard
    if not runs_all_devices():
        return build(batch_shard(mesh, rules).loader_args())
    return StackedLoader([build(batch_shard(mesh, rules, r).loader_args()) for r in range(mesh.size)])


def save_on_devices(save: Callable[[Any], Any], state: Any) -> Any:
    """``save(state)`` on every device (a checkpoint save: per-rank files, rank 0's index);
    in a batched run on one thread per device, each with its block of ``state``. Returns
    what ``save`` returned (rank 0's in a batched run)."""
    return on_device_threads(save, state)[0]
