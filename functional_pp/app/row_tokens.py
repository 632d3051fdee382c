"""The tokens of each row a run's step computes: ``sequence_len``, or the objective's own row
length where it lays its rows out longer (EBFT's block-parallel rows: the document, then every
sample of every block, ``functional_pp/preference/ebft_layout.py``), padded as the run pads them
under context parallelism. The start-up summary's batch line, the step's MFU, ``validate
--memory`` and ``plan`` all count these (docs/preference.md "EBFT")."""
from __future__ import annotations

from functional_pp.config import TrainConfig

__all__ = ["row_tokens", "layout_seq_multiple"]


def layout_seq_multiple(mesh, rules) -> int:
    """What a row's length must divide by under ``mesh`` and ``rules`` (``BatchShard.seq_multiple``)."""
    from functional_pp.data import batch_shard
    return batch_shard(mesh, rules, 0).seq_multiple


def row_tokens(cfg: TrainConfig, mesh=None, rules=None, *, multiple: int | None = None) -> int:
    """The tokens of each row of ``cfg``'s training batch; where the objective pads its rows, its
    length rounded up to a multiple of ``multiple`` (default: :func:`layout_seq_multiple` of
    ``mesh`` and ``rules``, 1 without them); ``sequence_len`` for objectives whose rows are the
    data's own (the layout then not asked)."""
    from functional_pp.app.ebft_run import ebft_settings, is_ebft
    if is_ebft(cfg):
        from functional_pp.preference.ebft_rollout import row_length_of
        if multiple is None:
            multiple = 1 if mesh is None else layout_seq_multiple(mesh, rules)
        return row_length_of(ebft_settings(cfg), cfg.sequence_len, multiple)
    return cfg.sequence_len
