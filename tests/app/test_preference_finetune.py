"""``rl: dpo`` (and ipo, orpo, simpo, kto) from an Axolotl-style config, end to end: a tiny Llama
fine-tuned on chosen / rejected pairs (KTO: unpaired completions), its loss equal to TRL's
DPOTrainer / KTOTrainer on transformers' Llama with the run's weights (a step past the first,
where the policy differs from the reference), a FSDP x TP layout equal to one device, and
unsupported methods refused first."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_tokenizer import make_tokenizer
from trl_oracle import dpo_loss, kto_loss

from functional_pp.app.export import export_run
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
          rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
QUESTIONS = ["Is the sky blue?", "Name a prime.", "What is 2+2?", "Say hi.", "Pick a colour.", "Count to 3.",
             "Is water wet?", "Spell cat."]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny transformers Llama with a byte-level tokenizer (EOS <|im_end|>), saved."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer(d, None, "<|im_end|>")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tok.vocab_size, **KW,
                                                                   eos_token_id=tok.eos_id))
    model.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Intel-Orca-style records (chatml.intel): a question, a good and a bad answer."""
    f = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with open(f, "w") as out:
        for i, q in enumerate(QUESTIONS * 2):
            rec = {"question": q, "chosen": f"Sure: answer {i % 5}.", "rejected": "No."}
            if i % 3 == 0:
                rec["system"] = "Be brief."
            out.write(json.dumps(rec) + "\n")
    return f


def config(base: Path, pairs: Path, out: Path, **over) -> TrainConfig:
    d = {"base_model": str(base), "rl": "dpo", "rl_beta": 0.5,
         "datasets": [{"path": str(pairs), "type": "chatml.intel"}],
         "sequence_len": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 3,
         "learning_rate": 5e-3, "lr_scheduler": "constant", "optimizer": "adamw", "max_grad_norm": None,
         "logging": {"log_every": 1, "output_dir": str(out), "plot": False}, **over}
    return TrainConfig.from_dict(d, name="dpo")


def _trl_loss(policy_dir: Path, ref_dir: Path, cfg: TrainConfig, step: int) -> tuple[float, dict]:
    """TRL's DPO loss of step ``step``'s pairs (as the run's loader gives them) with the policy
    and reference read by transformers."""
    from functional_pp.app.preference_run import load_pairs
    from functional_pp.data.pair_loader import PairLoader
    pairs = load_pairs(cfg).train
    gb = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    batch = PairLoader(pairs, global_batch_size=gb, seq_len=cfg.sequence_len, seed=cfg.seed).global_batch(step)
    ids = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    mask = torch.zeros_like(ids)
    mask[:, 1:] = (labels[:, :-1] != -100).long()
    models = []
    for d in (policy_dir, ref_dir):
        m = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
        m.config._attn_implementation = "eager"
        trl.trainer.utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1",
                                                        "log_sum_sq_probs"))
        models.append(m)
    policy, reference = models
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True).log_probs.sum(1)
        loss, metrics = dpo_loss(policy, ids, mask, ref[:gb], ref[gb:], beta=cfg.rl_beta,
                                 loss_type=cfg.dpo_loss_type or "sigmoid", loss_weights=cfg.dpo_loss_weights,
                                 label_smoothing=cfg.dpo_label_smoothing, use_weighting=bool(cfg.dpo_use_weighting))
    return float(loss), metrics


