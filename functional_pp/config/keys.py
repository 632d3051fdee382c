"""Groups of top-level config keys that several config modules read: the mesh sizes
(Accelerate's names -> mesh axes), each optimizer's own keys, the sections."""
from __future__ import annotations

__all__ = ["MESH_KEYS", "ADAM_KEYS", "SGD_KEYS", "ADAM_OPTIMIZERS", "SECTION_KEYS", "LORA_KEYS"]

MESH_KEYS = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard",
             "cp_size": "cp", "tp_size": "tp", "ep_size": "ep"}
ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_epsilon")
SGD_KEYS = ("momentum",)
ADAM_OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit")
SECTION_KEYS = ("model", "data", "logging", "checkpoint")
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_target_linear",
             "lora_modules_to_save", "peft_use_rslora", "peft_use_dora", "lora_model_dir", "peft",
             "nvfp4_merge_aware")


def foreign_optimizer_keys(optimizer: str) -> tuple[str, ...]:
    """The keys of the optimizer *not* chosen (they are refused, and left out of a dump)."""
    return SGD_KEYS if optimizer in ADAM_OPTIMIZERS else ADAM_KEYS
