"""``rl: ebft`` end to end (docs/preference.md "EBFT"): Axolotl's strided mode trains from a
config on raw-text documents (``ebft_pretrain.transform``, full fine-tuning: the frozen feature
copy) and on prompt + completion documents (``ebft_strided_structured.transform``, LoRA: the base
without the adapters); a FSDP x TP run equals one device step by step (the same samples, the
same rewards and loss), and so does a context-parallel one (block-parallel rows split over cp);
a resumed run equals an uninterrupted one; ``validate`` reads the
documents; the structured mode and bad settings are refused before any work."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from functional_pp.app.loop import train
from functional_pp.app.metrics import read_metrics
from functional_pp.config import ConfigError, TrainConfig

EBFT = {"mode": "strided", "stride": 4, "context_length": 4, "generate_max_len": 4, "n_samples_per_prompt": 2,
        "temperature": 0.9, "feature_layers": [0.5, 1.0], "use_whitening": True, "ce_coef": 0.1}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ebft-data")
    with open(d / "text.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * 3}\n"}) + "\n")
    with open(d / "pairs.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"input": f"add {i}", "output": f"{i} + {i} = {2 * i}, twice {i}"}) + "\n")
    return d


def config(data: Path, out: Path, file: str = "text.jsonl", kind: str = "ebft_pretrain.transform",
           **over) -> TrainConfig:
    return TrainConfig.from_dict(_raw(data, out, file, kind, **over), name="ebft")


def _raw(data: Path, out: Path, file: str = "text.jsonl", kind: str = "ebft_pretrain.transform", **over) -> dict:
    return {"rl": "ebft", "ebft": {**EBFT, **over.pop("ebft", {})},
         "datasets": [{"path": str(data / file), "type": kind}],
         "model": {"preset": "tiny", "hidden": 32, "mlp": 64, "layers": 2}, "sequence_len": 16,
         "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-2, "lr_scheduler": "constant",
         "optimizer": "adamw", "logging": {"log_every": 1, "output_dir": str(out), "plot": False}, **over}


def _metrics(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]


#: the block-parallel rows of EBFT's documents of 16 tokens: 3 blocks x 2 samples of 4 + 1 tokens after them
ROW = 16 + 3 * 2 * (4 + 1)


def test_fsdp_tp_steps_equal_one_device(data, tmp_path):
    """... and the summary, tokens/s and MFU count the block-parallel rows as computed (padded to
    a multiple of 2 x cp under context parallelism), not ``sequence_len`` tokens per row."""
    from functional_pp.config import model_family
    from functional_pp.config.models import model_config
    runs = {}
    for name, sim, mesh in (("one", 1, {}), ("fsdp_tp", 4, {"dp_shard_size": 2, "tp_size": 2}),
                            ("cp", 2, {"cp_size": 2})):
        out = tmp_path / name
        text = io.StringIO()
        cfg = config(data, out, micro_batch_size=2 // mesh.get("dp_shard_size", 1), peak_flops_per_device=1e9, **mesh)
        train(cfg, simulate=sim, stream=text)
        runs[name] = _metrics(out)
        row = ROW + (2 if name == "cp" else 0)       # (48: a multiple of 2 x cp 2)
        assert "ebft:       strided, 2 documents per step" in text.getvalue()
        assert f"batch:      2 sequences x {row} tokens = {2 * row} tokens/step" in text.getvalue()
        flops = model_family(cfg).flops_per_token(model_config(cfg), row)
        for m in runs[name]:
            assert m["tokens"] == 2 * row
            assert m["mfu_avg"] == pytest.approx(m["tokens_per_s_avg"] * flops / (1e9 * sim), rel=1e-9)
    assert len(runs["one"]) == 2
    for a, b in [(a, b) for other in ("fsdp_tp", "cp") for a, b in zip(runs["one"], runs[other])]:
        for key in ("loss", "ebft_mean_reward", "ebft_alignment", "ebft_diversity", "ebft_advantages_std"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert runs["one"][0]["ebft_blocks"] == 2 * 3                 # (16 - 4 - 4) // 4 + 1 blocks per document


def test_a_resumed_run_equals_an_uninterrupted_one(data, tmp_path):
    """The checkpoint holds the loader's position and the generation key: the resumed steps
    sample the same blocks (the same rewards) and their losses are bit for bit the same."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(config(data, whole, max_steps=3), simulate=1, stream=io.StringIO())
    train(config(data, parts, max_steps=3), simulate=1, stop_after=2, stream=io.StringIO())
    train(config(data, parts, max_steps=3), simulate=1, resume=True, stream=io.StringIO())
    a, b = _metrics(whole), _metrics(parts)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "ebft_mean_reward", "ebft_alignment"):
            assert x[key] == y[key], (x["step"], key)


