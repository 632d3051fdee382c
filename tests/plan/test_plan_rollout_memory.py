"""An online run's rollout (GRPO, EBFT) holds a key / value cache of the sampled batch beside the
training state (app/rollout_memory.py): ``validate --memory`` prints it and its peak is the larger
of the rollout's and the step's, and ``plan`` fits layouts by it. Oracle: a real rollout
(preference/rollout.py ``sample_completions``, an eager ``generate``) on real weights, measured by
the memory tracker as the generation tests measure ``generate``."""
from __future__ import annotations

from contextlib import contextmanager

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp.app import grpo_run, report
from functional_pp.app.report import planned_estimate, planned_memory
from functional_pp.app.rollout_memory import estimate_rollout
from functional_pp.cli.plan import explain, rank_layouts
from functional_pp.config import TrainConfig, model_config, model_family
from functional_pp.models.kv_cache import cache_bytes
from functional_pp.parallel import sharding
from functional_pp.plan import Space
from functional_pp.plan.tracker import MemoryTracker
from functional_pp.preference.rollout import sample_completions

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=4, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
GRPO = dict(rl="grpo", sequence_len=64, micro_batch_size=1, gradient_accumulation_steps=32, bf16=True,
            optimizer="adamw_torch_fused", activation_checkpointing=True, datasets=[{"path": "unused.jsonl"}],
            trl={"reward_funcs": ["toy_rewards.letters"], "num_generations": 4, "max_completion_length": 48})
ONE = Space(max_axis={"tp": 1, "cp": 1}, precision="bf16", remat=(True,), keep_gathered=(False,), micro_batch_sizes=(1,))


@contextmanager
def _recorded_caches():
    """The key / value caches ``generate`` makes inside the block, in a list."""
    from functional_pp.models import kv_cache, sampling
    caches = []

    class Recorded(kv_cache.KVCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)
    sampling.KVCache = Recorded
    try:
        yield caches
    finally:
        sampling.KVCache = kv_cache.KVCache


def _cfg(base_dir, **kw) -> TrainConfig:
    return TrainConfig.from_dict({**GRPO, "base_model": str(base_dir), **kw}, name="rollout")


def test_rollout_estimate_holds_a_measured_rollouts_cache(base_dir):
    """A real rollout of the config's 4 prompts x 4 generations (16 rows, 16 prompt + 48 new
    tokens, bf16) holds a cache of 16 x 63 positions (an eager ``generate`` stores every position
    but the last sampled), the estimate's (the eager model's: a static cache of 64 positions and
    its forwards were 33% high); the real peak above the weights lies within 20% under the
    estimate's cache + forward, or over it by at most the host's sampling tensors (rows x vocab
    ``logits.float().cpu()`` and probabilities, the drawn ids and done flags: on a GPU not the
    device's)."""
    cfg = _cfg(base_dir)
    mesh, model_cfg = fpp.Mesh(), model_config(cfg)
    gen = estimate_rollout(cfg, mesh, cfg.build_rules(mesh), model_cfg, 16, torch.bfloat16)
    family = model_family(cfg)
    _, decls, _, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family, model_cfg, None,
                                                     family.param_decls(model_cfg, torch.bfloat16))
    params = sharding.named_tree(fpp.init_params(decls, seed=0), decls)
    leaves = [x.data for x in optree.tree_leaves(params)]
    weights = sum(t.numel() * t.element_size() for t in leaves)
    tracker = MemoryTracker({"weights": weights}, leaves, timeline=False)
    with _recorded_caches() as caches, tracker:
        sample_completions(policy, params, [[1 + i] * 16 for i in range(4)], num_generations=4,
                           max_completion_length=48, stop_ids=[], pad_id=0)
    (cache,) = caches
    measured = cache.nbytes()
    assert measured == cache_bytes(model_cfg, 16, 63, torch.bfloat16) > 0
    assert gen.cache_bytes == measured
    real, est = tracker.run.peak_bytes - weights, gen.cache_bytes + gen.forward_bytes
    host = 16 * (2 * HF["vocab_size"] * 4 + 9)      # last logits and probabilities (fp32), ids and done flags
    # (and 0.3% of small host tensors the meta run does not make: 2,176 bytes since each row draws
    # from its own generator)
    assert real - host <= 1.003 * est <= 1.2 * real, (real, est)


