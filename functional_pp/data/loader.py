"""Deterministic, mesh-independent language-model batches.

Step ``t``'s *global* batch depends only on ``(tokens, global_batch_size,
seq_len, seed, t)``; the data-parallel / context-parallel layout only decides
which slice of it a device sees.  That makes every parallel run comparable to a
single-device oracle (:meth:`DataLoader.global_batch` + :func:`shard_batch`).

Sampling: the stream is cut into ``K = (N - 1) // seq_len`` windows of
``seq_len + 1`` tokens with stride ``seq_len`` (consecutive windows share one
token so every token is a label exactly once), shifted by a per-epoch random
offset within the leftover slack.  Each epoch visits the windows in a random
permutation drawn from ``np.random.default_rng([seed, epoch])``; step ``t`` is
batch ``t % steps_per_epoch`` of epoch ``t // steps_per_epoch``.

Batch layout (one device): ``{"tokens": int64 [b_local, s_local], "labels":
int64 [b_local, s_local], "positions": int64 [s_local]}``, where ``positions``
are the global sequence positions of the local tokens (for rotary embeddings).

Documents (``eos_id`` given): a label whose input token is EOS (the next
document's first token) is -100, tokens not ``trained`` are -100 as labels, and
``"segments": int64 [b_local, s_local]`` numbers the documents of each row (the
count of EOS tokens before a position) so attention stays inside a document
(``docs/data.md``). A stream whose examples hold the EOS id inside them (a chat
template's turn end that is also the model's EOS) carries ``starts`` (1 at each
document's first token): documents then start there, not after every EOS.

Context parallelism with ``balanced=True`` (causal load balancing) cuts the
sequence into ``2 * cp_size`` chunks; rank ``i`` holds chunks ``i`` and
``2 * cp_size - 1 - i``.  With ``balanced=False`` rank ``i`` holds chunk ``i``
of ``cp_size``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "DataLoader",
    "balanced_chunk_indices",
    "shard_sequence",
    "unshard_sequence",
    "shard_batch",
    "to_device",
]

#: Label value ignored by the loss (``torch.nn.functional.cross_entropy``'s
#: default ``ignore_index``).  Use it to pad labels; the corpora in this package
#: never produce it.
IGNORE_INDEX: int = -100

_STATE_VERSION = 1


# ----------------------------------------------------------------------------
# Pure sharding helpers
# ----------------------------------------------------------------------------


def _check_cp(seq_len: int, cp_size: int, cp_rank: int, balanced: bool) -> int:
    """Validate a context-parallel layout; return the number of chunks."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    n_chunks = 2 * cp_size if balanced else cp_size
    if seq_len % n_chunks != 0:
        what = f"2*cp_size={n_chunks} (balanced)" if balanced else f"cp_size={cp_size}"
        raise ValueError(f"seq_len={seq_len} is not divisible by {what}")
    return n_chunks


def balanced_chunk_indices(seq_len: int, cp_size: int, cp_rank: int,
                           balanced: bool = True) -> torch.Tensor:
    """Global positions (LongTensor) held by context-parallel rank ``cp_rank``.

    Balanced: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``;
    e.g. ``seq_len=8, cp_size=2`` → rank 0 ``[0,1,6,7]``, rank 1 ``[2,3,4,5]``.
    Unbalanced: contiguous chunk ``cp_rank`` of ``cp_size``.
    """
    n_chunks = _check_cp(seq_len, cp_size, cp_rank, balanced)
    c = seq_len // n_chunks
    if not balanced:
        return torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.long)
    j = n_chunks - 1 - cp_rank
    return torch.cat([
        torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.long),
        torch.arange(j * c, (j + 1) * c, dtype=torch.long),
    ])


def shard_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int,
                   balanced: bool = True) -> torch.Tensor:
    """Rank ``cp_rank``'s part of ``x`` along sequence dimension ``dim``."""
    dim = dim % x.dim()
    n_chunks = _check_cp(x.shape[dim], cp_size, cp_rank, balanced)
    if cp_size == 1:
        return x
    c = x.shape[dim] // n_chunks
    if not balanced:
        return x.narrow(dim, cp_rank * c, c)
    j = n_chunks - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * c, c), x.narrow(dim, j * c, c)], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], dim: int,
                     balanced: bool = True) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: rebuild the full sequence from all
    ranks' parts (``parts[i]`` from cp rank ``i``)."""
    parts = list(parts)
    if not parts:
        raise ValueError("unshard_sequence needs at least one part")
    dim = dim % parts[0].dim()
    if not balanced or len(parts) == 1:
        return torch.cat(parts, dim=dim)
    firsts, seconds = [], []
    for i, p in enumerate(parts):
        if p.shape[dim] % 2 != 0:
            raise ValueError(
                f"balanced part {i} has odd length {p.shape[dim]} along dim {dim}"
            )
        a, b = p.chunk(2, dim=dim)
        firsts.append(a)
        seconds.append(b)
    return torch.cat(firsts + seconds[::-1], dim=dim)


