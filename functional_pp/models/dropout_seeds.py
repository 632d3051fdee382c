"""The decoder's dropout seeds: one per training forward, one per layer and call site from it.

transformers applies ``attention_dropout`` (and ``residual_dropout`` / ``embedding_dropout`` of
Seed-OSS, StarCoder 2, ...) in training only:
here a forward trains when gradients are enabled and no key / value cache samples (evaluation and
generation run under ``torch.no_grad``). Each training forward takes the next number of a counter
kept with the device's context (a new launch starts at 0; one device outside a launch counts per
thread), so every device of a layout counts the same forwards and, with the layer's index, hashes
the same masks as one device (``ops.keep_mask.keep_mask``). A training loop names its step
(:func:`begin_step`): the count restarts within it, so a resumed run draws the masks of the
uninterrupted one. The seed is a host number: under a
compiled step it would be traced as a constant, so dropout there is refused by name, as under a
pipeline (its stages' probe forwards would count apart from one device's)."""
from __future__ import annotations

import torch

from functional_pp._torch import is_tracing
from functional_pp.core.runtime import per_thread
from functional_pp.core.runtime import current_context
from functional_pp.parallel.pipeline.stage import current_stage

_outside = per_thread("models.dropout_seeds")
_KEY, _STEP = "dropout_forwards", "dropout_step"
_PER_STEP = 1 << 16            # (forwards of one step: micro-batches, a preference loss's passes)
#: the call sites of a layer: attention's probabilities, the attention's and the MLP's outputs;
#: the embedding's output is site EMBEDDING of layer 0 (a site no layer uses)
EMBEDDING, ATTENTION, ATTENTION_OUT, MLP_OUT = 0, 1, 2, 3


def forward_seed(attention_dropout: float, residual_dropout: float, cached: bool,
                 embedding_dropout: float = 0.0) -> int | None:
    """The seed of this forward's dropout masks, or None when it applies none (every rate 0,
    gradients off, or sampling with a cache: ``cached``)."""
    if not (attention_dropout or residual_dropout or embedding_dropout) or cached or not torch.is_grad_enabled():
        return None
    what = f"attention_dropout={attention_dropout}, residual_dropout={residual_dropout}"
    what += f", embedding_dropout={embedding_dropout}" if embedding_dropout else ""
    return _next_seed(f"dropout ({what})", "mask seed", "the dropout to 0.0")


def noise_seed(what: str) -> int:
    """The count of this training forward for random draws other than dropout (``what`` names
    them: the diffusion objective's masks, models/diffusion_lm.py): taken from the same counter as
    :func:`forward_seed`, so every layout and a resumed run draw the same; refused under a compiled
    step and a pipeline for the same reasons."""
    return _next_seed(what, "seed", None)


def _next_seed(what: str, seed: str, instead: str | None) -> int:
    """The next forward's seed of this step; ``what`` refused by name (``instead``: what else to set
    to do without it) under a compiled step (its ``seed`` advances on the host) and under pipeline stages."""
    if is_tracing():
        raise ValueError(f"{what} under a compiled step is not supported (its {seed} advances on the host every "
                         f"forward); set compile: false (torch_compile: false){f' or {instead}' if instead else ''}")
    if current_stage() is not None:
        raise ValueError(f"{what} under pipeline parallelism (pp) is not supported yet; use FSDP, TP or CP "
                         f"(pp_size 1){f' or set {instead}' if instead else ''}")
    store = _store()
    n = store.get(_KEY, 0)
    store[_KEY] = n + 1
    return store.get(_STEP, 0) * _PER_STEP + n


def begin_step(step: int) -> None:
    """The forwards that follow belong to training step ``step`` (the loop's count, which a resumed
    run continues): their seeds depend on it and on their order within it, not on the forwards
    this process ran before."""
    store = _store()
    store[_STEP], store[_KEY] = int(step), 0


def _store() -> dict:
    ctx = current_context(required=False)
    return _outside.__dict__ if ctx is None else ctx.extras


def site_seed(forward: int, layer: int, site: int) -> int:
    """The seed of one call site (:data:`ATTENTION`, ...) of layer ``layer`` in forward ``forward``."""
    return (forward * 1_000_003 + layer) * 4 + site
