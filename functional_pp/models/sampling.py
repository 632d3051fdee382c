"""Sampling from a model's pure function (docs/generation.md): ``forward(params, tokens)`` giving
logits (batch seq vocab) is run once over the prompts and then once per new token, with a
key / value cache (:mod:`functional_pp.models.kv_cache`) so that each step computes only the new
token. Greedy (``temperature`` 0) or sampled with transformers' temperature, top-k and top-p
filters, in that order; rows stop at ``eos_id`` (then padded with ``pad_id``), all of them at
``max_new_tokens``.

Under a layout (inside :func:`functional_pp.launch`), the same code runs on every device: the
prompts are laid out by the rules as a training batch is, the last position's logits are
gathered whole (batch and vocabulary) so every device draws the same next tokens from the same
seeded generator."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from functional_pp import ops
from functional_pp.models.kv_cache import KVCache, caching
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

__all__ = ["filtered_logits", "generate"]


def filtered_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> torch.Tensor:
    """``logits`` ``[batch, vocab]`` divided by ``temperature``, all but the ``top_k`` largest
    (0: no limit) set to -inf, then all but the smallest set of most likely tokens whose
    probability reaches ``top_p`` (transformers' ``TopPLogitsWarper``: at least one kept)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no limit), got {top_k}")
    x = logits / temperature
    if top_k:
        kth = torch.topk(x, min(top_k, x.size(-1)), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        ascending, order = torch.sort(x, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x


def _last_logits(logits: Named) -> torch.Tensor:
    """The last position's logits, whole on this device (``[batch, vocab]``)."""
    last = ops.take(logits, "seq", -1)
    return relayout(last, tuple(() for _ in last.dims), "generate").value().permute(
        last.dims.index("batch"), last.dims.index("vocab"))


def generate(forward: Callable[[Any, Named], Named], params: Any, prompts: torch.Tensor, *, max_new_tokens: int,
             eos_id: int | Sequence[int] | None = None, pad_id: int | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> torch.Tensor:
    """``prompts`` (``[batch, length]`` token ids, one length for all rows) followed by up to
    ``max_new_tokens`` new tokens per row (``[batch, length + n]``, ``n`` the steps taken); see
    the module docstring. ``eos_id``: one stop token or several (a chat model's EOS and its
    end-of-turn token); ``pad_id`` defaults to the first."""
    if prompts.dim() != 2 or prompts.size(1) == 0:
        raise ValueError(f"prompts must be [batch, length] token ids with length >= 1, got {tuple(prompts.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stops = None if eos_id is None else torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id))
    pad = pad_id if pad_id is not None else int(stops[0]) if stops is not None and len(stops) else 0
    out = prompts
    done = torch.zeros(prompts.size(0), dtype=torch.bool)
    cache = KVCache()
    with torch.no_grad(), caching(cache):
        logits = forward(params, named(prompts, "batch seq"))
        for step in range(max_new_tokens):
            last = _last_logits(logits).float().cpu()
            if temperature == 0:
                nxt = last.argmax(dim=-1)
            else:
                probs = filtered_logits(last, temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            out = torch.cat([out, nxt[:, None].to(device=out.device, dtype=out.dtype)], dim=1)
            if stops is not None:
                done |= torch.isin(nxt, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = forward(params, named(nxt[:, None].to(prompts.dtype).to(prompts.device), "batch seq"))
    return out
