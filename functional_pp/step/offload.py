"""CPU offload of parameters, gradients and optimizer state (``train_step(offload_params=True)``;
Axolotl's ``fsdp_config.offload_params``, torch FSDP2's ``CPUOffloadPolicy``; docs/memory.md
"CPU offload").

Between steps the fp32 master shards and the optimizer state live on the host (pinned where the
compute device is CUDA, so the copies are DMAs). A step copies each shard to the compute device
once, cast there to the compute precision (the fp32 copy is freed at once); forward and backward
run on the device as without offload (FSDP units gather the device shards); the gradients, in
the compute precision as the reduce-scatter leaves them, are copied back to the host and
widened to the master dtype there, exactly what the cast's backward does without offload; the
update runs on the host. The device holds, during a step only, the compute-precision shards and
their gradients: 2 + 2 bytes per parameter and device in bf16 instead of 4 + 4 + 8 (+ 2) with
AdamW."""
from __future__ import annotations

import torch

HOST = torch.device("cpu")


def pins(compute: torch.device) -> bool:
    """Whether host copies for ``compute`` are pinned (page-locked): for a CUDA device."""
    return compute.type == "cuda"


def to_host(x: torch.Tensor, compute: torch.device) -> torch.Tensor:
    """``x`` (a master shard or an optimizer state leaf) as a host tensor, pinned for a CUDA
    ``compute`` device; a host tensor already there is kept."""
    x = x.detach()
    if x.device.type == "cpu" and (not pins(compute) or x.is_pinned()):
        return x
    out = x.to(HOST)
    return out.pin_memory() if pins(compute) else out


def to_compute(x: torch.Tensor, compute: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """A host shard on the ``compute`` device in ``dtype`` (None: its own), not differentiable:
    the step's leaf to differentiate against."""
    with torch.no_grad():
        out = x.to(compute, non_blocking=x.is_pinned())
        return out.to(dtype) if dtype is not None and out.dtype != dtype and out.is_floating_point() else out


def grad_to_host(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A device gradient on the host in the master ``dtype`` (a blocking copy: the update reads
    it next)."""
    return g.to(HOST).to(dtype)
