"""Range checks of token ids and labels, identical on every layout (docs/bad_inputs.md §1).

A vocabulary split across devices would otherwise turn an out-of-range id into a zero row
(embedding) or a zero logit (cross-entropy): a wrong loss and no error. The check runs on the
whole id tensor this device holds, against the *global* vocabulary size, before any split.

Eager code outside a training step raises at once. Inside a training step the check is one
fused reduction whose small summary tensor is returned with the step's metrics and raised
after the step (no host sync inside the step, traceable by ``torch.compile(fullgraph=True)``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import per_thread

_state = per_thread("ops.token_ids")
_MAX_DIMS = 4
_KINDS = {0: ("embed", "token id"), 1: ("cross_entropy", "label")}


class TokenIdError(ValueError):
    """A token id or label lies outside the vocabulary (names the id, its position and the
    vocabulary size)."""


@contextmanager
def deferred_checks() -> Iterator[list]:
    """Collect the summaries of the checks run inside (training step) instead of raising."""
    prev = getattr(_state, "pending", None)
    _state.pending = pending = []
    try:
        yield pending
    finally:
        _state.pending = prev


def defer_collected(checks: list) -> None:
    """Add checks collected by another :func:`deferred_checks` block (a natively traced
    step's, step/native_trace.py) to this thread's active list, if any."""
    pending = getattr(_state, "pending", None)
    if pending is not None:
        pending.extend(checks)


@contextmanager
def checks_apart() -> Iterator[None]:
    """Collect the checks run inside in a list of their own, added to the enclosing
    :func:`deferred_checks` list after the block (if any): a compiled function called inside
    then always starts from an empty list (one graph, not one per list length)."""
    outer = getattr(_state, "pending", None)
    with deferred_checks() as mine:
        yield
    if outer is not None:
        outer.extend(mine)


def check_ids(ids: torch.Tensor, vocab: int, kind: str, dims: Sequence[str],
              ignore_index: int | None = None) -> torch.Tensor:
    """Check that every entry of ``ids`` is in ``[0, vocab)`` (or equals ``ignore_index``);
    returns the ids to use (inside a training step bad entries are replaced by a harmless
    value so the step completes, and the error is raised right after it).

    ``kind`` is ``"embed"`` or ``"cross_entropy"``; ``dims`` names the dimensions of ``ids``
    (for the position in the message)."""
    if ids.is_meta:
        return ids      # shapes only (layout planning): there are no values to check
    code = next(c for c, (k, _) in _KINDS.items() if k == kind)
    flat = ids.reshape(-1)
    clamped = flat.clamp(0, vocab - 1)
    # the ids to use: in range as they are, else the nearest id (no ignore index) or the ignore
    # index (which is outside [0, vocab), so it is kept as it is); bad = changed by that
    # (3 ops for ids with the flag, 5 for labels; docs/eager_overhead.md)
    checked = clamped if ignore_index is None else flat.masked_fill(clamped != flat, ignore_index)
    bad = checked != flat
    pending = getattr(_state, "pending", None)
    if pending is None and is_tracing():
        return ids      # a user's own compiled function: no place to report; train_step checks
    if pending is None:
        if flat.numel() and bool(bad.any()):
            first = int(bad.to(torch.int64).argmax())
            raise TokenIdError(_message(code, int(flat[first]), _unravel(first, ids.shape), dims,
                                        vocab, ignore_index))
        return ids
    if flat.numel() == 0:
        return ids
    # bad entries replaced by harmless ones (the step raises after it completes)
    checked = checked.reshape(ids.shape)
    if not is_tracing():
        # eager: only the flag now; the position and value are looked up if it is set
        pending.append((_LazySummary(bad.any(), flat, bad, ids.shape, code, vocab, ignore_index), tuple(dims)))
        return checked
    pending.append((_summary(flat, bad, ids.shape, code, vocab, ignore_index), tuple(dims)))
    return checked


class _LazySummary:
    """A failed-check flag whose full summary (:func:`_summary`) is built only when read."""

    def __init__(self, flag: torch.Tensor, *args):
        self.flag, self.args = flag, args

    def __getitem__(self, i):
        return self.flag if i == 0 else self.tolist()[i]

    def tolist(self) -> list:
        return _summary(*self.args).tolist()


def _summary(flat: torch.Tensor, bad: torch.Tensor, shape, code: int, vocab: int, ignore_index: int | None):
    """One int64 vector: failed?, kind, the first bad value, vocabulary, ignore index, its position."""
    first = bad.to(torch.int64).argmax()
    value = flat.gather(0, first.unsqueeze(0)).squeeze(0).to(torch.int64)
    coords = [(first // _stride(shape, d)) % shape[d] for d in range(len(shape))]
    coords += [torch.zeros_like(first)] * (_MAX_DIMS - len(coords))
    ignore = ignore_index if ignore_index is not None else -(2 ** 62)
    const = lambda v: torch.full((), v, dtype=torch.int64, device=flat.device)  # noqa: E731
    return torch.stack([bad.any().to(torch.int64), const(code), value, const(vocab), const(ignore),
                        *[c.to(torch.int64) for c in coords[:_MAX_DIMS]]])


def raise_if_bad(summaries: list[tuple[torch.Tensor, tuple[str, ...]]]) -> None:
    """Raise :class:`TokenIdError` for the first failed summary of :func:`deferred_checks`."""
    message = bad_id_message(summaries)
    if message is not None:
        raise TokenIdError(message)


def bad_id_message(summaries: list[tuple[torch.Tensor, tuple[str, ...]]]) -> str | None:
    """The error message of the first failed summary of :func:`deferred_checks` (read from the
    device), or None when every check passed."""
    for summary, dims in summaries:
        s = summary.tolist()
        if s[0]:
            code, value, vocab, ignore = s[1], s[2], s[3], s[4]
            coords = s[5:5 + min(len(dims), _MAX_DIMS)]
            return _message(code, value, coords, dims, vocab, None if ignore == -(2 ** 62) else ignore)
    return None


def failed_flag(since: int = 0) -> torch.Tensor | None:
    """Whether a check collected by the enclosing :func:`deferred_checks` (those from index
    ``since`` on) failed, as a 0-dim bool on the device (no host read); None without checks."""
    pending = getattr(_state, "pending", None) or []
    flags = [summary.flag if isinstance(summary, _LazySummary) else summary[0] != 0
             for summary, _ in pending[since:]]
    if not flags:
        return None
    bad = flags[0]
    for flag in flags[1:]:
        bad = bad | flag        # (two checks per step, ids and labels: one op)
    return bad


def checks_so_far() -> int:
    """How many checks the enclosing :func:`deferred_checks` has collected (0 outside one)."""
    return len(getattr(_state, "pending", None) or [])


def _stride(shape: Sequence[int], d: int) -> int:
    n = 1
    for s in shape[d + 1:]:
        n *= int(s)
    return n


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    return [(flat // _stride(shape, d)) % int(shape[d]) for d in range(len(shape))]


def _message(code: int, value: int, coords: Sequence[int], dims: Sequence[str], vocab: int,
             ignore_index: int | None) -> str:
    op, what = _KINDS[code]
    where = ", ".join(f"{d} {c}" for d, c in zip(dims, coords))
    valid = f"0..{vocab - 1}" + (f" or the ignore index {ignore_index}" if ignore_index is not None else "")
    fix = ("make the model's vocabulary larger than every id (model.vocab), or fix the data / "
           "tokenizer that produced it")
    return (f"{op}: {what} {value} at position [{where}] of this device's block is outside the "
            f"vocabulary of size {vocab} (valid: {valid}); {fix}")
