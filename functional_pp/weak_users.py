"""Inductor's in-place reuse of dying buffers in a compiled step that updates its weights in
place (docs/compile.md "Writes into dying buffers").

With ``donate_state`` the compiled step ends with ``copy_`` of every new weight into the
weight passed in. Inductor orders each such write after every kernel that read the old weight
by a *weak* (ordering-only, "fake") dependency on that kernel's output: on ``x @ w`` for every
matmul of the model. A weak user counts as a remaining use of the buffer, so a kernel in which
``x @ w`` dies cannot write its result into it in place (``decide_inplace_update``): the MLP's
backward wrote ``d gate`` into a new buffer instead of the dead ``up``, and the loss kernel the
logits' gradient into a second buffer instead of the dead logits. A plain module's backward
graph has no such writes and reuses both.

:func:`drop_ordering_only_users` removes, after fusion, the weak users whose every dependency
on the buffer is fake (the write does not read it and it is not a view of the written
buffer). The writes stay ordered: the dependency itself is kept on the writing node, and the
kernel order is fixed before code generation; buffer lifetimes already ignore fake
dependencies (inductor's memory planning)."""
from __future__ import annotations

from typing import Any


def _orders_only(user: Any, name: str) -> bool:
    """Whether scheduler-node user ``user`` of buffer ``name`` only orders after it: a weak
    user all of whose dependencies on it are fake weak dependencies."""
    from torch._inductor.dependencies import WeakDep

    if not user.is_weak or not hasattr(user.node, "read_writes"):      # (the graph's output node)
        return False
    deps = [d for d in user.node.read_writes.reads if d.name == name]
    return bool(deps) and all(isinstance(d, WeakDep) and d.is_fake for d in deps)


def drop_ordering_only_users(nodes: list[Any]) -> list[Any]:
    """Inductor scheduler nodes (after fusion, order final) with every buffer's ordering-only
    users removed from its users, so a kernel where the buffer dies may write into it."""
    for fused in nodes:
        for node in fused.get_nodes():
            for buf in node.get_outputs():
                name = buf.get_name()
                if any(_orders_only(u, name) for u in buf.users):
                    buf.users = [u for u in buf.users if not _orders_only(u, name)]
    return nodes
