"""torchrun's variables left in the shell (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) made a plain ``functional-pp train`` wait up to the collective timeout (600 s)
in silence for ranks that never come (issue 46). Outside torchrun (no ``TORCHELASTIC_RUN_ID``)
the rendezvous is bounded (devices/rendezvous.py): the run fails naming the variables and how to
train alone, as rank 0 (nobody joins) and as rank 1 (no master answers), within the first
contact's bound (seconds), not the wait for the other ranks (UNMANAGED_WAIT)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from functional_pp.devices import rendezvous

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank, says", [(0, "the other 1 rank(s) did not join at port"),
                                        (1, "rank 0's store at 127.0.0.1:{port} did not answer")])
def test_stray_torchrun_variables_fail_in_seconds_naming_them(tmp_path, rank, says):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 1, "dp_shard_size": 2,
        "data": {"max_bytes": 20_000}, "output_dir": str(tmp_path / "o")}))
    # the default collective timeout (600 s): the first contact's bound (FIRST_CONTACT) decides
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "functional_pp", "train", str(tmp_path / "c.yaml")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stderr[-3000:]
    assert (f"RANK={rank}, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT={port} are set in the environment "
            f"(not by torchrun") in res.stderr, res.stderr[-3000:]
    assert rendezvous.FIRST_CONTACT < rendezvous.UNMANAGED_WAIT
    assert says.format(port=port) in res.stderr and f"within {rendezvous.FIRST_CONTACT:.0f} s" in res.stderr
    assert "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT" in res.stderr



@pytest.mark.multiprocess
def test_ranks_started_without_torchrun_that_meet_train(tmp_path):
    """The same variables set on purpose (a launcher without torchrun's agent, e.g. srun): two
    processes that meet within the bound train together, as under torchrun."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 2, "dp_shard_size": 2,
        "data": {"max_bytes": 20_000}, "output_dir": str(tmp_path / "o"), "logging": {"plot": False}}))
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    procs = [subprocess.Popen([sys.executable, "-m", "functional_pp", "train", str(tmp_path / "c.yaml")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    steps = [json.loads(line)["step"] for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_simulate_with_stray_torchrun_variables_names_them(monkeypatch):
    """``--simulate N`` with the variables left in the shell said "cannot be used under torchrun"
    although torchrun was not running; it names the variables and the ``unset`` that fixes it."""
    from functional_pp.app.world import resolve_world
    from functional_pp.config import ConfigError, TrainConfig
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        resolve_world(TrainConfig.from_dict({"model": "tiny"}), simulate=1)
    assert ("--simulate 1: RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500 are set in the "
            "environment, not by torchrun") in str(e.value)
    assert "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT" in str(e.value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")                 # under torchrun's agent: as before
    with pytest.raises(ConfigError, match="cannot be used under torchrun"):
        resolve_world(TrainConfig.from_dict({"model": "tiny"}), simulate=1)


_COUNT_DESTROY = ("import torch.distributed as dist\n"
                  "real = dist.destroy_process_group\n"
                  "def destroy(*a, **k):\n"
                  "    print('destroyed', flush=True)\n"
                  "    return real(*a, **k)\n"
                  "dist.destroy_process_group = destroy\n")


def _run_rank_alone(body: str) -> subprocess.CompletedProcess:
    """``body`` as rank 0 of 1 (variables set, no torchrun agent), destroy_process_group announcing itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _COUNT_DESTROY + body], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_joined_process_group_is_destroyed_when_the_process_exits():
    """A process group left to the interpreter's teardown aborted a torchrun rank after its work
    ("terminate called without an active exception", exit -6: `functional-pp generate` under
    torchrun in CI): joining registers its destruction at exit."""
    res = _run_rank_alone("from functional_pp.devices.rendezvous import join_from_env\n"
                          "join_from_env('gloo', 60)\n"
                          "print('joined', dist.get_world_size(), flush=True)\n")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["joined", "1", "destroyed"], res.stdout


def test_a_process_group_the_caller_initialised_is_destroyed_when_the_process_exits():
    """User code that initialises the process group itself and then launches (``launch`` does not
    join then) left the group to the interpreter's teardown, as above: ``launch`` registers its
    destruction at exit too, once."""
    res = _run_rank_alone("import functional_pp as fpp\n"
                          "dist.init_process_group('gloo')\n"
                          "for _ in range(2):\n"
                          "    print('ran', fpp.launch(lambda: fpp.current_rank(), fpp.Mesh(), simulate=False), flush=True)\n")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["ran", "0", "ran", "0", "destroyed"], res.stdout
