"""Axolotl's / Accelerate's FSDP keys mapped onto this FSDP (config/fsdp_keys.py), DeepSpeed
refused with the equivalent sizes; reshard_after_forward: false trains the same losses on 2
simulated FSDP devices with fewer all-gathers (the gathered weights kept for backward)."""
import json

import pytest
import yaml

from functional_pp import cli
from functional_pp.config import ConfigError, TrainConfig


def problems(d: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(d)
    return e.value.problems


def test_fsdp_config_maps_onto_our_fsdp():
    cfg = TrainConfig.from_dict({"fsdp_version": 2, "fsdp_config": {
        "offload_params": False, "reshard_after_forward": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "state_dict_type": "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": True, "activation_checkpointing": True}})
    assert cfg.reshard_after_forward is False and cfg.activation_checkpointing is True
    notes = " | ".join(cfg.notes)
    assert "FSDP units are the model's layers" in notes and "reads only its slices" in notes
    assert "fsdp_version: 2" in notes
    old = TrainConfig.from_dict({"fsdp": "full_shard auto_wrap", "gradient_checkpointing": False,
                                 "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP",
                                                 "fsdp_activation_checkpointing": True}})
    assert old.reshard_after_forward is False and old.activation_checkpointing is True
    assert TrainConfig.from_dict({"fsdp_config": {"sharding_strategy": "FULL_SHARD"}}).reshard_after_forward


def test_fsdp_hybrid_and_deepspeed_are_refused_with_what_to_do():
    p = problems({"fsdp": ["full_shard", "offload"], "fsdp_config": {"fsdp_offload_params": "yes",
                                                                      "sharding_strategy": "HYBRID_SHARD",
                                                                      "wrap_everything": 1}})
    assert any(m == "fsdp_config.fsdp_offload_params must be true/false, got 'yes'" for m in p)
    assert any("HYBRID_SHARD" in m and "dp_replicate_size: <nodes>" in m for m in p)
    assert any(m.startswith("unknown key 'fsdp_config.wrap_everything'") for m in p)
    (unknown,) = problems({"deepspeed": "my_ds.json"})
    assert unknown.startswith("'deepspeed' is not supported for my_ds.json: the file does not exist and is not "
                              "one of Axolotl's deepspeed_configs")


@pytest.mark.parametrize("d", [{"fsdp": "full_shard offload"}, {"fsdp_config": {"offload_params": True}},
                               {"fsdp_config": {"fsdp_offload_params": True}}, {"fsdp_config": {"cpu_offload": True}},
                               {"deepspeed": "deepspeed_configs/zero3_bf16_cpuoffload_all.json"},
                               {"deepspeed": "deepspeed_configs/zero3_bf16_cpuoffload_params.json"}])
def test_cpu_offload_keys_map_onto_offload_params(d):
    cfg = TrainConfig.from_dict(d)
    assert cfg.offload_params is True and cfg.activation_offloading is False
    assert TrainConfig.from_dict({"fsdp_config": {"activation_cpu_offload": True}}).activation_offloading is True


def test_offload_params_is_refused_where_it_cannot_run():
    assert any("compile: per_layer" in m for m in problems({"offload_params": True, "compile": True}))
    assert any("pp_size > 1" in m for m in problems({"offload_params": True, "pp_size": 2}))


@pytest.mark.parametrize("stage, keep_gathered", [(1, True), (2, True), (3, False)])
def test_deepspeed_zero_stages_map_onto_fsdp(tmp_path, stage, keep_gathered):
    """A DeepSpeed JSON's ZeRO stage becomes FSDP over dp_shard (ZeRO-1 / 2: weights kept gathered for
    backward), said in the start-up notes; Axolotl's bundled names are read without the file."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": stage, "overlap_comm": True},
                              "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}))
    for value in (str(ds), f"deepspeed_configs/zero{stage}.json"):
        cfg = TrainConfig.from_dict({"deepspeed": value})
        assert cfg.reshard_after_forward is (not keep_gathered), value
        assert any(n.startswith(f"deepspeed: {value} (ZeRO-{stage} = FSDP over dp_shard") for n in cfg.notes)
    ds.write_text(json.dumps({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}))
    cfg = TrainConfig.from_dict({"deepspeed": str(ds)})
    assert cfg.offload_params and cfg.reshard_after_forward is (not keep_gathered)
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    (p,) = problems({"deepspeed": str(ds)})
    assert p.startswith(f"deepspeed: offloading to 'nvme' is not supported ({ds}): only to the CPU")
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    assert "plain data parallelism: remove it and give dp_replicate_size" in problems({"deepspeed": str(ds)})[0]


def _train(tmp_path, name, **keys):
    out = tmp_path / name
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "max_steps": 2, "model": "tiny",
           "data": {"max_bytes": 100_000}, "logging_steps": 1, "output_dir": str(out), **keys}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(tmp_path / f"{name}.yaml"), "--simulate", "2"]) == 0
    losses = [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    return losses, (out / "comm_report.txt").read_text()


def test_reshard_after_forward_false_keeps_gathered_weights_same_losses(tmp_path, capsys):
    base, base_report = _train(tmp_path, "zero3", fsdp_config={"reshard_after_forward": True})
    kept, kept_report = _train(tmp_path, "zero2", fsdp_config={"reshard_after_forward": False})
    capsys.readouterr()
    assert kept == pytest.approx(base, rel=1e-6, abs=1e-6)

    def gathers(text):                     # all_gather bytes per device ("mesh axes  kind  count  bytes")
        return sum(int(line.split()[3].replace(",", "")) for line in text.splitlines()
                   if line.split()[1:2] == ["all_gather"])
    assert gathers(kept_report) < gathers(base_report), (kept_report, base_report)
