"""The declared config schema: Axolotl / Accelerate aliases, keys refused with their reason,
every problem of a file at once, YAML 1.1 numbers, and help generated from the schema."""
import pytest
import yaml

from functional_pp import cli
from functional_pp.config import ConfigError, TrainConfig, config_help


def test_axolotl_and_accelerate_aliases_mean_the_same_as_our_keys():
    ours = TrainConfig.from_dict({
        "tp_size": 2, "cp_size": 2, "activation_checkpointing": True, "optimizer": "adamw",
        "lr_scheduler": "constant", "logging": {"output_dir": "o", "log_every": 5},
        "checkpoint": {"save_every": 7, "keep_last": 2}, "precision": "bf16"})
    theirs = TrainConfig.from_dict({
        "tensor_parallel_size": 2, "context_parallel_size": 2, "gradient_checkpointing": True,
        "optimizer": "adamw_torch_fused", "lr_scheduler": "constant_with_warmup",
        "output_dir": "o", "logging_steps": 5, "save_steps": 7, "save_total_limit": 2,
        "mixed_precision": "bf16"})
    assert theirs.to_dict() == ours.to_dict()
    acc = TrainConfig.from_dict({"parallelism_config": {
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 1},
        "num_processes": 8, "distributed_type": "MULTI_GPU"})
    assert dict(acc.mesh(8).shape) == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert acc.notes == ["distributed_type (accelerate launcher settings: this run is launched by "
                         "torchrun or --simulate)"]
    with pytest.raises(ConfigError, match="num_processes: 8 but the world size gives 4"):
        acc.validate(4)
    cos = TrainConfig.from_dict({"lr_scheduler": "cosine_with_restarts", "max_steps": 10,
                                 "warmup_ratio": 0.25, "cosine_min_lr_ratio": 0.1,
                                 "learning_rate": "2e-4"})
    assert cos.lr_scheduler == "cosine" and cos.warmup() == 3
    assert cos.min_lr() == pytest.approx(2e-5)
    assert TrainConfig.from_dict(cos.to_dict()).to_dict() == cos.to_dict()
    assert TrainConfig.from_dict({"bf16": "auto"}).precision in ("bf16", "fp32")


def test_yaml_1_1_exponent_strings_are_numbers_for_numeric_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\npeak_flops_per_device: 5e10\nmin_learning_rate: 2e-5\n"
                    "max_steps: 1e2\n")
    assert yaml.safe_load(path.read_text())["learning_rate"] == "1e-3"     # what PyYAML gives
    cfg = TrainConfig.from_yaml(path)
    assert cfg.learning_rate == 1e-3 and cfg.peak_flops_per_device == 5e10
    assert cfg.min_learning_rate == 2e-5 and cfg.max_steps == 100
    for bad, msg in (({"tp_size": "2"}, "tp_size must be an integer, got '2'"),
                     ({"learning_rate": "fast"}, "learning_rate must be a number, got 'fast'"),
                     ({"max_steps": "1.5e0"}, "max_steps must be an integer"),
                     ({"sequence_parallel": "1e0"}, "sequence_parallel must be true/false")):
        with pytest.raises(ConfigError, match=msg):
            TrainConfig.from_dict(bad)


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    path = tmp_path / "pasted.yaml"
    path.write_text(yaml.safe_dump({
        "learning_rat": 1e-3, "micro_batchsize": 2, "flash_attention": True, "peft": {"loftq": True},
        "load_in_8bit": True, "deepspeed": "ds.json", "tp_size": "two",
        "logging": {"outputdir": "x"}, "datasets": [{"path": "a.jsonl", "typ": "alpaca"}],
        "max_steps": 0}))
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_yaml(path)
    text = str(info.value)
    assert text.startswith(f"10 problems in {path}:") and len(info.value.problems) == 10
    for want in ("unknown key 'learning_rat'; did you mean 'learning_rate'?",
                 "unknown key 'micro_batchsize'; did you mean 'micro_batch_size'?",
                 "peft: loftq is not supported: peft's own options here are loftq_config only",
                 "peft is set but adapter is not: add adapter: lora",
                 "load_in_8bit: a quantized base is frozen, so it trains only under an adapter",
                 "'deepspeed' is not supported",
                 "tp_size must be an integer, got 'two'",
                 "unknown key 'logging.outputdir'; did you mean 'output_dir'?",
                 "unknown key 'datasets[0].typ'; did you mean 'type'?", "max_steps must be >= 1, got 0"):
        assert want in text, want
    assert "did you mean" not in text.split("peft: loftq")[1].splitlines()[0]


