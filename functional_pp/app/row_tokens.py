"""The tokens of each row a run's step computes: ``sequence_len``, or the objective's own row
length where it lays its rows out longer (EBFT's block-parallel rows: the document, then every
sample of every block, ``functional_pp/preference/ebft_layout.py``), padded as the run pads them
under context parallelism. The start-up summary's batch line, the step's MFU, ``validate
--memory`` and ``plan`` all count these (docs/preference.md "EBFT"). An example may be several
rows (:func:`rows_per_example`: a pair's chosen and rejected rows), which ``plan``'s tokens/s
counts (:func:`step_tokens`)."""
from __future__ import annotations

from functional_pp.config import TrainConfig

__all__ = ["row_tokens", "layout_seq_multiple", "rows_per_example", "step_tokens"]


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


def rows_per_example(cfg: TrainConfig) -> int:
    """The rows ``cfg``'s step computes per example of its global batch: 2 for a pair objective
    and a reward model (the chosen and the rejected row) and for KTO (the completion and its KL
    row; 1 with ``apo_zero_unpaired``, which reads no KL rows), else 1 (app/held_models.py
    ``step_batch``)."""
    from functional_pp.app.held_models import pair_objective, unpaired_objective
    if pair_objective(cfg) or cfg.reward_model:
        return 2
    if unpaired_objective(cfg):
        return 1 if (cfg.kto_loss_type or "kto") == "apo_zero_unpaired" else 2
    return 1


def step_tokens(cfg: TrainConfig, global_batch: int, row: int) -> int:
    """The tokens one step computes: ``global_batch`` examples x :func:`rows_per_example` rows of
    ``row`` tokens (:func:`row_tokens`)."""
    return global_batch * rows_per_example(cfg) * row
