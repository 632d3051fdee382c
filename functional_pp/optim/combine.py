"""Composing transformations: :func:`chain`."""
from __future__ import annotations

from typing import Any

from functional_pp.optim.base import (ALIASED, FRESH, INHERIT, GradientTransformation, PyTree, returns_fresh, transform,
                                      update_with)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations; updates flow through them left to right. The state is a tuple
    with one entry per transformation. Extra keyword arguments of ``update`` reach every
    transformation that accepts them; ``donate_updates`` reaches the first one as given and
    each later one when the updates it receives are new tensors of an earlier one
    (docs/optim.md), so a chain of foreach transformations allocates its updates once.
    ``grad_norm`` (the norm of the updates as given) reaches the first transformation only."""

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple, params: PyTree = None, *, donate_updates: bool = False,
               **extra: Any):
        if len(state) != len(transforms):
            raise ValueError(f"chain: expected a state of length {len(transforms)} (one per transformation), "
                             f"got {len(state)}")
        new_state = []
        donated = donate_updates
        for t, s in zip(transforms, state):
            updates, s = update_with(t, updates, s, params, donate_updates=donated, **extra)
            donated = returns_fresh(t, donated)
            extra.pop("grad_norm", None)     # the next transformation sees other updates
            new_state.append(s)
        return updates, tuple(new_state)

    def fresh_after_all(donated: bool) -> bool:
        for t in transforms:
            donated = returns_fresh(t, donated)
        return donated

    returns = FRESH if fresh_after_all(False) else INHERIT if fresh_after_all(True) else ALIASED
    return transform(init, update, returns)