@pytest.mark.parametrize("d, message", [
    ({"model_type": "BertForMaskedLM"}, "model_type: 'BertForMaskedLM' is not supported"),
    ({"tp_size": 2, "tensor_parallel_size": 4}, "tensor_parallel_size: 4 contradicts tp_size: 2"),
    ({"warmup_steps": 2, "warmup_ratio": 0.1}, "give warmup_steps or warmup_ratio, not both"),
    ({"val_set_size": 2.5}, "val_set_size must be a fraction in [0, 1) or a whole count"),
    ({"base_model": "x", "model": "tiny"}, "give either base_model"),
    ({"datasets": [{"type": "alpaca"}]}, "datasets[0] needs a path"),
    ({"parallelism_config": {"parallelism_config_pp_size": 2}}, "unknown key 'parallelism_config."),
])
def test_alias_and_value_errors(d, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(d)
    assert message in str(info.value)


def test_train_help_lists_every_key_with_its_default(capsys):
    text = config_help()
    for key in ("learning_rate", "base_model", "val_set_size", "sample_packing", "wandb_project",
                "save_every", "field_messages"):
        assert f"\n  {key}\n" in text, key
    assert "(default: 0.0003)" in text and "tensor_parallel_size -> tp_size" in text
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    assert "sample_packing" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("functional-pp ")


AXOLOTL = """
base_model: ./Meta-Llama-3-8B
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
load_in_4bit: false
strict: false
datasets:
  - path: data/alpaca.jsonl
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.05
output_dir: ./outputs/out
sequence_len: 8192
sample_packing: true
pad_to_sequence_len: true
wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:
gradient_accumulation_steps: 8
micro_batch_size: 1
num_epochs: 1
optimizer: paged_adamw_8bit
lr_scheduler: cosine
learning_rate: 2e-5
train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
early_stopping_patience:
resume_from_checkpoint:
logging_steps: 1
xformers_attention:
flash_attention: true
warmup_steps: 100
evals_per_epoch: 2
eval_table_size:
saves_per_epoch: 1
debug:
deepspeed:
weight_decay: 0.0
fsdp:
fsdp_config:
special_tokens:
  pad_token: <|end_of_text|>
"""


def test_a_typical_axolotl_config_fails_only_on_what_has_no_meaning_here(tmp_path):
    path = tmp_path / "axolotl.yaml"
    path.write_text(AXOLOTL)
    cfg = TrainConfig.from_yaml(path)         # paged_adamw_8bit: 8-bit AdamW, the paging noted
    assert cfg.optimizer == "adamw_8bit"
    assert any("paged_adamw_8bit = adamw_8bit" in n and "unified memory" in n for n in cfg.notes)
    path.write_text(AXOLOTL.replace("optimizer: paged_adamw_8bit", "optimizer: paged_lion_8bit"))
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_yaml(path)
    assert sorted(p.split(":")[0].split("'")[1] if p.startswith("'") else p.split(":")[0]
                  for p in info.value.problems) == ["optimizer"]     # epochs, attention: accepted
    assert "'paged_lion_8bit' is not supported (adamw, adamw_8bit or sgd)" in str(info.value)
    fixed = "\n".join(line for line in AXOLOTL.splitlines() if not line.startswith(
        ("optimizer", "flash_attention", "evals_per_epoch", "saves_per_epoch")))
    path.write_text(fixed + "\noptimizer: adamw_torch\neval_steps: 50\nsave_steps: 100\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.learning_rate, cfg.num_epochs, cfg.activation_checkpointing) == (2e-5, 1, True)
    assert cfg.logging.output_dir == "./outputs/out" and cfg.checkpoint.save_every == 100
    assert cfg.datasets[0].type == "alpaca" and cfg.val_set_size == 0.05 and cfg.tf32 is False
    assert cfg.dataset_prepared_path == "last_run_prepared"              # the tokenized data is cached there
    assert any(n.startswith("special_tokens.pad_token") for n in cfg.notes)
    with pytest.raises(ConfigError, match="base_model './Meta-Llama-3-8B' is not a Hugging Face model directory"):
        cfg.validate(1)


def test_blank_values_mean_unset():
    """`save_steps:` with nothing (YAML null) is unset, as in Axolotl: the default is used; where
    null is a value of the key (max_grad_norm: no clipping) it keeps that meaning."""
    import yaml
    text = """
save_steps:
max_steps:
warmup_steps:
gradient_accumulation_steps:
learning_rate: 1e-3
logging_steps:
output_dir:
flash_attention:
dataset_prepared_path:
gradient_checkpointing_kwargs:
parallelism_config:
eval_steps:
max_grad_norm:
datasets:
  - path: d.jsonl
    type: chat_template
    split:
    field_messages:
    roles_to_train:
checkpoint:
  keep_last:
"""
    cfg = TrainConfig.from_dict(yaml.safe_load(text))
    default = TrainConfig()
    assert cfg.checkpoint.save_every == default.checkpoint.save_every == 0
    assert cfg.max_steps == default.max_steps and "max_steps" not in cfg._given
    assert cfg.gradient_accumulation_steps == 1 and cfg.logging.log_every == default.logging.log_every
    assert cfg.logging.output_dir is None and cfg.eval_steps is None
    assert cfg.max_grad_norm is None                   # null is a value here: no clipping
    assert cfg.checkpoint.keep_last is None            # ... and here: keep all
    d = cfg.datasets[0]
    assert (d.split, d.field_messages, d.roles_to_train) == ("train", "messages", None)
    cfg.set_epochs(10)                                 # a blank max_steps lets num_epochs decide
    assert cfg.max_steps == default.max_steps          # (no num_epochs here)


def test_axolotl_switch_keys_have_a_meaning_or_a_precise_refusal():
    cfg = TrainConfig.from_dict({"attn_implementation": "sdpa", "flash_attention": True, "strict": False,
                                 "trust_remote_code": True, "liger_rms_norm": True, "tf32": True,
                                 "plugins": ["axolotl.integrations.liger.LigerPlugin"],
                                 "gradient_checkpointing_kwargs": {"use_reentrant": True},
                                 "remove_unused_columns": False, "ddp_find_unused_parameters": False,
                                 "saves_per_epoch": 2, "evals_per_epoch": 4, "num_epochs": 2})
    notes = " | ".join(cfg.notes)
    for key in ("attn_implementation: sdpa", "flash_attention", "trust_remote_code", "liger_rms_norm",
                "LigerPlugin"):
        assert key in notes
    assert "strict" not in notes                       # false asks for nothing
    cfg.set_epochs(10)                                 # 10 steps per epoch, 2 epochs: 20 steps
    assert cfg.max_steps == 20 and cfg.checkpoint.save_every == 5 and cfg.eval_steps == 3
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"attn_implementation": "flash_attn", "plugins": ["my.Plugin"],
                               "saves_per_epoch": 1, "save_steps": 10, "rl": "dpo", "qat": {"x": 1},
                               "use_swanlab": True, "swanlab_lark_webhook_url": "u", "peft": {"loftq_config": {}},
                               "totally_unknown_key": 1, "torchdistx_path": None})
    p = e.value.problems
    assert any(m.startswith("attn_implementation: 'flash_attn' is not an attention implementation (choose eager, sdpa")
               for m in p)
    assert any(m.startswith("plugins: 'my.Plugin' is not supported") for m in p)
    assert "give save_steps or saves_per_epoch, not both" in p
    assert any(m.startswith("rl: dpo trains on chosen / rejected pairs") for m in p)   # (no datasets)
    assert any(m.startswith("qat.x is not a QAT option") for m in p)
    assert any(m.startswith("'swanlab_lark_webhook_url' is not supported: this SwanLab option") for m in p)
    assert any(m.startswith("peft is set but adapter is not: add adapter: lora") for m in p)   # (LoftQ needs LoRA)
    assert not any("torchdistx_path" in m for m in p)                          # blank: unset
    unknown = [m for m in p if "totally_unknown_key" in m][0]
    assert "valid:" not in unknown and "--help" in unknown           # no 60-key list


