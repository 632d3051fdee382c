"""Where a run happens: how many devices and how they run (simulated threads, or one rank per
process under torchrun), which torch device holds this process's parameters, and that
device's peak FLOP/s (docs/real_processes.md)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from functional_pp.app.sim_mode import simulation_mode
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.devices.launch import under_torchrun
from functional_pp.devices.rendezvous import ENV as RANK_ENV

__all__ = ["World", "resolve_world", "is_main_process", "select_device", "peak_flops", "describe_device",
           "PEAK_BF16"]

@dataclass(frozen=True)
class World:
    """How many devices run and how: simulated (batched or threads), or one rank per process
    (torchrun)."""

    size: int
    simulate: bool
    launcher: str          # where the device count comes from, for messages
    sim_mode: str | None = field(default=None, compare=False)   # "batched" | "threaded" (app/sim_mode.py)

    @property
    def launch_mode(self) -> bool | str:
        """``launch``'s ``simulate=``: ``"batched"``, True (threads) or False (torchrun)."""
        return "batched" if self.simulate and self.sim_mode == "batched" else self.simulate


def resolve_world(cfg: TrainConfig, simulate: int | None = None) -> World:
    """The world the run will use: torchrun's ``WORLD_SIZE``, ``--simulate N``, or (outside
    torchrun, without accelerators) the mesh's own size on simulated devices."""
    if under_torchrun():
        n = int(os.environ["WORLD_SIZE"])
        if simulate is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
            named = ", ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in RANK_ENV)
            raise ConfigError(f"--simulate {simulate}: {named} are set in the environment, not by torchrun (no "
                              f"TORCHELASTIC_RUN_ID), left by another launch; unset them (unset "
                              f"{' '.join(RANK_ENV)}) to run simulated devices in this process")
        if simulate is not None:
            raise ConfigError(f"--simulate {simulate} cannot be used under torchrun (which already "
                              f"runs {n} processes); drop one of them")
        return World(n, False, f"torchrun (WORLD_SIZE={n})")
    if simulate is not None:
        if simulate < 1:
            raise ConfigError(f"--simulate needs a device count >= 1, got {simulate}")
        return World(simulate, True, f"--simulate {simulate}", simulation_mode(cfg, simulate))
    n = math.prod(cfg.mesh_sizes(None).values())
    if n > 1 and torch.cuda.is_available():
        raise ConfigError(f"the mesh needs {n} devices: launch with `torchrun --nproc_per_node {n} "
                          f"-m functional_pp train ...`, or pass --simulate {n} to run them as "
                          f"simulated devices in this process")
    return World(n, True, "simulated devices" if n > 1 else "one device", simulation_mode(cfg, n))


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


def select_device(simulate: bool, world_size: int, torchrun: bool,
                  cuda_available: bool | None = None) -> torch.device | None:
    """The device of this process's parameters: the local GPU under torchrun, ``cuda:0`` for a
    single-device run on a machine with a GPU, else the CPU (None)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        return None
    if torchrun:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if world_size == 1:
        return torch.device("cuda", 0)
    return None


#: dense bf16 peak FLOP/s by GPU name (substring match, first hit wins)
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("A10G", 70e12), ("L40S", 362e12), ("L4", 121e12),
             ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12))


def peak_flops(device: torch.device | None, name: str | None = None) -> float | None:
    """Peak bf16 FLOP/s of a known GPU (None: unknown or CPU; set peak_flops_per_device)."""
    if name is None:
        if device is None or device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16:
        if key in name:
            return flops
    return None


def describe_device(device: torch.device | None, simulate: bool, world_size: int,
                    sim_mode: str | None = None) -> str:
    """``cuda:0 (NVIDIA H100 ...)`` / ``cpu`` / ``N simulated devices on the CPU (batched)``."""
    if device is not None and device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if simulate and world_size > 1:
        how = {"batched": " (batched: one run for all devices)",
               "threaded": " (threaded: one thread per device)"}.get(sim_mode or "", "")
        return f"{world_size} simulated devices on the CPU{how}"
    return "cpu"
