"""Axolotl's / Accelerate's FSDP settings (``fsdp``, ``fsdp_config``, ``fsdp_version``) and
``deepspeed``'s ZeRO stage mapped onto this trainer's FSDP.

FSDP here is ``dp_shard`` (every device when no sizes are given): each layer (``@fpp.layer``) is
one unit whose weights are all-gathered before use and reduce-scattered after backward.
``reshard_after_forward: false`` (``SHARD_GRAD_OP``, ZeRO-2) keeps the gathered weights for
backward (the step's ``keep_gathered``); ``deepspeed``'s ZeRO stage maps onto the same;
CPU offload (``offload_params``, ``fsdp: offload``, DeepSpeed's ``offload_param`` /
``offload_optimizer`` to the CPU) is ``offload_params``, ``activation_cpu_offload`` is
``activation_offloading`` (docs/memory.md). See docs/config.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from functional_pp.config.schema import Issues

__all__ = ["FSDP_KEYS", "fsdp_settings", "deepspeed_settings"]

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
            out["offload_params"] = True
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
            if not isinstance(value, bool):
                issues.add(f"{where} must be true/false, got {value!r}")
            else:
                out["activation_offloading" if key == "activation_cpu_offload" else "offload_params"] = value
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


#: Axolotl's bundled ``deepspeed_configs/*.json`` -> (ZeRO stage, offloads to the CPU): read by name
#: when the file is not there (a config copied without Axolotl's repository)
BUNDLED_DEEPSPEED = {"zero1.json": (1, False), "zero1_torch_compile.json": (1, False), "zero2.json": (2, False),
                     "zero3.json": (3, False), "zero3_bf16.json": (3, False),
                     "zero3_bf16_cpuoffload_params.json": (3, True), "zero3_bf16_cpuoffload_all.json": (3, True)}


def _zero_stage(value: Any, issues: Issues) -> tuple[int, bool] | None:
    """``(ZeRO stage, offloads anything to the CPU)`` of ``deepspeed: value`` (a JSON file, its text or a
    mapping; a missing file by Axolotl's bundled name), or None with the problem recorded."""
    conf = value
    if isinstance(value, str):
        path = Path(value).expanduser()
        if path.is_file() or value.lstrip().startswith("{"):
            try:
                conf = json.loads(path.read_text() if path.is_file() else value)
            except ValueError as exc:
                issues.add(f"deepspeed: {value} is not valid JSON ({exc})")
                return None
        elif path.name in BUNDLED_DEEPSPEED:
            return BUNDLED_DEEPSPEED[path.name]
        else:
            issues.add(f"'deepspeed' is not supported for {value}: the file does not exist and is not one of "
                       f"Axolotl's deepspeed_configs ({', '.join(BUNDLED_DEEPSPEED)}): give the JSON (its "
                       f"zero_optimization is read) or remove it and give dp_shard_size: <devices> (FSDP)")
            return None
    zero = conf.get("zero_optimization") if isinstance(conf, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3):
        issues.add(f"deepspeed: zero_optimization.stage {stage!r} is not 0, 1, 2 or 3")
        return None
    devices = {zero[k].get("device", "none") for k in ("offload_param", "offload_optimizer")
               if isinstance(zero, dict) and isinstance(zero.get(k), dict)} - {"none", None}
    if devices - {"cpu"}:
        issues.add(f"deepspeed: offloading to {sorted(devices - {'cpu'})[0]!r} is not supported ({value}): only "
                   f"to the CPU (offload_params here); set the offload device to \"cpu\" or remove it")
        return None
    return stage, bool(devices)


def deepspeed_settings(value: Any, issues: Issues) -> tuple[dict[str, Any], list[str]]:
    """``(canonical keys -> values, start-up notes)`` of ``deepspeed: value``: its ZeRO stage
    mapped onto FSDP over ``dp_shard`` (ZeRO-3: the default; ZeRO-1 / 2: the weights kept
    gathered for backward, ``reshard_after_forward: false``, the same math); offloading to the
    CPU is ``offload_params`` (parameters, gradients and optimizer state: DeepSpeed's
    ``offload_optimizer`` alone moves more here); stage 0 (plain data parallelism, sizes to give)
    refused by name."""
    found = _zero_stage(value, issues)
    if found is None:
        return {}, []
    stage, off = found
    offload = {"offload_params": True} if off else {}
    if stage == 0:
        issues.add(f"'deepspeed' ZeRO stage 0 ({value}) is plain data parallelism: remove it and give "
                   f"dp_replicate_size: <devices>")
        return {}, []
    if stage == 3:
        return offload, [f"deepspeed: {value} (ZeRO-3 = FSDP over dp_shard here, the default: the same math"
                         + (", CPU offload = offload_params)" if off else ")")]
    return {"reshard_after_forward": False, **offload}, [
        f"deepspeed: {value} (ZeRO-{stage} = FSDP over dp_shard with the weights kept gathered for backward, "
        f"reshard_after_forward: false: the same math, with parameters sharded too)"]
