"""A model of PyTorch's CUDA caching allocator: the bytes a step *reserves* (what
``torch.cuda.max_memory_reserved`` and torchtitan's logged memory report), not only those it
holds (docs/planning.md, "Reserved memory").

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` with its default settings:

* a request is rounded up to a multiple of 512 bytes (at least 512);
* requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
  from the large pool, whose segments are 20 MiB for requests under 10 MiB and the request
  rounded up to 2 MiB otherwise;
* a request takes the smallest cached free block of its pool that is large enough (best fit)
  and splits it when the rest is at least 512 bytes (small pool) or more than 1 MiB (large);
  a block not split is handed out whole;
* a freed block returns to its pool and merges with its free neighbours in the same segment;
  segments are never returned (reserved memory only grows within a step), and a request no
  free block fits allocates a new segment;
* every CUDA stream has pools of its own: a block is cached for the stream that allocated it
  and reused only by requests on that stream (``BlockPool`` is keyed by stream in the C++).
  FSDP2 allocates its all-gather outputs on its all-gather copy-in stream and its
  reduce-scatter outputs on its reduce-scatter stream, so what those buffers leave cached is
  not reused by the compute stream, nor the compute stream's blocks by them
  (:data:`COMPUTE`; plan/fsdp2.py replays those buffers).

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which
torchtitan's launcher sets) each pool of each stream is one segment that grows at its end:
a request no free block fits takes the free block at the segment's end, if there is one, and
maps as many more pages as it lacks (2 MiB pages for the small pool, 20 MiB for the large);
any rest of at least 512 bytes is split off, and a freed block merges with its neighbours as
before. So blocks freed in the middle are reused by whatever fits, and the end grows only by
what is missing: far less is cached unused than with a segment per large request.

What the model leaves out: ``max_split_size_mb`` and the release of cached segments (or, with
expandable segments, their pages) when ``cudaMalloc`` fails."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20          # requests up to 1 MiB use the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20         # for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
#: the default (compute) stream
COMPUTE = "compute"


def rounded(nbytes: int) -> int:
    """The block size the allocator hands out for a request of ``nbytes``."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment ``cudaMalloc``'d for a rounded request no cached block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    small: bool                  # in the small pool (its segment is 2 MiB of small requests)
    stream: str = COMPUTE        # the stream whose pools the block belongs to
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """Replays allocations and frees (by key) through the caching allocator's rules and
    tracks reserved bytes and their peak, in all and per stream."""

    def __init__(self, expandable_segments: bool = False) -> None:
        self.expandable = expandable_segments
        self._ends: dict[tuple[str, bool], _Block] = {}   # expandable: (stream, small) -> its segment's last block
        self._free: dict[tuple[str, bool], list] = {}   # (stream, small pool?): sorted keys of free blocks
        self._blocks: dict[tuple, _Block] = {}      # key of a free block -> block
        self._live: dict[object, _Block] = {}
        self._segments = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.reserved_by_stream: dict[str, int] = {}

    def malloc(self, key: object, nbytes: int, stream: str = COMPUTE) -> None:
        """Allocate ``nbytes`` for ``key`` (a tensor's storage) on ``stream``."""
        size = rounded(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._free.setdefault((stream, small), [])
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = self._blocks.pop(pool.pop(i))
        elif self.expandable:
            block = self._expand(stream, small, size)
        else:
            block = _Block(self._segments, 0, self._reserve(stream, segment_size(size)), small, stream=stream)
            self._segments += 1
        rest = block.size - size
        if rest >= MIN_BLOCK if small or self.expandable else rest > SMALL_REQUEST:
            tail = _Block(block.segment, block.offset + size, rest, small, block.stream, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            elif self.expandable:
                self._ends[(stream, small)] = tail
            block.next, block.size = tail, size
            self._cache(tail)
        block.free = False
        self._live[key] = block

    def _reserve(self, stream: str, nbytes: int) -> int:
        self.reserved += nbytes
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return nbytes

    def _expand(self, stream: str, small: bool, size: int) -> _Block:
        """Grow the pool's expandable segment at its end by the pages ``size`` lacks beyond the
        free block there (if any); that block, grown, is the new one."""
        end = self._ends.get((stream, small))
        have = end.size if end is not None and end.free else 0
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        grown = self._reserve(stream, -(-(size - have) // page) * page)
        if have:
            self._uncache(end)
            end.size += grown
            return end
        if end is None:
            block = _Block(self._segments, 0, grown, small, stream=stream)
            self._segments += 1
        else:
            block = _Block(end.segment, end.offset + end.size, grown, small, stream, True, end)
            end.next = block
        self._ends[(stream, small)] = block
        return block

    def free(self, key: object) -> None:
        """Return ``key``'s block to its pool, merged with its free neighbours."""
        block = self._live.pop(key, None)
        if block is None:
            return
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._uncache(other)
        end = (block.stream, block.small)
        if block.prev is not None and block.prev.free:
            if self._ends.get(end) is block:
                self._ends[end] = block.prev
            block = _absorb(block.prev, block)
        if block.next is not None and block.next.free:
            if self._ends.get(end) is block.next:
                self._ends[end] = block
            block = _absorb(block, block.next)
        self._cache(block)

    def _cache(self, block: _Block) -> None:
        k = block.key()
        self._blocks[k] = block
        bisect.insort(self._free.setdefault((block.stream, block.small), []), k)

    def _uncache(self, block: _Block) -> None:
        k = block.key()
        self._blocks.pop(k, None)
        pool = self._free[(block.stream, block.small)]
        i = bisect.bisect_left(pool, k)
        if i < len(pool) and pool[i] == k:
            pool.pop(i)


def _absorb(left, right):
    """``right`` merged into its free neighbour ``left`` (one segment's adjacent blocks); ``left``."""
    left.size += right.size
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
    return left
