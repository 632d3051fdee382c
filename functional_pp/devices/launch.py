"""Run a function on every device of a mesh: simulated threads, local processes, or torchrun.

Mechanism: Devices (the entry point: threads, batched, processes or torchrun).
"""
from __future__ import annotations

import os
import socket
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch

from functional_pp._torch import (compile_cache_limits, compile_despite_peers_fx_tracing,
                                  dynamo_settings_are_thread_local, reset_compile_workers_after_fork)
from functional_pp.core.mesh import Mesh, require_mesh
from functional_pp.core.runtime import DeviceContext, current_context, set_process_context, thread_context
from functional_pp.devices.fork_quiesce import QUIESCE_LIMIT, quiesce_before_fork
from functional_pp.devices.process_watch import (DEFAULT_PROCESS_TIMEOUT, explain_comm_failure, is_comm_failure,
                                                 supervise)
from functional_pp.devices.sim import SimAborted, SimBackend, SimWorld


class DeviceError(RuntimeError):
    """A device failed; names its rank and mesh coordinates."""

    def __init__(self, rank: int, coords: dict[str, int], exc: BaseException, tb: str = ""):
        where = ", ".join(f"{a}={i}" for a, i in coords.items())
        super().__init__(f"device {rank} ({where}) failed: {type(exc).__name__}: {exc}"
                         + (f"\n--- traceback on device {rank} ---\n{tb}" if tb else ""))
        self.rank, self.coords, self.original = rank, coords, exc


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(fn: Callable[[], Any], mesh: Mesh, *, simulate: bool | str | None = None,
           processes: bool = False, timeout: float | None = None) -> Any:
    """Run ``fn()`` on every device of ``mesh``.

    - ``simulate=True`` (the default outside torchrun): one thread per device in this process,
      with exact collective semantics; returns the results in rank order. A failure on any
      device stops all of them and raises :class:`DeviceError` naming the rank.
    - under ``torchrun`` (``simulate=False``): this process is one rank (gloo on CPU, NCCL on
      CUDA); returns this rank's result.
    - ``simulate="batched"``: ``fn`` runs once for all devices, every op batched over a device
      dimension (docs/simulation.md, "Batched simulation"); build per-device inputs with
      :func:`functional_pp.per_device`. Returns the results in rank order.
    - ``processes=True``: fork one gloo process per device on this machine; returns the results
      in rank order (they must be picklable).

    ``timeout`` (seconds) bounds every wait for a peer: simulated devices fail when no device
    made progress for that long (default 300; a device returning early fails its peers at
    once), real processes pass it to the process group (default 600) and name the ranks
    that did not take part (docs/bad_inputs.md §4).
    """
    require_mesh(mesh, "launch(fn, mesh)")
    if not callable(fn):
        raise TypeError(f"launch(fn, mesh): fn must be a function run on every device, got {type(fn).__name__}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"launch: timeout must be a positive number of seconds, got {timeout!r}")
    if processes:
        return _launch_processes(fn, mesh, timeout or DEFAULT_PROCESS_TIMEOUT)
    if simulate is None:
        simulate = not under_torchrun()
    if simulate == "batched":
        from functional_pp.devices.batched_run import launch_batched
        return launch_batched(fn, mesh)
    if simulate not in (True, False):
        raise ValueError(f"launch: simulate must be True (one thread per device), False (torchrun) or "
                         f"'batched' (all devices in one batched run), got {simulate!r}")
    if simulate:
        return _launch_threads(fn, mesh, timeout or 300.0)
    return _launch_distributed(fn, mesh, timeout or DEFAULT_PROCESS_TIMEOUT)


def _launch_threads(fn, mesh: Mesh, timeout: float) -> list:
    if current_context(required=False) is not None:
        raise RuntimeError("functional_pp.launch cannot be nested inside another launch")
    world = SimWorld(mesh.size, timeout)
    results: list = [None] * mesh.size
    errors: list = [None] * mesh.size
    dynamo_settings_are_thread_local()      # probed here, on the host, before the device threads

    def run(rank: int) -> None:
        ctx = DeviceContext(mesh, rank, SimBackend(world, rank), simulated=True)
        world.start(rank)
        with thread_context(ctx), _compile_cache_limits(mesh.size), compile_despite_peers_fx_tracing():
            try:
                results[rank] = fn()
                world.finish(rank)       # peers still waiting for this device fail at once
            except BaseException as exc:  # noqa: BLE001 - re-raised below with the rank
                errors[rank] = (exc, traceback.format_exc())
                world.abort(rank, exc)

    from functional_pp.devices.sim import _unregister
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [threading.Thread(target=run, args=(r,), name=f"fpp-device-{r}", daemon=True)
                   for r in range(mesh.size)]
        for t in threads:
            t.start()
        _join(threads, world)
    finally:
        torch.set_num_threads(threads_before)
        _unregister(world)
    if world.failure is not None:
        rank = world.failure[0]
        exc, tb = errors[rank] if errors[rank] else (world.failure[1], "")
        if isinstance(exc, SimAborted):  # pick the first real failure
            for r, e in enumerate(errors):
                if e and not isinstance(e[0], SimAborted):
                    rank, (exc, tb) = r, e
                    break
        raise DeviceError(rank, mesh.coords(rank), exc, tb) from exc
    return results


def _join(threads: list, world: SimWorld, grace: float = 10.0) -> None:
    """Wait for the device threads; once a device failed, wait at most ``grace`` seconds for
    the others (a device blocked outside any collective can never be interrupted: its daemon
    thread is abandoned rather than hanging the caller)."""
    failed_at = None
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=0.2)
        if world.failure is not None:
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > grace:
                return
    _wait_until_exited(threads)


