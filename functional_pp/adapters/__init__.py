"""Parameter-efficient fine-tuning over any model written with the named ops: LoRA adapters
declared beside the base weights (their dimension names plus a rank dimension, so the rules
shard them), a loss transform that applies them inside ``ops.einsum``, the trainable mask
that freezes the rest, merging, and the PEFT adapter format (docs/adapters.md)."""
from functional_pp.adapters.lora import (RANK, LoraConfig, LoraWeight, adapt, apply, check_names, frozen_under,
                                         init, init_magnitudes, joined, merge, nvfp4_scales, split, targets,
                                         trainable, unfrozen, with_shared_a)

__all__ = ["RANK", "LoraConfig", "LoraWeight", "adapt", "apply", "check_names", "frozen_under", "init",
           "init_magnitudes", "joined", "merge", "nvfp4_scales", "split", "targets", "trainable", "unfrozen",
           "with_shared_a"]
