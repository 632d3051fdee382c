"""Sampling from a model's pure function (docs/generation.md): ``forward(params, tokens)`` giving
logits (batch seq vocab) is run once over the prompts and then once per new token, with a
key / value cache (:mod:`functional_pp.models.kv_cache`) so that each step computes only the new
token. Greedy (``temperature`` 0) or sampled with transformers' temperature, top-k and top-p
filters, in that order; rows stop at ``eos_id`` (then padded with ``pad_id``), all of them at
``max_new_tokens``. Prompts of different lengths go in one batch left-padded with an
``attention_mask`` (:func:`left_padded` makes both), as transformers' ``padding_side="left"``.

Under a layout (inside :func:`functional_pp.launch`), the same code runs on every device: the
prompts are laid out by the rules as a training batch is, the last position's logits are
gathered whole (batch and vocabulary) so every device draws the same next tokens from the same
seeded generators (one for the batch, or one per row: a row's tokens then do not depend on the
rows beside it).

``compile=True`` (or a backend name) runs each new token's forward as one ``torch.compile``
graph over a static cache (:meth:`KVCache.decoding`: buffers of prompt + ``max_new_tokens``
positions, the step's position a tensor), so the graph compiled for the first new token serves
every later one; the prompt's forward runs eagerly."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from functional_pp import ops
from functional_pp.compile.backend import graph_backend
from functional_pp.compile.gate import CompileGate
from functional_pp.compile.recompute import reset_region_ids
from functional_pp._torch import compile_backend_names, compile_cache_limits
from functional_pp.models.kv_cache import KVCache, caching
from functional_pp.parallel.fsdp.regather import relayout
from functional_pp.parallel.named import Named
from functional_pp.parallel.reshard import named

__all__ = ["check_compile", "filtered_logits", "generate", "last_logits", "left_padded"]


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


def last_logits(logits: Named) -> torch.Tensor:
    """The last position's logits, whole on this device (``[batch, vocab]``)."""
    last = ops.take(logits, "seq", -1)
    return relayout(last, tuple(() for _ in last.dims), "generate").value().permute(
        last.dims.index("batch"), last.dims.index("vocab"))


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, attention_mask)``, both ``[batch, longest]``: each prompt's token ids after
    ``pad_id`` padding (mask 0) up to the longest prompt's length."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"left_padded: give one or more prompts of at least one token each (lengths "
                         f"{[len(p) for p in prompts]})")
    n = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), n), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, n - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, n - len(p):] = 1
    return tokens, mask


def _left_pad_counts(attention_mask: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each row's padding tokens (``[batch]``), the mask checked: 0s then 1s, at least one 1."""
    if tuple(attention_mask.shape) != shape:
        raise ValueError(f"attention_mask must have the prompts' shape {shape}, got {tuple(attention_mask.shape)}")
    m = attention_mask.detach().cpu().long()
    if ((m != 0) & (m != 1)).any():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a prompt's token)")
    bad = ((m[:, 1:] < m[:, :-1]).any(1) | (m[:, -1] == 0)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"attention_mask rows {bad} are not left-padded prompts (0s, then at least one 1): pad "
                         f"on the left (left_padded(), or a tokenizer with padding_side='left')")
    return (m == 0).sum(1)


def _generators(seed: int | Sequence[int], rows: int) -> list[torch.Generator]:
    """One CPU generator for the whole batch (an int ``seed``) or one per row (a seed per row)."""
    if not isinstance(seed, (Sequence, torch.Tensor)):
        return [torch.Generator(device="cpu").manual_seed(int(seed))]
    seeds = [int(s) for s in seed]
    if len(seeds) != rows:
        raise ValueError(f"seed: give one int, or one seed per row ({rows} rows), got {len(seeds)} seeds")
    return [torch.Generator(device="cpu").manual_seed(s) for s in seeds]


def _drawn(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ``[batch, vocab]``: all rows from one generator, or each
    row from its own (then a row's draw is the one it makes alone)."""
    if len(generators) == 1:
        return torch.multinomial(probs, 1, generator=generators[0]).squeeze(1)
    return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g).squeeze(1)
                      for i, g in enumerate(generators)])


def _decode_step(forward: Callable[[Any, Named], Named], params: Any, token: Named, position: torch.Tensor,
                 left_pad: Named, layers: list, capacity: int) -> tuple[torch.Tensor, list]:
    """One new token's forward over a static cache (what ``compile=`` compiles): the last
    position's logits, whole (``[batch, vocab]``), and the cache's buffers with its keys and
    values written at ``position``. ``token`` (``batch seq``) is laid out before the call, so
    the graph does not read the device's rank: simulated devices share it."""
    cache = KVCache.decoding(layers, position, left_pad, capacity)
    with caching(cache):
        logits = forward(params, token)
    return last_logits(logits), cache.layers


