"""In-place buffer reuse in a compiled step that writes its donated state (docs/compile.md
"Buffer reuse past the update").

A step with ``donate_state=True`` writes the new parameters into the graph's inputs. Inductor
orders each such write after every reader of the old value by giving the write an
ordering-only dependency (a *fake* ``WeakDep``) on the *output* of each node that read the
parameter, and it counts that write as one more user of the output. Inductor overwrites a
buffer in place only when its consumer is its last user, so no output of a matmul with a
parameter was ever reused: the logits ``x @ lm_head`` kept their 32 MiB buffer while the
cross-entropy wrote the logits' gradient into a fresh one (plain torch, whose backward graph
writes no parameter, reuses it).

The write does not read that output, so overwriting the output cannot change what the write
sees, and the order of the kernels is untouched. :func:`reuse_past_ordering_deps` makes
inductor's in-place decision disregard such users while it compiles inside the context; every
other condition of the decision (the consumer is the last real reader, same size, same index
in a fused kernel) stays inductor's."""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

_state = threading.local()
_install_lock = threading.Lock()
_installed: list[bool] = []


def ordering_only(user: Any, name: str) -> bool:
    """Whether scheduler ``user`` (an inductor ``NodeUser``) of buffer ``name`` only orders
    itself after the buffer's producer without reading the buffer: a weak user whose every
    dependency on ``name`` is a fake ``WeakDep`` (one on a view of the mutated buffer is not
    fake and still blocks the reuse)."""
    if not getattr(user, "is_weak", False):
        return False
    reads = getattr(getattr(user.node, "read_writes", None), "reads", ())
    deps = [d for d in reads if getattr(d, "name", None) == name]
    return bool(deps) and all(getattr(d, "is_fake", False) for d in deps)


def _decide_inplace_update(original):
    def decide_inplace_update(self) -> None:
        if not getattr(_state, "active", False):
            return original(self)
        scheduler = self.scheduler
        hidden = []
        for read in self.read_writes.reads:
            buf = (scheduler.name_to_donated_buffer.get(read.name)
                   or scheduler.name_to_buf.get(read.name))
            users = getattr(buf, "users", None)
            if not users:
                continue
            kept = [u for u in users if not ordering_only(u, read.name)]
            if len(kept) != len(users):
                hidden.append((buf, users))
                buf.users = kept
        try:
            return original(self)
        finally:                          # only the decision sees the shorter lists
            for buf, users in reversed(hidden):
                buf.users = users
    decide_inplace_update.__wrapped__ = original
    return decide_inplace_update


def _install() -> bool:
    """Wrap inductor's ``decide_inplace_update`` once per process (inactive outside the
    context); False, with a warning, when this torch has no such method."""
    with _install_lock:
        if not _installed:
            from torch._inductor import scheduler
            node = scheduler.BaseSchedulerNode
            original = getattr(node, "decide_inplace_update", None)
            if original is None:
                warnings.warn("functional_pp._torch.buffer_reuse: this torch's inductor has no "
                              "BaseSchedulerNode.decide_inplace_update; compiled steps with donated "
                              "state will not reuse matmul outputs in place (update _torch/buffer_reuse.py)",
                              RuntimeWarning, stacklevel=3)
                _installed.append(False)
            else:
                node.decide_inplace_update = _decide_inplace_update(original)
                _installed.append(True)
        return _installed[0]


@contextlib.contextmanager
def reuse_past_ordering_deps() -> Iterator[bool]:
    """Context for an inductor compilation on this thread: a buffer whose only other users
    are ordering-only (:func:`ordering_only`) may be overwritten in place by its last reader.
    Yields whether the reuse is in effect."""
    installed = _install()
    previous = getattr(_state, "active", False)
    _state.active = installed
    try:
        yield installed
    finally:
        _state.active = previous