def test_dpo_run_equals_trl_past_the_first_step(base, pairs, tmp_path):
    out = tmp_path / "run"
    cfg = config(base, pairs, out, checkpoint={"save_every": 2})
    r = train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3]
    # step 1: the policy is the reference: every log-ratio 0, TRL's loss log 2
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m[0]["rewards_margins"] == pytest.approx(0.0, abs=1e-6)
    # step 3 runs on the parameters after step 2 (checkpoint 2): TRL's loss on them
    exported = export_run(out, tmp_path / "hf-step2", step=2)
    want, metrics = _trl_loss(exported, base, cfg, step=2)
    assert abs(want - math.log(2)) > 1e-3               # the policy moved away from the reference
    assert m[2]["loss"] == pytest.approx(want, rel=2e-5, abs=2e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        assert m[2][name.replace("/", "_")] == pytest.approx(metrics[name], rel=1e-4, abs=1e-5), name
    assert r.final_step == 3


@pytest.mark.parametrize("over", [dict(dpo_loss_type=["sigmoid", "bco_pair", "sft"], dpo_loss_weights=[0.8, 0.2, 1.0]),
                                  dict(dpo_use_weighting=True, dpo_loss_type="robust", dpo_label_smoothing=0.1)])
def test_dpo_loss_type_list_and_weighting_runs_equal_trl(base, pairs, tmp_path, over):
    """TRL's MPO mix (dpo_loss_type [sigmoid, bco_pair, sft] with dpo_loss_weights) and WPO's
    weighting (dpo_use_weighting) from the config: the loss past the first step equals TRL's
    DPOTrainer with the same arguments."""
    out = tmp_path / "run"
    cfg = config(base, pairs, out, checkpoint={"save_every": 2}, **over)
    train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    want, _ = _trl_loss(export_run(out, tmp_path / "hf-step2", step=2), base, cfg, step=2)
    assert m[2]["loss"] == pytest.approx(want, rel=2e-5, abs=2e-6)
    if "dpo_loss_weights" in over:
        assert m[0]["loss"] > math.log(2) + 1                # the sft term counts


@pytest.mark.parametrize("over,message", [
    ({"dpo_loss_type": "bogus"}, r"dpo loss_type 'bogus' is not one of sigmoid, hinge, ipo"),
    ({"dpo_loss_type": ["sigmoid", "aot"]}, r"'aot' sorts the log-ratios over the batch \(AOT\), which is not built"),
    ({"dpo_loss_type": ["sigmoid", "sft"], "dpo_loss_weights": [1.0]}, r"gives 1 weights for 2 loss types"),
    ({"dpo_loss_type": ["sigmoid"], "dpo_loss_weights": ["a"]}, r"dpo_loss_weights must be a list of numbers"),
    ({"dpo_loss_type": "exo_pair"}, r"exo_pair needs dpo_label_smoothing > 0"),
    ({"dpo_label_smoothing": 0.1}, r"label smoothing in dpo_loss_type robust and exo_pair only"),
    ({"rl": "kto", "dpo_loss_type": "hinge"}, r"dpo_loss_type is read by rl: dpo only"),
    ({"kto_loss_type": "kto"}, r"kto_loss_type is read by rl: kto only"),
    ({"rl": "kto", "kto_loss_type": "bco"}, r"kto_loss_type 'bco' is not one of kto, apo_zero_unpaired"),
    ({"rl": "orpo", "dpo_use_weighting": True}, r"dpo_use_weighting is read by rl: dpo / ipo only"),
    ({"dpo_use_weighting": True, "dpo_loss_type": ["sigmoid", "sft"]}, r"dpo_use_weighting with dpo_loss_type sft"),
    ({"rpo_alpha": 0.5}, r"its RPO is dpo_loss_type \[sigmoid, sft\] with dpo_loss_weights \[1.0, alpha\]"),
])
def test_bad_loss_types_are_refused_before_any_work(base, pairs, tmp_path, over, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train(config(base, pairs, out, **over), simulate=1, stream=io.StringIO())
    assert not out.exists()


def test_dpo_fsdp_tp_run_equals_one_device(base, pairs, tmp_path):
    one = train(config(base, pairs, tmp_path / "one"), simulate=1, stream=io.StringIO())
    four = train(config(base, pairs, tmp_path / "four", dp_shard_size=2, tp_size=2, micro_batch_size=2),
                 simulate=4, stream=io.StringIO())     # (micro_batch_size is per data-parallel rank)
    assert len(one.losses) == 3 and one.losses[2] != one.losses[0]
    torch.testing.assert_close(torch.tensor(four.losses), torch.tensor(one.losses), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("method,over", [("ipo", {}), ("orpo", {"orpo_alpha": 0.2}), ("simpo", {"rl_beta": 2.0}),
                                         ("dpo", {"adapter": "lora", "lora_r": 4, "lora_alpha": 8,
                                                  "lora_target_modules": ["q_proj", "v_proj"]})])
def test_other_methods_train(base, pairs, tmp_path, method, over):
    cfg = config(base, pairs, tmp_path / method, rl=method, max_steps=4, **over)
    r = train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(tmp_path / method / "metrics.jsonl")
    assert all(math.isfinite(x) for x in r.losses)
    assert r.losses[-1] < r.losses[0]
    assert m[-1]["rewards_margins"] > m[0]["rewards_margins"]


@pytest.mark.parametrize("rl,why", [("ppo", "another objective than GRPO's")])
def test_unsupported_methods_are_refused_by_name_before_any_work(base, pairs, tmp_path, rl, why):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"'rl: {rl}' is not supported yet: .*{why}"):
        train(config(base, pairs, out, rl=rl), simulate=1, stream=io.StringIO())
    assert not out.exists()


def test_ebft_section_without_rl_ebft_is_refused(base, pairs, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="'ebft' is read by rl: ebft only \\(this config has rl: dpo\\)"):
        train(config(base, pairs, out, rl="dpo", ebft={"mode": "strided", "stride": 8}), simulate=1,
              stream=io.StringIO())
    assert not out.exists()


def test_bad_pairs_are_refused_naming_the_record(base, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"question": "q", "chosen": "a", "rejected": "b"}) + "\n"
                 + json.dumps({"question": "q", "chosen": "a"}) + "\n")
    with pytest.raises(ConfigError, match=r"datasets\[0\]: .*bad.jsonl: record 2 has no field 'rejected'"):
        train(config(base, f, tmp_path / "run"), simulate=1, stream=io.StringIO())
    g = tmp_path / "type.jsonl"
    g.write_text(f.read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match=r"rl: dpo: datasets\[0\].type 'alpaca' is not a preference dataset "
                                         r"type built here; choose one of chatml.intel"):
        train(config(base, g, tmp_path / "run2", datasets=[{"path": str(g), "type": "alpaca"}]), simulate=1,
              stream=io.StringIO())


