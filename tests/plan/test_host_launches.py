"""The host term of the time model: an eager step takes at least the host's time launching its
ops (``Cluster.launch_seconds`` per op that runs a kernel); the dry-run counts the launches a
real step makes (docs/planning.md, "Time model")."""
import functools

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama
from functional_pp.plan.measure import measure

CFG = llama.Config.tiny(layers=3)
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((2, 32), "batch seq"), "labels": ((2, 32), "batch seq")}


@pytest.fixture(scope="module")
def tiny():
    return plan.estimate(LOSS, llama.init(CFG), fpp.Mesh(), fpp.Rules(), BATCH)


def test_the_dry_run_counts_the_launches_of_a_real_step(tiny):
    """The 1- and 2-layer runs extrapolated to 3 layers launch what a real 3-layer step on the CPU
    launches (the same program, meta kernels answering its ops), but for what the dry-run does
    not run: the token-id checks (3 ops for the ids, 5 for the labels, docs/eager_overhead.md),
    which meta tensors skip, and the host's read of the metrics (one ``stack``); and its
    update (``TrainStep.trace``, the step without donation) copies each parameter first."""
    run, _, _ = measure(LOSS, llama.init(CFG), fpp.Mesh(), fpp.Rules(), BATCH)
    dry = {phase: tiny.extrapolate(lambda r: r.launches.get(phase, 0)) for phase in run.launches}
    leaves = len(fpp.leaves_with_paths(llama.init(CFG)))
    assert dry["backward"] == run.launches["backward"]
    assert run.launches["forward"] - dry["forward"] == 3 + 5
    assert dry["update"] - run.launches["update"] == leaves - 1
    per_layer = tiny.runs[1].launches["forward"] - tiny.runs[0].launches["forward"]
    assert per_layer > 10          # a layer's norms, projections, rotary, attention, MLP


def test_an_eager_step_takes_at_least_the_hosts_launch_time(tiny):
    """On a fast device the tiny model's step is the host's: its launches x ``launch_seconds``;
    without the host term it is the device's work; a compiled step (fused launches the eager
    dry-run does not count) and a slow device are not charged more."""
    cl = plan.cluster("h100x8")
    launches = tiny.extrapolate(lambda r: sum(r.launches.values()))
    t, device = plan.cost(tiny, cl), plan.cost(tiny, cl.with_(launch_seconds=0.0))
    assert t.host_s == pytest.approx(launches * cl.launch_seconds) and device.host_s == 0.0
    assert device.step_s == pytest.approx(device.compute_s + device.exposed_comm_s + device.update_s)
    assert device.step_s < t.host_s and t.step_s == t.host_s
    assert t.mfu == pytest.approx(device.mfu * device.step_s / t.step_s)
    compiled = plan.cost(tiny, cl, compiled=True)
    assert compiled.host_s == 0.0 and compiled.step_s == plan.cost(tiny, cl.with_(launch_seconds=0.0),
                                                                     compiled=True).step_s
    slow = cl.with_(peak_flops=1e9)
    assert plan.cost(tiny, slow).step_s == plan.cost(tiny, slow.with_(launch_seconds=0.0)).step_s


def test_a_pipeline_launches_each_micro_batch():
    """A pipeline's runs are one micro-batch of one stage: the host launches them once per micro-batch."""
    cfg = llama.Config.tiny(layers=4)
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), fpp.Mesh(pp=2),
                        llama.default_rules().replace(layers="pp"),
                        {k: ((4, 32), d) for k, (_, d) in BATCH.items()}, grad_accum=4)
    cl = plan.cluster("h100x8")
    t = plan.cost(est, cl)
    assert t.host_s == pytest.approx(4 * est.extrapolate(lambda r: sum(r.launches.values())) * cl.launch_seconds)