def test_strategies_fractional_warmup_and_eval_batch_size():
    cfg = TrainConfig.from_dict({"save_strategy": "epoch", "eval_strategy": "epoch", "warmup_steps": 0.1,
                                 "eval_batch_size": 8, "num_epochs": 1})
    assert (cfg.saves_per_epoch, cfg.evals_per_epoch) == (1, 1) and "eval_batch_size" in " ".join(cfg.notes)
    cfg.set_epochs(30)
    assert cfg.warmup() == 3 and cfg.checkpoint.save_every == 30 and cfg.eval_steps == 30
    assert TrainConfig.from_dict({"save_strategy": "no", "save_steps": None}).checkpoint.save_every == 0
    for bad, msg in (({"save_strategy": "last"}, "save_strategy: 'last' is not supported"),
                     ({"eval_strategy": "no"}, "set val_set_size: 0"),
                     ({"warmup_steps": 1.5}, "whole number of steps or a fraction")):
        with pytest.raises(ConfigError, match=msg):
            TrainConfig.from_dict(bad)


def test_data_keys_excess_length_and_shuffle_merged_datasets():
    cfg = TrainConfig.from_dict({"excess_length_strategy": "truncate", "shuffle_merged_datasets": True})
    assert cfg.excess_length_strategy == "truncate" and "shuffle_merged_datasets" in " ".join(cfg.notes)
    with pytest.raises(ConfigError, match="excess_length_strategy"):
        TrainConfig.from_dict({"excess_length_strategy": "cut"})


