"""``validate --memory``, ``plan`` and ``layout: auto`` count the frozen model a run holds beside
the trained one (app/held_models.py): DPO's reference and EBFT's feature model, a frozen copy
under full fine-tuning (sharded like the policy, in the compute dtype), none under LoRA (the
base with the adapters left out) or with ``precompute_ref_log_probs``. Oracle: a real
simulated step of the run's own objective (app/preference_run.py), measured."""
from __future__ import annotations

import pytest
import torch

from functional_pp.app.preference_run import REFERENCE, preference_objective, preference_spec
from functional_pp.app.report import human_bytes, planned_memory
from functional_pp.cli.plan import _model, explain, rank_layouts
from functional_pp.config import TrainConfig, model_config, model_family
from functional_pp.core.layout import local_shape
from functional_pp.core.tree import leaves_with_paths
from functional_pp.plan import Space
from functional_pp.plan.measure import measure

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
          num_key_value_heads=1, head_dim=128, max_position_embeddings=128, tie_word_embeddings=False)
DPO = dict(rl="dpo", sequence_len=16, micro_batch_size=1, gradient_accumulation_steps=1, bf16=True,
           optimizer="adamw_torch_fused", datasets=[{"path": "unused.jsonl", "type": "chatml.intel"}])
LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True)
FSDP2 = Space(fsdp=(("dp_shard",),), sequence_parallel=(False,), regather_activations=(False,), remat=(False,),
              keep_gathered=(False,), cp_attention=("ring",), max_axis={"tp": 1, "cp": 1, "dp_replicate": 1},
              precision="bf16")


def _cfg(base_dir, **kw) -> TrainConfig:
    d = {**DPO, "base_model": str(base_dir), **kw}
    return TrainConfig.from_dict({k: v for k, v in d.items() if v is not None}, name="held")


def _local_bytes(decls, mesh, rules) -> int:
    return sum(torch.Size(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, name=p), mesh)).numel()
               * d.dtype.itemsize for p, d in leaves_with_paths(decls))


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_dpo_estimate_holds_what_a_real_dpo_step_holds(base_dir, adapter):
    """The estimate runs the DPO objective on pairs as the step does: under full fine-tuning its
    weights are the real step's (fp32 masters + the bf16 reference copy), under LoRA no copy is
    held; its peak is the measured one either way."""
    cfg = _cfg(base_dir, **(LORA if adapter else {}))
    (est,) = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
    family, model_cfg = model_family(cfg), model_config(cfg)
    loss, decls, trainable, _ = preference_objective(cfg, preference_spec(cfg), family, model_cfg,
                                                     cfg.lora_config(), family.param_decls(model_cfg))
    assert (REFERENCE in decls) == (adapter is None) == (REFERENCE in _model(cfg)[1])
    batch = {f"{side}_{k}": ((2, 16), "batch seq") for side in ("chosen", "rejected") for k in ("tokens", "labels")}
    run, _, _ = measure(loss, decls, est.mesh, est.rules, batch, precision="bf16", trainable=trainable)
    assert est.memory["weights"] == run.peak_breakdown["weights"]
    if adapter is None:
        reference = _local_bytes(decls[REFERENCE], est.mesh, est.rules)
        assert reference > 0.2 * est.memory["weights"]            # bf16 beside fp32 masters: a third of them
    # (LoRA: the policy on the chosen and the rejected rows, the base's weights gathered for both)
    assert abs(est.peak_bytes / run.peak_bytes - 1) < 0.02, (est.memory, run.peak_breakdown)


def test_validate_memory_prints_the_reference_line(base_dir):
    """The copy's bytes per device as the run shards them; why none is held under LoRA and with
    precomputed reference log-probabilities; no line for an objective without a reference."""
    def line(cfg):
        mesh = cfg.mesh(2)
        text = planned_memory(cfg, mesh, cfg.build_rules(mesh), model_config(cfg))
        return mesh, next((x for x in text.splitlines() if x.startswith("reference model:")), None)
    cfg = _cfg(base_dir, dp_shard_size=2)
    mesh, text = line(cfg)
    family, model_cfg = model_family(cfg), model_config(cfg)
    decls = preference_objective(cfg, preference_spec(cfg), family, model_cfg, None, family.param_decls(model_cfg))[1]
    held = _local_bytes(decls[REFERENCE], mesh, cfg.build_rules(mesh))
    assert held == sum(torch.Size(d.shape).numel() for _, d in leaves_with_paths(decls[REFERENCE]))  # 2 B / 2 devices
    assert text == (f"reference model: {human_bytes(held)} per device (frozen, bfloat16, sharded like the policy; "
                    f"weights only, in the peak above)")
    assert line(_cfg(base_dir, dp_shard_size=2, **LORA))[1].endswith("none held: the base with the adapters left out")
    assert "precompute_ref_log_probs" in line(_cfg(base_dir, dp_shard_size=2, precompute_ref_log_probs=True))[1]
    assert line(_cfg(base_dir, dp_shard_size=2, rl="orpo"))[1] is None
    assert line(_cfg(base_dir, dp_shard_size=2, rl=None, datasets=None, data={"max_bytes": 1000}))[1] is None


