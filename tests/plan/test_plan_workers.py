"""The planner's dry-runs in worker processes (functional_pp/plan/workers.py): the same ranking,
rejections and progress for any number of workers, the exhaustive search and the beam alike."""
import functools
import os

import pytest

from functional_pp import plan
from functional_pp.cli import main
from functional_pp.models import llama
from functional_pp.plan.workers import Pool

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 18), "batch seq"), "labels": ((8, 18), "batch seq")}   # 18: cp=2 cannot balance it
# 2 devices: data parallel, FSDP, tp, cp (one too short a row: rejected), with recomputation and
# micro-batch sizes to expand
SPACE = plan.Space(remat=(False, True), keep_gathered=(False,), regather_activations=(False,), fsdp=(("dp_shard",),),
                   micro_batch_sizes=(1, 2), precision="fp32")


@functools.lru_cache(maxsize=None)
def _ranked(jobs: int, strategy=None, limit=None):
    seen = []
    r = plan.search(LOSS, llama.init(CFG), 2, BATCH, cluster="h100x8", space=SPACE, strategy=strategy,
                    memory_limit_bytes=limit, jobs=jobs, progress=lambda i, n, name: seen.append((i, n)))
    rows = [(e.describe(), e.peak_bytes, e.reserved_bytes, e.time.step_s, e.comm_bytes, e.flops) for e in r]
    return rows, list(r.rejected), seen


def _pid(_x):
    return os.getpid()


def test_pool_maps_in_order_on_other_processes():
    got = []
    with Pool(_pid, jobs=2) as pool:
        pids = pool.map(range(6), lambda i, r: got.append(i))
        assert pool.map([1], None) == [os.getpid()]         # one item: in this process
    assert got == list(range(6)) and os.getpid() not in pids
    with Pool(_pid, jobs=1) as pool:
        assert set(pool.map(range(3))) == {os.getpid()}
    with pytest.raises(ValueError, match="jobs=0"):
        Pool(_pid, jobs=0)


def test_search_ranks_the_same_on_two_workers_as_in_one_process():
    one = _ranked(1, plan.exhaustive)
    rows, rejected, seen = _ranked(2, plan.exhaustive)
    assert len(one[0]) > 10 and one[1]                       # layouts estimated and some rejected
    assert (rows, rejected) == one[:2]
    assert [i for i, _ in seen] == list(range(len(seen))) and len(seen) == len(one[2])


def test_beam_ranks_the_same_on_two_workers():
    every = _ranked(1, plan.exhaustive)[0]
    limit = min(resv for _, _, resv, *_ in every)        # the leanest fit: lean probes (two at once), expansions
    beam = plan.beam(2)
    one = _ranked(1, beam, limit)
    assert 0 < len(one[0]) < len(every)
    assert _ranked(2, beam, limit)[:2] == one[:2]


def test_plan_refuses_zero_jobs(tmp_path, capsys):
    assert main(["plan", "examples/configs/4d.yaml", "--devices", "4", "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
