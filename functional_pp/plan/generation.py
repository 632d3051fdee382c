"""The dry run of a generation (``generate``, docs/generation.md "Memory"): one representative
device runs, on meta tensors, what a generation holds at its peak under a layout: its shards of
the parameters, the prompt's forward filling a static key / value cache of prompt + new tokens
(what ``generate(compile=...)`` allocates) and one new token's forward over it; or, for an eager
``generate`` (a rollout's), the prompt's forward and the last new token's, whose cache grows to
prompt + new tokens - 1 positions. The peak is measured by the dry run's memory
tracker (plan/tracker.py), the same accounting that measures a real call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from functional_pp import ops
from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.tree import map_with_path
from functional_pp.models.kv_cache import KVCache, caching
from functional_pp.models.sampling import last_logits
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named
from functional_pp.parallel.shard_map import use_rules
from functional_pp.plan.device import representative_device
from functional_pp.plan.dryrun import _meta_named_batch, _meta_param, _nbytes
from functional_pp.plan.tracker import MemoryTracker

__all__ = ["GenerationEstimate", "ForwardEstimate", "estimate_generation", "estimate_forward", "dry_forwards",
           "generation_forwards"]


@dataclass
class GenerationEstimate:
    """One device's memory for a generation of ``batch`` rows of ``prompt`` + ``new_tokens``
    positions: ``param_bytes`` (its shards of the weights), ``cache_bytes`` (the keys and values
    of every position, :func:`functional_pp.models.kv_cache.cache_bytes`; ``compiled`` False: of
    one position fewer, an eager ``generate``'s) and ``peak_bytes`` (the
    highest live memory: weights, cache and one forward's temporaries, the prompt's logits
    included)."""
    mesh: Mesh
    rules: Rules
    batch: int
    prompt: int
    new_tokens: int
    param_bytes: int
    cache_bytes: int
    peak_bytes: int
    memory: dict[str, int]          # the peak by the tracker's categories
    compiled: bool = True           # a static cache (generate(compile=...)); False: an eager generate's

    @property
    def forward_bytes(self) -> int:
        """What the peak holds beyond weights and cache: one forward's temporaries."""
        return self.peak_bytes - self.param_bytes - self.cache_bytes


def generation_forwards(forward: Callable[[Any, Named], Named], params: Any, prompts: Named, new_tokens: int,
                        *, compiled: bool = True) -> KVCache:
    """The forwards a generation's peak is made of, each one's last logits gathered whole as
    ``generate`` does; returns the cache. ``compiled`` (``generate(compile=...)``): ``prompts``
    (``batch seq``) through ``forward`` filling a static cache of prompt + ``new_tokens``
    positions, then one new token's forward over it. Eager (``compiled=False``, a rollout's
    ``generate``: prompts of one length, no padding): the prompt's forward filling a cache of its
    positions, then the last new token's forward over a cache of prompt + ``new_tokens`` - 2
    positions, each layer's keys and values concatenated into one position more (the old and the
    new held together: every earlier token's forward holds less), with the last logits and the
    rows' tokens so far held as ``generate`` holds them. Run on meta tensors by
    :func:`estimate_generation`, on real ones to measure."""
    length = prompts.size("seq")
    one = Named(prompts.data.narrow(prompts.dims.index("seq"), 0, 1), prompts.dims, prompts.split)
    if not compiled:
        cache = KVCache()
        with torch.no_grad():
            with caching(cache):
                logits = last_logits(forward(params, prompts))
            if new_tokens > 1:      # held as generate holds them: the last logits, the rows' tokens so far
                tokens = prompts.data.new_zeros(prompts.size("batch"), length + new_tokens - 1)
                logits = logits.new_zeros(logits.shape)     # (a new token's: the prompt's may view all its logits)
                cache.layers = [(_grown(k, new_tokens - 2), _grown(v, new_tokens - 2)) for k, v in cache.layers]
                cache.offset = length + new_tokens - 2
                with caching(cache):
                    last_logits(forward(params, one))
                del logits, tokens
        return cache
    left_pad = named(torch.zeros(prompts.size("batch"), dtype=torch.int64, device=prompts.data.device), "batch")
    cache = KVCache(left_pad, capacity=length + new_tokens)
    with torch.no_grad():
        with caching(cache):
            last_logits(forward(params, prompts))
        step = KVCache.decoding(cache.layers, torch.tensor(length, device=prompts.data.device), left_pad,
                                length + new_tokens)
        with caching(step):
            last_logits(forward(params, one))
    return step