def test_dpo_resumes_exactly_with_its_reference(base, pairs, tmp_path):
    whole = train(config(base, pairs, tmp_path / "whole", max_steps=4), simulate=1, stream=io.StringIO())
    split = config(base, pairs, tmp_path / "split", max_steps=4)
    first = train(split, simulate=1, stop_after=2, stream=io.StringIO())
    second = train(split, simulate=1, resume=True, stream=io.StringIO())
    assert first.stopped and second.start_step == 2
    assert first.losses + second.losses == whole.losses


def test_llama3_and_user_defined_types_from_yaml_train_and_resume(base, pairs, tmp_path):
    """A YAML config as Axolotl's users write it: a llama3.* type and a user-defined type (a
    mapping) over the same records; the run trains and resumes exactly (the mapping read back
    from the run's saved config)."""
    import yaml
    base = tmp_path / "tiny-llama3"                 # (Llama 3's headers need more than 64 byte positions)
    tok = make_tokenizer(base, None, "<|eot_id|>")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tok.vocab_size, **{
        **KW, "max_position_embeddings": 256}, eos_token_id=tok.eos_id)).save_pretrained(base)
    user_defined = {"field_prompt": "question", "prompt_format": "{system}\nQ: {prompt}\nA:",
                    "chosen_format": " {chosen}", "rejected_format": " {rejected}"}
    d = {"base_model": str(base), "rl": "dpo", "rl_beta": 0.5, "sequence_len": 160, "micro_batch_size": 4,
         "max_steps": 3, "learning_rate": 5e-3, "lr_scheduler": "constant", "max_grad_norm": None,
         "datasets": [{"path": str(pairs), "type": "llama3.intel"}, {"path": str(pairs), "type": user_defined}]}
    losses = []
    for name, stop in (("whole", None), ("split", 1)):
        f = tmp_path / f"{name}.yml"
        f.write_text(yaml.safe_dump({**d, "logging": {"log_every": 1, "output_dir": str(tmp_path / name),
                                                      "plot": False}}))
        cfg = TrainConfig.from_yaml(f)
        assert cfg.datasets[1].type == user_defined
        if stop is None:
            losses.append(train(cfg, simulate=1, stream=io.StringIO()).losses)
        else:
            first = train(cfg, simulate=1, stop_after=stop, stream=io.StringIO())
            second = train(cfg, simulate=1, resume=True, stream=io.StringIO())
            losses.append(first.losses + second.losses)
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    from functional_pp.app.preference_run import load_pairs
    read = load_pairs(cfg).train
    assert len(read) == 2 * len(QUESTIONS) * 2 and read.dropped == 0      # every record of both entries
    assert read.pairs[0].prompt != read.pairs[2 * len(QUESTIONS)].prompt   # (the two prompt formats)


