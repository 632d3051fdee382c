"""Axolotl's ``dataset_exact_deduplication``: a row equal to an earlier one (the same tokens and
the same trained positions) is left out and counted. One mechanism for language-model rows,
preference pairs and KTO completions."""
from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["ExactDuplicates"]


class ExactDuplicates:
    """Remembers a digest of each row seen; :meth:`is_repeat` says whether a row was seen before
    (and counts it). ``enabled=False``: nothing is a repeat (and nothing is remembered)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.count = 0
        self._seen: set[bytes] = set()

    def is_repeat(self, *parts: Any) -> bool:
        """``parts``: the row's token lists (and labels / masks); True when an equal row was seen."""
        if not self.enabled:
            return False
        h = hashlib.sha256()
        for p in parts:
            h.update(repr(None if p is None else [int(x) for x in p] if not isinstance(p, (str, bool, int))
                          else p).encode())
            h.update(b"\x00")
        key = h.digest()
        if key in self._seen:
            self.count += 1
            return True
        self._seen.add(key)
        return False
