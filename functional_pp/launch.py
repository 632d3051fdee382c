"""Run a function on every device of a mesh: simulated threads, local processes, or torchrun."""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import traceback
from typing import Any, Callable

import torch

from .backends.sim import SimAborted, SimBackend, SimWorld
from .mesh import Mesh
from .torch_private import compile_cache_limits
from .runtime import DeviceContext, current_context, set_process_context, thread_context


class DeviceError(RuntimeError):
    """A device failed; names its rank and mesh coordinates."""

    def __init__(self, rank: int, coords: dict[str, int], exc: BaseException, tb: str = ""):
        where = ", ".join(f"{a}={i}" for a, i in coords.items())
        super().__init__(f"device {rank} ({where}) failed: {type(exc).__name__}: {exc}"
                         + (f"\n--- traceback on device {rank} ---\n{tb}" if tb else ""))
        self.rank, self.coords, self.original = rank, coords, exc


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(fn: Callable[[], Any], mesh: Mesh, *, simulate: bool | None = None,
           processes: bool = False, timeout: float = 300.0) -> Any:
    """Run ``fn()`` on every device of ``mesh``.

    - ``simulate=True`` (the default outside torchrun): one thread per device in this process,
      with exact collective semantics; returns the results in rank order. A failure on any
      device stops all of them and raises :class:`DeviceError` naming the rank.
    - under ``torchrun`` (``simulate=False``): this process is one rank (gloo on CPU, NCCL on
      CUDA); returns this rank's result.
    - ``processes=True``: fork one gloo process per device on this machine; returns the results
      in rank order (they must be picklable).
    """
    if processes:
        return _launch_processes(fn, mesh, timeout)
    if simulate is None:
        simulate = not under_torchrun()
    if simulate:
        return _launch_threads(fn, mesh, timeout)
    return _launch_distributed(fn, mesh)


def _launch_threads(fn, mesh: Mesh, timeout: float) -> list:
    if current_context(required=False) is not None:
        raise RuntimeError("functional_pp.launch cannot be nested inside another launch")
    world = SimWorld(mesh.size, timeout)
    results: list = [None] * mesh.size
    errors: list = [None] * mesh.size

    def run(rank: int) -> None:
        ctx = DeviceContext(mesh, rank, SimBackend(world, rank), simulated=True)
        with thread_context(ctx), _compile_cache_limits(mesh.size):
            try:
                results[rank] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below with the rank
                errors[rank] = (exc, traceback.format_exc())
                world.abort(rank, exc)

    from .backends.sim import _unregister
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [threading.Thread(target=run, args=(r,), name=f"fpp-device-{r}", daemon=True)
                   for r in range(mesh.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
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


def _compile_cache_limits(n_devices: int):
    """Simulated devices share one process: torch.compile keeps one graph per device (each
    has its own rank baked in) and per training step built in the process, so allow many
    entries per function. Dynamo's settings are thread-local: each device thread sets its own."""
    return compile_cache_limits(8 * n_devices + 64)


def _launch_distributed(fn, mesh: Mesh):
    import torch.distributed as dist

    from .backends.dist import DistBackend

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    mesh.validate_world_size(dist.get_world_size())
    rank = dist.get_rank()
    ctx = DeviceContext(mesh, rank, DistBackend(mesh, rank), simulated=False)
    set_process_context(ctx)
    try:
        return fn()
    finally:
        set_process_context(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_main(fn, mesh: Mesh, rank: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(mesh.size), LOCAL_RANK=str(rank))
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", rank=rank, world_size=mesh.size)
        result = _launch_distributed(fn, mesh)
        try:
            payload = pickle.dumps((True, result, ""))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"the launched function's result cannot be pickled ({exc}); return "
                            f"tensors, numbers or other picklable values") from exc
    except BaseException as exc:  # noqa: BLE001
        payload = pickle.dumps((False, repr(exc), traceback.format_exc()))
    try:
        _write_result(outdir, rank, payload)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        os._exit(0)


def _write_result(outdir: str, rank: int, payload: bytes) -> None:
    """Results travel as files written whole and then renamed, by value (plain pickle): the
    parent never reads a partial result, and no tensor is shared through a file descriptor
    that vanishes with this process (docs/real_processes.md)."""
    tmp = os.path.join(outdir, f"{rank}.tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, os.path.join(outdir, f"{rank}.pkl"))


def _launch_processes(fn, mesh: Mesh, timeout: float) -> list:
    import multiprocessing as mp
    import shutil
    import tempfile

    ctx = mp.get_context("fork")
    outdir = tempfile.mkdtemp(prefix="fpp-launch-")
    port = _free_port()
    procs = [ctx.Process(target=_process_main, args=(fn, mesh, r, port, outdir), daemon=True)
             for r in range(mesh.size)]
    for p in procs:
        p.start()
    results: list = [None] * mesh.size
    pending = set(range(mesh.size))
    deadline = time.monotonic() + timeout
    try:
        while pending:
            # read exit states first: a process writes its result before it exits
            exited = {r for r in pending if procs[r].exitcode is not None}
            arrived = [(os.path.getmtime(path), r, path) for r in pending
                       if os.path.exists(path := os.path.join(outdir, f"{r}.pkl"))]
            for _, rank, path in sorted(arrived):        # the earliest failure is the cause
                with open(path, "rb") as f:
                    ok, value, tb = pickle.load(f)
                if not ok:
                    raise DeviceError(rank, mesh.coords(rank), RuntimeError(value), tb)
                results[rank] = value
                pending.discard(rank)
            for rank in sorted(exited & pending):
                raise DeviceError(rank, mesh.coords(rank), RuntimeError(
                    f"its process exited with code {procs[rank].exitcode} without a result "
                    f"(killed, out of memory, or crashed)"))
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"processes did not finish within {timeout:.0f}s: ranks "
                                   f"{sorted(pending)} never returned")
            if pending:
                time.sleep(0.05)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(outdir, ignore_errors=True)
    return results
