"""The masked-diffusion language-model objective (LLaDA; Axolotl's ``DiffusionPlugin``,
docs/finetune.md "Diffusion language models").

Each row draws a time ``t`` uniform in [0, 1) and masks each of its maskable input tokens with
probability ``p = (1 - eps) t + eps``: a token is maskable when it is an answer token (its label
is trained: ``train_on_inputs: false`` leaves the prompt visible) and not a special token
(BOS, EOS, padding). The masked tokens are replaced by ``mask_token_id``; the model reads the
noisy row with bidirectional attention inside each document (``causal=False``, block-diagonal
by ``segments`` in packed rows) and, as Axolotl's trainer, predicts input token ``i`` from
position ``i - 1`` (the next-token logits shifted onto the inputs: position ``j``'s label is
token ``j + 1``). The loss of a row is the sum over its masked tokens of their cross-entropy,
divided by ``p`` with ``importance_weighting``, over the row's answer tokens; the loss is the
mean over the rows.

The draws are hashes of the training seed, the forward's count within its step
(:func:`functional_pp.models.dropout_seeds.noise_seed`), the row's global index and the
token's global position (:func:`functional_pp.ops.keep_mask.uniform`): every layout masks the
same tokens as one device, and a resumed run those of the uninterrupted run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from functional_pp import ops
from functional_pp.core import step_values
from functional_pp.models import dropout_seeds
from functional_pp.ops.elementwise import broadcast
from functional_pp.ops.keep_mask import uniform
from functional_pp.parallel.named import Named, settle

__all__ = ["DiffusionSpec", "diffusion_loss", "NOISE_SCHEDULES", "SAMPLING_KEYS"]

NOISE_SCHEDULES = ("linear", "cosine")
#: keys of Axolotl's sampling during training and of its chat CLI: read and checked, they do not
#: change training (no samples are generated here)
SAMPLING_KEYS = ("generate_samples", "generation_interval", "num_generation_samples", "generation_steps",
                 "generation_temperature", "generation_max_length", "num_diffusion_steps")
_WHOLE = "diffusion_seq"        # the sequence, never split: where the labels shift by one position
_TIME, _TOKENS = 0, 1          # the two draws of a forward: each row's time, each token's mask


@dataclass(frozen=True)
class DiffusionSpec:
    """Axolotl's ``diffusion:`` block (its defaults). ``noise_schedule``, ``min_mask_ratio`` and
    ``max_mask_ratio`` are checked as Axolotl checks them and, as in Axolotl's trainer, do not
    change the masking (``p = (1 - eps) t + eps``); :data:`SAMPLING_KEYS` are for sampling."""

    mask_token_id: int | None = None
    eps: float = 1e-3
    importance_weighting: bool = True
    noise_schedule: str = "linear"
    min_mask_ratio: float = 0.1
    max_mask_ratio: float = 0.9
    mask_token_str: str | None = None
    num_diffusion_steps: int = 128
    generate_samples: bool = True
    generation_interval: int = 100
    num_generation_samples: int = 3
    generation_steps: int = 128
    generation_temperature: float = 0.0
    generation_max_length: int = 100

    def __post_init__(self) -> None:
        def number(key: str, lo: float, hi: float | None = None, integer: bool = False) -> None:
            v = getattr(self, key)
            ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
            if not ok or v < lo or (hi is not None and v > hi):
                kind = "an integer" if integer else "a number"
                where = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"diffusion.{key} must be {kind} {where}, got {v!r}")
        if self.noise_schedule not in NOISE_SCHEDULES:
            raise ValueError(f"diffusion.noise_schedule {self.noise_schedule!r} is not one of "
                             f"{', '.join(NOISE_SCHEDULES)}")
        for key in ("min_mask_ratio", "max_mask_ratio", "eps"):
            number(key, 0.0, 1.0)
        if self.min_mask_ratio > self.max_mask_ratio:
            raise ValueError(f"diffusion.min_mask_ratio ({self.min_mask_ratio}) must be <= max_mask_ratio "
                             f"({self.max_mask_ratio})")
        for key in ("num_diffusion_steps", "generation_interval", "num_generation_samples", "generation_steps",
                    "generation_max_length"):
            number(key, 1, integer=True)
        number("generation_temperature", 0.0)
        for key in ("importance_weighting", "generate_samples"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"diffusion.{key} must be true or false, got {getattr(self, key)!r}")
        if self.mask_token_id is not None and (isinstance(self.mask_token_id, bool)
                                               or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0):
            raise ValueError(f"diffusion.mask_token_id must be a token id (an integer >= 0), got "
                             f"{self.mask_token_id!r}")

    @classmethod
    def from_mapping(cls, d: dict) -> "DiffusionSpec":
        """The spec of a config's ``diffusion:`` mapping; numbers YAML reads as text (``1e-3``) read
        as numbers, as Axolotl's pydantic model reads them."""
        floats = ("eps", "min_mask_ratio", "max_mask_ratio", "generation_temperature")
        out = dict(d)
        for key in floats:
            if isinstance(out.get(key), str):
                try:
                    out[key] = float(out[key])
                except ValueError:
                    pass                  # (refused by name in __post_init__)
        return cls(**out)

    def check_vocab(self, vocab: int) -> None:
        """Refuse a ``mask_token_id`` the model's vocabulary does not hold (or none at all)."""
        if self.mask_token_id is None:
            raise ValueError("diffusion.mask_token_id is not set: give the id of a token of the vocabulary to mask "
                             "with (adding a token, mask_token_str, is not supported)")
        if not self.mask_token_id < vocab:
            raise ValueError(f"diffusion.mask_token_id {self.mask_token_id} is outside the model's vocabulary of "
                             f"{vocab} tokens (ids 0..{vocab - 1}); choose a token id below {vocab}")


