"""Dynamo's settings (``torch._dynamo.config``) set for a block, on every supported torch.

torch 2.13 on keeps a setting patched with ``config.patch`` for the patching thread only;
torch 2.11's patches are process-wide, and each restores the value it found on entry. Simulated
devices are threads that patch the same settings around overlapping calls (a compiled step's
``trace_autograd_ops``, graph cache limits): there the first device to finish restored the
setting while its peers were still compiling. Where settings are process-wide
(:func:`dynamo_settings_are_thread_local` False), :func:`patch_dynamo` counts the blocks that
hold each setting: the first one in saves the value, the last one out restores it, and while
blocks overlap the setting holds the value of the latest to enter. Some settings are aliases of
others (2.11's ``cache_size_limit`` is ``recompile_limit``): a block reads every value before it
sets any, and restores in reverse order.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator


@functools.cache
def dynamo_settings_are_thread_local() -> bool:
    """Capability: whether a ``torch._dynamo.config.patch`` on one thread leaves other threads'
    settings alone (torch 2.13 on; False on 2.11). Probed once by patching on a short thread."""
    import torch._dynamo.config as dcfg

    before = dcfg.suppress_errors
    patched, release, seen = threading.Event(), threading.Event(), []

    def patcher():
        with dcfg.patch(suppress_errors=not before):
            patched.set()
            release.wait(60)

    t = threading.Thread(target=patcher)
    t.start()
    try:
        patched.wait(60)
        seen.append(dcfg.suppress_errors)
    finally:
        release.set()
        t.join(60)
    return seen[0] == before


_lock = threading.Lock()
_held: dict[str, list] = {}         # setting -> [value before the first block, blocks holding it]


@contextlib.contextmanager
def patch_dynamo(**values: Any) -> Iterator[None]:
    """Dynamo's settings ``values`` inside the block, for this thread's compilations, restored
    after it even where settings are process-wide and blocks of other threads overlap."""
    import torch._dynamo.config as dcfg

    if dynamo_settings_are_thread_local():
        with dcfg.patch(**values):
            yield
        return
    with _lock:
        found = {name: getattr(dcfg, name) for name in values}   # all before any is set: some
        for name, value in values.items():                       # names are aliases of others
            held = _held.setdefault(name, [found[name], 0])
            held[1] += 1
            setattr(dcfg, name, value)
    try:
        yield
    finally:
        with _lock:
            for name in reversed(list(values)):
                held = _held[name]
                held[1] -= 1
                if held[1] == 0:
                    setattr(dcfg, name, held[0])
                    del _held[name]