def test_plan_refuses_a_device_the_reference_copy_does_not_fit(base_dir):
    """Between the supervised run's smallest reserved bytes and DPO's, plan fits the first and
    refuses DPO, naming the nearest layout."""
    space = Space(max_axis={"tp": 1, "cp": 1}, precision="bf16")
    sft = min(e.reserved_bytes for e in rank_layouts(_cfg(base_dir, rl="orpo"), 1, "h100x8", space=space))
    dpo = min(e.reserved_bytes for e in rank_layouts(_cfg(base_dir), 1, "h100x8", space=space))
    assert dpo > sft
    limit = (sft + dpo) / 2 / 2 ** 30
    assert rank_layouts(_cfg(base_dir, rl="orpo"), 1, "h100x8", space=space, memory_gib=limit).fitting()
    refused = rank_layouts(_cfg(base_dir), 1, "h100x8", space=space, memory_gib=limit)
    assert not refused.fitting() and explain(refused).startswith("NO LAYOUT FITS")


EBFT = {"mode": "strided", "stride": 4, "context_length": 4, "generate_max_len": 4, "n_samples_per_prompt": 2,
        "feature_layers": [0.5, 1.0]}


def test_ebft_estimate_holds_the_feature_copy(base_dir):
    """EBFT under full fine-tuning holds its feature model as a frozen copy (bf16, sharded like the
    policy): the estimate's weights are the policy's plus the copy's; none under LoRA."""
    def estimate(**kw):
        cfg = _cfg(base_dir, rl="ebft", ebft=EBFT, dp_shard_size=2,
                   datasets=[{"path": "unused.jsonl", "type": "ebft_pretrain.transform"}], **kw)
        (est,) = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
        mesh = cfg.mesh(2)
        return cfg, est, planned_memory(cfg, mesh, cfg.build_rules(mesh), model_config(cfg)).splitlines()[-1]
    cfg, est, line = estimate()
    _, decls, _ = _model(cfg)
    policy = {k: v for k, v in decls.items() if k != REFERENCE}
    assert est.memory["weights"] == 4 * _local_bytes(policy, est.mesh, est.rules) // 2 + _local_bytes(
        decls[REFERENCE], est.mesh, est.rules)                  # fp32 masters (declared bf16) + the bf16 copy
    assert line.startswith(f"feature model: {human_bytes(_local_bytes(decls[REFERENCE], est.mesh, est.rules))} "
                           f"per device (frozen, bfloat16, sharded like the policy")
    assert estimate(**LORA)[2] == "feature model: none held: the base with the adapters left out"