# graphs the compiled step may hold: one per batch and cache shape, model and layout of a process
COMPILED_DECODE_GRAPHS = 64
_compiled: dict[Any, CompileGate] = {}          # per backend: one compiled step for every call and device


def check_compile(compile: bool | str) -> None:
    """Refuse a ``compile`` that is neither a bool nor a ``torch.compile`` backend name."""
    if isinstance(compile, bool):
        return
    backends = compile_backend_names()
    if not isinstance(compile, str) or compile not in backends:
        raise ValueError(f"compile must be True, False or a torch.compile backend name ({', '.join(backends)}), "
                         f"got {compile!r}")


def decode_step(compile: bool | str) -> Callable[..., tuple[torch.Tensor, list]]:
    """:func:`_decode_step` compiled with ``compile`` (True: inductor, or a backend name; static
    shapes), shared by every ``generate`` call and simulated device."""
    gate = _compiled.get(compile)
    if gate is None:
        fn = torch.compile(_decode_step, backend=graph_backend(compile), fullgraph=True, dynamic=False)
        gate = _compiled.setdefault(compile, CompileGate(fn, _decode_step.__code__))

    def step(*args):
        reset_region_ids()               # (dynamo guards on the counter of traced regions)
        with compile_cache_limits(COMPILED_DECODE_GRAPHS):
            return gate(*args)
    return step


def generate(forward: Callable[[Any, Named], Named], params: Any, prompts: torch.Tensor, *, max_new_tokens: int,
             eos_id: int | Sequence[int] | None = None, pad_id: int | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             attention_mask: torch.Tensor | None = None, compile: bool | str = False) -> torch.Tensor:
    """``prompts`` (``[batch, length]`` token ids) followed by up to ``max_new_tokens`` new
    tokens per row (``[batch, length + n]``, ``n`` the steps taken); see the module docstring.
    ``eos_id``: one stop token or several (a chat model's EOS and its end-of-turn token);
    ``pad_id`` defaults to the first. ``attention_mask`` (``[batch, length]``, 0 on the padding
    of left-padded prompts of different lengths, 1 on their tokens; None: all 1): each row's
    positions count from its first token and no token sees the padding. ``compile``: each new
    token's forward one compiled graph (True: inductor, or a backend name such as
    ``"aot_eager"``) over a static cache of ``length + max_new_tokens`` positions; the same
    tokens as eager. ``seed``: one generator for the batch, or one seed per row (each row draws
    from its own generator: its tokens do not depend on the rows sampled beside it)."""
    if prompts.dim() != 2 or prompts.size(1) == 0:
        raise ValueError(f"prompts must be [batch, length] token ids with length >= 1, got {tuple(prompts.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_compile(compile)
    pads = None if attention_mask is None else _left_pad_counts(attention_mask, tuple(prompts.shape))
    generators = _generators(seed, prompts.size(0))
    stops = None if eos_id is None else torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id))
    pad = pad_id if pad_id is not None else int(stops[0]) if stops is not None and len(stops) else 0
    out = prompts
    done = torch.zeros(prompts.size(0), dtype=torch.bool)
    capacity = prompts.size(1) + max_new_tokens if compile else None
    with torch.no_grad():
        if capacity is not None:        # every row's padding, zeros included: a static cache's step reads it
            pads = torch.zeros(prompts.size(0), dtype=torch.long) if pads is None else pads
        cache = KVCache(None if pads is None or not pads.any() and capacity is None
                        else named(pads.to(prompts.device), "batch"), capacity)
    step_fn = decode_step(compile) if compile else None
    with torch.no_grad(), caching(cache):
        logits = last_logits(forward(params, named(prompts, "batch seq")))
        for step in range(max_new_tokens):
            last = logits.float().cpu()
            if temperature == 0:
                nxt = last.argmax(dim=-1)
            else:
                probs = filtered_logits(last, temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)
                nxt = _drawn(probs, generators)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            out = torch.cat([out, nxt[:, None].to(device=out.device, dtype=out.dtype)], dim=1)
            if stops is not None:
                done |= torch.isin(nxt, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            token = nxt[:, None].to(prompts.dtype).to(prompts.device)
            if step_fn is None:
                logits = last_logits(forward(params, named(token, "batch seq")))
            else:
                position = torch.tensor(prompts.size(1) + step, device=prompts.device)
                logits, cache.layers = step_fn(forward, params, named(token, "batch seq"), position, cache.left_pad,
                                               cache.layers, capacity)
    return out
