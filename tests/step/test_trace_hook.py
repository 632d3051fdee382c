"""``TrainStep.trace``: the public hook the planner measures a step with (plan/dryrun.py) runs
the step's device function once and returns a named :class:`DeviceStepResult`, the same
numbers the step itself computes."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step.result import DeviceStepResult

CFG = llama.Config.tiny()
MESH, RULES = fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")


def _device():
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), mesh=MESH, rules=RULES)
    with pytest.raises(RuntimeError, match=r"step.init\(params\) before step.trace"):
        step.trace({}, {})
    state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=MESH, rules=RULES, seed=0))
    with fpp.use_rules(RULES):
        batch = {k: v.data for k, v in local_batch(make_batch(CFG, batch=4, seq=8), MESH, RULES).items()}
    with fpp.use_rules(RULES), step.apply_policy():
        traced = step.trace(state, batch)
    new, metrics = step(state, batch)
    return traced, new, metrics


def test_trace_runs_the_device_step_once_and_names_its_result():
    for traced, new, metrics in fpp.launch(_device, MESH):
        assert isinstance(traced, DeviceStepResult)
        assert traced.metrics["loss"].item() == metrics["loss"]
        assert int(traced.step) == int(new["step"]) == 1 and int(traced.skipped) == 0
        for (path, a), (_, b) in zip(fpp.leaves_with_paths(traced.params), fpp.leaves_with_paths(new["params"])):
            assert torch.equal(a, b), path
