"""A key / value cache for sampling from a model's pure function (docs/generation.md): while a
:class:`KVCache` is active (:func:`caching`), each forward of the decoder continues the
sequences it holds: positions start after the cached tokens, each attention layer's keys and
values are the cached ones followed by the new tokens', and the cache keeps them for the next
forward. The first forward (the prompt) attends causally; a later one feeds one new token per
row, which sees every cached key. The model's code calls :func:`active` at two places
(``models/llama.py``: the positions, the keys and values); nothing else changes.

Prompts of different lengths share one batch left-padded (``KVCache(left_pad=...)``): each
row's positions count from its first real token and its padding keys are masked, in the
prompt's forward and in every later one (segment ids of ``ops.attention``: 1 a real token, 0
padding, so a real query sees only real keys), as transformers with ``padding_side="left"``.

A static cache (``KVCache(capacity=n)``, a compiled decode step's: docs/generation.md) holds
every layer's keys and values in buffers of ``n`` positions from the prompt's forward on; a
later forward (:meth:`KVCache.decoding`, its position a 0-dim tensor) writes its token's keys
and values at that position and attends over the whole buffer with the positions not yet
written masked (key segment 0), so every token's forward has the same shapes and its position
is a value, not a constant: one compiled graph serves every new token."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from functional_pp import ops
from functional_pp.core.runtime import per_thread
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

__all__ = ["KVCache", "caching", "active", "cache_bytes"]

_local = per_thread("models.kv_cache")         # simulated devices are threads: a cache each


class KVCache:
    """The keys and values of every attention layer for the tokens seen so far (``offset``)."""

    def __init__(self, left_pad: Named | None = None, capacity: int | None = None) -> None:
        """``left_pad`` (``batch``): each row's padding tokens before its prompt (None: none);
        ``capacity``: a static cache's positions (prompt, padding and new tokens; None: the
        cache grows by one position per forward)."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"KVCache: capacity must be >= 1 positions, got {capacity}")
        self.layers: list[tuple[Named, Named]] = []
        self.offset = 0
        self.left_pad = left_pad
        self.capacity = capacity
        self.position: torch.Tensor | None = None    # a static cache's decode step: where its token goes
        self._layer = 0
        self._new = 0
        self._segments: tuple[Named, Named] | None = None

    @classmethod
    def decoding(cls, layers: list[tuple[Named, Named]], position: torch.Tensor, left_pad: Named | None,
                 capacity: int) -> "KVCache":
        """A static cache's decode step: ``layers`` (each ``capacity`` positions, the prompt's
        forward's buffers or the last step's) and ``position`` (0-dim ``int64``: the new token's
        index in them, every position before it written)."""
        cache = cls(left_pad, capacity)
        cache.layers, cache.position = list(layers), position
        return cache

    def end(self, new_tokens: int) -> int:
        """One past the last position a forward of ``new_tokens`` reaches (a static cache's
        decode step: at most its capacity less one, the last new token being drawn, never fed)."""
        return self.capacity - 1 if self.position is not None else self.offset + new_tokens

    def start(self, positions: Named, new_tokens: int) -> Named:
        """A forward of ``new_tokens`` begins: its positions, after the cached tokens (with
        ``left_pad``: ``seq batch``, each row's counted from its first real token, 0 on padding)."""
        if (self.offset or self.position is not None) and new_tokens != 1:
            raise ValueError(f"KVCache: a forward after the prompt feeds one token per row, got {new_tokens}")
        if self.capacity is not None and self.position is None and new_tokens > self.capacity:
            raise ValueError(f"KVCache: the prompt's {new_tokens} positions exceed the static cache's capacity "
                             f"{self.capacity}; make it prompt + max_new_tokens positions")
        self._layer, self._new = 0, new_tokens
        if self.position is not None:                    # a static cache's step: its keys are the buffers'
            position = self.position
            pos = positions.map(lambda t: t + position)
            left_pad = self.left_pad if self.left_pad is not None else named(
                torch.zeros(self.layers[0][0].size("batch"), dtype=torch.int64, device=positions.data.device),
                "batch")
            keys = ops.positions("seq", self.capacity, device=positions.data.device)
            written = keys.map(lambda t: (t <= position).to(torch.int64))
            self._segments = (_real(pos - left_pad), _real(keys - left_pad) * written)
            return (pos - left_pad).map(lambda t: t.clamp_min(0))
        pos = positions if self.offset == 0 else positions + self.offset
        if self.left_pad is None:
            return pos
        keys = ops.positions("seq", self.offset + new_tokens, device=positions.data.device)
        self._segments = (_real(pos - self.left_pad), _real(keys - self.left_pad))
        return (pos - self.left_pad).map(lambda t: t.clamp_min(0))

    def extend(self, k: Named, v: Named, segments: Named | None = None, window: int | None = None
               ) -> tuple[Named, Named, bool, Named | None, Named | None, int | None]:
        """The next layer's keys and values with the cached ones before them, whether its
        attention is causal (the prompt's) or sees every key (a new token's), the queries'
        and the keys' segment ids for ``ops.attention`` (``segments``, None; with ``left_pad``
        1 on real tokens and 0 on padding, the keys' None when they are the queries'), and the
        window ``ops.attention`` still has to apply: a new token's sliding ``window`` (the
        layer's) is the keys' segment 0 on the cached positions ``window`` or more before it,
        as transformers' sliding cache, and None is returned for it."""
        k, v, causal, queries, keys = self._extend(k, v, segments)
        if window is None or causal:
            return k, v, causal, queries, keys, window
        now = self.position if self.position is not None else self.offset
        n = k.size("seq")
        inside = ops.positions("seq", n, device=k.data.device).map(lambda t: (t > now - window).to(torch.int64))
        if keys is None:                                  # no padding: every query and key real
            rows = named(torch.zeros(k.size("batch"), dtype=torch.int64, device=k.data.device), "batch")
            queries = _real(ops.positions("seq", 1, device=k.data.device) - rows)
            keys = _real(ops.positions("seq", n, device=k.data.device) - rows)
        keys = keys * inside
        return k, v, causal, queries, keys, None

    def _extend(self, k: Named, v: Named, segments: Named | None
                ) -> tuple[Named, Named, bool, Named | None, Named | None]:
        if self.left_pad is not None and segments is not None:
            raise ValueError("KVCache: left-padded prompts cannot also be packed (segments); give one or the other")
        i = self._layer
        self._layer += 1
        if self.position is not None:                    # a static cache's step: written at its position
            bk, bv = self.layers[i]
            k, v = _written(bk, k, self.position), _written(bv, v, self.position)
            self.layers[i] = (k, v)
            queries, keys = self._segments
            return k, v, False, queries, keys
        if self.capacity is not None:                    # a static cache's prompt: buffers of capacity
            self.layers.append((_padded(k, self.capacity), _padded(v, self.capacity)))
            causal = True
        elif i < len(self.layers):
            pk, pv = self.layers[i]
            k, v = ops.concat([pk, k], "seq"), ops.concat([pv, v], "seq")
            self.layers[i] = (k, v)
            causal = False
        else:
            self.layers.append((k, v))
            causal = True
        if self._segments is None:
            return k, v, causal, segments, None
        queries, keys = self._segments
        return k, v, causal, queries, None if causal else keys

    def prompt_padding(self) -> Named | None:
        """Each row's left padding (``batch``) while the prompt's forward runs (None after it, or
        without padding): what a per-sequence computation (experts' capacity) must leave out."""
        return self.left_pad if self.offset == 0 and self.position is None else None

    def finish(self) -> None:
        """The forward ended: its tokens are cached."""
        if self.position is None:
            self.offset += self._new

    def nbytes(self) -> int:
        """The bytes of the keys and values held on this device."""
        return sum(t.data.numel() * t.data.element_size() for kv in self.layers for t in kv)


