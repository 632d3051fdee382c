"""One compilation for every simulated device: the first device to call a ``torch.compile``d
function compiles it while the others wait, then they run the cached graph (docs/compile.md).

Without the gate, device threads that call before the first compilation is cached each
compile (dynamo compiles under a global lock, one after the other) even when the graph does
not depend on the device."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from functional_pp._torch import cached_graph_count


class CompileGate:
    """Wraps a compiled function ``fn`` (traced from ``code``): in each launch of simulated
    devices, the first caller runs it at once; other callers wait until its graph is in
    dynamo's cache (its compilation is over, it now runs, and may wait for them in a
    collective) or its call has ended. ``call(fn, *args)``, if given, calls ``fn`` (once the
    caller may: after any wait)."""

    def __init__(self, fn: Callable[..., Any], code, call: Callable[..., Any] | None = None) -> None:
        self._fn, self._code = fn, code
        self._call = call or (lambda fn, *args: fn(*args))
        self._lock = threading.Lock()
        self._launch: Any = None           # the simulated world the gate was last opened for
        self._leader: int | None = None
        self._cached_before = 0
        self._done = threading.Event()

    def __call__(self, *args: Any) -> Any:
        me, launch = threading.get_ident(), _current_launch()
        with self._lock:
            if launch is not self._launch:          # a new launch: its devices compile again
                self._launch, self._leader, self._done = launch, None, threading.Event()
            done = self._done
            if done.is_set():
                leader = False
            elif self._leader is None:
                self._leader, self._cached_before = me, cached_graph_count(self._code)
                leader = True
            else:
                leader = self._leader == me
        if done.is_set():
            return self._call(self._fn, *args)
        if not leader:
            with _turn_given_up(launch):      # the leader compiles meanwhile
                while not done.wait(0.05):
                    if cached_graph_count(self._code) > self._cached_before:
                        break
            return self._call(self._fn, *args)
        try:
            return self._call(self._fn, *args)
        finally:
            done.set()


@contextmanager
def _turn_given_up(world: Any) -> Iterator[None]:
    """Let other simulated devices run while this one waits (devices/sim_turns.py)."""
    if world is None:
        yield
        return
    from functional_pp.core.runtime import current_context
    rank = current_context().rank
    world.turns.give(rank)
    try:
        yield
    finally:
        world.turns.take(rank)


def _current_launch() -> Any:
    """The simulated world of the running device (None outside simulated devices)."""
    from functional_pp.core.runtime import current_context
    ctx = current_context(required=False)
    return getattr(getattr(ctx, "backend", None), "world", None)
