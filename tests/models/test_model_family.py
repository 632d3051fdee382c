"""The training loop, its config and its report are not tied to Llama: a second model family
(a one-layer MLP language model with its own dimension names, registered here) trains through
the same ``functional-pp train`` loop, on one device and with FSDP over two simulated devices
(same losses: the single device is the oracle); unknown family names are refused with the known
ones named (functional_pp/models/family.py)."""
from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import ops
from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, ModelConfig, TrainConfig, model_config
from functional_pp.models import ModelFamily, UnknownFamilyError, family_names, get_family, register, unregister


@dataclass(frozen=True)
class MlpConfig:
    vocab: int = 256
    embd: int = 16
    ff: int = 32


def mlp_init(cfg: MlpConfig, dtype: torch.dtype = torch.float32) -> dict:
    def w(shape, dims):
        return fpp.param(shape, dims, init="normal", scale=0.1, dtype=dtype)
    return {"wte": w((cfg.vocab, cfg.embd), "vocab embd"), "up": w((cfg.embd, cfg.ff), "embd ff"),
            "down": w((cfg.ff, cfg.embd), "ff embd"), "head": w((cfg.embd, cfg.vocab), "embd vocab")}


def mlp_loss(params: dict, batch: dict, cfg: MlpConfig):
    x = ops.embed(params["wte"], batch["tokens"])                       # batch seq embd
    h = fpp.ops.gelu(fpp.ops.einsum("batch seq embd, embd ff -> batch seq ff", x, params["up"]))
    x = x + fpp.ops.einsum("batch seq ff, ff embd -> batch seq embd", h, params["down"])
    logits = fpp.ops.einsum("batch seq embd, embd vocab -> batch seq vocab", x, params["head"])
    return ops.cross_entropy(logits, batch["labels"])


def mlp_rules(sequence_parallel: bool = False) -> fpp.Rules:
    return fpp.Rules(batch=("dp_replicate", "dp_shard"), embd="dp_shard")    # FSDP along embd


MLP_LM = ModelFamily(
    name="mlp_lm", config_class=MlpConfig, presets={"tiny": MlpConfig}, param_decls=mlp_init, loss=mlp_loss,
    flops_per_token=lambda cfg, seq: 6.0 * (2 * cfg.embd * cfg.ff + cfg.embd * cfg.vocab),
    default_rules=mlp_rules,
    activations=lambda cfg, batch, seq: {"batch seq embd": (batch, seq, cfg.embd)},
    summary_fields=("vocab", "embd", "ff"))


@pytest.fixture
def mlp_family():
    register(MLP_LM)
    yield MLP_LM
    unregister("mlp_lm")


def config(out: Path, **overrides) -> TrainConfig:
    d = {"micro_batch_size": 4, "sequence_len": 16, "learning_rate": 1e-2, "lr_scheduler": "constant",
         "max_steps": 3, "model": {"family": "mlp_lm", "preset": "tiny", "ff": 24},
         "data": {"max_bytes": 20_000}, "logging": {"log_every": 1, "output_dir": str(out), "plot": False},
         **overrides}
    return TrainConfig.from_dict(d, name="mlp")


def test_a_second_family_trains_through_the_same_loop(tmp_path, mlp_family):
    out = io.StringIO()
    one = train(config(tmp_path / "one"), stream=out)
    summary = out.getvalue()
    assert "model:      mlp_lm tiny (vocab=256, embd=16, ff=24): " in summary
    assert one.final_step == 3 and len(one.losses) == 3
    assert all(math.isfinite(x) for x in one.losses) and one.losses[-1] < one.losses[0]
    assert [m["step"] for m in read_metrics(tmp_path / "one" / "metrics.jsonl")] == [1, 2, 3]
    # FSDP over two simulated devices: same global batch, the one-device losses
    two = train(config(tmp_path / "two", dp_shard_size=2, micro_batch_size=2), stream=io.StringIO())
    assert two.losses == pytest.approx(one.losses, rel=1e-5, abs=1e-6)
    saved = ck.load_checkpoint(tmp_path / "two" / "checkpoints", keys=["step"]).metadata
    assert saved["model_config"] == {"vocab": 256, "embd": 16, "ff": 24}


def test_family_config_is_checked_against_the_mesh_and_its_names(mlp_family):
    cfg = TrainConfig.from_dict({"model": {"family": "mlp_lm", "ff": 24}, "dp_shard_size": 3})
    with pytest.raises(ConfigError, match="'embd' has size 16"):
        cfg.validate(3)                          # embd (16) does not split over 3 devices
    cfg = TrainConfig.from_dict({"model": {"family": "mlp_lm"}, "rules": {"hidden": "dp_shard"}})
    with pytest.raises(ConfigError, match="unknown dim name 'hidden'"):
        cfg.validate(1)                          # a Llama name, not this family's
    with pytest.raises(ConfigError, match=r"unknown key 'model.layers' \(valid: embd, ff, vocab\)"):
        TrainConfig.from_dict({"model": {"family": "mlp_lm", "layers": 2}})
    with pytest.raises(ConfigError, match="model.preset '8b' is not a preset.*presets: tiny"):
        TrainConfig.from_dict({"model": {"family": "mlp_lm", "preset": "8b"}})
    with pytest.raises(ConfigError, match="model family 'mlp_lm' has no Hugging Face mapping"):
        cfg = TrainConfig.from_dict({"base_model": "."})
        cfg.model = ModelConfig(family="mlp_lm")
        model_config(cfg)


def test_layout_search_refuses_a_family_without_llamas_dimension_names(mlp_family):
    from functional_pp.cli.plan import rank_layouts
    cfg = TrainConfig.from_dict({"model": {"family": "mlp_lm"}, "layout": "auto"})
    with pytest.raises(ConfigError, match="model family 'mlp_lm' has no res_seq, hidden, heads, kv_heads, mlp: give"):
        rank_layouts(cfg, 2)


def test_unknown_family_names_the_known_ones(mlp_family):
    with pytest.raises(UnknownFamilyError, match=r"unknown model family 'gpt'; known families: llama, mlp_lm"):
        get_family("gpt")
    with pytest.raises(ConfigError, match=r"model.family: unknown model family 'gtp2'; known families: "
                                          r"llama, mlp_lm"):
        TrainConfig.from_dict({"model": {"family": "gtp2", "preset": "tiny"}})
    with pytest.raises(ValueError, match="'mlp_lm' is already registered"):
        register(dataclasses.replace(MLP_LM, summary_fields=()))
    with pytest.raises(ValueError, match="ModelFamily 'other': give at least one preset"):
        dataclasses.replace(MLP_LM, name="other", presets={})
    assert family_names() == ["llama", "mlp_lm"]


def test_llama_is_registered_by_the_models_package():
    llama = get_family("llama")
    assert "mlp_lm" not in family_names()
    cfg = llama.build_config("tiny", layers=3, rope_scaling={"factor": 2.0})
    assert cfg.layers == 3 and cfg.rope_scaling.factor == 2.0
    assert {"hidden", "heads", "kv_heads", "mlp", "vocab", "res_seq"} <= llama.dim_names(cfg)
    assert TrainConfig.from_dict({"model": "tiny"}).to_dict()["model"] == {"preset": "tiny"}
