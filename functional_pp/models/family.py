"""Model families: what the training loop, its config and its report need to know about a
model, as one record per family, looked up by name (``model: {family: llama}`` in a config).

A family is a config class with named presets, the parameter declarations (``param_decls``:
a model's ``init``, docs/names.md), the loss, the FLOPs per token, the default rules and the
activations whose layout the config checks against the mesh before any work. ``functional_pp.models`` registers ``"llama"``; a
user registers another with :func:`register` (``docs/models.md``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ModelFamily", "register", "get_family", "family_names", "UnknownFamilyError"]


class UnknownFamilyError(KeyError):
    """A model family name that no module registered; the message names the known ones."""

    def __str__(self) -> str:            # KeyError would quote the whole message
        return str(self.args[0])


@dataclass(frozen=True)
class ModelFamily:
    """One model family. ``loss(params, batch, cfg=...)`` returns a named scalar;
    ``param_decls(cfg, dtype)`` the parameter declarations (``llama.init``); ``presets`` maps a preset name to a
    function of keyword overrides returning a ``config_class`` instance;
    ``activations(cfg, batch, seq)`` the activations' ``{dims: shape}`` (global sizes) that
    must split evenly on the mesh; ``default_rules(sequence_parallel=)`` the rules the config
    starts from. ``summary_fields`` are printed in the start-up report; ``vocab_size(cfg)``
    bounds the token ids; ``hf_config_from_dict`` (or None) reads a Hugging Face
    ``config.json`` for ``base_model``; ``pipeline_ends(cfg)`` (or None: every parameter outside
    ``layers`` on every stage) the parameter path prefixes only the first and only the last
    pipeline stage hold (``pipeline_step``'s ``first_stage`` / ``last_stage``); ``forward(params,
    tokens, cfg=...)`` (or None) the logits (batch seq vocab), which preference training
    (``rl:``, docs/preference.md) needs; ``serial_under_cp(cfg)`` (or None) the model's layers that
    are a recurrence along the sequence, None where there are none: under context parallelism their
    blocks run device after device (ops/sequence_chain.py), which the planner's time model counts
    (plan/timing.py) and the batched simulator (every device at once) cannot run them; ``uncached_layers(cfg)`` (or None)
    why the model cannot sample with a key / value cache (layers whose state it does not hold),
    None where it can (checked before any work against every config and command that samples:
    ``rl: grpo``, ``functional-pp generate``; :meth:`ModelFamily.sampling_refusal`); ``layer_states(params,
    tokens, cfg, layers)`` (or None) the hidden states after the given numbers of layers (transformers'
    ``hidden_states[i]``), which ``rl: ebft``'s features need; ``prefix_refusal(cfg)`` (or None:
    never) why the model's forward cannot take continuations packed after their shared context
    (``position_ids`` and attention's ``prefix``: ``rl: ebft``'s block-parallel rows), None where it
    can (checked before any work)."""

    name: str
    config_class: type
    presets: Mapping[str, Callable[..., Any]]
    param_decls: Callable[..., Any]
    loss: Callable[..., Any]
    flops_per_token: Callable[[Any, int], float]
    default_rules: Callable[..., Any]
    activations: Callable[[Any, int, int], dict[str, tuple[int, ...]]]
    summary_fields: tuple[str, ...] = ()
    vocab_size: Callable[[Any], int] = field(default=lambda cfg: cfg.vocab)
    hf_config_from_dict: Callable[[dict], Any] | None = None
    pipeline_ends: Callable[[Any], tuple[tuple[str, ...], tuple[str, ...]]] | None = None
    forward: Callable[..., Any] | None = None
    serial_under_cp: Callable[[Any], str | None] | None = None
    uncached_layers: Callable[[Any], str | None] | None = None
    layer_states: Callable[..., Any] | None = None
    prefix_refusal: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelFamily: name must be a non-empty string, got {self.name!r}")
        if not self.presets:
            raise ValueError(f"ModelFamily {self.name!r}: give at least one preset (a name -> a "
                             f"function of field overrides returning a {self.config_class.__name__})")

    def build_config(self, preset: str, **overrides: Any) -> Any:
        """The config of ``preset`` with ``overrides`` (field values) applied."""
        if preset not in self.presets:
            raise ValueError(f"model family {self.name!r} has no preset {preset!r}; choose one of "
                             f"{', '.join(self.presets)}")
        return self.presets[preset](**overrides)

    def config_to_dict(self, cfg: Any) -> dict:
        """A JSON-able dict of ``cfg`` (its ``to_dict`` when it has one)."""
        to_dict = getattr(cfg, "to_dict", None)
        return to_dict() if callable(to_dict) else dataclasses.asdict(cfg)

    def sampling_refusal(self, cfg: Any, what: str, instead: str = "") -> str | None:
        """Why ``what`` (the config key or command that samples, e.g. ``"rl: grpo"``) cannot run on
        the model ``cfg``, with the fix (``instead``: a further one); None where the model samples
        with a key / value cache."""
        why = self.uncached_layers(cfg) if self.uncached_layers is not None else None
        if why is None:
            return None
        return (f"{what} samples completions with a key / value cache, which this model cannot use yet ({why}: "
                f"their state is not cached); use a model whose layers are all attention{instead}")

    def dim_names(self, cfg: Any) -> set[str]:
        """Every dimension name of the parameters and of the checked activations."""
        from functional_pp.core.tree import leaves_with_paths
        names = {d for _, decl in leaves_with_paths(self.param_decls(cfg)) for d in decl.dims}
        for dims in self.activations(cfg, 1, 1):
            names.update(dims.split())
        return names


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make ``family`` known under ``family.name``; ``replace=True`` overwrites a family of the
    same name (otherwise that is an error, so two modules cannot silently fight over a name)."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register() takes a ModelFamily, got {type(family).__name__}")
    if family.name in _FAMILIES and not replace and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is already registered; pass replace=True "
                         f"to overwrite it")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Forget the family ``name`` (tests registering a family of their own)."""
    _FAMILIES.pop(name, None)


def family_names() -> list[str]:
    """The names of the registered families, sorted."""
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name``; :class:`UnknownFamilyError` names the known ones."""
    try:
        return _FAMILIES[name]
    except (KeyError, TypeError):
        raise UnknownFamilyError(f"unknown model family {name!r}; known families: "
                                 f"{', '.join(family_names()) or 'none'} (register one with "
                                 f"functional_pp.models.register)") from None
