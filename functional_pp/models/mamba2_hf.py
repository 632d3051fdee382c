"""The Hugging Face files of a Mamba2 mixer (models/mamba2.py), shared by the hybrid families:
its rows of :data:`functional_pp.models.llama_hf.LLAMA_TABLE` (our parameters under
``layers.{i}.mamba``) and the fused tensors the files hold. ``in_proj.weight`` ``[2 I + 2 G N + NH,
hidden]`` is z, x, B, C and dt along its rows; ``conv1d.weight`` ``[I + 2 G N, 1, K]`` and
``conv1d.bias`` are x, B and C (``I`` = heads x head_dim, ``G`` groups, ``N`` the state); ours hold each
part with its heads by name (``ssm_groups ssm_group_heads ssm_head_dim``), HF's rows in that order."""
from __future__ import annotations

_M = "model.layers.{i}.mamba"
_OURS = "layers.{i}.mamba"

PROJECTIONS = ("z_proj", "x_proj", "b_proj", "c_proj", "dt_proj")
"""The parts of ``in_proj`` along its rows, in order (our parameters' names, and the parts' in the table)."""

TABLE: tuple[tuple[str, str, str], ...] = (
    *((f"{_M}.{part}.weight", f"{_OURS}.{part}", "flat_out") for part in PROJECTIONS),
    *((f"{_M}.conv_{part}.weight", f"{_OURS}.conv_{part}", "conv_taps") for part in "xbc"),
    *((f"{_M}.conv_{part}.bias", f"{_OURS}.conv_{part}_bias", "flat") for part in "xbc"),
    (f"{_M}.A_log", f"{_OURS}.A_log", "flat"), (f"{_M}.D", f"{_OURS}.D", "flat"),
    (f"{_M}.dt_bias", f"{_OURS}.dt_bias", "flat"), (f"{_M}.norm.weight", f"{_OURS}.norm", "flat"),
    (f"{_M}.out_proj.weight", f"{_OURS}.out_proj", "flat_in"),
)
"""``(HF name, our path, kind)`` of a Mamba2 mixer's parameters; the parts of the fused tensors under
our names (``z_proj``, ``conv_x``, ...), which :func:`fused` joins (and a LoRA target ``in_proj`` is
read as its parts, as Phi-3's ``qkv_proj``)."""


def fused(prefix: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The fused tensors of a mixer whose files name it ``prefix`` (after the family's renames, e.g.
    ``backbone.layers.{i}.mixer``): each with its parts' names in order along its rows."""
    return ((f"{prefix}.in_proj.weight", tuple(f"{prefix}.{p}.weight" for p in PROJECTIONS)),
            (f"{prefix}.conv1d.weight", tuple(f"{prefix}.conv_{p}.weight" for p in "xbc")),
            (f"{prefix}.conv1d.bias", tuple(f"{prefix}.conv_{p}.bias" for p in "xbc")))