def _wait_until_exited(threads: list, limit: float = 10.0) -> None:
    """Wait (at most ``limit`` seconds) until the OS threads behind finished device threads are
    gone. ``Thread.join`` returns before a thread runs its native thread-local destructors
    (MKL frees its per-thread buffers there, under its allocator's lock); a process forked in
    that window (``launch(processes=True)`` right after a simulated run) inherits the lock held
    and its first matrix product spins forever (docs/real_processes.md). Linux only."""
    deadline = time.monotonic() + limit
    for t in threads:
        task = f"/proc/self/task/{t.native_id}"
        while t.native_id is not None and os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.001)


def _compile_cache_limits(n_devices: int):
    """Simulated devices share one process: torch.compile keeps one graph per device (each
    has its own rank baked in) and per training step built in the process, so allow many
    entries per function. Each device thread sets its own (_torch.patch_dynamo)."""
    return compile_cache_limits(8 * n_devices + 64)


def _launch_distributed(fn, mesh: Mesh, timeout: float = DEFAULT_PROCESS_TIMEOUT, local_gpu: bool = True):
    """This process as one rank of ``mesh``; ``local_gpu``: make GPU ``LOCAL_RANK`` current (torchrun;
    not the CPU gloo processes of ``launch(processes=True)``, more of them than GPUs on a machine)."""
    import torch.distributed as dist

    from functional_pp.devices.dist import DistBackend
    from functional_pp.devices.rendezvous import join_from_env, leave_at_exit

    gpu = use_local_gpu() if local_gpu else None    # also when the caller initialised the process group
    if not dist.is_initialized():
        join_from_env("nccl" if gpu is not None else "gloo", timeout)     # (outside torchrun: bounded)
    leave_at_exit()     # a group the caller initialised too: destroyed before the interpreter's teardown
    mesh.validate_world_size(dist.get_world_size())
    rank = dist.get_rank()
    ctx = DeviceContext(mesh, rank, DistBackend(mesh, rank, timeout=timeout), simulated=False)
    set_process_context(ctx)
    try:
        return fn()
    except Exception as exc:
        if is_comm_failure(exc):         # name the ranks that do not answer
            raise explain_comm_failure(exc, rank, dist.get_world_size(), timeout) from exc
        raise
    finally:
        set_process_context(None)


