"""Axolotl-style configs at run level: no parallelism sizes means every device is data parallel
(printed at start, `--simulate 2` works), and the resume keys work as in Axolotl:
`auto_resume_from_checkpoints: true` and `resume_from_checkpoint: PATH`."""
import json
from pathlib import Path

import yaml

from functional_pp import cli


def write(path: Path, **overrides) -> Path:
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "constant",
           "max_steps": 2, "model": "tiny", "data": {"max_bytes": 100_000}, "logging_steps": 1,
           "save_steps": None}                     # blank, as Axolotl configs write it
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_no_sizes_means_all_devices_data_parallel(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", output_dir=str(tmp_path / "out"))
    assert cli.main(["train", str(cfg), "--simulate", "2"]) == 0
    printed = capsys.readouterr().out
    assert "dp_shard=2" in printed and "= 2 devices" in printed
    assert "no parallelism sizes given: all 2 devices are data parallel, dp_shard_size: 2" in printed
    assert "dp 2" in printed and steps(tmp_path / "out") == [1, 2]


def test_auto_resume_from_checkpoints_and_resume_from_checkpoint_path(tmp_path, capsys):
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.yaml", output_dir=str(out))
    assert cli.main(["train", str(cfg)]) == 0
    # adding auto_resume_from_checkpoints (and more steps of a constant schedule) resumes
    cfg = write(tmp_path / "c.yaml", output_dir=str(out), auto_resume_from_checkpoints=True, max_steps=3)
    assert cli.main(["train", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "(step 2)" in printed and steps(out) == [1, 2, 3]
    # resume_from_checkpoint: a checkpoint of this very output directory
    ckpt = out / "checkpoints" / "step-000003"
    assert ckpt.is_dir()
    cfg = write(tmp_path / "c.yaml", output_dir=str(out), resume_from_checkpoint=str(ckpt), max_steps=4)
    assert cli.main(["train", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "(step 3)" in printed and steps(out) == [1, 2, 3, 4]
    # auto_resume with nothing to resume starts from step 0
    cfg = write(tmp_path / "d.yaml", output_dir=str(tmp_path / "fresh"), auto_resume_from_checkpoints=True)
    assert cli.main(["train", str(cfg)]) == 0
    assert steps(tmp_path / "fresh") == [1, 2]


EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "axolotl_examples" / "corpus"   # Axolotl's, Apache-2.0


def test_axolotl_full_finetune_example_runs_as_written(tmp_path, capsys):
    """Axolotl's lfm2-350m-fft.yaml, edited only in paths and sizes (a tiny model, a local ShareGPT
    file, a local tokenizer): its cosmetic keys, blank values, epoch schedules, plugin and
    attn_implementation are accepted; 2 simulated devices are data parallel; replies train."""
    import pytest
    pytest.importorskip("tokenizers")
    from chat_tokenizer import make_tokenizer

    from functional_pp.data.chat import template_text
    tok_dir = tmp_path / "tok"
    make_tokenizer(tok_dir, None, "<|im_end|>", template=template_text("chatml"))
    rows = [{"conversations": [{"from": "human", "value": f"What is {i}+{i}?"},
                               {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(300)]
    data = tmp_path / "fine_tome.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = yaml.safe_load((EXAMPLES / "LiquidAI" / "lfm2-350m-fft.yaml").read_text())
    del cfg["base_model"]                                         # paths and sizes only:
    cfg.update(model={"preset": "tiny", "vocab": 512}, tokenizer=str(tok_dir), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"),
               sequence_len=64, micro_batch_size=2, gradient_accumulation_steps=1)
    cfg["datasets"][0]["path"] = str(data)
    assert cfg["datasets"][0]["split"] == "train[:20%]"                 # (as written: 60 of the 300 rows)
    path = tmp_path / "lfm2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["validate", str(path), "--simulate", "2"]) == 0
    printed = capsys.readouterr().out
    assert "all 2 devices are data parallel" in printed
    assert "9 steps (num_epochs 1 x 9 steps per epoch), checkpoint every 9, held-out loss every 5" in printed
    assert "60 rows" in printed and "[[It is" in printed and "<|im_end|>]]" in printed
    assert "attn_implementation: flash_attention_2" in printed and "CutCrossEntropyPlugin" in printed
    assert cli.main(["train", str(path), "--simulate", "2"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    n = len(steps(out))
    assert n >= 2 and f"step {n}/{n}" in printed                     # num_epochs: 1
    assert (out / "checkpoints" / f"step-{n:06d}").is_dir()           # saves_per_epoch: 1
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in m for m in evals) >= 2                  # evals_per_epoch: 2 (and step 0)


def test_axolotl_lora_8bit_example_is_accepted_with_an_int8_base():
    from functional_pp.config import TrainConfig
    d = yaml.safe_load((EXAMPLES / "llama-3" / "instruct-lora-8b.yml").read_text())
    d.pop("base_model")
    # adapter: lora and its lora_* keys are read (docs/adapters.md), adamw_bnb_8bit is adamw_8bit,
    # load_in_8bit: an int8 frozen base (docs/quantization.md)
    cfg = TrainConfig.from_dict(d)
    assert cfg.adapter == "lora" and cfg.base_quantization() == {"kind": "int8", "double_quant": False, "experts": False}
