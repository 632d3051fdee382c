"""Simulated collectives behave like real ones where torch.compile can tell: peers read a
snapshot of each input (never the live tensor, which the caller may overwrite as soon as
the collective returns), and results have the strides the fake kernel promises."""
import sys
import time

import pytest
import torch

import functional_pp as fpp
from functional_pp.core import runtime

N = 2


def test_input_overwritten_right_after_a_collective_does_not_reach_peers():
    """Eager code that overwrites a collective's input as soon as it returns (what inductor
    does with its buffers): every peer must still see the value sent."""
    def fn():
        r = fpp.current_rank()
        bad = 0
        for step in range(150):
            x = torch.full((200_000,), float(r + 1 + step))
            y = fpp.all_gather(x, "dp_shard", axis=0, tiled=True)
            x.fill_(-1.0)                      # reuse the buffer at once
            z = fpp.psum(x.fill_(float(r + step)), "dp_shard")
            x.zero_()
            expected_y = torch.cat([torch.full((200_000,), float(i + 1 + step)) for i in range(N)])
            bad += int(not torch.equal(y, expected_y)) + int(not bool((z == 2 * step + 1).all()))
        return bad
    assert fpp.launch(fn, fpp.Mesh(dp_shard=N)) == [0] * N


def _every_collective(x):
    """Each collective on a non-contiguous input (a transposed view), followed by in-place
    use of the results so that strides matter to the compiled code."""
    xt = x.t()                                                   # non-contiguous (8, 4)
    outs = [
        fpp.psum(xt, "dp_shard"),
        fpp.pmax(xt, "dp_shard"),
        fpp.all_gather(xt, "dp_shard", axis=1, tiled=True),
        fpp.psum_scatter(xt, "dp_shard", scatter_dimension=0, tiled=True),
        fpp.all_to_all(xt, "dp_shard", split_axis=0, concat_axis=1, tiled=True),
        fpp.ppermute(xt, "dp_shard", [(0, 1), (1, 0)]),
    ]
    return [o * 2 + 1 for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_collectives_equal_eager_on_non_contiguous_inputs(backend):
    def fn():
        x = torch.arange(32, dtype=torch.float64).reshape(4, 8) * (fpp.current_rank() + 1)
        eager = _every_collective(x)
        compiled = torch.compile(_every_collective, backend=backend, fullgraph=True)(x)
        return [(e, c) for e, c in zip(eager, compiled)]
    for rank, pairs in enumerate(fpp.launch(fn, fpp.Mesh(dp_shard=N))):
        for i, (e, c) in enumerate(pairs):
            torch.testing.assert_close(c, e, rtol=0, atol=0, msg=lambda m: f"rank {rank} collective {i}: {m}")
            assert c.stride() == e.stride() or c.is_contiguous(), (rank, i, c.stride(), e.stride())


def test_fake_kernel_strides_equal_real_kernel_strides():
    """The fake (meta) result of every simulated collective has the real result's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fn():
        x = torch.arange(32, dtype=torch.float64).reshape(4, 8).t()
        real = _raw_results(x)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = _raw_results(mode.from_tensor(x))
        return [(r.shape, r.stride(), f.shape, f.stride()) for r, f in zip(real, fake)]
    for rows in fpp.launch(fn, fpp.Mesh(dp_shard=N)):
        for rs, rst, fs, fst in rows:
            assert (rs, rst) == (fs, fst)


def _raw_results(x):
    ctx = runtime.current_context()
    b, g = ctx.backend, ctx.mesh.group(ctx.rank, ("dp_shard",))
    return [b.all_reduce(x, "sum", g), b.all_reduce(x, "max", g), b.all_gather(x, 0, g),
            b.reduce_scatter(x, 0, g), b.all_to_all(x, 0, 1, g), b.permute(x, ((0, 1), (1, 0)), g)]


def test_every_rank_gets_its_own_result_tensor_bitwise_equal_to_a_left_to_right_sum():
    """The sum is computed once per group (by the last device to arrive) in the order of
    ``functools.reduce(torch.add, inputs)``; every rank gets a separate tensor, so one rank
    writing its result in place (as AdamW does with its gradient buffers) changes no other."""
    import functools
    n = 5
    inputs = [torch.randn(60, dtype=torch.float32, generator=torch.Generator().manual_seed(r)) * 10 ** r
              for r in range(n)]                            # magnitudes where the order of a sum matters

    def fn():
        r = fpp.current_rank()
        s = fpp.psum(inputs[r], "dp_shard")
        g = fpp.all_gather(inputs[r], "dp_shard", axis=0, tiled=True)
        rs = fpp.psum_scatter(inputs[r].reshape(n, -1), "dp_shard", scatter_dimension=0, tiled=True)
        fpp.psum(torch.zeros(()), "dp_shard")               # every rank holds its results now
        if r == 0:
            s.fill_(float("nan"))
            g.fill_(float("nan"))
        fpp.psum(torch.zeros(()), "dp_shard")               # rank 0 has written before the others look
        return s.clone(), g.clone(), rs.clone(), s.data_ptr(), g.data_ptr(), inputs[r].data_ptr()

    out = fpp.launch(fn, fpp.Mesh(dp_shard=n))
    expected = functools.reduce(torch.add, inputs)
    assert not torch.equal(expected, functools.reduce(torch.add, inputs[::-1]))   # the order shows
    for r, (s, g, rs, *_) in enumerate(out[1:], start=1):
        assert torch.equal(s, expected), r
        assert torch.equal(g, torch.cat(inputs)), r
        assert torch.equal(rs, expected.reshape(n, -1)[r:r + 1]), r
    pointers = [p for *_, sp, gp, ip in out for p in (sp, gp, ip)]
    assert len(set(pointers)) == len(pointers)              # no two ranks share a result or an input


def test_eager_collectives_run_without_the_custom_op_and_compiled_ones_with_it():
    """Eager code calls the simulated collective directly (no custom-op dispatch: the cost of
    simulating many devices, docs/simulation.md); anything traced or faked uses the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def ops_called(fn):            # one thread of a process may profile at a time: rank 0
        if fpp.current_rank() != 0:
            return fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name == "fpp_sim::collective" for e in prof.events())

    def fn():
        x = torch.ones(4)
        eager = ops_called(lambda: fpp.psum(x, "dp_shard"))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_x = mode.from_tensor(x)
            faked = ops_called(lambda: runtime.current_context().backend.all_reduce(fake_x, "sum", (0, 1)))
        return eager, faked
    eager, faked = fpp.launch(fn, fpp.Mesh(dp_shard=N))[0]
    assert eager == 0 and faked >= 1