def test_validate_memory_counts_the_rollout(base_dir):
    """With 32 accumulated rows sampled at once the rollout's cache sets the peak: weights +
    optimizer state + cache + forward, printed on a ``rollout:`` line; a shorter rollout leaves
    the step's peak."""
    cfg = _cfg(base_dir)
    mesh = cfg.mesh(1)
    est = planned_estimate(cfg, mesh, cfg.build_rules(mesh), model_config(cfg))
    gen = est.rollout
    assert gen.batch == 32 and (gen.prompt, gen.new_tokens) == (16, 48)
    assert est.peak_bytes == (est.memory["weights"] + est.memory["optimizer state"] + gen.cast_bytes + gen.cache_bytes
                              + gen.forward_bytes)
    text = planned_memory(cfg, mesh, cfg.build_rules(mesh), model_config(cfg)).splitlines()
    assert any(x.startswith("rollout:    key / value cache ") and "it sets the peak above" in x for x in text)
    short = _cfg(base_dir, gradient_accumulation_steps=1, micro_batch_size=4, activation_checkpointing=False)
    text = planned_memory(short, mesh, short.build_rules(mesh), model_config(short)).splitlines()
    assert any(x.startswith("rollout:") and "the step peak above is higher" in x for x in text)


def test_plan_refuses_a_device_the_rollout_does_not_fit(base_dir, monkeypatch):
    """Between the step's reserved bytes and the rollout's, plan refuses the run (naming the
    nearest layout); without the rollout counted it would fit."""
    cfg = _cfg(base_dir)
    with_rollout = min(e.reserved_bytes for e in rank_layouts(cfg, 1, "h100x8", space=ONE))
    with monkeypatch.context() as m:
        m.setattr(report, "add_rollout", lambda *a: None, raising=False)
        step_only = min(e.reserved_bytes for e in rank_layouts(cfg, 1, "h100x8", space=ONE))
    assert with_rollout > step_only
    refused = rank_layouts(cfg, 1, "h100x8", space=ONE, memory_gib=(with_rollout + step_only) / 2 / 2 ** 30)
    assert not refused.fitting() and explain(refused).startswith("NO LAYOUT FITS")


EBFT = {"mode": "strided", "stride": 4, "context_length": 4, "generate_max_len": 4, "n_samples_per_prompt": 2,
        "feature_layers": [0.5, 1.0]}


def _ebft_cfg(base_dir, documents: int) -> TrainConfig:
    return TrainConfig.from_dict({**GRPO, "base_model": str(base_dir), "rl": "ebft", "ebft": EBFT, "trl": None,
                                  "sequence_len": 16, "gradient_accumulation_steps": documents,
                                  "datasets": [{"path": "unused.jsonl", "type": "ebft_pretrain.transform"}]},
                                 name="ebft")


def test_ebft_rollout_is_documents_by_samples_at_the_last_anchor(base_dir):
    """EBFT's sampling calls hold at most the cache of the step's documents x samples rows at the
    last anchor (12 of a 16-token document: anchors 4, 8, 12; ebft_rollout.call_tokens)."""
    cfg = _ebft_cfg(base_dir, 4)
    mesh = cfg.mesh(1)
    est = planned_estimate(cfg, mesh, cfg.build_rules(mesh), model_config(cfg))
    assert (est.rollout.batch, est.rollout.prompt, est.rollout.new_tokens) == (8, 12, 4)
    assert est.rollout.cache_bytes == cache_bytes(model_config(cfg), 8, 15, torch.bfloat16)    # (eager: 12 + 4 - 1)