def _grown(x: Named, positions: int) -> Named:
    """Cached keys or values ``x`` with ``positions`` more (zeros), as many sampled tokens' would be."""
    x = ops.concat([x], "seq")
    axis = x.dims.index("seq")
    shape = list(x.data.shape)
    shape[axis] += positions
    return x.replace(data=x.data.new_zeros(shape))


def estimate_generation(forward: Callable[[Any, Named], Named], decls: Any, mesh: Mesh, rules: Rules, *,
                        batch: int, prompt: int, new_tokens: int, rank: int = 0,
                        compiled: bool = True) -> GenerationEstimate:
    """The memory of one device (``rank``) generating ``new_tokens`` after prompts of ``batch``
    rows of ``prompt`` positions (padding included) with ``forward`` (e.g.
    ``functools.partial(llama.forward, cfg=cfg)``) over parameters declared by ``decls``, laid
    out by ``rules`` on ``mesh``; ``compiled``: a static cache (``generate(compile=...)``), else
    an eager ``generate``'s growing one (:func:`generation_forwards`). Runs the forwards on meta
    tensors (nothing allocated); the layout is checked first."""
    if batch < 1 or prompt < 1 or new_tokens < 1:
        raise ValueError(f"estimate_generation: batch, prompt and new_tokens must be >= 1, got {batch}, {prompt}, "
                         f"{new_tokens}")
    weights, run, cache = dry_forwards(
        decls, mesh, rules, {"tokens": ((batch, prompt), "batch seq")},
        lambda params, ins: generation_forwards(forward, params, ins["tokens"], new_tokens, compiled=compiled), rank)
    return GenerationEstimate(mesh, rules, batch, prompt, new_tokens, weights, cache.nbytes(), run.peak_bytes,
                              dict(run.peak_breakdown), compiled)


@dataclass
class ForwardEstimate:
    """One device's memory for a no-grad pass over a batch (a rollout's scoring forward):
    ``param_bytes`` (its shards of the weights) and ``peak_bytes`` (weights, the batch's inputs
    and the pass's temporaries at their highest)."""
    param_bytes: int
    peak_bytes: int
    memory: dict[str, int]          # the peak by the tracker's categories

    @property
    def forward_bytes(self) -> int:
        """What the peak holds beyond the weights."""
        return self.peak_bytes - self.param_bytes


def estimate_forward(fn: Callable[[Any, dict[str, Named]], Any], decls: Any, mesh: Mesh, rules: Rules,
                     inputs: dict, rank: int = 0) -> ForwardEstimate:
    """The memory of one device (``rank``) running ``fn(params, batch)`` without gradients over
    parameters declared by ``decls`` and a batch of ``inputs`` (key -> (global shape, dims[,
    dtype]), as :func:`functional_pp.plan.dryrun.estimate`'s), laid out by ``rules`` on ``mesh``,
    on meta tensors."""
    def run(params, batch):
        with torch.no_grad():
            return fn(params, batch)
    weights, tracked, _ = dry_forwards(decls, mesh, rules, inputs, run, rank)
    return ForwardEstimate(weights, tracked.peak_bytes, dict(tracked.peak_breakdown))


def dry_forwards(decls: Any, mesh: Mesh, rules: Rules, inputs: dict, fn: Callable[[Any, dict[str, Named]], Any],
                 rank: int = 0) -> tuple[int, Any, Any]:
    """``(weight bytes, the tracker's DeviceRun, fn's result)`` of ``fn(params, batch)`` run by one
    device (``rank``) on meta shards of ``decls`` and of ``inputs``, laid out by ``rules`` on
    ``mesh`` (checked first); the batch is made under the tracker, as a real call makes it."""
    rules.check(mesh)
    with representative_device(mesh, rank), use_rules(rules):
        params = map_with_path(lambda p, d: _meta_param(d, rules, mesh, p).replace(is_param=True), decls)
        leaves = [x.data for x in _leaves(params)]
        weights = _nbytes(leaves)
        tracker = MemoryTracker({"weights": weights}, leaves, timeline=False)
        with tracker:
            out = fn(params, _meta_named_batch(inputs, rules, mesh))
    return weights, tracker.run, out


def _leaves(params) -> list[Named]:
    import optree
    return [x for x in optree.tree_leaves(params) if isinstance(x, Named)]