def test_dpo_resume_on_rewritten_pairs_is_refused(base, pairs, tmp_path):
    """A preference run's checkpoint holds a hash of its pairs' tokens, as SFT's of its tokens
    (issue 46): pairs rewritten with as many records are refused at resume, naming both hashes;
    --allow-config-change continues."""
    mine = tmp_path / "pairs.jsonl"
    mine.write_text(pairs.read_text())
    cfg = config(base, mine, tmp_path / "run", max_steps=2)
    train(cfg, simulate=1, stop_after=1, stream=io.StringIO())
    mine.write_text(pairs.read_text().replace("Sure: answer", "Sure: Answer"))     # same pairs, other tokens
    with pytest.raises(ConfigError, match=r"--resume: the training tokens differ .* sha256 \w+ then; .* now"):
        train(cfg, simulate=1, resume=True, stream=io.StringIO())
    assert train(cfg, simulate=1, resume=True, allow_config_change=True, stream=io.StringIO()).start_step == 1


def test_dpo_from_a_chat_template_dataset_as_axolotls_example_writes_it(tmp_path):
    """Axolotl's llama-3 DPO example's dataset entry (type chat_template.default, field_messages,
    message_property_mappings, roles) and chat_template: llama3, as written; a tiny Llama."""
    import yaml
    from axolotl_corpus import CORPUS
    raw = yaml.safe_load((CORPUS / "llama-3/instruct-dpo-lora-8b.yml").read_text())
    d = tmp_path / "llama"
    tok = make_tokenizer(d, "<|begin_of_text|>", "<|eot_id|>")
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=tok.vocab_size, **{**KW, "max_position_embeddings": 128})
    transformers.LlamaForCausalLM(conf).save_pretrained(d)
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps({"conversation": [{"role": "user", "content": q}],
                                     "chosen": {"role": "assistant", "content": f"Yes: {i}."},
                                     "rejected": {"role": "assistant", "content": "No."}}) + "\n"
                         for i, q in enumerate(QUESTIONS)))
    entry = {**raw["datasets"][0], "path": str(f)}
    out = tmp_path / "run"
    cfg = config(d, f, out, datasets=[entry], chat_template=raw["chat_template"], adapter="lora", lora_r=4,
                 lora_alpha=8, lora_target_linear=True, sequence_len=96)
    r = train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)      # the adapters start at zero
    assert r.losses[-1] < r.losses[0] and m[-1]["rewards_margins"] > 0


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory) -> Path:
    """Intel-Orca-style KTO records (chatml.intel): a question, one answer, desirable or not."""
    f = tmp_path_factory.mktemp("kto") / "kto.jsonl"
    with open(f, "w") as out:
        for i, q in enumerate(QUESTIONS * 2):
            good = i % 3 != 1
            out.write(json.dumps({"question": q, "completion": f"Sure: answer {i % 5}." if good else "No.",
                                  "label": good}) + "\n")
    return f


def _kto_config(base, data, out, **over):
    kto = dict(rl="kto", rl_beta=0.3, kto_desirable_weight=1.2, kto_undesirable_weight=0.8)
    return config(base, data, out, **{**kto, **over})


