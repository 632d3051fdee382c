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


@pytest.mark.parametrize("d, chunks", [
    ({"cut_cross_entropy": True}, 8),
    ({"liger_fused_linear_cross_entropy": True}, 8),
    ({"chunked_cross_entropy": True, "chunked_cross_entropy_num_chunks": 4}, 4),
    ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]}, 8),   # true by default
    ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"], "cut_cross_entropy": False}, None),
    ({"chunked_cross_entropy_num_chunks": 4}, None),
    ({"cut_cross_entropy": True, "loss_chunks": 2}, 2),
    ({"loss_chunks": 3}, 3),
])
def test_fused_head_loss_keys_chunk_the_head_and_loss(d, chunks):
    """Axolotl's cut cross-entropy, Liger's fused linear cross-entropy and chunked cross-entropy
    ask for the memory of the logits: they turn ``loss_chunks`` on, and the model's loss runs
    the head and cross-entropy over that many token chunks (they were accepted as "already
    fused" while the whole logits were formed)."""
    from functional_pp.config.models import model_config
    cfg = TrainConfig.from_dict(d)
    assert cfg.loss_chunks == chunks and model_config(cfg).loss_chunks == chunks
    if chunks and len(d) == 1 and "loss_chunks" not in d:
        assert any(f"loss_chunks {chunks}" in n for n in cfg.notes), cfg.notes


@pytest.mark.parametrize("d, why", [
    ({"model": {"preset": "tiny", "final_softcap": 30.0}}, "soft-capped"),
    ({"model": {"preset": "tiny", "logit_scale": 0.5}}, "scaled"),
    ({"rl": "dpo", "datasets": [{"path": "pairs.jsonl", "type": "chatml.intel"}]}, "rl: dpo's objective"),
    ({"diffusion": {"mask_token_id": 3}}, "diffusion's objective"),
])
def test_logits_the_chunked_loss_does_not_compute_stay_whole_and_the_notes_say_so(d, why):
    """The chunked head loss computes the next-token cross-entropy of plain logits: a model whose
    logits are soft-capped or scaled, and an objective that reads the logits themselves, keep
    the whole logits, and the start-up notes say that ``loss_chunks`` was not applied."""
    from functional_pp.config.models import model_config
    cfg = TrainConfig.from_dict({"cut_cross_entropy": True, **d})
    model = model_config(cfg)
    assert cfg.loss_chunks == 8 and model.loss_chunks is None
    assert any("loss_chunks: 8 not applied" in n and why in n for n in cfg.notes), cfg.notes


@pytest.mark.parametrize("d, message", [
    ({"loss_chunks": 0}, "loss_chunks must be >= 1"),
    ({"loss_chunks": 2, "loss_chunk_bytes": 1024}, "not both"),
    ({"cut_cross_entropy": "yes"}, "cut_cross_entropy must be true or false"),
    ({"chunked_cross_entropy": True, "chunked_cross_entropy_num_chunks": 0}, "must be a positive integer"),
])
def test_bad_loss_chunk_values_are_refused(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(d)
