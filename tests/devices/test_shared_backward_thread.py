"""Simulated devices on one GPU (docs/simulation.md, "On a GPU"): for CUDA tensors the autograd
engine runs backward functions on one device thread per GPU, shared by every thread that calls
backward. Threaded simulated devices on one GPU therefore share it: device 0's backward
reduce-scatter waited in the rendezvous for device 1, whose backward was queued behind it on
that same thread, for ever (the first GPU run hung this way for FSDP, TP and CP).

Emulated here without a GPU: :func:`backward_on_one_shared_thread` runs every
``torch.autograd.grad`` call of the process on one shared worker thread, as CUDA's device thread
runs the backward of every simulated device. The threaded simulator now refuses a collective
on a thread other than its device's at once, naming what to do instead; the batched simulator
(one backward for all devices) runs there and equals one device. Every launch is bounded by
the simulator's no-progress watchdog (``timeout``): with the refusal removed these tests fail
with its ``CollectiveTimeout`` instead of hanging."""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.devices.launch import DeviceError
from functional_pp.devices.sim import SharedBackwardThread, SimWorld
from functional_pp.models import llama

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=4, seq=16, seed=s) for s in range(2)]
R = fpp.Rules
DP_RULES = R(batch=("dp_replicate", "dp_shard"))
LAYOUTS = {      # each with a collective in its backward pass
    "fsdp": (dict(dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"), {}),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True), {}),
    "cp_ring": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="ring")),
}
TIMEOUT = 30.0   # the watchdog's bound on a launch that would hang


@contextlib.contextmanager
def backward_on_one_shared_thread() -> Iterator[list[str]]:
    """Every ``torch.autograd.grad`` call runs on one worker thread shared by all callers (the
    caller waits for it), as CUDA's autograd device thread runs every simulated device's
    backward; yields the names of the callers' threads."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autograd-device-thread")
    original, callers = torch.autograd.grad, []

    def grad(*args, **kwargs):
        import threading
        callers.append(threading.current_thread().name)
        return pool.submit(original, *args, **kwargs).result()
    torch.autograd.grad = grad
    try:
        yield callers
    finally:
        torch.autograd.grad = original
        pool.shutdown(wait=False, cancel_futures=True)


def _run(layout: str, simulate=True):
    mesh_kw, rules, options = LAYOUTS[layout]
    mesh = fpp.Mesh(**mesh_kw)

    def fn():
        with fpp.configure(**options):
            return train_steps(CFG, DATA, mesh, rules)()
    return fpp.launch(fn, mesh, simulate=simulate, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def one_device():
    return fpp.launch(train_steps(CFG, DATA, fpp.Mesh(), R()), fpp.Mesh())[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_threaded_simulation_refuses_a_shared_backward_thread_instead_of_hanging(layout):
    with backward_on_one_shared_thread() as callers, pytest.raises(DeviceError) as info:
        _run(layout)
    assert callers, "no backward ran on the shared thread"
    err = info.value
    assert isinstance(err.original, SharedBackwardThread), f"not refused: {type(err.original).__name__}: {err}"
    assert 'simulate="batched"' in str(err) and "torchrun" in str(err)
    assert "autograd-device-thread" in str(err)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batched_simulation_on_a_shared_backward_thread_equals_one_device(layout, one_device):
    with backward_on_one_shared_thread() as callers:
        runs = _run(layout, simulate="batched")
    assert len(callers) == len(DATA)          # one backward per step, for all devices
    for run in runs:
        assert_same_run(one_device, run, rtol=1e-9, atol=1e-12)


def test_threaded_plain_data_parallelism_on_a_shared_backward_thread_equals_one_device(one_device):
    """Plain DP reduces its gradients after the backward pass, on the device's own thread (the
    bucket is launched by ``GradBuckets.finish``): nothing is refused."""
    mesh = fpp.Mesh(dp_replicate=2)
    with backward_on_one_shared_thread():
        runs = fpp.launch(train_steps(CFG, DATA, mesh, DP_RULES), mesh, timeout=TIMEOUT)
    for run in runs:
        assert_same_run(one_device, run, rtol=1e-9, atol=1e-12)


def _on_a_thread(fn):
    """``fn()`` on a fresh thread: its result or the exception it raised."""
    import threading
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            box["value"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TIMEOUT)
    return box.get("value")


def test_a_foreign_thread_passes_only_where_every_peer_is_on_another_device():
    """Refused where a peer's tensors are on the same device as this collective's input (or on
    an unknown one); let through where each simulated device has a GPU of its own (so an
    autograd thread of its own, and nothing waits in vain)."""
    world = SimWorld(2, timeout=TIMEOUT)
    world.start(0)                                   # this thread is device 0's own
    x = torch.zeros(2, device="meta")
    got = _on_a_thread(lambda: world.exchange(0, (0, 1), x, ("x",)))
    assert isinstance(got, SharedBackwardThread) and "unknown" not in str(got)   # device 1 not seen yet
    world._placed[1] = torch.device("meta")
    assert isinstance(_on_a_thread(lambda: world.exchange(0, (0, 1), x, ("x",))), SharedBackwardThread)

    world = SimWorld(2, timeout=TIMEOUT)
    world.start(0)
    world._placed[1] = torch.device("cpu")           # device 1 holds its tensors elsewhere

    def device_1():
        world.start(1)
        return world.exchange(1, (0, 1), "b", ("x",))
    import threading
    peer = threading.Thread(target=lambda: _on_a_thread(device_1), daemon=True)
    got = _on_a_thread(lambda: (peer.start(), world.exchange(0, (0, 1), x, ("x",)))[1])
    assert not isinstance(got, BaseException), got
    assert got[1] == "b"
