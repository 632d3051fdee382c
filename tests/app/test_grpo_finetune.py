"""``rl: grpo`` end to end (docs/preference.md "GRPO"): on a toy task (reward: the fraction of a
completion's bytes that are lower-case letters) a tiny model's mean reward rises; a FSDP x TP
run (the reference copy sharded too) equals one device step by step (the same completions, so
the same rewards; the same loss); a resumed run equals an uninterrupted one; Axolotl's form of
the config (reward functions and a dataset transform in modules beside the config, vLLM keys)
trains from the CLI and exports like an SFT run; bad reward functions and data are refused
before any work; two gloo processes under torchrun equal simulation."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from functional_pp import cli
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig

REWARDS = '''
def _text(c):
    return c if isinstance(c, str) else c[0]["content"]     # a chat prompt's completion: [{role, content}]


def letters(prompts, completions, **kwargs):
    return [sum("a" <= ch <= "z" for ch in _text(c)) / max(1, len(_text(c))) for c in completions]


def index(prompts, completions, answer, **kwargs):
    return [float(a) for a in answer]


def answer_echo(prompts, completions, answer, trainer_state, log_metric, **kwargs):
    assert isinstance(prompts[0], list) and prompts[0][0]["role"] == "user"
    log_metric("echo_step", trainer_state.global_step)
    return [float(str(a) in _text(c)) for a, c in zip(answer, completions)]
'''
TRANSFORM = '''
def to_prompt(cfg, **kwargs):
    def transform(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": example["n"]}
    return transform, {"remove_columns": ["question"]}
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """A directory with prompts.jsonl and the reward module toy_rewards.py."""
    d = tmp_path_factory.mktemp("grpo-task")
    (d / "toy_rewards.py").write_text(REWARDS)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": "xy" * (1 + i % 3), "answer": i}) + "\n")
    return d


def config(task: Path, out: Path, **over) -> TrainConfig:
    trl = {"reward_funcs": ["toy_rewards.letters"], "num_generations": 4, "max_completion_length": 6,
           **over.pop("trl", {})}
    d = {"rl": "grpo", "trl": trl, "datasets": [{"path": str(task / "prompts.jsonl")}],
         "model": {"preset": "tiny", "hidden": 32, "mlp": 64}, "sequence_len": 16, "micro_batch_size": 16,
         "max_steps": 3, "learning_rate": 1e-2, "lr_scheduler": "constant", "optimizer": "adamw",
         "logging": {"log_every": 1, "output_dir": str(out), "plot": False}, **over}
    cfg = TrainConfig.from_dict(d, name="grpo")
    cfg.source_path = str(task / "config.yaml")          # the reward module beside the config
    return cfg


def _metrics(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]


def test_the_mean_reward_rises_on_a_toy_task(task, tmp_path):
    out = tmp_path / "toy"
    train(config(task, out, max_steps=30), simulate=1, stream=io.StringIO())
    m = _metrics(out)
    first, last = (sum(x["reward"] for x in part) / 5 for part in (m[:5], m[-5:]))
    assert last > first + 0.4, (first, last)
    assert all(math.isfinite(x["loss"]) for x in m)
    for key in ("reward_std", "rewards_letters_mean", "rewards_letters_std", "completions_mean_length",
                "completions_min_length", "completions_max_length", "completions_clipped_ratio",
                "clip_ratio_region_mean", "frac_reward_zero_std"):
        assert key in m[-1], key
    assert m[-1]["completions_max_length"] <= 6


def test_fsdp_tp_steps_equal_one_device(task, tmp_path):
    """beta > 0: the KL to the frozen reference copy, sharded like the policy; num_iterations 2:
    the second step reuses the generation with the sampling policy's log-probabilities."""
    runs = {}
    for name, sim, mesh in (("one", 1, {}), ("fsdp_tp", 4, {"dp_shard_size": 2, "tp_size": 2}),
                            ("tp_sp", 2, {"tp_size": 2, "sequence_parallel": True})):
        out = tmp_path / name
        train(config(task, out, trl={"beta": 0.04, "temperature": 0.9, "top_k": 50, "num_iterations": 2},
                     micro_batch_size=16 // mesh.get("dp_shard_size", 1), learning_rate=3e-2, **mesh),
              simulate=sim, stream=io.StringIO())
        runs[name] = _metrics(out)
    assert ["reward" in m for m in runs["one"]] == [True, False, True]          # steps 1 and 3 sample
    for layout in ("fsdp_tp", "tp_sp"):          # (sequence_parallel: sampling keeps the residual sequence whole)
        for a, b in zip(runs["one"], runs[layout]):
            assert a.get("reward") == b.get("reward") and a.get("completions_mean_length") == b.get(
                "completions_mean_length"), layout
            for key in ("loss", "kl", "clip_ratio_region_mean"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (layout, a["step"], key)
    assert runs["one"][-1]["kl"] > 0                     # the policy moved away from the reference
    assert runs["one"][1]["clip_ratio_region_mean"] > 0  # the reused generation: ratios away from 1


def test_pipeline_steps_equal_one_device(task, tmp_path):
    """pp 2 (1F1B, two micro-batches): every device samples with the whole model (its stages'
    layers gathered over pp, ``logical_params``), the step runs the policy's and the frozen
    reference's forwards through the stages; beta > 0, two updates per generation, held-out
    prompts evaluated at steps 0, 2 and 3: rewards, losses, KL and clip ratios equal one device's."""
    runs = {}
    for name, sim, mesh in (("one", 1, {}), ("pp", 2, {"pp_size": 2})):
        out = tmp_path / name
        train(config(task, out, trl={"beta": 0.04, "num_iterations": 2}, micro_batch_size=8,
                     gradient_accumulation_steps=2, learning_rate=3e-2, val_set_size=4, eval_steps=2,
                     model={"preset": "tiny", "hidden": 32, "mlp": 64, "layers": 2}, **mesh),
              simulate=sim, stream=io.StringIO())
        runs[name] = read_metrics(out / "metrics.jsonl")
    assert runs["one"][-1]["kl"] > 0 and sum("eval_loss" in m for m in runs["one"]) == 3
    for a, b in zip(runs["one"], runs["pp"], strict=True):
        assert a.keys() == b.keys()
        assert a.get("reward") == b.get("reward") and a.get("eval_reward") == b.get("eval_reward")
        for key in ("loss", "kl", "clip_ratio_region_mean", "grad_norm", "eval_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_context_parallel_and_gspo_steps_equal_one_device(task, tmp_path):
    """cp 2 (cp 2 x FSDP 2, cp 2 x tp 2 with sequence_parallel): sampling keeps each row's sequence whole on every device of its
    cp group, the step splits it (load-balanced); GSPO's per-sequence ratio sums over the split
    sequence. Two updates per generation (the ratio away from 1) with the KL term. cp x FSDP is
    compared with FSDP alone: bnpo normalises each device's micro-batch by its own tokens, so 2
    devices' micro-batches of 8 are another step than one device's 16 wherever their halves'
    tokens differ (docs/preference.md; TRL's too)."""
    runs = {}
    for name, sim, mesh in (("one", 1, {}), ("fsdp", 2, {"dp_shard_size": 2}), ("cp", 2, {"cp_size": 2}),
                            ("cp_fsdp", 4, {"cp_size": 2, "dp_shard_size": 2}),
                            ("cp_tp_sp", 4, {"cp_size": 2, "tp_size": 2, "sequence_parallel": True})):
        out = tmp_path / name
        train(config(task, out, trl={"beta": 0.04, "num_iterations": 2, "importance_sampling_level": "sequence",
                                     "loss_type": "bnpo"},
                     micro_batch_size=16 // mesh.get("dp_shard_size", 1), learning_rate=3e-2, **mesh),
              simulate=sim, stream=io.StringIO())
        runs[name] = _metrics(out)
    assert runs["one"][1]["clip_ratio_region_mean"] > 0 and runs["one"][-1]["kl"] > 0
    assert [m.get("reward") for m in runs["fsdp"]] == [m.get("reward") for m in runs["one"]]   # the same samples
    for layout, without in (("cp", "one"), ("cp_fsdp", "fsdp"), ("cp_tp_sp", "one")):
        for a, b in zip(runs[without], runs[layout], strict=True):
            assert a.get("reward") == b.get("reward"), layout
            for key in ("loss", "kl", "clip_ratio_region_mean", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (layout, a["step"], key)


def test_evaluation_samples_the_held_out_prompts_on_every_layout(task, tmp_path):
    """val_set_size 4: at steps 0, 2 and 4 the held-out prompts (their records' ``answer``, by
    the reward ``index``) are sampled with num_generations_eval completions each and scored:
    TRL's metrics prefixed eval_; a FSDP x TP run evaluates the same completions and loss."""
    from functional_pp.app.grpo_run import grpo_settings, load_prompts
    runs = {}
    for name, sim, mesh in (("one", 1, {}), ("fsdp_tp", 4, {"dp_shard_size": 2, "tp_size": 2})):
        out = tmp_path / name
        cfg = config(task, out, trl={"reward_funcs": ["toy_rewards.letters", "toy_rewards.index"], "beta": 0.04,
                                     "num_generations_eval": 2},
                     val_set_size=4, eval_steps=2, max_steps=4, micro_batch_size=8 // mesh.get("dp_shard_size", 1),
                     **mesh)
        text = io.StringIO()
        train(cfg, simulate=sim, stream=text)
        runs[name] = read_metrics(out / "metrics.jsonl")
    assert "grpo eval:  4 held-out prompts x 2 generations in 1 batch(es) of 4" in text.getvalue()
    held_out = load_prompts(cfg, grpo_settings(cfg)).val
    want = sum(p.columns["answer"] for p in held_out.prompts) / 4
    evals = [m for m in runs["one"] if "eval_reward" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    for m in evals:
        assert m["eval_rewards_index_mean"] == pytest.approx(want)
        for key in ("eval_loss", "eval_reward_std", "eval_frac_reward_zero_std", "eval_completions_mean_length",
                    "eval_completions_min_length", "eval_completions_max_length", "eval_kl",
                    "eval_clip_ratio_region_mean"):
            assert key in m, key
    assert evals[-1]["eval_kl"] > 0
    for a, b in zip(runs["one"], runs["fsdp_tp"], strict=True):
        assert a.get("eval_reward") == b.get("eval_reward") and a.get("eval_completions_mean_length") == b.get(
            "eval_completions_mean_length")
        for key in ("eval_loss", "eval_kl"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_gradient_accumulation_equals_one_large_batch(task, tmp_path, loss_type):
    """The step's 16 completions in 2 micro-batches of 8 on one device, or one micro-batch of 8
    on each of 2 data-parallel devices (TRL: 2 processes), are TRL's same step; and, but for
    ``bnpo`` (TRL normalises each micro-batch by its own tokens), one batch of 16."""
    runs = []
    for name, micro, accum, sim, mesh in (("one", 16, 1, 1, {}), ("accum", 8, 2, 1, {}),
                                          ("dp", 8, 1, 2, {"dp_replicate_size": 2})):
        out = tmp_path / name
        train(config(task, out, trl={"loss_type": loss_type},
                     micro_batch_size=micro, gradient_accumulation_steps=accum, max_steps=1, **mesh),
              simulate=sim, stream=io.StringIO())
        runs.append(_metrics(out)[0])
    one, accum, dp = runs
    assert one["reward"] == accum["reward"] == dp["reward"]
    pairs = [(accum, dp)] + ([(one, accum)] if loss_type != "bnpo" else [])
    for a, b in pairs:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["grad_norm"] > 1e-3


def test_lora_takes_the_base_without_adapters_as_the_reference(task, tmp_path):
    out = tmp_path / "lora"
    r = train(config(task, out, trl={"beta": 0.1}, adapter="lora", lora_r=4, lora_alpha=8,
                     lora_target_modules=["q_proj", "v_proj"], learning_rate=5e-2, max_steps=3),
              simulate=1, stream=io.StringIO())
    m = _metrics(out)
    assert m[0]["kl"] == 0 and m[-1]["kl"] > 0                 # LoRA's B starts at 0: the policy is the base
    assert all(math.isfinite(x["loss"]) for x in m) and r.final_step == 3


@pytest.mark.parametrize("iterations", [1, 2])
def test_a_resumed_run_equals_an_uninterrupted_one(task, tmp_path, iterations):
    """num_iterations 2, stopped after step 3: the resumed step reuses the checkpoint's generation;
    the evaluations (steps 2 and 4) too are the same."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    trl = {"num_iterations": iterations}
    kw = dict(max_steps=4, trl=trl, val_set_size=4, eval_steps=2, micro_batch_size=8)
    train(config(task, whole, **kw), simulate=1, stream=io.StringIO())
    train(config(task, parts, **kw), simulate=1, stop_after=3, stream=io.StringIO())
    train(config(task, parts, **kw), simulate=1, resume=True, stream=io.StringIO())
    a, b = _metrics(whole), _metrics(parts)
    assert [m["step"] for m in b] == [1, 2, 3, 4] and "eval_reward" in b[-1]
    for x, y in zip(a, b):
        for key in ("loss", "reward", "completions_mean_length", "grad_norm", "clip_ratio_region_mean", "eval_reward",
                    "eval_loss"):
            assert x.get(key) == y.get(key), (x["step"], key)


def test_an_axolotl_config_trains_from_the_cli_and_exports(task, tmp_path, monkeypatch, capsys):
    """Reward functions and the dataset transform in modules beside the config (imported from
    there, the working directory elsewhere), Axolotl's vLLM keys accepted, a chat prompt."""
    d = tmp_path / "project"
    d.mkdir()
    (d / "rwd.py").write_text(REWARDS + TRANSFORM)
    with open(d / "questions.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"say {i}", "n": i}) + "\n")
    out = tmp_path / "run"
    (d / "grpo.yaml").write_text(f"""
rl: grpo
trl:
  beta: 0.01
  max_completion_length: 4
  num_generations: 2
  temperature: 0.7
  top_p: 0.95
  use_vllm: true
  vllm_server_host: 0.0.0.0
  reward_funcs: [rwd.letters, rwd.answer_echo]
  reward_weights: [1.0, 2.0]
  log_completions: true
vllm:
  host: 0.0.0.0
  port: 8000
chat_template: chatml
datasets:
  - path: {d / 'questions.jsonl'}
    type: rwd.to_prompt
model: {{preset: tiny, hidden: 32, mlp: 64}}
sequence_len: 80
micro_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 2
learning_rate: 1.0e-3
output_dir: {out}
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["train", str(d / "grpo.yaml")]) == 0
    text = capsys.readouterr().out
    assert "2 prompts x 2 generations per step" in text and "| reward " in text      # the progress line
    assert "use_vllm, vllm_server_host, log_completions, vllm.host, vllm.port not used: generation runs " \
           "in-process" in text
    m = _metrics(out)
    assert [x["step"] for x in m] == [1, 2] and "rewards_answer_echo_mean" in m[-1] and "kl" in m[-1]
    assert [x["echo_step"] for x in m] == [0, 1]              # TRL's trainer_state and log_metric
    assert cli.main(["export", str(out), str(tmp_path / "hf")]) == 0
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("reference" in n for n, _ in model.named_parameters())


def test_bad_reward_functions_and_settings_are_refused_before_any_work(task, tmp_path):
    out = tmp_path / "never"
    cases = [({"trl": {"reward_funcs": ["nowhere.reward"]}}, r"trl.reward_funcs\[0\]: cannot import module 'nowhere'"),
             ({"trl": {"reward_funcs": ["toy_rewards.missing"]}}, "has no function 'missing'"),
             ({"trl": {"min_p": 0.1}}, "trl.min_p: min-p sampling is not built"),
             ({"micro_batch_size": 6}, "global batch of 6 completions .* not a multiple of trl.num_generations 4"),
             ({"val_set_size": 2}, "val_set_size: 2 held-out prompts are fewer than one evaluation batch's 4"),
             ({"trl": {"num_generations_eval": 3}, "val_set_size": 4},
              "global batch of 16 completions is not a multiple of trl.num_generations_eval 3"),
             ({"trl": {"importance_sampling_level": "seq"}}, "trl.importance_sampling_level 'seq' is not one of")]
    for over, why in cases:
        trl = dict(over.pop("trl", {}))
        with pytest.raises(ConfigError, match=why):
            train(config(task, out, trl=trl, **over), simulate=over.get("pp_size", 1), stream=io.StringIO())
    assert not out.exists()
    with pytest.raises(ConfigError, match="'trl' is not supported with rl: dpo"):
        TrainConfig.from_dict({"rl": "dpo", "trl": {"beta": 0.1}, "datasets": [{"path": "x.jsonl"}]})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_gloo_processes_equal_simulation(task, tmp_path):
    """torchrun, 2 real processes with FSDP: each samples the step's completions."""
    import os
    import subprocess
    import sys
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(f"""
rl: grpo
trl: {{reward_funcs: [toy_rewards.letters], num_generations: 4, max_completion_length: 6}}
datasets: [{{path: {task / 'prompts.jsonl'}}}]
model: {{preset: tiny, hidden: 32, mlp: 64}}
sequence_len: 16
micro_batch_size: 4
dp_shard_size: 2
max_steps: 2
learning_rate: 1.0e-2
""")
    (tmp_path / "toy_rewards.py").write_text(REWARDS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(cfg), "--output", str(tmp_path / "torchrun")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cli.main(["train", str(cfg), "--output", str(tmp_path / "sim")]) == 0
    real, sim = _metrics(tmp_path / "torchrun"), _metrics(tmp_path / "sim")
    assert [m["step"] for m in real] == [m["step"] for m in sim] == [1, 2]
    for a, b in zip(real, sim):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)


def _params(out: Path, step: int) -> dict:
    from functional_pp import checkpoint as ck
    return ck.load_checkpoint(out / "checkpoints", step=step, keys=["params"]).tree["params"]


@pytest.mark.parametrize("layout,simulate", [({}, 1), ({"dp_shard_size": 2, "tp_size": 2, "micro_batch_size": 8}, 4)])
def test_sync_ref_model_mixes_the_reference_toward_the_policy(task, tmp_path, layout, simulate):
    """trl.sync_ref_model (TR-DPO, TRL's SyncRefModelCallback): every ref_model_sync_steps steps
    the reference becomes alpha * policy + (1 - alpha) * reference (checked on the checkpoints,
    the copy sharded like the policy under FSDP x TP); the steps between leave it."""
    from functional_pp.core.tree import leaves_with_paths
    out = tmp_path / "run"
    trl = {"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 0.3, "ref_model_sync_steps": 2}
    train(config(task, out, trl=trl, max_steps=3, checkpoint={"save_every": 1}, **layout), simulate=simulate,
          stream=io.StringIO())
    p1, p2, p3 = (_params(out, s) for s in (1, 2, 3))
    moved = 0
    for (path, r1), (_, r2), (_, r3), (_, pol2) in zip(*(leaves_with_paths(p["reference"]) for p in (p1, p2, p3)),
                                                      leaves_with_paths({k: v for k, v in p2.items()
                                                                         if k != "reference"})):
        torch.testing.assert_close(r2, 0.3 * pol2 + 0.7 * r1, rtol=1e-6, atol=1e-7, msg=lambda m: f"{path}: {m}")
        assert torch.equal(r3, r2), path                 # step 3: no sync
        moved += int(not torch.equal(r2, r1))
    assert moved > 0


def test_sync_ref_model_is_refused_where_it_cannot_apply(task, tmp_path):
    with pytest.raises(ConfigError, match=r"trl.sync_ref_model mixes the reference toward the policy, but trl.beta"):
        train(config(task, tmp_path / "a", trl={"sync_ref_model": True}), simulate=1, stream=io.StringIO())
    with pytest.raises(ConfigError, match=r"trl.sync_ref_model with adapter: lora is not supported"):
        train(config(task, tmp_path / "b", trl={"beta": 0.1, "sync_ref_model": True}, adapter="lora", lora_r=4,
                     lora_alpha=8, lora_target_modules=["q_proj"]), simulate=1, stream=io.StringIO())
    with pytest.raises(ConfigError, match=r"trl.ref_model_mixup_alpha must be in \[0, 1\], got 1.5"):
        train(config(task, tmp_path / "c", trl={"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 1.5}),
              simulate=1, stream=io.StringIO())
