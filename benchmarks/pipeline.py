"""Pipeline step time on gloo processes over an artificially slow link, against what the
executed schedule predicts (issue 31).

    python benchmarks/pipeline.py                               # pp 2, 1F1B and GPipe, 20 ms link
    python benchmarks/pipeline.py --pp 2 4 --micro 8 --link-ms 10
    python benchmarks/pipeline.py --preset tiny --steps 2 --warmup 1   # a smoke test

The baseline is one process running ``train_step`` with the same micro-batches: ``t1``, that
is ``3m`` slots of the whole model (unit forward, double backward). A stage does ``1/p`` of
the model, so one slot of the pipeline takes ``t1 / (3 m p)``. The predicted step is then
``makespan · t1 / (3 m p) + rounds · link``. The makespan comes from the timeline
(``functional_pp/parallel/pipeline/timing.py``). ``rounds`` is the number of lock-step
permutes the busiest device takes part in, plus its all-reduces over ``pp`` (the loss and the
gradients of the parameters outside the layers), each delayed by the link's latency
(``FPP_SLOW_LINK_MS``, functional_pp/devices/slow_link.py). The benchmark prints per
(pp, schedule) the measured median step, the prediction and the schedule's bubble, then one
JSON line. Measure with at least one CPU core per process: with fewer, the processes share
cores and the stages no longer run at the same time.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import functional_pp as fpp  # noqa: E402
from functional_pp.devices.slow_link import ENV_MS  # noqa: E402
from functional_pp.models import llama  # noqa: E402

PRESETS = {
    "tiny": dict(model=dict(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, mlp=128), rows=1, seq=32),
    "medium": dict(model=dict(vocab=2048, hidden=256, layers=8, heads=4, kv_heads=2, mlp=704), rows=2, seq=128),
}


def _device(args, pp: int, schedule: str):
    torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    cfg = llama.Config.tiny(**preset["model"])
    mesh = fpp.Mesh(pp=pp) if pp > 1 else fpp.Mesh()
    rules = fpp.Rules(layers="pp") if pp > 1 else fpp.Rules()
    loss = functools.partial(llama.loss, cfg=cfg)
    opt = fpp.optim.adamw(1e-3)
    if pp > 1:
        step = fpp.pipeline_step(loss, opt, mesh=mesh, rules=rules, grad_accum=args.micro, schedule=schedule)
    else:
        step = fpp.train_step(loss, opt, mesh=mesh, rules=rules, grad_accum=args.micro)
    state = step.init(fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0))
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.vocab, (preset["rows"] * args.micro, preset["seq"] + 1), generator=g)
    batch = {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with fpp.comm_report() as rep:
            state, m = step(state, batch)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    rounds = 0
    if pp > 1:        # the permutes this device takes part in, and the all-reduces over pp
        me = fpp.current_rank()
        rounds = sum(1 for msgs, _ in step._rounds for kind in ("act", "grad")
                     if any(me in x[3:] for x in msgs if x[0] == kind))
        rounds += sum(1 for e in rep.events if e.kind == "all_reduce")
    return statistics.median(times), m["loss"], rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--link-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from functional_pp.parallel.pipeline.schedule import build
    from functional_pp.parallel.pipeline.timing import simulate

    t1 = fpp.launch(functools.partial(_device, args, 1, "1f1b"), fpp.Mesh(), processes=True, timeout=900)[0][0]
    print(f"one process, train_step, {args.micro} micro-batches: {t1 * 1e3:.1f} ms")
    rows = []
    os.environ[ENV_MS] = str(args.link_ms)             # read by each forked rank's backend
    try:
        for pp in args.pp:
            for schedule in args.schedules:
                res = fpp.launch(functools.partial(_device, args, pp, schedule), fpp.Mesh(pp=pp), processes=True,
                                 timeout=900)
                timeline = simulate(build(schedule, pp, args.micro))
                measured = max(r[0] for r in res)
                rounds = max(r[2] for r in res)
                predicted = timeline.makespan * t1 / (3 * args.micro * pp) + rounds * args.link_ms / 1e3
                rows.append(dict(pp=pp, schedule=schedule, measured_ms=measured * 1e3, predicted_ms=predicted * 1e3,
                                 bubble=timeline.bubble, rounds=rounds, loss=res[-1][1]))
                print(f"pp {pp} {schedule:>16}: measured {measured * 1e3:7.1f} ms, predicted {predicted * 1e3:7.1f} ms "
                      f"(bubble {timeline.bubble:.3f}, {rounds} collectives x {args.link_ms:g} ms)", flush=True)
    finally:
        os.environ.pop(ENV_MS, None)
    print(json.dumps({"t1_ms": t1 * 1e3, "link_ms": args.link_ms, "micro": args.micro, "rows": rows}))


if __name__ == "__main__":
    main()