def _trl_kto_loss(policy_dir: Path, ref_dir: Path, cfg: TrainConfig, step: int) -> tuple[float, dict]:
    """TRL's KTOTrainer loss of step ``step``'s completions (as the run's loader gives them,
    with their KL rows) with the policy and reference read by transformers."""
    from functional_pp.app.preference_run import load_pairs
    from functional_pp.data.pair_loader import PairLoader
    data = load_pairs(cfg).train
    batch = PairLoader(data, global_batch_size=cfg.micro_batch_size, seq_len=cfg.sequence_len,
                       seed=cfg.seed).global_batch(step)
    masks = {}
    for key in ("", "kl_"):
        m = torch.zeros_like(batch[f"{key}tokens"])
        m[:, 1:] = (batch[f"{key}labels"][:, :-1] != -100).long()
        masks[key] = m
    models = []
    for d in (policy_dir, ref_dir):
        m = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
        m.config._attn_implementation = "eager"
        trl.trainer.utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        models.append(m)
    policy, reference = models

    def ref_logps(key):
        ids = batch[f"{key}tokens"]
        return reference(input_ids=ids, labels=ids.masked_fill(masks[key] == 0, -100),
                         fused_lm_head=True).log_probs.sum(1)
    with torch.no_grad():
        loss, metrics = kto_loss(policy, batch["tokens"], masks[""], batch["desirable"][:, 0].bool(), ref_logps(""),
                                 batch["kl_tokens"], masks["kl_"], ref_logps("kl_"), beta=cfg.rl_beta,
                                 desirable_weight=cfg.kto_desirable_weight,
                                 undesirable_weight=cfg.kto_undesirable_weight, loss_type=cfg.kto_loss_type or "kto")
    return float(loss), metrics


def test_kto_apo_zero_unpaired_run_equals_trl(base, unpaired, tmp_path):
    out = tmp_path / "run"
    cfg = _kto_config(base, unpaired, out, checkpoint={"save_every": 2}, kto_loss_type="apo_zero_unpaired")
    train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    want, metrics = _trl_kto_loss(export_run(out, tmp_path / "hf-step2", step=2), base, cfg, step=2)
    assert m[2]["loss"] == pytest.approx(want, rel=2e-5, abs=2e-6)
    assert m[2]["kl"] == metrics["kl"] == 0.0            # no KL term


def test_kto_run_equals_trl_past_the_first_step(base, unpaired, tmp_path):
    out = tmp_path / "run"
    cfg = _kto_config(base, unpaired, out, checkpoint={"save_every": 2})
    train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    # step 1: the policy is the reference: every log-ratio and the KL 0, each loss w * (1 - sigmoid(0))
    assert m[0]["kl"] == 0.0 and m[0]["rewards_margins"] == pytest.approx(0.0, abs=1e-6)
    exported = export_run(out, tmp_path / "hf-step2", step=2)
    want, metrics = _trl_kto_loss(exported, base, cfg, step=2)
    assert metrics["kl"] > 0
    assert m[2]["loss"] == pytest.approx(want, rel=2e-5, abs=2e-6)
    names = [n for n in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
             if n in metrics]           # (TRL logs a kind's rewards only when the batch holds one)
    assert len(names) >= 3
    for name in names:
        assert m[2][name.replace("/", "_")] == pytest.approx(metrics[name], rel=1e-4, abs=1e-5), name


def test_kto_with_lora_takes_the_base_as_reference(base, unpaired, tmp_path):
    cfg = _kto_config(base, unpaired, tmp_path / "lora", adapter="lora", lora_r=4, lora_alpha=8,
                      lora_target_modules=["q_proj", "v_proj"], max_steps=4)
    r = train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(tmp_path / "lora" / "metrics.jsonl")
    assert m[0]["kl"] == 0.0                       # the adapters start at zero: policy == base
    assert m[-1]["kl"] > 0 and r.losses[-1] < r.losses[0]


