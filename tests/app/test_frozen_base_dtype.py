"""A LoRA / QLoRA run under ``bf16: true`` holds its frozen base in bf16 (the compute dtype: the
step keeps frozen parameters in their dtype, no fp32 master) and its adapters in fp32: the same
run as when the base was loaded in fp32 and cast to bf16 every step, loss for loss and bit for
bit (app/inputs.py ``frozen_in_compute_dtype``; docs/adapters.md "Frozen parameters")."""
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.app import inputs
from functional_pp.checkpoint import hf
from functional_pp.core import tree

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3", ROOT / "examples" / "make_tiny_hf_qwen3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(tmp_path_factory.mktemp("frozen") / "inputs")


def _train(made, out: Path, config: str, base: str, *extra: str) -> str:
    stream = io.StringIO()
    args = ["train", str(ROOT / "examples" / "configs" / config), "--set", f"base_model={made / base}",
            "--set", f"datasets=[{{path: {made / 'alpaca.jsonl'}, type: alpaca}}]", "--set", "bf16=true",
            "--set", "max_steps=3", "--set", "save_steps=3", "--set", "val_set_size=0", *extra,
            "--output", str(out)]
    import contextlib
    with contextlib.redirect_stdout(stream):
        assert cli.main(args) == 0
    return stream.getvalue()


def _losses(out: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _params(out: Path) -> dict:
    return ck.load_checkpoint(out / "checkpoints", keys=["params"]).tree["params"]


@pytest.mark.parametrize("config, base, extra", [
    ("lora.yaml", "tiny-qwen3", ()),                         # FSDP 2 x TP 2 (simulated)
    ("qlora.yaml", "tiny-qwen3-hd64", ("--set", "lora_modules_to_save=[lm_head]")),
], ids=["lora_fsdp_tp", "qlora"])
def test_bf16_run_holds_its_frozen_base_in_bf16_with_the_same_results(made, tmp_path, monkeypatch, config, base,
                                                                     extra):
    text = _train(made, tmp_path / "new", config, base, *extra)
    new = _params(tmp_path / "new")
    with monkeypatch.context() as m:             # as before: the frozen base loaded and kept in fp32
        m.setattr(inputs, "frozen_in_compute_dtype", lambda decls, trainable, precision: decls)
        old_text = _train(made, tmp_path / "old", config, base, *extra)
    old = _params(tmp_path / "old")
    assert _losses(tmp_path / "new") == _losses(tmp_path / "old")          # exactly
    frozen, lora = adapters.split(new)
    new, old = dict(tree.leaves_with_paths(new)), dict(tree.leaves_with_paths(old))
    assert lora and all(x.dtype == torch.float32 for ab in lora.values() for x in ab.values())
    n16 = 0
    for p, x in new.items():
        ref = old[p]
        trained = ".lora." in "." + p or (bool(extra) and ".lm_head." in "." + p + ".")   # (modules_to_save)
        if trained:
            assert x.dtype == torch.float32 and torch.equal(x, ref), p
        elif x.is_floating_point():
            assert x.dtype == torch.bfloat16 and ref.dtype == torch.float32, p
            assert torch.equal(x, ref.to(torch.bfloat16)), p                # the values the step used
            n16 += 1
        else:                                                                # quantized codes
            assert torch.equal(x, ref), p
    assert n16 > 0
    if config == "lora.yaml":
        cfg = hf.config_from_hf(made / base)
        file = dict(tree.leaves_with_paths(hf.load_hf_params(made / base, cfg)))
        assert all(torch.equal(x, file[p].to(torch.bfloat16)) for p, x in tree.leaves_with_paths(frozen))

    # the start-up summary counts the frozen weights at 2 bytes (the old one at 4)
    def frozen_bytes(t):
        line = next(x for x in t.splitlines() if x.startswith("memory:"))
        return line, re.search(r"frozen x ([0-9 /B]+) \(weights only\)", line).group(1)
    assert frozen_bytes(text)[1].startswith("2 B"), frozen_bytes(text)[0]
    assert frozen_bytes(old_text)[1].startswith("4 B"), frozen_bytes(old_text)[0]


def test_fp32_and_full_runs_keep_their_declarations():
    decls = {"w": fpp.param((4, 4), "a b"), "lora": {"w": {"lora_A": fpp.param((4, 2), "a r")}}}
    mask = adapters.trainable(adapters.LoraConfig(r=2, alpha=2, target_modules=("w",)))
    assert inputs.frozen_in_compute_dtype(decls, mask, "fp32") is decls
    assert inputs.frozen_in_compute_dtype(decls, None, "bf16") is decls
    half = inputs.frozen_in_compute_dtype(decls, mask, "bf16")
    assert half["w"].dtype == torch.bfloat16 and half["lora"]["w"]["lora_A"].dtype == torch.float32


def test_the_planner_counts_the_frozen_base_in_the_compute_dtype(made, monkeypatch):
    """``validate --memory`` (app/report.py ``planned_memory``, plan.estimate of the run's own
    declarations): the weights a device holds shrink by 2 bytes per frozen parameter."""
    import functools

    import yaml

    from functional_pp.app import report
    from functional_pp.config import TrainConfig, model_config
    from functional_pp.plan import estimate
    c = yaml.safe_load((ROOT / "examples" / "configs" / "lora.yaml").read_text())
    c.update(base_model=str(made / "tiny-qwen3"), bf16=True, datasets=[{"path": str(made / "alpaca.jsonl"),
                                                                        "type": "alpaca"}])
    cfg = TrainConfig.from_dict(c)
    cfg.validate(4)
    mesh, model_cfg = cfg.mesh(4), model_config(cfg)
    rules = cfg.build_rules(mesh)
    batch = {k: ((cfg.global_batch(mesh, rules), cfg.sequence_len), "batch seq") for k in ("tokens", "labels")}

    def planned():
        loss, decls, trainable = report.run_model(cfg, model_cfg)
        est = estimate(loss, decls, mesh, rules, batch, optimizer=fpp.optim.adamw(1e-3), precision="bf16",
                       timeline=False, trainable=trainable)
        frozen = dict(fpp.leaves_with_paths(trainable(decls)))
        n = report.param_memory(tree.map_with_path(lambda p, d: None if frozen[p] else d, decls),
                                mesh, rules)[1]
        return est.memory["weights"], n
    new, n_frozen = planned()
    with monkeypatch.context() as m:
        m.setattr(inputs, "frozen_in_compute_dtype", lambda decls, trainable, precision: decls)
        old, _ = planned()
    assert n_frozen > 0 and old - new == 2 * n_frozen
