"""``functional-pp plan`` and ``layout: auto`` search ``loss_chunks`` where the config leaves it
free and the model takes it, keep it where the config fixes it, never give it to a model whose
logits the chunked loss does not compute, paste it with the chosen layout, and name it when
nothing fits (issue 44 item 1). Oracle: the ranking of the same config with the whole logits."""
from __future__ import annotations

import yaml

from functional_pp import cli, plan
from functional_pp.app.report import planned_estimate
from functional_pp.cli.plan import apply_layout, auto_layout, config_space, layout_yaml, rank_layouts
from functional_pp.config import TrainConfig, model_config

# a big vocabulary for the hidden size: the logits decide whether a layout fits
BASE = {"model": {"preset": "tiny", "vocab": 16384}, "sequence_len": 256, "global_batch_size": 8,
        "micro_batch_size": 4, "optimizer": "sgd", "momentum": 0.9, "lr_scheduler": "constant",
        "max_grad_norm": None, "data": {"max_bytes": 100_000}}
NARROW = dict(max_axis={"tp": 1, "cp": 1}, keep_gathered=(False,))      # data parallel or FSDP on 2 devices


def _config(tmp_path, name="c.yaml", **keys) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, **keys}))
    return str(path)


def _below(reserved: int) -> list[str]:
    """The plan's flag for a memory limit a MiB below ``reserved`` bytes (the allocator reserves
    whole MiB segments: no layout lies between)."""
    return ["--memory-gb", f"{(reserved - 2 ** 20) / 1e9:.9f}"]


def _rank(cfg, **kw):
    return rank_layouts(cfg, 2, "h100x8", space=plan.Space(**{**vars(config_space(cfg)), **NARROW}),
                        strategy="exhaustive", **kw)


def test_plan_finds_the_layout_that_fits_only_with_loss_chunks_and_pastes_it(tmp_path, capsys):
    path = _config(tmp_path)
    cfg = TrainConfig.from_yaml(path)
    assert config_space(cfg).loss_chunks == (None, 8)
    ranking = _rank(cfg)
    whole = [e for e in ranking if not e.settings.get("loss_chunks")]
    assert whole and len(whole) < len(ranking)
    limit = min(e.reserved_bytes for e in whole) - 2 ** 20      # no layout with the whole logits fits
    fits = [e for e in ranking if e.reserved_bytes <= limit]
    assert fits and all(e.settings["loss_chunks"] == 8 for e in fits)
    assert cli.main(["plan", path, "--devices", "2", "--max-axis", "tp=1,cp=1", *_below(limit + 2 ** 20)]) == 0
    out = capsys.readouterr().out
    keys = yaml.safe_load(out.split("to train it, set in the config:\n")[1].split("Pareto front")[0])
    assert keys["loss_chunks"] == 8
    # the keys pasted train that layout: validate's estimate of the pasted config is the plan's
    best = min(fits, key=lambda e: e.time.step_s)
    pasted = TrainConfig.from_yaml(_config(tmp_path, "pasted.yaml", **yaml.safe_load(layout_yaml(cfg, best, 2))))
    assert pasted.loss_chunks == 8 and model_config(pasted).loss_chunks == 8
    mesh = pasted.mesh(2)
    again = planned_estimate(pasted, mesh, pasted.build_rules(mesh), model_config(pasted))
    assert again.peak_bytes == best.peak_bytes
    # layout: auto trains with it
    chosen = auto_layout(cfg, 2, plan.cluster("h100x8").with_(memory_bytes=limit), stream=open("/dev/null", "w"),
                         jobs=1)
    assert chosen.loss_chunks == 8 and model_config(chosen).loss_chunks == 8
    assert apply_layout(cfg, best, 2).loss_chunks == 8


def test_a_config_that_fixes_loss_chunks_keeps_it_and_nothing_fits_names_it(tmp_path, capsys):
    four = TrainConfig.from_yaml(_config(tmp_path, loss_chunks=4))
    assert config_space(four).loss_chunks == (4,)
    assert {e.settings.get("loss_chunks") for e in _rank(four)} == {4}
    by_bytes = TrainConfig.from_yaml(_config(tmp_path, loss_chunk_bytes=1 << 20))
    assert config_space(by_bytes).loss_chunks == (None,)        # the config's own chunks, by bytes
    path = _config(tmp_path, "off.yaml", loss_chunks=None)
    off = TrainConfig.from_yaml(path)
    assert config_space(off).loss_chunks == (None,)
    ranking = _rank(off)
    assert not any(e.settings.get("loss_chunks") for e in ranking)
    nearest = min(e.reserved_bytes for e in ranking)
    assert cli.main(["plan", path, "--devices", "2", "--max-axis", "tp=1,cp=1", *_below(nearest)]) == 1
    out = capsys.readouterr().out
    assert "NO LAYOUT FITS" in out
    assert "loss_chunks: 8 (the config fixes loss_chunks; remove it to let plan search it)" in out


def test_a_softcapped_model_never_gets_loss_chunks(tmp_path, capsys):
    capped = {"model": {"preset": "tiny", "vocab": 16384, "final_softcap": 30.0}}
    for keys in ({}, {"loss_chunks": 8}):
        cfg = TrainConfig.from_yaml(_config(tmp_path, **capped, **keys))
        assert config_space(cfg).loss_chunks == (None,)
    path = _config(tmp_path, **capped)
    ranking = _rank(TrainConfig.from_yaml(path))
    assert ranking and not any(e.settings.get("loss_chunks") for e in ranking)
    nearest = min(e.reserved_bytes for e in ranking)
    assert cli.main(["plan", path, "--devices", "2", "--max-axis", "tp=1,cp=1", *_below(nearest)]) == 1
    out = capsys.readouterr().out
    assert "NO LAYOUT FITS" in out and "loss_chunks" not in out