def test_structured_documents_train_with_lora(data, tmp_path):
    out = tmp_path / "lora"
    train(config(data, out, "pairs.jsonl", "ebft_strided_structured.transform", adapter="lora", lora_r=4,
                 lora_alpha=8, lora_target_linear=True, ebft={"min_completion_prefix": 1}, max_steps=2),
          simulate=1, stream=io.StringIO())
    m = _metrics(out)
    assert len(m) == 2 and all(x["ebft_blocks"] > 0 for x in m)


def test_validate_reads_the_documents_and_prints_the_ebft_line(data, tmp_path, capsys):
    import yaml

    from functional_pp import cli
    path = tmp_path / "ebft.yaml"
    path.write_text(yaml.safe_dump(_raw(data, tmp_path / "out", "pairs.jsonl", "ebft_strided_structured.transform")))
    assert cli.main(["validate", str(path), "--simulate", "2"]) == 0
    text = capsys.readouterr().out
    assert "ebft:       strided, 4 documents per step" in text     # 2 x dp 2
    # (the prompts' documents: their rows hold the blocks of a document without a prompt)
    assert f"batch:      4 sequences x {ROW} tokens = {4 * ROW} tokens/step" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("over,why", [
    ({"ebft": {"mode": "structured"}}, "ebft.mode 'structured' is not built: only the strided mode"),
    ({"ebft": {"embed_method": "concat"}}, "ebft.embed_method 'concat' is not built for the strided mode"),
    ({"datasets_type": "alpaca"}, "datasets\\[0\\].type 'alpaca' is not an EBFT dataset type"),
    ({"val_set_size": 0.25}, "held-out EBFT evaluation is not built"),
    ({"model": {"preset": "tiny", "hidden": 32, "mlp": 64, "layers": 2, "sliding_window": 4}},
     "block-parallel row .* cannot take: layers \\[0, 1\\] have sliding-window attention")])
def test_bad_settings_are_refused_before_any_work(data, tmp_path, over, why):
    out = tmp_path / "bad"
    kind = over.pop("datasets_type", "ebft_pretrain.transform")
    with pytest.raises(ConfigError, match=why):
        train(config(data, out, kind=kind, **over), simulate=1, stream=io.StringIO())
    assert not out.exists()


def test_validate_memory_and_plan_count_the_block_parallel_rows(data, tmp_path, capsys, monkeypatch):
    """``validate --memory``'s peak is the dry run of rows of ``ROW`` tokens (that of the same
    config without EBFT at ``sequence_len: ROW``), and ``plan`` searches with such rows."""
    import yaml

    from functional_pp import cli
    from functional_pp.app.report import human_bytes, planned_estimate
    from functional_pp.cli import plan as plan_cli
    from functional_pp.config.models import model_config
    # (LoRA: no frozen feature copy, which the plain run would not hold: tests/plan/test_plan_held_models.py)
    raw = _raw(data, tmp_path / "out", dp_shard_size=2, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True)
    path = tmp_path / "ebft.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", str(path), "--simulate", "2", "--memory"]) == 0
    peak = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("peak:"))
    plain = TrainConfig.from_dict({**{k: v for k, v in raw.items() if k not in ("rl", "ebft")}, "sequence_len": ROW,
                                   "datasets": [{"path": str(data / "text.jsonl"), "type": "completion"}]})
    mesh = plain.mesh(2)
    est = planned_estimate(plain, mesh, plain.build_rules(mesh), model_config(plain))
    assert peak.startswith(f"peak:       {human_bytes(est.peak_bytes)} per device")
    seen = {}

    def search(loss, decls, n, batch, **kw):
        seen.update(batch=batch, cp=kw["space"].max_axis["cp"])
        raise RuntimeError("stop")
    monkeypatch.setattr(plan_cli, "search", search)
    with pytest.raises(RuntimeError, match="stop"):
        plan_cli.rank_layouts(config(data, tmp_path / "p", sequence_len=2048), 4, stream=io.StringIO())
    # documents of 2048 tokens: 511 blocks x 2 samples of 5 tokens, cp up to 7158 // 1024 = 6 (4 devices: 1, 2, 4),
    # the rows padded to a multiple of 2 x 1, 2 x 2 and 2 x 4
    assert seen["cp"] == 6 and seen["batch"]["tokens"][0][1] == 7160