def test_kto_fsdp_tp_run_equals_one_device(base, unpaired, tmp_path):
    one = train(_kto_config(base, unpaired, tmp_path / "one"), simulate=1, stream=io.StringIO())
    four = train(_kto_config(base, unpaired, tmp_path / "four", dp_shard_size=2, tp_size=2, micro_batch_size=2),
                 simulate=4, stream=io.StringIO())
    assert len(one.losses) == 3 and one.losses[2] != one.losses[0]
    torch.testing.assert_close(torch.tensor(four.losses), torch.tensor(one.losses), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rec,over,message", [
    ({"question": "q", "completion": "a", "label": "true"}, {},
     r"datasets: datasets\[0\]: .*: record 1: field 'label' is 'true' \(str\), not true or false"),
    ({"question": "q", "completion": "a", "label": True}, {"datasets": [{"type": "chatml.argilla_chat_x"}]},
     r"rl: kto: datasets\[0\].type 'chatml.argilla_chat_x' is not a KTO dataset type built here"),
    ({"question": "q", "completion": "a", "label": True}, {"rl": "dpo", "kto_undesirable_weight": None},
     r"kto_desirable_weight is read by rl: kto only"),
    ({"question": "q", "completion": "a", "label": True}, {"kto_undesirable_weight": 0.0},
     r"kto_undesirable_weight must be > 0, got 0.0"),
])
def test_bad_kto_inputs_are_refused_before_any_work(base, tmp_path, rec, over, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    if "datasets" in over:
        over = {**over, "datasets": [{**over["datasets"][0], "path": str(f)}]}
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train(_kto_config(base, f, out, **over), simulate=1, stream=io.StringIO())
    assert not out.exists()


def test_held_out_pairs_are_evaluated_as_trl_on_every_layout(base, pairs, tmp_path):
    """val_set_size holds out pairs (3 of those that fit: the one eval batch of 4 wraps, its 4th
    pair weighing 0); eval_loss is the mean DPO loss of the held-out pairs, TRL's on the run's
    weights, and eval_rewards_* / eval_logps_* are the metrics TRL's DPOTrainer logs evaluating
    them (eval_rewards/chosen, ...); a FSDP x TP run evaluates the same."""
    from functional_pp.app.preference_run import load_pairs
    out = tmp_path / "run"
    cfg = config(base, pairs, out, val_set_size=3, checkpoint={"save_every": 2})
    one = train(cfg, simulate=1, stream=io.StringIO())
    m = read_metrics(out / "metrics.jsonl")
    evals = {x["step"]: x["eval_loss"] for x in m if "eval_loss" in x}
    assert evals[0] == pytest.approx(math.log(2), abs=1e-6)          # policy == reference
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected")
    first = next(x for x in m if x["step"] == 0)
    assert first["eval_rewards_margins"] == pytest.approx(0.0, abs=1e-6) and first["eval_logps_chosen"] < 0
    held = load_pairs(cfg).val
    train_pairs = load_pairs(cfg).train
    assert len(held) == 3 and len(train_pairs) + train_pairs.dropped == 13
    rows = held.batch_rows(range(3), cfg.sequence_len)
    ids = torch.from_numpy(np.concatenate([rows["chosen_tokens"], rows["rejected_tokens"]]))
    labels = torch.from_numpy(np.concatenate([rows["chosen_labels"], rows["rejected_labels"]]))
    mask = torch.zeros_like(ids)
    mask[:, 1:] = (labels[:, :-1] != -100).long()
    exported = export_run(out, tmp_path / "hf-step2", step=2)
    models = []
    for d in (exported, base):
        model = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
        model.config._attn_implementation = "eager"
        trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        models.append(model)
    with torch.no_grad():
        ref = models[1](input_ids=ids, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True).log_probs.sum(1)
        want, logged = dpo_loss(models[0], ids, mask, ref[:3], ref[3:], beta=cfg.rl_beta, loss_type="sigmoid")
    assert abs(float(want) - math.log(2)) > 1e-3
    assert evals[2] == pytest.approx(float(want), rel=2e-5, abs=2e-6)
    at2 = next(x for x in m if x["step"] == 2 and "eval_loss" in x)
    assert not models[0].training and abs(logged["rewards/margins"]) > 1e-4      # (TRL's eval dict, moved)
    for name in names:
        assert at2["eval_" + name.replace("/", "_")] == pytest.approx(logged[name], rel=1e-4, abs=1e-5), name
    four = train(config(base, pairs, tmp_path / "four", val_set_size=3, dp_shard_size=2, tp_size=2,
                        micro_batch_size=2), simulate=4, stream=io.StringIO())
    m4 = read_metrics(tmp_path / "four" / "metrics.jsonl")
    torch.testing.assert_close(torch.tensor(four.losses), torch.tensor(one.losses), rtol=2e-5, atol=2e-6)
    for key in ("eval_loss", *("eval_" + n.replace("/", "_") for n in names)):
        torch.testing.assert_close(torch.tensor([x[key] for x in m4 if "eval_loss" in x]),
                                   torch.tensor([x[key] for x in m if "eval_loss" in x]), rtol=2e-5, atol=2e-6,
                                   msg=key)


def test_dpo_lora_with_activation_checkpointing_under_fsdp(base, pairs, tmp_path):
    """Axolotl's DPO examples: LoRA, gradient_checkpointing, data parallel. The adapters are used
    by both forwards (chosen, rejected), so their two gradients are summed during backward; a
    bucket launched by that sum used to receive the next gradient (TypeError in
    parallel/buckets/eager.py)."""
    lora = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True, dp_shard_size=2, micro_batch_size=2)
    plain = train(config(base, pairs, tmp_path / "plain", **lora), simulate=2, stream=io.StringIO())
    remat = train(config(base, pairs, tmp_path / "remat", gradient_checkpointing=True, **lora), simulate=2,
                  stream=io.StringIO())
    assert plain.losses[-1] != plain.losses[0]
    torch.testing.assert_close(torch.tensor(remat.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)


def test_kto_resumes_exactly(base, unpaired, tmp_path):
    whole = train(_kto_config(base, unpaired, tmp_path / "whole", max_steps=4), simulate=1, stream=io.StringIO())
    split = _kto_config(base, unpaired, tmp_path / "split", max_steps=4)
    first = train(split, simulate=1, stop_after=2, stream=io.StringIO())
    second = train(split, simulate=1, resume=True, stream=io.StringIO())
    assert first.stopped and second.start_step == 2
    assert first.losses + second.losses == whole.losses


def _param_names(run_dir: Path) -> str:
    """The checkpoint index's text (its parameter paths)."""
    step = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return (step / "index.json").read_text()


def test_precomputed_reference_equals_the_held_reference(base, pairs, tmp_path):
    """precompute_ref_log_probs: one pass of the reference before training, stored with the
    pairs (and written to reference_logps.npz), the reference not held: the stored values equal
    transformers' log-probabilities of the pairs under the base model, and the run (training and
    held-out evaluation, then a resume) equals the run that holds the reference, step by step."""
    from functional_pp.app.preference_run import load_pairs
    over = dict(val_set_size=3, max_steps=4, checkpoint={"save_every": 2})
    held = train(config(base, pairs, tmp_path / "held", **over), simulate=1, stream=io.StringIO())
    cfg = config(base, pairs, tmp_path / "pre", precompute_ref_log_probs=True, **over)
    first = train(cfg, simulate=1, stop_after=2, stream=io.StringIO())
    second = train(cfg, simulate=1, resume=True, stream=io.StringIO())
    assert first.losses + second.losses == held.losses and held.losses[-1] < held.losses[0]
    pre, want = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("pre", "held"))
    assert [m.get("eval_loss") for m in pre] == [m.get("eval_loss") for m in want]
    assert '"reference' in _param_names(tmp_path / "held") and '"reference' not in _param_names(tmp_path / "pre")
    saved = np.load(tmp_path / "pre" / "reference_logps.npz")
    data = load_pairs(cfg)
    for name, pair_set in (("train", data.train), ("val", data.val)):
        rows = pair_set.batch_rows(range(len(pair_set)), cfg.sequence_len)
        model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        for col, side in enumerate(("chosen", "rejected")):
            ids, labels = (torch.from_numpy(rows[f"{side}_{k}"]) for k in ("tokens", "labels"))
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits, -1)
            mask = labels != -100
            want_lp = (lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask).sum(1)
            np.testing.assert_allclose(saved[name][:, col], want_lp.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("over,simulate", [
    ({"dp_shard_size": 2, "tp_size": 2, "micro_batch_size": 2}, 4),
    ({"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}, 1)])
def test_precomputed_reference_on_fsdp_tp_and_with_lora(base, pairs, tmp_path, over, simulate):
    """Under FSDP x TP (the pass laid out as the step) and with LoRA (the reference: the base
    without the adapters) a precomputed run equals one holding the reference on one device."""
    lora = {k: v for k, v in over.items() if "lora" in k or k == "adapter"}
    one = train(config(base, pairs, tmp_path / "one", **lora), simulate=1, stream=io.StringIO())
    pre = train(config(base, pairs, tmp_path / "pre", precompute_ref_log_probs=True, **over), simulate=simulate,
                stream=io.StringIO())
    assert one.losses[-1] != one.losses[0]
    torch.testing.assert_close(torch.tensor(pre.losses), torch.tensor(one.losses), rtol=2e-5, atol=2e-6)


def test_precomputed_reference_is_refused_where_it_cannot_apply(base, pairs, unpaired, tmp_path):
    with pytest.raises(ConfigError, match=r"precompute_ref_log_probs is built for rl: dpo / ipo .*rl: kto"):
        train(_kto_config(base, unpaired, tmp_path / "kto", precompute_ref_log_probs=True), simulate=1,
              stream=io.StringIO())
    with pytest.raises(ConfigError, match=r"rl: orpo: it has no reference"):
        train(config(base, pairs, tmp_path / "orpo", rl="orpo", precompute_ref_log_probs=True), simulate=1,
              stream=io.StringIO())
    cfg = config(base, pairs, tmp_path / "run", precompute_ref_log_probs=True, max_steps=2)
    train(cfg, simulate=1, stop_after=1, stream=io.StringIO())
    (tmp_path / "run" / "reference_logps.npz").unlink()
    with pytest.raises(ConfigError, match=r"reference_logps.npz\), which is missing; start a new run"):
        train(cfg, simulate=1, resume=True, stream=io.StringIO())


@pytest.mark.multiprocess
def test_precomputed_reference_on_two_gloo_processes_equals_simulation(base, pairs, tmp_path):
    """torchrun, 2 real processes (FSDP): each computes its rows' reference log-probs and every
    process gets them all; the stored values and the run equal the simulated one."""
    import os
    import subprocess
    import sys

    import yaml
    d = {"base_model": str(base), "rl": "dpo", "rl_beta": 0.5, "precompute_ref_log_probs": True,
         "datasets": [{"path": str(pairs), "type": "chatml.intel"}], "sequence_len": 64, "micro_batch_size": 2,
         "dp_shard_size": 2, "max_steps": 2, "learning_rate": 5e-3, "lr_scheduler": "constant"}
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(yaml.safe_dump(d))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(cfg), "--output", str(tmp_path / "torchrun")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = train(TrainConfig.from_dict({**d, "logging": {"output_dir": str(tmp_path / "sim"), "plot": False}}),
                simulate=2, stream=io.StringIO())
    real = read_metrics(tmp_path / "torchrun" / "metrics.jsonl")
    assert [m["loss"] for m in real] == pytest.approx(sim.losses, rel=1e-6, abs=1e-9)
    a, b = (np.load(tmp_path / r / "reference_logps.npz")["train"] for r in ("torchrun", "sim"))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert (a < 0).all()


def test_dpo_pp2_run_equals_one_device_and_resumes_exactly(base, pairs, tmp_path):
    """``rl: dpo`` with ``pp_size: 2`` (1F1B, the frozen reference copy's layers split over the
    stages as the policy's): its losses, held-out losses and TRL's metrics equal one device's, and
    stopped at step 2 and resumed from its (per-stage) checkpoint it equals the uninterrupted run bit
    for bit."""
    over = dict(max_steps=4, micro_batch_size=2, gradient_accumulation_steps=2, val_set_size=4, eval_steps=2,
                checkpoint={"save_every": 2})
    one = train(config(base, pairs, tmp_path / "one", **over), simulate=1, stream=io.StringIO())
    pp2 = train(config(base, pairs, tmp_path / "pp2", pp_size=2, **over), simulate=2, stream=io.StringIO())
    assert len(one.losses) == 4 and one.losses[3] != one.losses[0]
    torch.testing.assert_close(torch.tensor(pp2.losses), torch.tensor(one.losses), rtol=2e-5, atol=2e-6)
    m_one, m_pp2 = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("one", "pp2"))
    assert len(m_pp2) == len(m_one) and sum("rewards_margins" in m for m in m_pp2) == 4
    for a, b in zip(m_pp2, m_one):
        assert a.keys() == b.keys()
        for k in a:
            if k.startswith(("rewards", "logps", "eval_")):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), k
    assert [m["step"] for m in m_pp2 if "eval_loss" in m] == [0, 2, 4]
    split = config(base, pairs, tmp_path / "split", pp_size=2, **over)
    first = train(split, simulate=2, stop_after=2, stream=io.StringIO())
    second = train(split, simulate=2, resume=True, stream=io.StringIO())
    assert first.stopped and second.start_step == 2
    assert first.losses + second.losses == pp2.losses