def test_sleeping_devices_that_time_out_and_wake_late_keep_the_rendezvous_consistent(monkeypatch):
    """A device waiting in a collective sleeps on its own lock and looks at the watchdog every
    ``SimWorld.POLL`` seconds. With a tiny poll interval, sleeps time out all the time and
    releases land just after a timeout: every exchange must still deliver the right values, and
    afterwards every device's wake-up lock is held again with nobody left registered asleep
    (a lost or duplicated release would show here, or raise 'release unlocked lock')."""
    import random
    import threading

    from functional_pp.devices.sim import SimWorld
    monkeypatch.setattr(SimWorld, "POLL", 1e-4)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                 # switch threads between any two bytecodes
    n, rounds = 3, 400
    world = SimWorld(n, timeout=60)
    got, errors = [[] for _ in range(n)], []

    def device(rank):
        rng = random.Random(rank)
        try:
            for i in range(rounds):
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 1e-3)     # arrive late: the others time out waiting
                got[rank].append(world.exchange(rank, tuple(range(n)), (rank, i), ("exchange", i)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            world.abort(rank, exc)

    threads = [threading.Thread(target=device, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for rank in range(n):
        assert got[rank] == [[(r, i) for r in range(n)] for i in range(rounds)]
    assert not world._asleep and not world._slots
    assert all(lock.locked() for lock in world._wake)


def test_a_release_landing_just_after_a_sleep_timed_out_is_taken_once():
    """The interleaving the stress test above only meets by chance, forced: device 0's sleep
    times out just as device 1 completes the rendezvous and releases it. Device 0 must take
    that release (its lock held again afterwards), or its next sleep would return at once and
    a later release would fail on an unlocked lock."""
    import threading

    from functional_pp.devices.sim import SimWorld
    world = SimWorld(2, timeout=60)
    real = world._wake[0]
    released = threading.Event()

    class TimesOutAfterTheRelease:
        first = True

        def acquire(self, blocking=True, timeout=-1):
            if timeout != -1 and self.first:           # the first sleep: "times out" after the release
                self.first = False
                released.wait(30)
                return False
            return real.acquire(blocking, timeout)

        def release(self):
            real.release()
            released.set()

    world._wake[0] = TimesOutAfterTheRelease()
    out = []
    t = threading.Thread(target=lambda: out.append(world.exchange(0, (0, 1), "a", ("x",))), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while 0 not in world._asleep and time.monotonic() < deadline:
        time.sleep(0.001)
    assert world.exchange(1, (0, 1), "b", ("x",)) == ["a", "b"]
    t.join(timeout=30)
    assert out == [["a", "b"]]
    assert real.locked() and not world._asleep
