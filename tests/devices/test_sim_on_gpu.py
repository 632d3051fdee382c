"""Simulated devices on one real GPU (docs/simulation.md, "On a GPU"); skipped without CUDA.
The CPU-side checks of the same behaviour: tests/devices/test_shared_backward_thread.py (CUDA's
shared backward thread emulated) and tests/devices/test_step_device.py (no op of a step leaves
the parameters' device)."""
from __future__ import annotations

import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.devices.launch import DeviceError
from functional_pp.devices.sim import SharedBackwardThread
from functional_pp.models import llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=8, seq=16, seed=s) for s in range(2)]
R = fpp.Rules
FSDP = R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard")
LAYOUTS = {
    "dp": (dict(dp_replicate=2), R(batch=("dp_replicate", "dp_shard")), {}),
    "fsdp": (dict(dp_shard=2), FSDP, {}),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), FSDP, {}),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True), {}),
    "cp_ring": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="ring")),
    "cp_allgather": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="allgather")),
    "4d": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True), {}),
}


def _run(layout: str, simulate, mesh=None):
    mesh_kw, rules, options = LAYOUTS[layout]
    mesh = mesh or fpp.Mesh(**mesh_kw)

    def fn():
        with fpp.configure(**options):
            return train_steps(CFG, DATA, mesh, rules, device="cuda")()
    return fpp.launch(fn, mesh, simulate=simulate, timeout=120)


@pytest.fixture(scope="module")
def one_device():
    return fpp.launch(train_steps(CFG, DATA, fpp.Mesh(), R(), device="cuda"), fpp.Mesh())[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batched_simulation_on_cuda_equals_one_device(layout, one_device):
    for run in _run(layout, "batched"):
        assert_same_run(one_device, run, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layout", ["fsdp", "tp_sp", "cp_ring"])
def test_threaded_simulation_on_cuda_refuses_a_backward_collective(layout):
    with pytest.raises(DeviceError) as info:
        _run(layout, True)
    assert isinstance(info.value.original, SharedBackwardThread), str(info.value)