def use_local_gpu() -> int | None:
    """With CUDA: make this process's GPU, ``LOCAL_RANK`` (torchrun's rank on its node), the
    current device, so that NCCL and every tensor made on "cuda" use it; returns its index
    (None without CUDA). More processes on a node than visible GPUs raises, naming both."""
    if not torch.cuda.is_available():
        return None
    index, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(f"LOCAL_RANK={index} but this process sees {count} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start "
                           f"torchrun with --nproc-per-node at most {count}, one process per GPU")
    torch.cuda.set_device(index)
    return index


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_main(fn, mesh: Mesh, rank: int, port: int, queue, timeout: float) -> None:
    torch.set_num_threads(1)
    reset_compile_workers_after_fork()   # the parent's compile threads did not come along
    # a fresh rank, as under torchrun: the parent's compiled code (counted against dynamo's
    # recompile limit, built for its own devices) does not come along either
    torch.compiler.reset()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(mesh.size), LOCAL_RANK=str(rank))
    import datetime

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", rank=rank, world_size=mesh.size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = _launch_distributed(fn, mesh, timeout, local_gpu=False)
        queue.put(_by_value((rank, True, result, "")))
    except BaseException as exc:  # noqa: BLE001
        queue.put(_by_value((rank, False, _picklable(exc), traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        # os._exit skips the queue's feeder thread: flush the result into the pipe first, so a
        # parent that sees this process gone always finds its report.
        queue.close()
        queue.join_thread()
        os._exit(0)


def _by_value(report: tuple) -> bytes:
    """A report pickled by value with plain pickle: the queue's own pickler would share tensors
    through file descriptors that vanish when this process exits (docs/real_processes.md)."""
    import pickle
    try:
        return pickle.dumps(report)
    except Exception as exc:  # noqa: BLE001
        rank = report[0]
        return pickle.dumps((rank, False, TypeError(
            f"the launched function's result cannot be pickled ({exc}); return tensors, numbers "
            f"or other picklable values"), traceback.format_exc()))


class _ReportQueue:
    """The parent's view of the report queue: unpickles what :func:`_by_value` sent."""

    def __init__(self, q):
        self._q = q

    def get(self, timeout: float):
        import pickle
        return pickle.loads(self._q.get(timeout=timeout))

    def empty(self) -> bool:
        return self._q.empty()


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (its type reaches the parent), else a
    RuntimeError with its type and message."""
    import pickle
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _quiesce_then(fork: Callable[[], None]) -> None:
    """``fork()`` once every other thread of this process sleeps (``fork_quiesce``): a thread that
    runs native code at the fork can leave the child a lock held or a structure half-written.
    Threads still busy after the bound are named in a warning and the fork goes ahead."""
    busy = quiesce_before_fork(QUIESCE_LIMIT)
    if busy:
        warnings.warn(f"launch(processes=True): forking while thread(s) {busy} of this process (native ids) kept "
                      f"running for {QUIESCE_LIMIT:g}s: a lock one of them holds at the fork stays held in the "
                      f"child (a hang or an abort there); stop or pause such threads before launching",
                      RuntimeWarning, stacklevel=4)
    fork()


def _launch_processes(fn, mesh: Mesh, timeout: float) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_process_main, args=(fn, mesh, r, port, q, timeout), daemon=True)
             for r in range(mesh.size)]
    for p in procs:
        _quiesce_then(p.start)
    results = None
    try:
        results = supervise(procs, _ReportQueue(q), mesh.size, timeout,
                            lambda rank, exc, tb: DeviceError(rank, mesh.coords(rank), exc, tb))
    finally:
        for p in procs:                  # after a failure the others are stopped at once
            p.join(timeout=5 if results is not None else 0.1)
            if p.is_alive():
                p.kill()
    return results