def _measured_pass(decls, run) -> int:
    """The peak above the weights of ``run(params)`` on real weights of ``decls``, measured."""
    params = sharding.named_tree(fpp.init_params(decls, seed=0), decls)
    leaves = [x.data for x in optree.tree_leaves(params)]
    weights = sum(t.numel() * t.element_size() for t in leaves)
    tracker = MemoryTracker({"weights": weights}, leaves, timeline=False)
    with tracker:
        run(params)
    return tracker.run.peak_bytes - weights


def test_grpo_old_logps_forward_is_a_measured_one(base_dir):
    """With num_iterations 2 the rollout's scoring forward is GRPO's old_logps pass over the 16
    rows x 64 positions: the estimate's (the sampler's own code on meta tensors) is a real pass's
    measured peak above the weights but for the labels' local copy, made later in the real one
    (16 x 64 int64); without it (num_iterations 1) there is none."""
    cfg = _cfg(base_dir, trl={**GRPO["trl"], "num_iterations": 2})
    mesh, model_cfg = fpp.Mesh(), model_config(cfg)
    gen = estimate_rollout(cfg, mesh, cfg.build_rules(mesh), model_cfg, 16, torch.bfloat16)
    assert gen.shape.scored == (16, 64) and gen.shape.scoring == "old_logps forward"
    family = model_family(cfg)
    _, decls, _, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family, model_cfg, None,
                                                     family.param_decls(model_cfg, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    whole = {k: torch.randint(1, HF["vocab_size"], (16, 64), generator=g) for k in ("tokens", "labels")}
    sampler = grpo_run.GRPOSampler(grpo_run.grpo_settings(cfg), policy, None, [], 64, 0, [], 0)
    real = _measured_pass(decls, lambda params: sampler._logps(params, whole))
    # (over by the labels' copy, 16 x 64 int64, which the real pass makes later, and by a few
    # hundred bytes of small tensors whose lifetimes vary from run to run: within 1%)
    assert real <= gen.scoring_bytes <= 1.01 * real, (real, gen.scoring_bytes)
    assert gen.scoring_bytes > gen.sampling_bytes and gen.added_bytes == gen.cast_bytes + gen.scoring_bytes
    assert estimate_rollout(_cfg(base_dir), mesh, cfg.build_rules(mesh), model_cfg, 16, torch.bfloat16).scoring is None


def test_ebft_feature_forward_is_a_measured_one(base_dir):
    """EBFT's scoring forward is the feature model over the step's 4 block-parallel rows (46
    positions: a 16-token document and 3 blocks x 2 samples x 5): the estimate is a real pass's
    (``EBFTSampler._states``) measured peak above the weights, to 1 KiB."""
    from functional_pp.app import ebft_run
    from functional_pp.preference.ebft_layout import block_parallel_row
    cfg = _ebft_cfg(base_dir, 4)
    mesh, model_cfg = fpp.Mesh(), model_config(cfg)
    gen = estimate_rollout(cfg, mesh, cfg.build_rules(mesh), model_cfg, 4, torch.bfloat16)
    assert gen.shape.scored == (4, 46) and gen.shape.scoring == "feature-model forward"
    spec, family = ebft_run.ebft_settings(cfg), model_family(cfg)
    _, decls, _, policy, features = ebft_run.ebft_objective_of(cfg, spec, family, model_cfg, None,
                                                               family.param_decls(model_cfg, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    rows = [block_parallel_row(torch.randint(1, 128, (16,), generator=g).tolist(), [4, 8, 12],
                               torch.randint(1, 128, (3, 2, 4), generator=g), 46, 0) for _ in range(4)]
    rows = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    sampler = ebft_run.EBFTSampler(spec, policy, features, 0, 0)
    real = _measured_pass(decls, lambda params: sampler._states(params, 1, rows))
    assert abs(gen.scoring_bytes - real) <= 1024, (real, gen.scoring_bytes)


def test_validate_memory_counts_the_scoring_forward(base_dir):
    """16 EBFT documents scored in one feature-model pass (one step trains them one by one) hold
    more than the sampling and the step: the peak is the held state + the compute copy + that
    forward, printed on the rollout line."""
    cfg = _ebft_cfg(base_dir, 16)
    mesh = cfg.mesh(1)
    est = planned_estimate(cfg, mesh, cfg.build_rules(mesh), model_config(cfg))
    gen = est.rollout
    assert gen.scoring_bytes > gen.sampling_bytes
    assert est.memory["scoring forward"] == gen.scoring_bytes and "key / value cache" not in est.memory
    assert est.peak_bytes == (est.memory["weights"] + est.memory["optimizer state"] + gen.cast_bytes
                              + gen.scoring_bytes)
    text = planned_memory(cfg, mesh, cfg.build_rules(mesh), model_config(cfg))
    assert "then its feature-model forward" in text and "it sets the peak above" in text


def _device_rollout_cache(full, decls, policy, rules) -> int:
    """The bytes of the cache this device's real rollout holds (16 rows over dp, 16 + 48 tokens)."""
    from functional_pp.core.runtime import current_context
    from functional_pp.parallel.shard_map import use_rules
    with _recorded_caches() as caches, use_rules(rules):
        local = sharding.shard(full, decls, current_context().mesh, rules, fpp.current_rank())
        sample_completions(policy, sharding.named_tree(local, decls), [[1 + i] * 16 for i in range(4)],
                           num_generations=4, max_completion_length=48, stop_ids=[], pad_id=0, row_multiple=2)
    (cache,) = caches
    return cache.nbytes()


def test_fsdp_rollout_cache_is_each_gloo_processs_measured_cache(base_dir):
    """Under dp_shard=2 each device samples half the rows: the estimate's per-device cache is what
    each of two real gloo processes' (eager) rollouts holds."""
    cfg = _cfg(base_dir, dp_shard_size=2)
    mesh, model_cfg = cfg.mesh(2), model_config(cfg)
    rules = grpo_run._sampling_rules(cfg.build_rules(mesh))
    gen = estimate_rollout(cfg, mesh, cfg.build_rules(mesh), model_cfg, 16, torch.bfloat16)
    family = model_family(cfg)
    _, decls, _, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family, model_cfg, None,
                                                     family.param_decls(model_cfg, torch.bfloat16))
    full = fpp.init_params(decls, seed=0)
    measured = fpp.launch(lambda: _device_rollout_cache(full, decls, policy, rules), mesh, processes=True,
                          timeout=120)
    assert measured == [cache_bytes(model_cfg, 16, 63, torch.bfloat16, batch_split=2)] * 2 == [gen.cache_bytes] * 2


def test_rollout_counts_the_compute_copy_the_sampling_reads(base_dir):
    """Under bf16 the sampling reads ``step.named_params``: the fp32 masters cast to bf16, a copy
    held through the rollout beside them; the estimate's ``cast_bytes`` are that copy's, measured
    on a real step's state (none under fp32)."""
    from functional_pp import optim
    from functional_pp.step.train import train_step
    cfg = _cfg(base_dir)
    mesh, model_cfg = fpp.Mesh(), model_config(cfg)
    family = model_family(cfg)
    loss, decls, trainable, _ = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family, model_cfg, None,
                                                           family.param_decls(model_cfg))

    def copy_bytes():
        step = train_step(loss, optim.adamw(1e-4), mesh=mesh, rules=fpp.Rules(), precision="bf16", trainable=trainable)
        state = step.init(fpp.init(lambda: decls, mesh=mesh, rules=fpp.Rules(), seed=0))
        masters = {x.data_ptr() for x in optree.tree_leaves(state["params"])}
        return sum(x.data.numel() * x.data.element_size() for x in optree.tree_leaves(step.named_params(state["params"]))
                   if x.data.data_ptr() not in masters)
    (measured,) = fpp.launch(copy_bytes, mesh)
    rules = cfg.build_rules(mesh)
    assert estimate_rollout(cfg, mesh, rules, model_cfg, 16, torch.bfloat16).cast_bytes == measured > 0
    assert estimate_rollout(cfg, mesh, rules, model_cfg, 16, torch.float32).cast_bytes == 0


def _pipelined_rollout(decls, trainable, loss, policy, rules, family, model_cfg) -> tuple[int, int, int]:
    """On a pp stage: ``(the bytes of the whole model logical_params gathers beside the stage's
    own, the real rollout's cache, its measured peak above the stage's parameters)`` (16 rows,
    16 + 48 tokens), sampled as the loop samples under a pipeline."""
    from functional_pp import optim
    from functional_pp.app.pipeline_parts import pipeline_parts
    from functional_pp.core.runtime import current_context
    from functional_pp.parallel.shard_map import use_rules
    from functional_pp.step.pipeline import pipeline_step
    layers, first, last = pipeline_parts(family, model_cfg)
    step = pipeline_step(loss, optim.adamw(1e-4), mesh=current_context().mesh, rules=rules, precision="bf16",
                         trainable=trainable, grad_accum=2, layers=layers, first_stage=first, last_stage=last)
    state = step.init(fpp.init(lambda: decls, mesh=current_context().mesh, rules=rules, seed=0))
    own = [getattr(x, "data", x) for x in optree.tree_leaves(state["params"])]
    held = sum(t.numel() * t.element_size() for t in own)
    tracker = MemoryTracker({"weights": held}, own, timeline=False)
    with _recorded_caches() as caches, tracker:
        whole = step.logical_params(state["params"])
        mine = {t.untyped_storage().data_ptr() for t in own}
        gathered = sum(t.numel() * t.element_size() for t in (getattr(x, "data", x) for x in optree.tree_leaves(whole))
                       if t.untyped_storage().data_ptr() not in mine)
        with use_rules(grpo_run._sampling_rules(rules)), step.apply_policy():
            sample_completions(policy, step.named_params(whole), [[1 + i] * 16 for i in range(4)],
                               num_generations=4, max_completion_length=48, stop_ids=[], pad_id=0)
    (cache,) = caches
    return gathered, cache.nbytes(), tracker.run.peak_bytes - held


def test_pipelined_rollout_holds_the_whole_model_and_its_cache_on_each_stage(base_dir):
    """Under pp=2 every device samples with the whole model (the loop's ``logical_params``: each
    stage's layers, embedding and head gathered over pp): each of two real gloo processes holds
    every layer's cache (the estimate's, not a stage's half) and the gathered model (float32
    masters) beside its own stage's; the rollout's measured peak above the stage's parameters is
    the estimate's gathered model + compute copy + cache + forward but the host's sampling
    tensors, within 20%."""
    cfg = _cfg(base_dir, pp_size=2)
    mesh, model_cfg = cfg.mesh(2), model_config(cfg)
    rules = cfg.build_rules(mesh)
    gen = estimate_rollout(cfg, mesh, rules, model_cfg, 16, torch.bfloat16)
    family = model_family(cfg)
    loss, decls, trainable, policy = grpo_run.grpo_objective_of(cfg, grpo_run.grpo_settings(cfg), family, model_cfg,
                                                                None, family.param_decls(model_cfg))
    measured = fpp.launch(lambda: _pipelined_rollout(decls, trainable, loss, policy, rules, family, model_cfg), mesh,
                          processes=True, timeout=180)
    whole_fp32 = sum(torch.Size(d.shape).numel() * 4 for d in optree.tree_leaves(decls))
    host = 16 * (2 * HF["vocab_size"] * 4 + 9)
    for gathered, cache, peak in measured:
        assert gathered == gen.gathered_bytes == whole_fp32
        assert cache == gen.cache_bytes == cache_bytes(model_cfg, 16, 63, torch.bfloat16)
        # (and 0.2% of small host tensors the meta run does not make: 2,176 bytes since each row
        # draws from its own generator)
        assert peak - host <= 1.002 * gen.added_bytes <= 1.2 * peak, (peak, gen.added_bytes)
