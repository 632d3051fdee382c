"""Two "nodes" on one machine (docs/real_processes.md, "Several nodes"): two network namespaces
joined by a veth pair, one ``torchrun --nnodes 2`` agent in each with a c10d rendezvous, gloo
over the veth. The CLI's run on the 2 x 2 = 4 ranks equals the same config on 4 simulated
devices, when one node is killed the other stops within the collective timeout, naming
the ranks it lost, and a link slowed by ``tc`` shows in the step time as the comm report's
bytes predict. Needs root and ``ip netns`` (skipped, with the reason, elsewhere)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from functional_pp import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "cosine",
          "warmup_steps": 1, "model": "tiny", "data": {"max_bytes": 300_000}, "logging": {"log_every": 1},
          "dp_shard_size": 2, "tp_size": 2}


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip netns`)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"fpp-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe)
    _ip("netns", "del", probe)
    return None if made.returncode == 0 else f"`ip netns add` failed: {made.stderr.strip()}"


@pytest.fixture(scope="module")
def nodes():
    """Two namespaces ``(name, interface, address)`` joined by a veth pair; removed afterwards."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:5]
    made = [(f"fpp{tag}{i}", f"fv{tag}{i}", f"10.213.{int(tag[:2], 16)}.{i + 1}") for i in range(2)]
    try:
        for ns, _, _ in made:
            assert _ip("netns", "add", ns).returncode == 0
        assert _ip("link", "add", made[0][1], "type", "veth", "peer", "name", made[1][1]).returncode == 0
        for ns, dev, addr in made:
            for cmd in (("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                        ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")):
                res = _ip(*cmd)
                assert res.returncode == 0, (cmd, res.stderr)
        yield made
    finally:
        for ns, _, _ in made:
            _ip("netns", "del", ns)       # deletes the veth pair with it


def _torchrun(node: tuple, index: int, host: str, cfg: Path, out: Path, run_id: str, log: Path) -> subprocess.Popen:
    """The agent of node ``index``: the c10d store is hosted by node 0 (``is_host``), each node
    announces its own address (``--local-addr``: hostnames do not resolve across namespaces)
    and gloo binds to its veth (``GLOO_SOCKET_IFNAME``)."""
    ns, dev, addr = node
    cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1",
           f"PYTHONPATH={ROOT}", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:29531",
           "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(index == 0)}", "--local-addr", addr,
           "-m", "functional_pp", "train", str(cfg), "--output", str(out)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cfg.parent,
                            start_new_session=True)


def _kill_node(ns: str) -> None:
    """Every process of the namespace: the agent and its ranks (the ranks of torchrun run in
    sessions of their own and outlive a killed agent)."""
    for pid in _ip("netns", "pids", ns).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(procs: list, nodes: list, timeout: float) -> list[int | None]:
    """The exit codes, waiting up to ``timeout`` s in all; then every process of both nodes killed."""
    deadline = time.monotonic() + timeout
    try:
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
    finally:
        for ns, _, _ in nodes:
            _kill_node(ns)
        for p in procs:
            p.wait(timeout=60)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_equal_four_simulated_devices(nodes, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "max_steps": 3}))
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    run_id = uuid.uuid4().hex[:8]
    procs = [_torchrun(node, i, nodes[0][2], cfg, tmp_path / "real", run_id, logs[i]) for i, node in enumerate(nodes)]
    codes = _wait(procs, nodes, timeout=600)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "torchrun (WORLD_SIZE=4)" in logs[0].read_text()
    assert cli.main(["train", str(cfg), "--simulate", "4", "--output", str(tmp_path / "sim")]) == 0
    real, simulated = _losses(tmp_path / "real"), _losses(tmp_path / "sim")
    assert len(real) == 3 and real == simulated                 # bitwise: every sum is over 2 devices
    shards = sorted(p.name for p in (tmp_path / "real" / "checkpoints" / "step-000003").glob("rank-*"))
    assert shards == [f"rank-{r:05d}.safetensors" for r in range(4)]    # each node wrote its ranks


def test_a_lost_node_stops_the_other_within_the_collective_timeout_naming_its_ranks(nodes, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "max_steps": 100_000, "collective_timeout": 20,
                                   "checkpoint": {"save_every": 0}}))
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    run_id = uuid.uuid4().hex[:8]
    procs = [_torchrun(node, i, nodes[0][2], cfg, tmp_path / "run", run_id, logs[i]) for i, node in enumerate(nodes)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        for _ in range(600):                                    # training has started on both nodes
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-3000:] for log in logs)
            time.sleep(1)
        else:
            pytest.fail("no training step was logged in 600 s:\n" + logs[0].read_text()[-3000:])
        _kill_node(nodes[1][0])                                 # node 1 lost: its agent and ranks 2, 3
        procs[1].wait(timeout=60)
    finally:
        code = _wait(procs[:1], nodes, timeout=300)[0]          # the timeout is 20 s; a hang fails here
    text = logs[0].read_text()
    assert code not in (0, None), text[-3000:]
    assert "CollectiveTimeoutError: rank 0: a collective failed" in text, text[-4000:]
    assert "ranks [2, 3] did not check in" in text, text[-4000:]



RATE, BURST = 500_000, 64_000          # bytes per second, and the token bucket (bytes) tbf lets through at once


def _shape(ns: str, dev: str, op: str) -> None:
    """A token-bucket filter (``tc qdisc ... tbf``) on one end of the veth: at most ``RATE``
    bytes per second leave the namespace (after a burst of ``BURST``)."""
    args = ["tbf", "rate", f"{RATE * 8}bit", "burst", str(BURST), "limit", "50000000"] if op == "add" else []
    res = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", op, "dev", dev, "root", *args],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_a_slowed_link_shows_in_the_step_time_and_changes_no_result(nodes, tmp_path):
    """The link between the nodes limited to 0.5 MB/s each way (``tc ... tbf``): every collective
    over ``dp_shard`` (the axis across the nodes; ``tp`` stays inside one) sends its bytes over
    it, two ranks of a node at once, so a step takes at least the report's dp_shard bytes x 2
    ranks / RATE (less one burst), while the losses stay bitwise those of 4 simulated devices."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "max_steps": 3}))
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    for ns, dev, _ in nodes:
        _shape(ns, dev, "add")
    try:
        run_id = uuid.uuid4().hex[:8]
        procs = [_torchrun(node, i, nodes[0][2], cfg, tmp_path / "real", run_id, logs[i])
                 for i, node in enumerate(nodes)]
        codes = _wait(procs, nodes, timeout=900)
    finally:
        for ns, dev, _ in nodes:
            _shape(ns, dev, "del")
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert cli.main(["train", str(cfg), "--simulate", "4", "--output", str(tmp_path / "sim")]) == 0
    assert _losses(tmp_path / "real") == _losses(tmp_path / "sim")
    report = (tmp_path / "real" / "comm_report.txt").read_text()
    crossing = sum(int(line.split()[3].replace(",", "")) for line in report.splitlines() if line.split()[:1] == ["dp_shard"])
    lines = (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_time_avg_s"] for line in lines]
    bound = (2 * crossing - BURST) / RATE
    print(f"{crossing} bytes per device over dp_shard per step; step times {times} s, at least {bound:.2f} s")
    assert bound > 0.5, report
    assert min(times) >= bound, (times, report)
