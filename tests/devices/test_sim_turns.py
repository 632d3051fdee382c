"""Simulated devices take turns (functional_pp/devices/sim_turns.py): one runs at a time,
switching when it sleeps in a collective, and a device blocked outside collectives while
holding its turn does not stop the others."""
import threading

import pytest
import torch

import functional_pp as fpp
from functional_pp.devices.sim import SimWorld


def _most_running_at_once(n_devices: int) -> int:
    """Devices that were between two collectives at the same moment, at most, while each
    spends its stretches in torch ops (which release the interpreter lock)."""
    lock, state = threading.Lock(), {"now": 0, "most": 0}
    a = torch.randn(96, 96)

    def fn():
        fpp.psum(torch.ones(()), "dp_shard")          # first calls (lazy set-up) may take long
        for _ in range(20):
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            for _ in range(5):
                torch.mm(a, a)
            with lock:
                state["now"] -= 1
            fpp.psum(torch.ones(()), "dp_shard")
    fpp.launch(fn, fpp.Mesh(dp_shard=n_devices), timeout=120)
    return state["most"]


def test_one_device_runs_at_a_time(monkeypatch):
    from functional_pp.devices.sim_turns import Turns
    monkeypatch.setattr(Turns, "GIVE_UP", 120.0)    # a holder slowed down by a busy machine waits
    assert SimWorld.RUNNING == 1
    assert _most_running_at_once(4) == 1


def test_without_turns_devices_do_run_at_once(monkeypatch):
    """The check above can see overlap: with every device allowed to run, they do."""
    monkeypatch.setattr(SimWorld, "RUNNING", 4)
    assert _most_running_at_once(4) > 1


def test_a_device_blocked_outside_collectives_with_its_turn_does_not_stop_the_others():
    """A barrier of the devices' own (not a collective): the first to reach it keeps its turn
    while it waits there; the others find it idle and run without a turn to reach it too."""
    barrier = threading.Barrier(4, timeout=60)

    def fn():
        x = fpp.psum(torch.ones(()), "dp_shard")
        barrier.wait()
        return float(fpp.psum(x, "dp_shard"))
    assert fpp.launch(fn, fpp.Mesh(dp_shard=4), timeout=120) == [16.0] * 4


def test_turns_are_handed_over_first_come_first_served():
    from functional_pp.devices.sim_turns import Turns
    turns = Turns(3, limit=1, patience=30)
    order, started = [], []
    turns.take(0)

    def waiter(rank):
        started.append(rank)
        turns.take(rank)
        order.append(rank)
        turns.give(rank)
    threads = []
    for r in (2, 1):                                # 2 queues first, then 1
        t = threading.Thread(target=waiter, args=(r,), daemon=True)
        t.start()
        threads.append(t)
        while r not in turns._queue:
            t.join(0.001)
    turns.give(0)
    for t in threads:
        t.join(timeout=30)
    assert order == [2, 1]
    assert turns._free == 1 and not any(turns._holding)


@pytest.mark.parametrize("limit", [1, 2])
def test_take_and_give_keep_count(limit):
    from functional_pp.devices.sim_turns import Turns
    turns = Turns(4, limit=limit)
    for r in range(limit):
        turns.take(r)
    assert turns._free == 0 and sum(turns._holding) == limit
    turns.give(0)
    turns.give(0)                                   # giving twice gives once
    assert turns._free == 1


def test_a_holder_spinning_while_it_waits_for_another_device_holds_it_up_for_give_up_seconds_only():
    """A turn holder busy-waiting (its CPU clock moves) for a device without a turn: that
    device runs anyway once it has waited ``give_up`` seconds."""
    import time

    from functional_pp.devices.sim_turns import Turns
    turns = Turns(2, limit=1, patience=0.01, give_up=0.3)
    turns.take(0)
    flag = threading.Event()

    def other():
        turns.take(1)
        flag.set()
    t = threading.Thread(target=other, daemon=True)
    t0 = time.monotonic()
    t.start()
    while not flag.is_set() and time.monotonic() - t0 < 30:
        sum(range(1000))                             # spin: the holder's CPU clock moves
    waited = time.monotonic() - t0
    assert flag.is_set() and 0.25 < waited < 10, waited
    turns.give(0)
    t.join(timeout=10)
