"""A key / value cache for sampling from a model's pure function (docs/generation.md): while a
:class:`KVCache` is active (:func:`caching`), each forward of the decoder continues the
sequences it holds: positions start after the cached tokens, each attention layer's keys and
values are the cached ones followed by the new tokens', and the cache keeps them for the next
forward. The first forward (the prompt) attends causally; a later one feeds one new token per
row, which sees every cached key. The model's code calls :func:`active` at two places
(``models/llama.py``: the positions, the keys and values); nothing else changes."""
from __future__ import annotations

import contextlib
from typing import Iterator

from functional_pp import ops
from functional_pp.core.runtime import per_thread
from functional_pp.parallel.named import Named

__all__ = ["KVCache", "caching", "active"]

_local = per_thread("models.kv_cache")         # simulated devices are threads: a cache each


class KVCache:
    """The keys and values of every attention layer for the tokens seen so far (``offset``)."""

    def __init__(self) -> None:
        self.layers: list[tuple[Named, Named]] = []
        self.offset = 0
        self._layer = 0
        self._new = 0

    def start(self, positions: Named, new_tokens: int) -> Named:
        """A forward of ``new_tokens`` begins: its positions, after the cached tokens."""
        if self.offset and new_tokens != 1:
            raise ValueError(f"KVCache: a forward after the prompt feeds one token per row, got {new_tokens}")
        self._layer, self._new = 0, new_tokens
        return positions if self.offset == 0 else positions + self.offset

    def extend(self, k: Named, v: Named) -> tuple[Named, Named, bool]:
        """The next layer's keys and values with the cached ones before them, and whether its
        attention is causal (the prompt's) or sees every key (a new token's)."""
        i = self._layer
        self._layer += 1
        if i < len(self.layers):
            pk, pv = self.layers[i]
            k, v = ops.concat([pk, k], "seq"), ops.concat([pv, v], "seq")
            self.layers[i] = (k, v)
            return k, v, False
        self.layers.append((k, v))
        return k, v, True

    def finish(self) -> None:
        """The forward ended: its tokens are cached."""
        self.offset += self._new


def active() -> KVCache | None:
    """The cache of the running forward (None: a plain forward)."""
    return getattr(_local, "cache", None)


@contextlib.contextmanager
def caching(cache: KVCache) -> Iterator[KVCache]:
    """Forwards inside continue the sequences ``cache`` holds."""
    before = active()
    _local.cache = cache
    try:
        yield cache
    finally:
        _local.cache = before