def _special(ids: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Where a block of integer ids is one of ``ids``."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        if not ids:
            return torch.zeros_like(t, dtype=torch.bool)
        return torch.isin(t, torch.tensor(ids, dtype=t.dtype, device=t.device))
    return fn


def noisy_batch(tokens: Named, labels: Named, spec: DiffusionSpec, special_ids: tuple[int, ...], seed: int,
                forward: int) -> tuple[Named, Named, Named, Named]:
    """The forward process of one batch: ``(noisy tokens, targets, p, answer tokens per row)``.
    ``targets`` (batch seq) is each position's label where the token after it was masked, else
    -100; ``p`` (batch) each row's mask probability; the answer count excludes the last label
    (the token after the row, never an input)."""
    B, S = tokens.size("batch"), tokens.size("seq")
    dev = tokens.data.device
    rows, pos = ops.positions("batch", B, device=dev), ops.positions("seq", S, device=dev)
    special = _special(special_ids)

    def draw(site: int, *coords: torch.Tensor) -> torch.Tensor:
        return uniform(seed, [torch.tensor(forward, device=dev), torch.tensor(site, device=dev), *coords])

    p = rows.map(lambda r: draw(_TIME, r) * (1 - spec.eps) + spec.eps)                          # batch (float64)
    # the token at position i is an answer token when position i - 1's label is trained
    # (shifted along a name no rule splits: under context parallelism the labels are gathered, the
    # rename back takes this device's positions)
    whole = ops.rename(labels, seq=_WHOLE)
    none = ops.slice_dim(whole, _WHOLE, 0, 1).map(lambda t: torch.full_like(t, ops.IGNORE_INDEX))
    before = ops.rename(ops.concat([none, ops.slice_dim(whole, _WHOLE, 0, S - 1)], _WHOLE), {_WHOLE: "seq"})
    masked = broadcast(lambda prev, t, r, i, q: (prev != ops.IGNORE_INDEX) & ~special(t) & (draw(_TOKENS, r, i) < q),
                       [before, tokens, rows, pos, p], "diffusion mask")
    noisy = ops.where(masked, spec.mask_token_id, tokens)
    # position j predicts token j + 1: masked when maskable (its label trained, not special) and drawn
    target = broadcast(lambda lab, r, i, q: torch.where(
        (lab != ops.IGNORE_INDEX) & ~special(lab) & (draw(_TOKENS, r, i + 1) < q) & (i + 1 < S), lab,
        ops.IGNORE_INDEX), [labels, rows, pos, p], "diffusion targets")
    answers = ops.sum(broadcast(lambda lab, i: ((lab != ops.IGNORE_INDEX) & (i + 1 < S)).to(torch.float64),
                                [labels, pos], "diffusion answers"), "seq")
    return noisy, target, p, answers


def diffusion_loss(params: Any, batch: dict, *, forward: Callable[..., Named], spec: DiffusionSpec,
                   special_ids: tuple[int, ...] = (), seed: int = 0) -> Named:
    """The masked-diffusion loss of ``batch`` (named ``tokens``, ``labels``, optionally
    ``segments``) under ``forward(params, tokens, segments=...)`` -> logits (batch seq vocab),
    a forward with bidirectional attention; ``special_ids`` are never masked; ``seed`` the
    training seed."""
    n = dropout_seeds.noise_seed("the diffusion objective's masks")
    tokens, labels = batch["tokens"], batch["labels"]
    noisy, target, p, answers = noisy_batch(tokens, labels, spec, tuple(special_ids), seed, n)
    logits = forward(params, noisy, segments=batch.get("segments"))
    nll = -ops.token_log_probs(logits, target)                                               # 0 where not masked
    weight = p.map(lambda q: (1.0 / q if spec.importance_weighting else torch.ones_like(q)).to(nll.data.dtype))
    per_row = ops.sum(nll * weight, "seq") / answers.map(lambda a: a.clamp(min=1.0).to(nll.data.dtype))
    if step_values.active():
        _report(nll, target)
    return ops.mean(per_row, "batch")


def _report(nll: Named, target: Named) -> None:
    """Axolotl's metrics of the masking, over the whole batch: ``diffusion_masked_tokens`` (their
    number), ``diffusion_mask_ratio`` (of the batch's tokens) and ``diffusion_ce_loss`` (their mean
    cross-entropy, unweighted)."""
    masked = target.map(lambda t: (t != ops.IGNORE_INDEX).to(torch.float64))
    count = settle(ops.sum(masked)).data
    ce = settle(ops.sum(nll.map(lambda t: t.detach().to(torch.float64)))).data
    step_values.report("diffusion_masked_tokens", count, "sum")
    step_values.report("diffusion_mask_ratio", count / (target.size("batch") * target.size("seq")))
    step_values.report("diffusion_ce_loss", ce / count.clamp(min=1.0))