def _dp_rows(batch_size: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if batch_size % dp_size != 0:
        raise ValueError(
            f"global_batch_size={batch_size} is not divisible by dp_size={dp_size}"
        )
    b = batch_size // dp_size
    return dp_rank * b, b


def shard_batch(batch: Mapping[str, torch.Tensor], dp_rank: int = 0, dp_size: int = 1,
                cp_rank: int = 0, cp_size: int = 1,
                balanced: bool = True) -> dict[str, torch.Tensor]:
    """Cut a full batch into one device's batch.

    Tensors of shape ``[B, S, ...]`` take the dp row block (dim 0) and the cp
    sequence part (dim 1); a 1-D ``positions`` of shape ``[S]`` takes only the
    cp part.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key == "positions" and value.dim() == 1:
            out[key] = shard_sequence(value, 0, cp_size, cp_rank, balanced)
            continue
        if value.dim() < 2:
            raise ValueError(f"batch[{key!r}] must be [B, S, ...], got shape "
                             f"{tuple(value.shape)}")
        start, b = _dp_rows(value.shape[0], dp_size, dp_rank)
        out[key] = shard_sequence(value.narrow(0, start, b), 1, cp_size, cp_rank, balanced)
    return out


# ----------------------------------------------------------------------------
# Loader
# ----------------------------------------------------------------------------


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """A host batch on ``device``: on CUDA through pinned (page-locked) host memory and a
    non-blocking copy, so the copy is one DMA that does not stall the host; elsewhere (CPU, no
    device) the tensors as they are or a plain ``.to``."""
    device = None if device is None else torch.device(device)
    if device is None or device.type == "cpu":
        return dict(batch)
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def sequences_digest(sequences: Any) -> tuple[str, int]:
    """``(digest, number of tokens)`` of a list of token sequences (preference pairs' prompts and
    completions, in order): :func:`tokens_digest` of their concatenation, with their lengths in
    the flags' place (so that a token moved between sequences changes it)."""
    seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
    tokens = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    return tokens_digest(tokens, np.array([len(s) for s in seqs], dtype=np.int64)), len(tokens)


def corpus_digest(corpus: Any) -> tuple[str, int]:
    """``(digest, number of tokens)``: :func:`tokens_digest` of a corpus's tokens and trained
    flags (what a loader over it records as ``tokens_sha256``); a set of preference pairs or
    completions (``sequences()``): :func:`sequences_digest`."""
    if hasattr(corpus, "sequences"):
        return sequences_digest(corpus.sequences())
    tokens = _as_numpy_tokens(corpus)
    return tokens_digest(tokens, getattr(corpus, "trained", None)), len(tokens)


def _as_numpy_tokens(corpus_tokens: Any) -> np.ndarray:
    tokens = getattr(corpus_tokens, "tokens", corpus_tokens)  # accept a Corpus
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"corpus tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"corpus tokens must be integers, got dtype {tokens.dtype}")
    return tokens


#: token streams up to this length are hashed whole by :func:`tokens_digest`
DIGEST_WHOLE = 1 << 24


def tokens_digest(tokens: Any, trained: Any = None) -> str:
    """A SHA-256 (16 hex digits) of a token stream and its trained flags: the whole stream up to
    :data:`DIGEST_WHOLE` tokens; beyond, its length, its first and last 2^20 tokens and 2^16
    spread evenly (a memory-mapped corpus is not read whole)."""
    h = hashlib.sha256(f"{len(tokens)}".encode())
    for arr in (tokens, trained):
        if arr is None:
            h.update(b"none")
            continue
        a = np.asarray(arr)
        n = len(a)
        parts = [a] if n <= DIGEST_WHOLE else [a[: 1 << 20], a[-(1 << 20):],
                                                 a[np.linspace(0, n - 1, 1 << 16).astype(np.int64)]]
        h.update(str(a.dtype).encode())
        for part in parts:
            h.update(np.ascontiguousarray(part))
    return h.hexdigest()[:16]


class DataLoader:
    """Deterministic next-token batches for one (dp_rank, cp_rank) device.

    The global batch of step ``t`` is independent of ``dp_size``/``cp_size``;
    this device yields ``shard_batch(global_batch(t), dp_rank, dp_size,
    cp_rank, cp_size, cp_balanced)``.  Tensor-parallel ranks simply build the
    same loader and receive identical data.

    ``drop_last=True``: each epoch has ``K // global_batch_size`` steps (the
    leftover windows are skipped).  ``drop_last=False``: ``ceil(K / B)`` steps,
    the last batch topped up by wrapping around the epoch's permutation.
    ``num_epochs=None`` iterates forever.
    """

    def __init__(self, corpus_tokens: Any, *, global_batch_size: int, seq_len: int,
                 seed: int = 0, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0,
                 cp_size: int = 1, cp_balanced: bool = True, drop_last: bool = True,
                 num_epochs: int | None = None, eos_id: int | None = None,
                 trained: np.ndarray | None = None) -> None:
        self.tokens = _as_numpy_tokens(corpus_tokens)
        self.eos_id = eos_id if eos_id is not None else getattr(corpus_tokens, "eos_id", None)
        self.trained = trained if trained is not None else getattr(corpus_tokens, "trained", None)
        self.images = getattr(corpus_tokens, "images", None)     # (a vision-language model's rows: RowImages)
        self.starts = getattr(corpus_tokens, "starts", None)     # (documents' first tokens, where not after EOS)
        if self.starts is not None and len(self.starts) != len(self.tokens):
            raise ValueError(f"document starts ({len(self.starts)}) and tokens ({len(self.tokens)}) differ in length")
        if self.trained is not None and len(self.trained) != len(self.tokens):
            raise ValueError(f"trained flags ({len(self.trained)}) and tokens ({len(self.tokens)}) "
                             f"differ in length")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self._row_start, self.local_batch_size = _dp_rows(global_batch_size, dp_size, dp_rank)
        _check_cp(seq_len, cp_size, cp_rank, cp_balanced)
        n = int(self.tokens.shape[0])
        if n < seq_len + 1:
            raise ValueError(
                f"corpus has {n} tokens, fewer than seq_len+1={seq_len + 1}"
            )
        self.num_windows = (n - 1) // seq_len
        self._slack = (n - 1) - self.num_windows * seq_len
        if self.images is not None and (self._slack or self.num_windows != len(self.images.rows)):
            raise ValueError(f"rows with images need one example per window of seq_len={seq_len}: the stream has "
                             f"{n} tokens for {len(self.images.rows)} rows (build it with sample_packing: false "
                             f"and this sequence_len)")
        if drop_last and self.num_windows < global_batch_size:
            raise ValueError(
                f"corpus has {n} tokens = {self.num_windows} windows of seq_len={seq_len}, "
                f"fewer than global_batch_size={global_batch_size} (use drop_last=False "
                f"or a bigger corpus)"
            )
        if num_epochs is not None and num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0 or None, got {num_epochs}")

        self.global_batch_size = int(global_batch_size)
        self.seq_len = int(seq_len)
        from functional_pp.core.seeds import check_seed
        self.seed = check_seed(seed, "DataLoader: seed")
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.cp_rank, self.cp_size = int(cp_rank), int(cp_size)
        self.cp_balanced = bool(cp_balanced)
        self.drop_last = bool(drop_last)
        self.num_epochs = num_epochs
        if drop_last:
            self.steps_per_epoch = self.num_windows // self.global_batch_size
        else:
            self.steps_per_epoch = math.ceil(self.num_windows / self.global_batch_size)
        self.step = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        self._positions = balanced_chunk_indices(seq_len, cp_size, cp_rank, cp_balanced)

    # -- sampling ------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.steps_per_epoch

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        """Window start offsets of ``epoch`` in visiting order."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(0, self._slack + 1))
        order = rng.permutation(self.num_windows)
        starts = offset + order.astype(np.int64) * self.seq_len
        self._epoch_cache = (epoch, starts)
        return starts

    def window_starts(self, step: int) -> np.ndarray:
        """Start offsets (into the token stream) of step ``step``'s global rows."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, i = divmod(int(step), self.steps_per_epoch)
        starts = self._epoch_starts(epoch)
        idx = (i * self.global_batch_size + np.arange(self.global_batch_size)) % self.num_windows
        return starts[idx]

    def _gather(self, starts: np.ndarray) -> dict[str, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
        windows = self.tokens[idx].astype(np.int64)
        tokens, labels = windows[:, :-1], windows[:, 1:].copy()
        out = {}
        if self.trained is not None:
            labels[self.trained[idx][:, 1:] == 0] = IGNORE_INDEX
        if self.starts is not None:                       # (1 where the next token starts a document)
            ends = self.starts[idx][:, 1:] != 0
        elif self.eos_id is not None:
            ends = tokens == self.eos_id
        if self.starts is not None or self.eos_id is not None:
            labels[ends] = IGNORE_INDEX                   # the next document's first token
            out["segments"] = torch.from_numpy(np.cumsum(ends, axis=1) - ends)
        return {"tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
                "labels": torch.from_numpy(labels), **out}

    def _image_entries(self, starts: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows' image entries (data/images.py), ``image_slots`` for the windows' input tokens."""
        if self.images is None:
            return {}
        idx = starts[:, None] + np.arange(self.seq_len, dtype=np.int64)[None, :]
        ids = torch.from_numpy(self.tokens[idx].astype(np.int64))
        return self.images.entries((starts // self.seq_len).tolist(), ids)

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The full, unsharded batch of ``step`` (single-device oracle)."""
        starts = self.window_starts(step)
        out = {**self._gather(starts), **self._image_entries(starts)}
        out["positions"] = torch.arange(self.seq_len, dtype=torch.long)
        return out

    def batch(self, step: int, *, each_window_once: bool = False) -> dict[str, torch.Tensor]:
        """This device's batch of ``step``; equals ``shard_batch(global_batch(step), ...)``. With
        ``each_window_once`` the rows that repeat a window of the epoch (the last batch topped up
        by wrapping, ``drop_last=False``) train no label: a held-out loss counts each token once."""
        starts = self.window_starts(step)
        rows = slice(self._row_start, self._row_start + self.local_batch_size)
        cp = (self.cp_size, self.cp_rank, self.cp_balanced)
        out = {k: shard_sequence(v, 1, *cp).contiguous() for k, v in self._gather(starts[rows]).items()}
        for k, v in self._image_entries(starts[rows]).items():        # (only image_slots / _groups run along seq)
            out[k] = shard_sequence(v, 1, *cp).contiguous() if k in ("image_slots", "image_groups") else v
        out["positions"] = self._positions.clone()
        if each_window_once:
            out["labels"][torch.from_numpy(self._repeated(step)[rows])] = IGNORE_INDEX
        return out

    def _repeated(self, step: int) -> np.ndarray:
        """Which global rows of ``step`` repeat a window already in its epoch (wrapped around)."""
        i = int(step) % self.steps_per_epoch
        return i * self.global_batch_size + np.arange(self.global_batch_size) >= self.num_windows

    # -- iteration -------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        out = self.batch(self.step)
        self.step += 1
        return out

    # -- checkpointing ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position of the loader (mesh-independent)."""
        return {
            "version": _STATE_VERSION,
            "step": int(self.step),
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "num_tokens": int(self.tokens.shape[0]),
            "drop_last": self.drop_last,
            "tokens_sha256": self.digest(),
        }

    def digest(self) -> str:
        """:func:`tokens_digest` of this loader's tokens and trained flags (computed once)."""
        if getattr(self, "_digest", None) is None:
            self._digest = tokens_digest(self.tokens, self.trained)
        return self._digest

    def load_state_dict(self, state: Mapping[str, Any], check_tokens: bool = True) -> None:
        """Resume from :meth:`state_dict` (possibly saved under another dp/cp layout). The
        tokens must be the ones the state was saved with (``tokens_sha256``; ``check_tokens=False``
        continues on other tokens): resuming at step N of other data was silent."""
        for key in ("global_batch_size", "seq_len", "num_tokens", "drop_last"):
            if key in state:
                mine = self.state_dict()[key]
                if state[key] != mine:
                    raise ValueError(
                        f"loader state has {key}={state[key]}, but this loader has {key}={mine}"
                    )
        if check_tokens and "tokens_sha256" in state and state["tokens_sha256"] != self.digest():
            raise ValueError(f"the training tokens differ from the ones the checkpoint was trained on "
                             f"({len(self.tokens)} tokens, sha256 {state['tokens_sha256']} then, "
                             f"{self.digest()} now): a data file, the tokenizer or a data setting changed "
                             f"since it was saved")
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"loader state has negative step={step}")
        self.seed = int(state.get("seed", self.seed))
        self._epoch_cache = None
        self.step = step

    def __repr__(self) -> str:
        return (
            f"DataLoader(tokens={self.tokens.shape[0]}, global_batch_size="
            f"{self.global_batch_size}, seq_len={self.seq_len}, seed={self.seed}, "
            f"dp={self.dp_rank}/{self.dp_size}, cp={self.cp_rank}/{self.cp_size}"
            f"{' balanced' if self.cp_balanced else ''}, step={self.step})"
        )