def test_pipeline_stage_holds_its_share_of_the_reference(base_dir):
    """Under pp the reference's layers are split over the stages as the policy's are (app/loop.py
    ``_build_step``'s copies): a stage of 2 of 4 layers holds 2 of the copy's."""
    space = Space(max_axis={"tp": 1, "cp": 1, "dp_shard": 1, "dp_replicate": 1}, precision="bf16", pp=(2,),
                  remat=(False,), keep_gathered=(False,), schedules=("1f1b",))
    weights = {rl: rank_layouts(_cfg(base_dir, rl=rl, gradient_accumulation_steps=2), 2, "h100x8", space=space)[0]
               .memory["weights"] for rl in ("orpo", "dpo")}
    reference = _model(_cfg(base_dir))[1][REFERENCE]
    stage = {**reference, "layers": reference["layers"][:2]}       # (the ends on each stage, as the policy's)
    assert weights["dpo"] - weights["orpo"] == sum(torch.Size(d.shape).numel() * 2 for _, d in leaves_with_paths(stage))


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_holds_a_reference_with_a_kl_term_only(base_dir, beta):
    """GRPO's reference is held (and counted) with a KL term (``trl.beta`` not 0) only."""
    cfg = _cfg(base_dir, rl="grpo", trl={"reward_funcs": ["toy_rewards.letters"], "num_generations": 2,
                                         "max_completion_length": 4, "beta": beta},
               datasets=[{"path": "unused.jsonl"}], dp_shard_size=2)
    mesh = cfg.mesh(2)
    lines = planned_memory(cfg, mesh, cfg.build_rules(mesh), model_config(cfg)).splitlines()
    held = [x for x in lines if x.startswith("reference model:")]
    assert (REFERENCE in _model(cfg)[1]) == bool(held) == (beta > 0)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_estimate_runs_kto_on_its_own_batch(base_dir, loss_type):
    """KTO's step is estimated as it runs: its loss on the completions, their KL rows (kto only)
    and the float ``desirable`` column, the policy and the reference (the base under LoRA) on
    both; its peak is a real KTO step's, measured."""
    cfg = _cfg(base_dir, rl="kto", kto_loss_type=loss_type, **LORA,
               datasets=[{"path": "unused.jsonl", "type": "chatml.ultra"}])
    (est,) = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
    family, model_cfg = model_family(cfg), model_config(cfg)
    loss, decls, trainable, _ = preference_objective(cfg, preference_spec(cfg), family, model_cfg,
                                                     cfg.lora_config(), family.param_decls(model_cfg))
    rows = ("tokens", "labels") + (("kl_tokens", "kl_labels") if loss_type == "kto" else ())
    batch = {**{k: ((2, 16), "batch seq") for k in rows}, "desirable": ((2, 16), "batch seq", torch.float32)}
    run, _, _ = measure(loss, decls, est.mesh, est.rules, batch, precision="bf16", trainable=trainable)
    held = ("weights", "optimizer state")
    step = [peak - sum(split.get(k, 0) for k in held)             # what the step adds to the held state
            for peak, split in ((est.peak_bytes, est.memory), (run.peak_bytes, run.peak_breakdown))]
    assert abs(step[0] / step[1] - 1) < 0.02, (est.memory, run.peak_breakdown)


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_reward_model_estimate_runs_its_pairs(base_dir, adapter):
    """A reward model's step is estimated on its batch of Bradley-Terry pairs through its score
    head (app/reward_run.py): its peak is a real reward step's, measured."""
    from functional_pp.app.reward_run import reward_objective, reward_spec, with_head_saved
    cfg = _cfg(base_dir, rl=None, reward_model=True, model_type="AutoModelForSequenceClassification",
               datasets=[{"path": "unused.jsonl", "type": "bradley_terry.chat_template"}], **(LORA if adapter else {}))
    (est,) = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
    model_cfg = model_config(cfg)
    base = model_family(cfg).param_decls(model_cfg)
    lora = with_head_saved(cfg.lora_config(), base) if adapter else None
    loss, decls, trainable = reward_objective(cfg, reward_spec(cfg), model_cfg, lora, base)
    floats = ("chosen_last", "rejected_last", "margin", "pair_weight")
    batch = {**{k: ((2, 16), "batch seq") for k in ("chosen_tokens", "rejected_tokens")},
             **{k: ((2, 16), "batch seq", torch.float32) for k in floats}}
    run, _, _ = measure(loss, decls, est.mesh, est.rules, batch, precision="bf16", trainable=trainable)
    assert est.memory["weights"] == run.peak_breakdown["weights"]
    assert abs(est.peak_bytes / run.peak_bytes - 1) < 0.02, (est.memory, run.peak_breakdown)


def test_process_reward_model_is_estimated_through_its_token_head(base_dir):
    """A process reward model's step (rows of ``tokens`` and per-token ``labels``) runs through its
    token-classification head: plan estimates it (the language-model loss had no ``lm_head``)."""
    cfg = _cfg(base_dir, rl=None, process_reward_model=True, num_labels=2, model_type="AutoModelForTokenClassification",
               datasets=[{"path": "unused.jsonl", "type": "stepwise_supervised", "step_separator": "\n"}])
    ranking = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
    assert len(ranking) == 1 and not ranking.rejected


@pytest.mark.parametrize("over, rows", [
    (dict(rl="dpo"), 2), (dict(rl="orpo"), 2),
    (dict(rl="kto", datasets=[{"path": "unused.jsonl", "type": "chatml.ultra"}]), 2),
    (dict(rl="kto", kto_loss_type="apo_zero_unpaired", datasets=[{"path": "unused.jsonl", "type": "chatml.ultra"}]),
     1),
    (dict(rl=None, reward_model=True, model_type="AutoModelForSequenceClassification",
          datasets=[{"path": "unused.jsonl", "type": "bradley_terry.chat_template"}]), 2),
    (dict(rl=None, datasets=None, data={"max_bytes": 1000}), 1)])
def test_plan_tokens_per_second_counts_every_row_the_step_computes(base_dir, over, rows):
    """plan's tokens/s counts each example's rows: a pair's chosen and rejected rows, KTO's
    completion and its KL row, a supervised row once."""
    ranking = rank_layouts(_cfg(base_dir, **over), 2, "h100x8", space=FSDP2)
    (est,) = ranking
    assert ranking.tokens_per_step == 2 * rows * 16                # 2 examples of 16-token rows
    assert ranking.tokens_per_s_per_device(est) == pytest.approx(2 * rows * 16 / (est.time.step_s * 2))
