"""Which simulator runs a simulated training run: the batched one (every device in one batched
run, ``launch(simulate="batched")``) or the threaded one (one thread per device), from the
config's ``simulation`` key or ``--sim-mode`` (docs/simulation.md, "The training loop on the
batched simulator")."""
from __future__ import annotations

from functional_pp.config import ConfigError, TrainConfig

__all__ = ["needs_threads", "simulation_mode", "BATCHED", "THREADED"]

BATCHED, THREADED = "batched", "threaded"


def needs_threads(cfg: TrainConfig) -> list[str]:
    """What in ``cfg`` the batched simulator cannot run (empty: nothing), as config keys."""
    reasons = []
    if cfg.compile:
        reasons.append(f"compile: {cfg.compile} (a batched run is eager: torch.compile does not "
                       f"trace its per-device tensors)")
    if cfg.rl is not None and str(cfg.rl).lower() in ("grpo", "gdpo"):
        reasons.append(f"rl: {cfg.rl} (each device samples the step's completions: one thread per device)")
    if cfg.pp_size > 1:
        reasons.append(f"pp_size: {cfg.pp_size} (each pipeline stage runs its own actions: one thread per device)")
    if cfg.cp_size > 1:
        serial = _serial_under_cp(cfg)
        if serial:
            reasons.append(f"cp_size: {cfg.cp_size} with a recurrence along the sequence ({serial}; each device "
                           f"runs its blocks from the state of the block before: one thread per device)")
    return reasons


def _serial_under_cp(cfg: TrainConfig) -> str | None:
    """The model's layers whose blocks run device after device under cp (``ModelFamily.serial_under_cp``)."""
    from functional_pp.config.models import model_config, model_family
    family = model_family(cfg)
    return family.serial_under_cp(model_config(cfg)) if family.serial_under_cp is not None else None


def simulation_mode(cfg: TrainConfig, world_size: int) -> str:
    """``"batched"`` or ``"threaded"`` for ``cfg`` on ``world_size`` simulated devices.
    ``simulation: threaded`` (the default: docs/simulation.md, "The training loop on the batched
    simulator", says why) is threaded, and so is every one-device run; ``auto`` is batched where
    the config runs eagerly and uses nothing the batched simulator refuses; ``batched`` with a
    config that needs threads raises a :class:`ConfigError` naming the keys."""
    if world_size == 1 or cfg.simulation == THREADED:     # one device: the plain run, as always
        return THREADED
    reasons = needs_threads(cfg)
    if cfg.simulation == BATCHED:
        if reasons:
            raise ConfigError("simulation: batched cannot run this config: " + "; ".join(reasons)
                              + ". Use simulation: threaded (--sim-mode threaded), or change "
                              + ("that key" if len(reasons) == 1 else "those keys"))
        return BATCHED
    return THREADED if reasons else BATCHED
