"""Ranks agree before they train (issue 46): each process of a run compares a fingerprint of its
config, data files, training tokens and versions with the others' and stops naming the ranks and
what differs. A stale copy of the dataset on one rank used to train (exit 0) with other losses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import functional_pp as fpp
from functional_pp.app.agreement import RanksDisagree, check_agreement, fingerprint

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = {"functional_pp": "x"}


def _exchange(fp):
    ctx = fpp.core.runtime.current_context()
    return ctx.backend.exchange_objects(fp, tuple(range(ctx.mesh.size)))


def test_fingerprints_name_what_differs_on_simulated_devices(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "same"}\n')

    def device(config_of_rank, tokens_of_rank):
        r = fpp.current_rank()
        fp = fingerprint(config_of_rank(r), [tmp_path / "a.jsonl"], tokens_of_rank(r), VERSIONS)
        check_agreement(fp, _exchange)
        return fp
    mesh = fpp.Mesh(dp_shard=3)
    same = fpp.launch(lambda: device(lambda r: {"max_steps": 10}, lambda r: np.arange(50)), mesh)
    assert same[0] == same[2] and same[0]["file " + str(tmp_path / "a.jsonl")].startswith("17 bytes, head sha256")
    with pytest.raises(Exception, match=r"the 3 ranks of this run would train on different inputs: config max_steps: "
                                        r"rank 0 10, rank 2 20; training tokens: rank 0 50, head sha256 \w+, ranks "
                                        r"1, 2 50, head sha256 \w+\. Give every rank the same config") as info:
        fpp.launch(lambda: device(lambda r: {"max_steps": 20 if r == 2 else 10},
                                  lambda r: np.arange(50) + (r > 0)), mesh)
    assert isinstance(getattr(info.value, "original", info.value), RanksDisagree)


@pytest.mark.multiprocess
def test_a_stale_dataset_on_one_torchrun_rank_is_refused(tmp_path):
    """Two gloo processes under torchrun, each reading its own copy of the dataset (the path names
    ``$LOCAL_RANK``): rank 1's is stale (one row differs); the run stops before training, exit 2,
    naming the files and the training tokens of both ranks."""
    rows = [{"text": f"row {i} " * 20} for i in range(40)]
    for rank, data in enumerate([rows, rows[:-1] + [{"text": "stale " * 20}]]):
        (tmp_path / f"copy{rank}").mkdir()
        (tmp_path / f"copy{rank}" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg = {"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 2, "dp_shard_size": 2,
           "datasets": [{"path": str(tmp_path / "copy${LOCAL_RANK}" / "rows.jsonl"), "type": "completion"}],
           "output_dir": str(tmp_path / "out"), "logging": {"plot": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(tmp_path / "c.yaml")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    err = proc.stdout + proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "the 2 ranks of this run would train on different inputs" in err, err[-3000:]
    assert f"config datasets[0].path: rank 0 \"{tmp_path}/copy0/rows.jsonl\", rank 1 \"{tmp_path}/copy1" in err, err[-3000:]
    assert "training tokens: rank 0 5440, head sha256" in err and "rank 1 5420, head sha256" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not (tmp_path / "out" / "metrics.jsonl").read_text()
