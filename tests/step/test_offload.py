"""CPU offload of parameters, gradients and optimizer state (``train_step(offload_params=True)``,
FSDP2's CPUOffloadPolicy; docs/memory.md "CPU offload"): the same numbers as without offload,
bitwise, under FSDP with accumulation, fp32 and bf16, on simulated devices and on gloo processes.
Placement (state on the host, forward on the device, update on the host) is checked on fake
CUDA in tests/devices/test_fake_cuda.py."""
import pytest
import torch
from harness import assert_same_run, launch_steps

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny(layers=1, hidden=32, mlp=64, vocab=64)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_steps_equal_steps_without_offload(precision):
    kw = dict(mesh=MESH, rules=RULES, steps=2, precision=precision, grad_accum=2)
    plain = launch_steps(CFG, **kw)
    offloaded = launch_steps(CFG, offload_params=True, **kw)
    for a, b in zip(plain, offloaded):
        assert_same_run(a, b)


@pytest.mark.multiprocess
def test_offloaded_steps_on_gloo_processes():
    kw = dict(mesh=MESH, rules=RULES, steps=2, precision="bf16")
    plain = launch_steps(CFG, **kw)
    for a, b in zip(plain, launch_steps(CFG, offload_params=True, processes=True, **kw)):
        assert_same_run(a, b)


def test_a_compiled_step_cannot_offload_yet():
    with pytest.raises(ValueError, match="offload_params=True, compile=True.*compile='per_layer'"):
        fpp.train_step(lambda p, b: None, fpp.optim.sgd(0.1), offload_params=True, compile=True)


@pytest.mark.parametrize("lever", ["offload_params", "activation_offloading"])
def test_a_pipeline_step_cannot_offload_yet(lever):
    from functional_pp.step.pipeline import pipeline_step
    with pytest.raises(ValueError, match=f"pipeline_step\\({lever}=True\\): a pipeline step cannot offload yet"):
        pipeline_step(lambda p, b: None, fpp.optim.sgd(0.1), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"),
                      **{lever: True})