def cache_bytes(cfg, batch: int, tokens: int, dtype: torch.dtype = torch.float32, *, batch_split: int = 1,
                kv_heads_split: int = 1) -> int:
    """Bytes of the keys and values a :class:`KVCache` holds on one device for ``batch`` rows of
    ``tokens`` positions (prompt, padding included, and new tokens) of decoder config ``cfg``:
    every layer's k and v, ``[batch / batch_split, tokens, kv_heads / kv_heads_split, head_dim]``
    (each layer's own widths; latent attention's per-head keys and values padded to one width);
    ``batch_split`` the devices the rows are split over (the data axes), ``kv_heads_split`` the
    tensor-parallel size."""
    item = torch.empty((), dtype=dtype).element_size()
    rows = -(-batch // batch_split)
    total = 0
    for layer in range(cfg.layers):
        if cfg.kv_lora_rank:
            kv_heads, width = cfg.kv_heads, max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
        else:
            kv_heads, width = cfg.attn_shape(layer)
        total += 2 * rows * tokens * (kv_heads // kv_heads_split) * width * item
    return total


def _padded(x: Named, capacity: int) -> Named:
    """``x`` (keys or values) with zeros after its positions up to ``capacity`` (``seq`` whole)."""
    x = ops.concat([x], "seq")
    axis = x.dims.index("seq")
    shape = list(x.data.shape)
    shape[axis] = capacity - shape[axis]
    return Named(torch.cat([x.data, x.data.new_zeros(shape)], dim=axis), x.dims, x.split, x.vary, x.partial)


def _written(buffer: Named, x: Named, position: torch.Tensor) -> Named:
    """``buffer`` with one position's keys or values ``x`` written at ``position`` (a tensor)."""
    x = ops.concat([x], "seq")
    if tuple(x.split[x.dims.index(d)] for d in buffer.dims) != buffer.split:
        raise ValueError(f"KVCache: a step's keys {x!r} are laid out unlike the cache's {buffer!r}")
    block = x.data.permute([x.dims.index(d) for d in buffer.dims])
    return buffer.replace(data=buffer.data.index_copy(buffer.dims.index("seq"), position.reshape(1), block))


def _real(shifted: Named) -> Named:
    """1 where a position (minus its row's padding) is a real token, 0 on padding."""
    return shifted.map(lambda t: (t >= 0).to(torch.int64))


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
