"""Models that cannot sample with a key / value cache (LFM2's ``conv`` layers, Gated DeltaNet's
``linear_attention`` layers, keys and values shared across layers) refused by name before any work
wherever a config or a command samples (``ModelFamily.uncached_layers`` / ``sampling_refusal``):
``rl: grpo`` at the config check (``validate``, ``train``, ``TrainConfig.validate``) and
``functional-pp generate`` right after ``config.json`` is read. The model directories hold a
``config.json`` and no weights, so a check that came after loading the model would fail otherwise.
A Llama with ``rl: grpo`` and a Qwen3.5 with ``rl: dpo`` are still accepted."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest
import yaml

from functional_pp import cli
from functional_pp.app.loop import train
from functional_pp.checkpoint import hf
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.models import LLAMA, llama

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):
    pytest.skip("transformers without Qwen3.5", allow_module_level=True)

QWEN3_5 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=128)
LFM2 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, layer_types=["conv", "conv", "full_attention"])
REWARDS = "def letters(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
GDN = "layers [0, 2] are linear_attention (Gated DeltaNet)"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """Model directories with a config.json only (Qwen3.5, LFM2), prompts, preference pairs and a
    reward module."""
    d = tmp_path_factory.mktemp("uncached")
    transformers.Qwen3_5TextConfig(**QWEN3_5).save_pretrained(d / "qwen3_5")
    transformers.Lfm2Config(**LFM2).save_pretrained(d / "lfm2")
    (d / "rewards.py").write_text(REWARDS)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": "ab" * i}) + "\n" for i in range(1, 9)))
    (d / "pairs.jsonl").write_text("".join(json.dumps({"prompt": "p", "chosen": "ab", "rejected": "cd"}) + "\n"
                                           for _ in range(8)))
    return d


def grpo(d, **over) -> dict:
    return {"rl": "grpo", "trl": {"reward_funcs": ["rewards.letters"], "num_generations": 2, "max_completion_length": 4},
            "datasets": [{"path": str(d / "prompts.jsonl")}], "sequence_len": 16, "micro_batch_size": 4,
            "max_steps": 1, "logging": {"output_dir": str(d / "never")}, **over}


def test_the_layers_that_cannot_use_the_cache_are_named(project):
    assert llama.uncached_layers(hf.config_from_hf(project / "qwen3_5")) == GDN
    assert llama.uncached_layers(hf.config_from_hf(project / "lfm2")) == "layers [0, 1] are conv (LFM2's short convolution)"
    tiny = llama.Config.tiny()
    assert llama.uncached_layers(tiny) is None and LLAMA.sampling_refusal(tiny, "rl: grpo") is None
    shared = dataclasses.replace(tiny, kv_shared_layers=1)
    assert llama.uncached_layers(shared) == "kv_shared_layers=1 (keys and values shared across layers)"


def test_grpo_is_refused_at_the_config_check(project, capsys):
    path = project / "qwen.yaml"
    path.write_text(yaml.safe_dump(grpo(project, base_model=str(project / "qwen3_5"))))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"rl: grpo samples completions with a key / value cache, which this model cannot use yet ({GDN}" in err
    assert "use a model whose layers are all attention, or an offline method that does not sample (rl: dpo" in err
    assert cli.main(["train", str(path)]) == 2 and "rl: grpo samples completions" in capsys.readouterr().err
    cfg = TrainConfig.from_dict(grpo(project, rl="gdpo", base_model=str(project / "lfm2")))     # the Python API
    with pytest.raises(ConfigError, match=r"rl: gdpo samples .*layers \[0, 1\] are conv \(LFM2's short convolution"):
        cfg.validate(1)
    with pytest.raises(ConfigError, match=r"rl: gdpo samples"):
        train(cfg, simulate=1, stream=io.StringIO())
    assert not (project / "never").exists()


def test_a_llama_with_grpo_and_a_qwen3_5_with_dpo_are_accepted(project, capsys):
    path = project / "llama.yaml"
    path.write_text(yaml.safe_dump(grpo(project, model={"preset": "tiny", "hidden": 32, "mlp": 64})))
    assert cli.main(["validate", str(path)]) == 0, capsys.readouterr().err
    dpo = TrainConfig.from_dict({"rl": "dpo", "base_model": str(project / "qwen3_5"), "sequence_len": 16,
                                 "datasets": [{"path": str(project / "pairs.jsonl"), "type": "chatml.intel"}],
                                 "micro_batch_size": 2, "max_steps": 1})
    dpo.validate(1)


def test_generate_is_refused_before_the_weights_load(project, capsys):
    assert cli.main(["generate", str(project / "qwen3_5"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"functional-pp generate samples completions with a key / value cache, which this model cannot use yet " \
           f"({GDN}" in err and "use a model whose layers are all attention" in err


@pytest.mark.multiprocess
def test_two_gloo_processes_refuse_before_any_work(project, tmp_path):
    """Under torchrun (2 real processes) every rank refuses at the config check, exit 2, no hang."""
    import os
    import subprocess
    import sys
    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump(grpo(project, base_model=str(project / "qwen3_5"), dp_shard_size=2,
                                        logging={"output_dir": str(tmp_path / "out")})))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(path)], capture_output=True, text=True, timeout=300,
                          cwd=project, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert proc.stderr.count(f"rl: grpo samples completions with a key / value cache") == 2, proc.stderr[-3000:]
    assert GDN in proc.stderr and not (tmp_path / "out").exists()
