"""Axolotl's plugin, kernel and offload names (issue 47): what only picks a kernel is accepted
and named in the start-up summary (we pick our own kernels, the same math); what changes the
math, or names a memory lever not built (offloading to disk), is refused naming it; the offload
keys of issue 45's memory levers map onto offload_params / activation_offloading."""
import pytest

from functional_pp.config import ConfigError, TrainConfig

KERNEL_CHOICES = {
    "plugins": ["axolotl.integrations.kernels.KernelsPlugin", "axolotl.integrations.expert_parallel.ExpertParallelPlugin"],
    "attn_implementation": "kernels-community/vllm-flash-attn3", "use_kernels": True, "use_scattermoe": True,
    "use_sonicmoe": True, "experts_implementation": "grouped_mm", "expert_parallel_num_nvl_bytes": 1 << 30,
    "liger_swiglu": True, "chunked_cross_entropy": True, "unsloth_lora_mlp": True, "unsloth_rope": True,
}


def test_kernel_choices_are_accepted_and_named_in_the_summary():
    cfg = TrainConfig.from_dict(KERNEL_CHOICES)
    notes = " | ".join(cfg.notes)
    for name in ("KernelsPlugin (Hugging Face hub kernels", "ExpertParallelPlugin (expert parallelism is ep_size",
                 "attn_implementation: kernels-community/vllm-flash-attn3 (a hub attention kernel",
                 "use_scattermoe (a kernel for the experts", "experts_implementation (a kernel for the experts",
                 "expert_parallel_num_nvl_bytes (DeepEP's", "liger_swiglu (Liger's", "chunked_cross_entropy",
                 "unsloth_lora_mlp (Unsloth's", "unsloth_rope"):
        assert name in notes, name
    assert TrainConfig.from_dict({"expert_parallel_size": 2, "plugins": KERNEL_CHOICES["plugins"][1:]}).ep_size == 2


@pytest.mark.parametrize("d, message", [
    ({"activation_offloading": "disk"}, "activation_offloading: disk is not supported: use true"),
    ({"gradient_checkpointing": "offload_disk"}, "offload_disk: activations offloaded to disk are not supported"),
    ({"liger_use_token_scaling": True}, "'liger_use_token_scaling' is not supported: .*another loss"),
    ({"attn_implementation": "flash_attn"}, "not an attention implementation .*or a hub kernel ORG/NAME"),
])
def test_what_changes_the_math_or_is_not_built_is_refused_by_name(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(d)


@pytest.mark.parametrize("d, params, activations, remat", [
    ({"activation_offloading": True}, False, True, False),
    ({"activation_offloading": "legacy"}, False, True, False),
    ({"gradient_checkpointing": "offload"}, False, True, True),
    ({"fsdp_config": {"offload_params": True}, "activation_offloading": True}, True, True, False),
])
def test_offload_keys_map_onto_the_memory_levers(d, params, activations, remat):
    cfg = TrainConfig.from_dict(d)
    assert (cfg.offload_params, cfg.activation_offloading, cfg.activation_checkpointing) == (params, activations, remat)
