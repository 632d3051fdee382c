"""The dry run of a generation (``generate``, docs/generation.md "Memory"): one representative
device runs, on meta tensors, what a generation holds at its peak under a layout: its shards of
the parameters, the prompt's forward filling a static key / value cache of prompt + new tokens
(what ``generate(compile=...)`` allocates; an eager ``generate``'s cache grows to one position
fewer) and one new token's forward over it. The peak is measured by the dry run's memory
tracker (plan/tracker.py), the same accounting that measures a real call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

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

__all__ = ["GenerationEstimate", "estimate_generation", "generation_forwards"]


@dataclass
class GenerationEstimate:
    """One device's memory for a generation of ``batch`` rows of ``prompt`` + ``new_tokens``
    positions: ``param_bytes`` (its shards of the weights), ``cache_bytes`` (the keys and values
    of every position, :func:`functional_pp.models.kv_cache.cache_bytes`) and ``peak_bytes`` (the
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

    @property
    def forward_bytes(self) -> int:
        """What the peak holds beyond weights and cache: one forward's temporaries."""
        return self.peak_bytes - self.param_bytes - self.cache_bytes


def generation_forwards(forward: Callable[[Any, Named], Named], params: Any, prompts: Named, new_tokens: int,
                        ) -> KVCache:
    """The forwards a generation's peak is made of: ``prompts`` (``batch seq``) through
    ``forward`` filling a static cache of prompt + ``new_tokens`` positions, then one new token's
    forward over it (each forward's last logits gathered whole, as ``generate`` does); returns
    the cache. Run on meta tensors by :func:`estimate_generation`, on real ones to measure."""
    length = prompts.size("seq")
    left_pad = named(torch.zeros(prompts.size("batch"), dtype=torch.int64, device=prompts.data.device), "batch")
    cache = KVCache(left_pad, capacity=length + new_tokens)
    with torch.no_grad():
        with caching(cache):
            last_logits(forward(params, prompts))
        step = KVCache.decoding(cache.layers, torch.tensor(length, device=prompts.data.device), left_pad,
                                length + new_tokens)
        with caching(step):
            last_logits(forward(params, Named(prompts.data.narrow(prompts.dims.index("seq"), 0, 1), prompts.dims,
                                              prompts.split)))
    return step


def estimate_generation(forward: Callable[[Any, Named], Named], decls: Any, mesh: Mesh, rules: Rules, *,
                        batch: int, prompt: int, new_tokens: int, rank: int = 0) -> GenerationEstimate:
    """The memory of one device (``rank``) generating ``new_tokens`` after prompts of ``batch``
    rows of ``prompt`` positions (padding included) with ``forward`` (e.g.
    ``functools.partial(llama.forward, cfg=cfg)``) over parameters declared by ``decls``, laid
    out by ``rules`` on ``mesh``. Runs
    the forwards on meta tensors (nothing allocated); the layout is checked first."""
    if batch < 1 or prompt < 1 or new_tokens < 1:
        raise ValueError(f"estimate_generation: batch, prompt and new_tokens must be >= 1, got {batch}, {prompt}, "
                         f"{new_tokens}")
    rules.check(mesh)
    with representative_device(mesh, rank), use_rules(rules):
        params = map_with_path(lambda p, d: _meta_param(d, rules, mesh, p).replace(is_param=True), decls)
        prompts = _meta_named_batch({"tokens": ((batch, prompt), "batch seq")}, rules, mesh)["tokens"]
        leaves = [x.data for x in _leaves(params)]
        weights = _nbytes(leaves)
        tracker = MemoryTracker({"weights": weights}, leaves, timeline=False)
        with tracker:
            cache = generation_forwards(forward, params, prompts, new_tokens)
    return GenerationEstimate(mesh, rules, batch, prompt, new_tokens, weights, cache.nbytes(),
                              tracker.run.peak_bytes, dict(tracker.run.peak_breakdown))


def _leaves(params) -> list[Named]:
    import optree
    return [x for x in optree.tree_leaves(params) if isinstance(x, Named)]
