"""The train command with pipeline parallelism: a pp = 2 run equals one device (losses, held-out
losses, checkpoints: parameters and optimizer state); its checkpoints keep the logical layout
(every layer under its name), so one saved on pp = 2 resumes on pp = 2 bitwise equal to the
uninterrupted run (optimizer state and loader position included), on one device equal to one
device, and one saved on one device resumes on pp = 2; export reads them."""
import io
import json
import math
from pathlib import Path

import pytest
import torch

from functional_pp import checkpoint as ck
from functional_pp.app.export import export_run
from functional_pp.app.loop import train
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models import llama

RUN = {"micro_batch_size": 1, "gradient_accumulation_steps": 2, "sequence_len": 32, "learning_rate": 3e-3,
       "lr_scheduler": "constant", "max_steps": 3, "model": {"preset": "tiny", "layers": 4},
       "data": {"max_bytes": 60_000}, "val_set_size": 0.02, "eval_steps": 2,
       "logging": {"log_every": 1, "plot": False}, "checkpoint": {"save_every": 2, "keep_last": 3}}


def run(out: Path, **keys) -> Path:
    cfg = TrainConfig.from_dict({**RUN, **keys, "logging": {**RUN["logging"], "output_dir": str(out)}})
    text = io.StringIO()
    train(cfg, simulate=cfg.pp_size, stream=text)
    (out / "printed.txt").write_text(text.getvalue())
    return out


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def saved(out: Path, step: int) -> dict[str, torch.Tensor]:
    tree = ck.load_checkpoint(out / "checkpoints", step=step, keys=["params", "opt", "step"]).tree
    return dict(leaves_with_paths(tree))


def assert_same(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Equal (bitwise by default; the pipeline sums a step's gradients in another order than one
    device, so across layouts equal to float32 rounding: AdamW turns the rounding of a near-zero
    gradient into at most ~1e-3 of one step's update, 3e-6 here)."""
    assert a.keys() == b.keys() and any(".layers.3." in k for k in a)      # every layer, by its name
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    return {"one": run(root / "one"), "pp2": run(root / "pp2", pp_size=2)}


def test_pp2_trains_evaluates_and_saves_as_one_device(runs):
    one, pp2 = metrics(runs["one"]), metrics(runs["pp2"])
    assert close([m.get("loss") for m in pp2], [m.get("loss") for m in one])
    assert pp2[1]["loss"] == one[1]["loss"]             # the first step's loss: the same sums, bitwise
    assert close([m.get("eval_loss") for m in pp2], [m.get("eval_loss") for m in one])
    assert [m["step"] for m in pp2 if "eval_loss" in m] == [0, 2, 3]
    for step in (2, 3):
        assert_same(saved(runs["pp2"], step), saved(runs["one"], step), rtol=1e-5, atol=1e-5)


def test_the_memory_report_counts_the_fullest_stage(runs):
    """The last of 2 stages holds layers 2 and 3, the final norm and the head (the embedding is
    on the first)."""
    tree = dict(leaves_with_paths(llama.init(llama.Config.tiny(layers=4))))
    last = sum(math.prod(x.shape) for p, x in tree.items() if p.startswith(("layers.2.", "layers.3.", "norm", "lm_head")))
    assert f"{last:,} parameters on each device of the fullest pipeline stage" in \
        (runs["pp2"] / "printed.txt").read_text()


@pytest.mark.parametrize("saved_on,resumed_on", [("pp2", 2), ("pp2", 1), ("one", 2)])
def test_a_checkpoint_resumes_on_any_pp_size(runs, tmp_path, saved_on, resumed_on):
    out = run(tmp_path / "resumed", pp_size=resumed_on,
              resume_from_checkpoint=str(runs[saved_on] / "checkpoints" / "step-000002"))
    resumed = [m for m in metrics(out) if "loss" in m]
    assert [m["step"] for m in resumed] == [3] and resumed[0]["resumed_from"] == 2
    same = runs["pp2" if resumed_on == 2 and saved_on == "pp2" else "one"]
    uninterrupted = [m for m in metrics(same) if "loss" in m][-1]
    tol = {} if same == runs["pp2"] else {"rtol": 1e-5, "atol": 1e-5}     # bitwise on the same layout
    assert close([resumed[0]["loss"]], [uninterrupted["loss"]])
    if not tol:
        assert resumed[0]["loss"] == uninterrupted["loss"] and resumed[0]["eval_loss"] == uninterrupted["eval_loss"]
    assert_same(saved(out, 3), saved(same, 3), **tol)        # parameters and optimizer state


def test_export_of_a_pipeline_checkpoint_equals_one_device(runs, tmp_path):
    from safetensors.torch import load_file
    for name in ("one", "pp2"):
        export_run(runs[name], tmp_path / name)
    tensors = {n: {k: v for f in sorted((tmp_path / n).glob("*.safetensors")) for k, v in load_file(f).items()}
               for n in ("one", "pp2")}
    assert len(tensors["one"]) > 10 and tensors["one"].keys() == tensors["pp2"].keys()
    assert_same(tensors["one"], tensors["pp2"], rtol=1e-5, atol=1e-5)


def test_a_pipeline_is_refused_on_the_batched_simulator_by_name(tmp_path):
    cfg = TrainConfig.from_dict({**RUN, "pp_size": 2, "simulation": "batched",
                                 "logging": {"output_dir": str(tmp_path / "run")}})
    with pytest.raises(ConfigError, match="simulation: batched cannot run this config: pp_size: 2"):
        train(cfg, simulate=2)
    assert not (tmp_path / "run").exists()
