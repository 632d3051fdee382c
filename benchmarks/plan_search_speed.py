"""How long the planner's search takes: issue 44's case, Llama 3 8B at 8k tokens on 64 H100s
(``examples/configs/4d.yaml`` with ``model: 8b``, ``sequence_len: 8192``, ``global_batch_size: 64``,
``micro_batch_size: 1``; ``functional-pp plan CONFIG --devices 64 --cluster h100x8``), the dry-runs in
this process and on worker processes, side by side, and the two rankings compared (target: < 30 s).

    python benchmarks/plan_search_speed.py            # --jobs N (default: one per core)
"""
import argparse
import os
import resource
import tempfile
import time

import yaml

from functional_pp.cli.plan import rank_layouts
from functional_pp.config import TrainConfig
from functional_pp.plan.workers import default_jobs


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _config() -> TrainConfig:
    raw = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "4d.yaml")))
    raw.update(model="8b", sequence_len=8192, global_batch_size=64, micro_batch_size=1)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(raw, f)
    return TrainConfig.from_yaml(f.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=default_jobs())
    args = p.parse_args()
    cfg = _config()
    rows = {}
    for jobs in (1, args.jobs) if args.jobs > 1 else (1,):
        wall, cpu = time.perf_counter(), _cpu()
        ranking = rank_layouts(cfg, 64, "h100x8", jobs=jobs)
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu
        rows[jobs] = [(e.describe(), e.reserved_bytes, e.time.step_s) for e in ranking]
        print(f"jobs={jobs}: {wall:.1f} s wall, {cpu:.1f} CPU-s, {len(ranking)} layouts estimated "
              f"({len(ranking.rejected)} rejected); chose {ranking.fitting()[0].describe()}", flush=True)
    if len(rows) == 2:
        print("same ranking:", rows[1] == rows[args.jobs])


if __name__ == "__main__":
    main()