def test_tokenizer_type_names_any_tokenizer_class():
    cfg = TrainConfig.from_dict({"tokenizer_type": "CodeLlamaTokenizer"})
    assert "tokenizer_type: CodeLlamaTokenizer (the tokenizer.json is read" in " ".join(cfg.notes)
    with pytest.raises(ConfigError, match="tokenizer_type: 'gpt2' is not a tokenizer class"):
        TrainConfig.from_dict({"tokenizer_type": "gpt2"})


def test_selective_activation_checkpointing_is_a_config_value():
    """``activation_checkpointing: selective`` (or Axolotl's key with that value) asks the step
    for ``remat="selective"``; a value that is neither a boolean nor ``selective`` is refused."""
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        for mode in ("selective", "selective_alternate"):
            cfg = TrainConfig.from_dict({key: mode})
            assert cfg.activation_checkpointing == mode and cfg.policy().remat == mode
    for mode in ("selective", "selective_alternate"):
        fsdp_too = TrainConfig.from_dict({"activation_checkpointing": mode, "dp_shard_size": 2,
                                          "fsdp_config": {"activation_checkpointing": True}})
        assert fsdp_too.policy().remat == mode        # the finer setting wins over FSDP's true
    assert TrainConfig.from_dict({"gradient_checkpointing": True}).policy().remat is True
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        TrainConfig.from_dict({"activation_checkpointing": "op"})
    with pytest.raises(ConfigError, match="offload_disk"):
        TrainConfig.from_dict({"gradient_checkpointing": "offload_disk"})
