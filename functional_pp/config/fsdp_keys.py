"""Axolotl's / Accelerate's FSDP settings (``fsdp``, ``fsdp_config``, ``fsdp_version``) mapped
onto this trainer's FSDP, and ``deepspeed`` refused with the sizes that do the same here.

FSDP here is ``dp_shard`` (every device when no sizes are given): each layer (``@fpp.layer``) is
one unit whose weights are all-gathered before use and reduce-scattered after backward.
``reshard_after_forward: false`` (``SHARD_GRAD_OP``, ZeRO-2) keeps the gathered weights for
backward (the step's ``keep_gathered``); offloading is refused. See docs/config.md."""
from __future__ import annotations

from typing import Any

from functional_pp.config.schema import Issues

__all__ = ["FSDP_KEYS", "fsdp_settings", "deepspeed_refusal", "OFFLOAD_PARAMS", "OFFLOAD_ACTIVATIONS"]

FSDP_KEYS = ("fsdp", "fsdp_config", "fsdp_version", "fsdp_final_state_dict_type")

_UNITS = "FSDP units are the model's layers (@fpp.layer)"
_STATE = "checkpoints are sharded safetensors; export writes the full model"
#: fsdp_config keys (also spelled fsdp_<key>) that ask for what this FSDP does -> the note
_NOTES = {"auto_wrap_policy": _UNITS, "transformer_layer_cls_to_wrap": _UNITS, "min_num_params": _UNITS,
          "state_dict_type": _STATE, "final_state_dict_type": _STATE,
          "cpu_ram_efficient_loading": "each device reads only its slices of base_model",
          "sync_module_states": "each device reads only its slices of base_model",
          "use_orig_params": "parameters keep their names and shapes (a pytree)",
          "limit_all_gathers": "gathers run one layer ahead", "forward_prefetch": "gathers run one layer ahead",
          "backward_prefetch": "gathers run one layer ahead", "version": "one FSDP (per-layer flat gathers)",
          "fsdp_version": "one FSDP (per-layer flat gathers)"}
#: the memory levers of issue 45 that Axolotl's offload keys name, refused until they land
OFFLOAD_PARAMS = ("CPU offload of parameters, gradients and optimizer state under FSDP (torch FSDP2's "
                  "CPUOffloadPolicy; issue 45's memory levers) is not built yet")
OFFLOAD_ACTIVATIONS = ("activation offloading (saved activations moved to host memory during forward; issue 45's "
                       "memory levers) is not built yet")
_OFFLOAD = (f"offloading: {OFFLOAD_PARAMS}: remove it (shard over more devices with dp_shard_size, or "
            f"recompute with gradient_checkpointing)")
_STRATEGIES = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}
_HYBRID = ("is not supported here by that name: give the sizes, dp_replicate_size: <nodes> and "
           "dp_shard_size: <devices per node> (HSDP)")


def fsdp_settings(d: dict, issues: Issues) -> tuple[dict[str, Any], list[str]]:
    """``(canonical keys -> values, start-up notes)`` of the FSDP keys of raw config ``d``."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    if d.get("fsdp_version") is not None:
        if d["fsdp_version"] not in (1, 2):
            issues.add(f"fsdp_version must be 1 or 2, got {d['fsdp_version']!r}")
        notes.append(f"fsdp_version: {d['fsdp_version']} (one FSDP here: per-layer flat gathers, as FSDP2)")
    if d.get("fsdp_final_state_dict_type") is not None:
        notes.append(f"fsdp_final_state_dict_type ({_STATE})")
    words = d.get("fsdp")
    if isinstance(words, str):
        words = words.split()
    for w in words or []:
        if w == "offload":
            issues.add(f"'fsdp: offload' is not supported: {_OFFLOAD}")
        elif w == "shard_grad_op":
            out["reshard_after_forward"] = False
        elif w == "hybrid_shard":
            issues.add(f"'fsdp: hybrid_shard' {_HYBRID}")
        elif w == "no_shard":
            issues.add("'fsdp: no_shard' is not supported by that name: give dp_replicate_size: "
                       "<devices> (plain data parallelism)")
        elif w not in ("full_shard", "auto_wrap"):
            issues.add(f"fsdp: {w!r} is not an FSDP option (full_shard, shard_grad_op, auto_wrap)")
    config = d.get("fsdp_config")
    if config is not None and not isinstance(config, dict):
        issues.add(f"fsdp_config must be a mapping, got {config!r}")
        config = None
    for raw_key, value in (config or {}).items():
        key = raw_key.removeprefix("fsdp_")
        where = f"fsdp_config.{raw_key}"
        if value is None:
            continue
        if key in ("offload_params", "cpu_offload", "activation_cpu_offload"):
            if value:
                issues.add(f"'{where}' is not supported: {_OFFLOAD}")
        elif key == "reshard_after_forward":
            if not isinstance(value, bool):
                issues.add(f"{where} must be true/false, got {value!r}")
            else:
                out["reshard_after_forward"] = value
        elif key == "sharding_strategy":
            name = str(value).upper()
            if name in _STRATEGIES:
                out["reshard_after_forward"] = _STRATEGIES[name]
            elif "HYBRID" in name:
                issues.add(f"'{where}: {value}' {_HYBRID}")
            elif name == "NO_SHARD":
                issues.add(f"'{where}: {value}' is not supported by that name: give "
                           f"dp_replicate_size: <devices> (plain data parallelism)")
            else:
                issues.add(f"{where}: {value!r} is not a sharding strategy (FULL_SHARD, SHARD_GRAD_OP)")
        elif key == "activation_checkpointing":
            out["activation_checkpointing"] = value
        elif key in _NOTES:
            notes.append(f"{where} ({_NOTES[key]})")
        else:
            issues.add(f"unknown key '{where}' (known: offload_params, reshard_after_forward, "
                       f"sharding_strategy, activation_checkpointing, {', '.join(_NOTES)})")
    return out, notes


def deepspeed_refusal(value: Any) -> str:
    """Why ``deepspeed: value`` is refused, with the sizes that do the same here."""
    name = str(value).lower()
    if "zero1" in name or "zero2" in name or "zero_1" in name or "zero_2" in name:
        same = ("dp_shard_size: <devices> with reshard_after_forward: false (weights kept gathered "
                "for backward, as ZeRO-2)")
    else:
        same = "dp_shard_size: <devices> (ZeRO-3 is FSDP here; it is the default when no sizes are given)"
    off = f" Its offloading: {OFFLOAD_PARAMS}." if "offload" in name else ""
    return f"DeepSpeed is not used here: remove deepspeed and give {same}.{off}"
