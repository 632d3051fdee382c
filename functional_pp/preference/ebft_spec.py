"""The ``ebft:`` section of an ``rl: ebft`` config (Axolotl's ``EBFTConfig``, its names and
defaults) read into :class:`EBFTSpec`; the strided mode only (docs/preference.md "EBFT")."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from functional_pp.preference.ebft import ADVANTAGE_ESTIMATORS, EMBED_METHODS

__all__ = ["EBFTSpec", "ebft_spec"]

#: Axolotl's keys read by its structured mode only (accepted, unused by the strided mode, as there)
STRUCTURED_ONLY = ("adaptive_max_tokens", "gt_length_multiplier")


@dataclass(frozen=True)
class EBFTSpec:
    """The strided mode's settings (Axolotl's defaults)."""

    stride: int = 8
    context_length: int = 8
    generate_max_len: int = 8
    n_samples_per_prompt: int = 4
    temperature: float = 0.6
    top_p: float = 1.0
    feature_layers: tuple[float, ...] = (0.25, 0.5, 0.75)
    embed_method: str = "last_token"
    use_whitening: bool = False
    alignment_coef: float = 1.0
    diversity_coef: float = 1.0
    rl_coef: float = 1.0
    ce_coef: float = 0.0
    advantage_estimator: str = "rloo"
    min_completion_prefix: int = 0
    mode: str = "strided"

    def __post_init__(self) -> None:
        for key in ("stride", "generate_max_len", "n_samples_per_prompt", "context_length"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"ebft.{key} must be >= 1, got {getattr(self, key)}")
        if self.min_completion_prefix < 0:
            raise ValueError(f"ebft.min_completion_prefix must be >= 0, got {self.min_completion_prefix}")
        if self.embed_method not in EMBED_METHODS:
            raise ValueError(f"ebft.embed_method {self.embed_method!r} is not built for the strided mode (it takes "
                             f"{', '.join(EMBED_METHODS)})")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"ebft.advantage_estimator {self.advantage_estimator!r} is not one of "
                             f"{', '.join(ADVANTAGE_ESTIMATORS)}")
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"ebft.temperature must be > 0 and ebft.top_p in (0, 1], got {self.temperature} and "
                             f"{self.top_p}")
        if not self.feature_layers or any(not 0 <= float(f) <= 1 for f in self.feature_layers):
            raise ValueError(f"ebft.feature_layers must be fractions of the depth in [0, 1], got "
                             f"{list(self.feature_layers)}")


def ebft_spec(section: dict | None) -> EBFTSpec:
    """The :class:`EBFTSpec` of an ``ebft:`` mapping; ``mode: structured`` (Axolotl's default:
    completions from a vLLM server, GRPO's clipped loss) and unknown keys are refused by name."""
    section = dict(section or {})
    mode = section.get("mode", "structured")
    if mode != "strided":
        raise ValueError(f"ebft.mode {mode!r} is not built: only the strided mode (ebft.mode: strided, Axolotl's "
                         f"AxolotlStridedEBFTTrainer) trains here; the structured mode samples whole completions from "
                         f"a vLLM server (docs/preference.md \"EBFT\")")
    known = {f.name for f in fields(EBFTSpec)}
    unknown = sorted(k for k in section if k not in known and k not in STRUCTURED_ONLY)
    if unknown:
        raise ValueError(f"ebft: unknown key(s) {', '.join(unknown)} (the strided mode reads {', '.join(sorted(known))})")
    kw: dict[str, Any] = {k: v for k, v in section.items() if k in known}
    if "feature_layers" in kw:
        kw["feature_layers"] = tuple(float(f) for f in kw["feature_layers"])
    return EBFTSpec(**kw)
