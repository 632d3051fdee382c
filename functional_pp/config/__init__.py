"""Training configuration: a YAML file with Accelerate / Axolotl names, parsed and checked
before any work is done.

The schema is declared once: dataclasses whose fields carry their type and help text
(``functional-pp train --help`` prints it, see :func:`config_help`). ``TrainConfig.from_yaml``
(or ``from_dict``) rewrites Axolotl / Accelerate aliases, checks every key and value with a
generic validator and reports *all* problems of a file at once; ``cfg.validate(world_size)``
checks what depends on the device count, the model and the data. Every problem raises
:class:`ConfigError` saying what to change (``docs/config.md``). One job per module:

- ``train_config``: :class:`TrainConfig`, the top-level keys and the values derived from them;
- ``sections``: the ``model``, ``datasets``, ``data``, ``logging``, ``checkpoint`` sections;
- ``schema``: the generic validator; ``aliases``: Axolotl / Accelerate names and refused keys;
- ``loading``: YAML / mapping in, mapping out; ``overrides``: ``--set key=value``;
- ``checks``: value ranges, and the checks against the world size, model and data;
- ``models``: the model family (``functional_pp.models.family``) and its config;
- ``keys``: groups of keys several of these modules read.

Example::

    dp_shard_size: 2          # FSDP over 2 devices
    tp_size: 2
    micro_batch_size: 4       # per data-parallel rank
    sequence_len: 128
    learning_rate: 3e-3       # YAML 1.1 reads this as a string: accepted as a number
    max_steps: 100
    model: {preset: tiny}     # or base_model: path/to/hf_llama_dir; {family: NAME, ...} for others
    datasets: [{path: data.jsonl, type: alpaca}]
    logging: {output_dir: runs/fsdp_tp, log_every: 10}
    checkpoint: {save_every: 50, keep_last: 2}
"""
from __future__ import annotations

from functional_pp.config.keys import ADAM_KEYS, MESH_KEYS, SGD_KEYS
from functional_pp.config.models import model_config, model_family
from functional_pp.config.overrides import apply_overrides
from functional_pp.config.schema import ConfigError, help_text
from functional_pp.config.sections import (PRESETS, CheckpointConfig, DataConfig, DatasetConfig, LoggingConfig,
                                           ModelConfig)
from functional_pp.config.train_config import TrainConfig

__all__ = ["ConfigError", "TrainConfig", "ModelConfig", "DataConfig", "DatasetConfig",
           "LoggingConfig", "CheckpointConfig", "MESH_KEYS", "PRESETS", "apply_overrides",
           "config_help", "model_config", "model_family", "ADAM_KEYS", "SGD_KEYS"]


def config_help() -> str:
    """Every config key with its type, default and help (``functional-pp train --help``)."""
    from functional_pp.config.aliases import ALIASES, UNSUPPORTED
    text = help_text([("top-level keys", TrainConfig), ("model (training from scratch)", ModelConfig),
                      ("datasets entries", DatasetConfig), ("data", DataConfig),
                      ("logging", LoggingConfig), ("checkpoint", CheckpointConfig)])
    aliases = ", ".join(f"{a} -> {c}" for a, (c, _) in sorted(ALIASES.items()))
    refused = ", ".join(sorted(UNSUPPORTED))
    return (f"{text}\naliases (Axolotl / Accelerate): {aliases}; parallelism_config: "
            f"{{parallelism_config_dp_replicate_size, ..._dp_shard_size, ..._tp_size, "
            f"..._cp_size}}\nrefused with the reason (no meaning here): {refused}")
