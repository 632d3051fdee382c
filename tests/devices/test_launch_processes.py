"""``launch(..., processes=True)`` returns large results, tensors included, whole, and names
a process that dies without a result, and ends a launch whose processes all deadlocked."""
import pytest
import torch

import functional_pp as fpp

pytestmark = pytest.mark.multiprocess


def _large_result():
    return torch.full((1 << 20,), float(fpp.current_rank()))        # 4 MiB: many pipe buffers


def test_large_results_arrive_whole():
    out = fpp.launch(_large_result, fpp.Mesh(dp_shard=4), processes=True, timeout=300)
    assert [float(x[0]) for x in out] == [0.0, 1.0, 2.0, 3.0]
    assert all(x.numel() == 1 << 20 and torch.all(x == x[0]) for x in out)


def _killed_on_rank_1():
    import os
    import signal
    if fpp.current_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_process_killed_without_result_is_named():
    # undetected, this would end in a TimeoutError after 120 s instead
    with pytest.raises(fpp.DeviceError, match=r"device 1 .*killed by SIGKILL without reporting a result"):
        fpp.launch(_killed_on_rank_1, fpp.Mesh(dp_shard=2), processes=True, timeout=120)


def _deadlocked():
    import threading
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()                # blocks forever without CPU use, as a lock inherited held at fork


def test_processes_all_blocked_outside_collectives_fail_in_bounded_time(monkeypatch):
    from functional_pp.devices import process_watch
    monkeypatch.setattr(process_watch, "IDLE_GRACE", 1.0)
    # undetected, this launch would never return (no collective to time out)
    with pytest.raises(fpp.DeviceError, match=r"device 0 .*used any CPU time for \d+s.*deadlocked"):
        fpp.launch(_deadlocked, fpp.Mesh(dp_shard=2), processes=True, timeout=2)


@pytest.mark.multiprocess
def test_a_forked_rank_gets_a_working_inductor_compile_pool():
    """A parent that already compiled with inductor holds a compile thread pool; its forked
    ranks inherit the cached pool without its threads. Each rank must get a working pool, or
    its first compilation waits forever."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    old = config.compile_threads
    config.compile_threads = 2
    try:
        assert AsyncCompile.pool().submit(int).result(timeout=60) == 0    # live threads here

        def fn():
            return AsyncCompile.pool().submit(lambda: 7).result(timeout=60)
        assert fpp.launch(fn, fpp.Mesh(dp_shard=2), processes=True, timeout=120) == [7, 7]
    finally:
        config.compile_threads = old


def _add_one(x):
    return x + 1


def test_a_forked_rank_starts_without_the_parents_compiled_code():
    """Compiled code is cached on the code object and counted against dynamo's recompile
    limit; a forked rank must start afresh (as under torchrun), or a parent that compiled a
    function for many shapes leaves its ranks no recompilation (fullgraph: a hard failure)."""
    import torch._dynamo.config as dynamo_config

    compiled = torch.compile(_add_one, fullgraph=True, dynamic=False, backend="eager")
    limit = dynamo_config.recompile_limit
    for n in range(1, limit + 1):            # the parent uses up every recompilation
        compiled(torch.zeros(n))

    def fn():
        return float(compiled(torch.zeros(limit + 1 + fpp.current_rank())).sum())
    try:
        assert fpp.launch(fn, fpp.Mesh(dp_shard=2), processes=True, timeout=300) == [float(limit + 1),
                                                                                      float(limit + 2)]
    finally:
        torch.compiler.reset()


def test_processes_on_a_machine_with_fewer_gpus_than_devices(monkeypatch):
    """The gloo processes of ``launch(processes=True)`` hold CPU tensors: on a machine with one GPU
    (emulated: torch.cuda answers as one device) every rank runs, instead of ranks >= 1 failing
    in torchrun's one-GPU-per-process check (``use_local_gpu``: "LOCAL_RANK=1 but this process
    sees 1 GPU(s)")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    out = fpp.launch(lambda: float(fpp.psum(torch.ones(()), "dp_shard")), fpp.Mesh(dp_shard=2), processes=True,
                     timeout=120)
    assert out == [2.0, 2.0]
