"""Deterministic, mesh-independent batches of preference pairs or of KTO's unpaired completions
(any set with ``batch_rows``: :class:`~functional_pp.data.pairs.PairSet`,
:class:`~functional_pp.data.unpaired.CompletionSet`; docs/preference.md): step
``t``'s global batch is pairs ``perm[t*B:(t+1)*B]`` of epoch ``t // steps_per_epoch``'s
permutation (``np.random.default_rng([seed, epoch])``); a device gets its rows and sequence
part of it (:func:`~functional_pp.data.loader.shard_batch`), as :class:`DataLoader` does."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from functional_pp.data.loader import corpus_digest, shard_batch
from functional_pp.data.pairs import PairSet

__all__ = ["PairLoader", "PAIR_BATCH_DIMS"]

#: the named dimensions of a pair batch's tensors (the training step's ``batch_dims``)
PAIR_BATCH_DIMS = PairSet.batch_dims


class PairLoader:
    """Batches of ``global_batch_size`` pairs for one device (``dp_rank`` / ``cp_rank`` of
    their sizes, as :class:`~functional_pp.data.DataLoader`); the leftover pairs of an epoch
    are skipped. ``drop_last=False`` (a held-out set): fewer pairs than a batch are allowed,
    read with ``each_window_once``."""

    def __init__(self, pairs: Any, *, global_batch_size: int, seq_len: int, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1, cp_balanced: bool = True,
                 drop_last: bool = True) -> None:
        if not len(pairs):
            raise ValueError(f"no {pairs.unit} in {pairs.name}")
        if drop_last and len(pairs) < global_batch_size:
            raise ValueError(f"{len(pairs)} {pairs.unit} (of {pairs.name}) are fewer than one batch of "
                             f"{global_batch_size}: lower micro_batch_size / gradient_accumulation_steps or add pairs")
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
        self.pairs, self.global_batch_size, self.seq_len, self.seed = pairs, int(global_batch_size), int(seq_len), seed
        self.shard = dict(dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank, cp_size=cp_size, balanced=cp_balanced)
        self.steps_per_epoch = max(1, len(pairs) // self.global_batch_size)
        self.step = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def pair_indices(self, step: int) -> np.ndarray:
        """The indices of step ``step``'s global pairs (or completions)."""
        epoch, i = divmod(int(step), self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))
        return order[i * self.global_batch_size:(i + 1) * self.global_batch_size]

    @property
    def num_windows(self) -> int:
        """The pairs an evaluation covers once (``app/evaluate.py``)."""
        return len(self.pairs)

    def global_batch(self, step: int, each_window_once: bool = False) -> dict[str, torch.Tensor]:
        """The full, unsharded batch of ``step`` (the single-device oracle); ``each_window_once``
        (evaluation): pairs ``step*B .. step*B + B - 1`` in order, those past the last wrapping
        around with weight 0 (``pair_weight``; they train no label), so that every pair counts once."""
        if each_window_once:
            at = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
            rows = self.pairs.batch_rows(at % len(self.pairs), self.seq_len, weights=at < len(self.pairs))
        else:
            rows = self.pairs.batch_rows(self.pair_indices(step), self.seq_len)
        return {k: torch.from_numpy(v) for k, v in rows.items()}

    def batch(self, step: int, each_window_once: bool = False) -> dict[str, torch.Tensor]:
        """This device's block of step ``step``'s batch."""
        return {k: v.contiguous() for k, v in
                shard_batch(self.global_batch(step, each_window_once), **self.shard).items()}

    def __iter__(self) -> "PairLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The loader's position (mesh-independent)."""
        digest, n_tokens = self._digest()
        return {"step": int(self.step), "global_batch_size": self.global_batch_size, "seq_len": self.seq_len,
                "num_pairs": len(self.pairs), "seed": int(self.seed), "tokens_sha256": digest,
                "num_tokens": n_tokens}

    def _digest(self) -> tuple[str, int]:
        """The pairs' :func:`~functional_pp.data.loader.corpus_digest`, computed once."""
        if getattr(self, "_digest_cache", None) is None:
            self._digest_cache = corpus_digest(self.pairs)
        return self._digest_cache

    def load_state_dict(self, state: Mapping[str, Any], check_tokens: bool = True) -> None:
        """Resume from :meth:`state_dict` (possibly saved under another layout; ``check_tokens`` is
        :meth:`DataLoader.load_state_dict`'s, the pairs are checked by count)."""
        mine = self.state_dict()
        for key in ("global_batch_size", "seq_len", "num_pairs"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"loader state has {key}={state[key]}, but this loader has {key}={mine[key]}")
        if check_tokens and "tokens_sha256" in state and state["tokens_sha256"] != mine["tokens_sha256"]:
            raise ValueError(f"loader state was saved on other {self.pairs.unit} (sha256 {state['tokens_sha256']} "
                             f"then, {mine['tokens_sha256']} now): the data, the tokenizer or a data setting "
                             f"changed")
        self.step = int(state["step"])
