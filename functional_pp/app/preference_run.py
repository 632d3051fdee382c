"""What ``rl: dpo | ipo | orpo | simpo | kto`` changes in a run (docs/preference.md): the objective
(:mod:`functional_pp.preference.objective`) over the model family's logits, the reference
model, the pair data and its loader. Used by :mod:`functional_pp.app.loop`.

The reference of DPO / IPO / KTO is the model the run starts from, as TRL takes it: with an
adapter the base with the adapters left out (nothing more is held); otherwise a frozen copy
of the initial parameters under the tree's ``reference`` key, declared and sharded like the
policy (no gradient, no optimizer state, in the compute dtype; checkpointed, so a resumed run
keeps it; left out of exports)."""
from __future__ import annotations

import functools
from typing import Any

from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths, tree_flatten, tree_map, tree_unflatten
from functional_pp.preference.objective import PreferenceSpec, preference_loss

__all__ = ["REFERENCE", "preference_spec", "preference_objective", "policy_and_reference", "holding_reference",
           "with_reference",
           "sync_reference",
           "load_pairs", "pair_steps"]

#: the key of the frozen reference copy in the parameter tree (full fine-tuning)
REFERENCE = "reference"


def preference_spec(cfg: TrainConfig) -> PreferenceSpec | None:
    """The run's preference method with its TRL arguments as Axolotl passes them (``rl_beta``;
    ``orpo_alpha`` for ORPO; SimPO's beta 2.0 unless given), a reward model's objective
    (``reward_model`` / ``process_reward_model``: app/reward_run.py), or None without them."""
    from functional_pp.app.reward_run import reward_spec
    if cfg.rl is None:
        return reward_spec(cfg)
    method = str(cfg.rl).lower()
    default_beta = {"simpo": 2.0}.get(method, 0.1)
    beta = cfg.orpo_alpha if method == "orpo" and cfg.orpo_alpha is not None else cfg.rl_beta
    given = cfg.dpo_loss_type
    given = tuple(given) if isinstance(given, list) else given
    loss_type = {"ipo": "ipo", "simpo": "simpo"}.get(method, given or "sigmoid")
    if method == "ipo" and given not in (None, "ipo", ("ipo",)):
        raise ConfigError(f"rl: ipo is dpo_loss_type ipo; remove dpo_loss_type: {cfg.dpo_loss_type}")
    types = (loss_type,) if isinstance(loss_type, str) else loss_type
    smoothed = {"robust", "exo_pair"} & set(types)
    if method in ("dpo", "ipo") and cfg.dpo_label_smoothing and not smoothed:
        raise ConfigError(f"dpo_label_smoothing {cfg.dpo_label_smoothing}: TRL applies label smoothing in "
                          f"dpo_loss_type robust and exo_pair only (its {', '.join(types)} loss ignores it); set "
                          f"dpo_loss_type: robust (or exo_pair) or remove it")
    if "exo_pair" in types and not cfg.dpo_label_smoothing > 0:
        raise ConfigError("dpo_loss_type exo_pair needs dpo_label_smoothing > 0 (TRL's; the EXO paper's 1e-3)")
    weights = cfg.dpo_loss_weights
    if weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(f"dpo_loss_weights must be a list of numbers, one per dpo_loss_type, got {weights!r}")
    try:
        return PreferenceSpec(method, beta=default_beta if beta is None else beta, loss_type=loss_type,
                              loss_weights=None if weights is None else tuple(float(w) for w in weights),
                              label_smoothing=cfg.dpo_label_smoothing, simpo_gamma=cfg.simpo_gamma,
                              cpo_alpha=cfg.cpo_alpha,
                              desirable_weight=1.0 if cfg.kto_desirable_weight is None else cfg.kto_desirable_weight,
                              undesirable_weight=(1.0 if cfg.kto_undesirable_weight is None
                                                  else cfg.kto_undesirable_weight),
                              kto_loss_type=cfg.kto_loss_type or "kto", use_weighting=bool(cfg.dpo_use_weighting))
    except ValueError as exc:
        raise ConfigError(f"rl: {cfg.rl}: {exc}") from exc


def preference_objective(cfg: TrainConfig, spec: PreferenceSpec, family: Any, model_cfg: Any, lora: Any,
                         base_decls: Any) -> tuple:
    """``(loss, declarations, trainable mask, reference for the precomputing pass or None)`` of
    a preference run: the policy's logits through the adapters (if any), the reference as the
    module docstring says; a reward model's (app/reward_run.py). With ``precompute_ref_log_probs``
    the reference runs once before training (app/reference_logps.py) and is not held: no frozen
    copy (the initial parameters are the policy's), the loss reads the batch's reference
    log-probabilities."""
    from functional_pp.app.reward_run import reward_objective
    from functional_pp.preference.reward import RewardSpec
    if isinstance(spec, RewardSpec):
        return (*reward_objective(cfg, spec, model_cfg, lora, base_decls), None)
    precompute = bool(cfg.precompute_ref_log_probs) and spec.needs_reference
    policy, reference, decls, trainable = policy_and_reference(cfg, spec.needs_reference and not precompute, family,
                                                               model_cfg, lora, base_decls)
    if not precompute:
        return preference_loss(spec, policy, reference), decls, trainable, None
    if lora is not None:         # the base without the adapters
        from functional_pp import adapters
        forward = functools.partial(family.forward, cfg=model_cfg)

        def reference(params, tokens):
            return forward(adapters.split(params)[0], tokens)
    else:                        # the initial parameters, before any step
        reference = policy
    return preference_loss(spec, policy, None), decls, trainable, reference


def policy_and_reference(cfg: TrainConfig, needs_reference: bool, family: Any, model_cfg: Any, lora: Any,
                         base_decls: Any, reference_fn: Any = None) -> tuple:
    """``(policy, reference or None, declarations, trainable mask)``: ``policy(params, tokens,
    **layout)`` the trained model's logits (``layout``: the forward's keyword inputs, e.g. EBFT's
    block-parallel rows') through the adapters (if any), ``reference(params, tokens)`` the
    model the run starts from (module docstring) when ``needs_reference``: its logits, or
    ``reference_fn(its params, tokens)`` where given (EBFT: its hidden states)."""
    from functional_pp import adapters
    from functional_pp.app.inputs import frozen_and_adapters
    if family.forward is None:
        raise ConfigError(f"rl: {cfg.rl}: model family {family.name!r} gives no forward (logits) function; "
                          f"register it with ModelFamily(forward=...)")
    forward = functools.partial(family.forward, cfg=model_cfg)
    if lora is not None and (lora.modules_to_save or cfg.unfrozen_parameters) and needs_reference:
        raise ConfigError(f"rl: {cfg.rl} with an adapter takes the base without adapters as the reference, but "
                          f"lora_modules_to_save / unfrozen_parameters train base weights: remove them")
    policy, decls, trainable = frozen_and_adapters(cfg, lora, forward, base_decls)
    reference = None
    ref_fn = forward if reference_fn is None else reference_fn
    if needs_reference and lora is not None:
        def reference(params, tokens, **layout):
            return ref_fn(adapters.split(params)[0], tokens, **layout)
    elif needs_reference:
        frozen_decls = frozen_and_adapters(cfg, None, forward, base_decls)[1]
        policy, decls, trainable = holding_reference(policy, decls, trainable, _frozen(frozen_decls, cfg))

        def reference(params, tokens, **layout):
            return ref_fn(params[REFERENCE], tokens, **layout)
    return policy, reference, decls, trainable


def holding_reference(fn: Any, decls: Any, trainable: Any, reference_decls: Any) -> tuple:
    """``(fn, declarations, trainable mask)`` with a frozen copy ``reference_decls`` held under
    :data:`REFERENCE` beside ``decls``: ``fn(params, *args, **kw)`` called on the parameters
    without it, the copy frozen in the mask (the policy's side of :func:`policy_and_reference`;
    the planner's dry-run holds the copy the same way: app/report.py ``run_model``)."""
    def without_reference(params, *args, **kw):
        return fn({k: v for k, v in params.items() if k != REFERENCE}, *args, **kw)
    return without_reference, {**decls, REFERENCE: reference_decls}, _reference_frozen(trainable)


def _frozen(decls: Any, cfg: TrainConfig) -> Any:
    """``decls`` declared as frozen parameters are (the run's compute dtype)."""
    from functional_pp.app.inputs import frozen_in_compute_dtype
    return frozen_in_compute_dtype(decls, lambda tree: tree_map(lambda _: False, tree), cfg.resolved_precision())


def _reference_frozen(trainable: Any):
    """The trainable mask with the reference copy frozen (``trainable`` None: all else trains)."""
    def mask(params: dict) -> dict:
        rest = {k: v for k, v in params.items() if k != REFERENCE}
        inner = tree_map(lambda _: True, rest) if trainable is None else trainable(rest)
        return {**inner, REFERENCE: tree_map(lambda _: False, params[REFERENCE])}
    return mask


def with_reference(params: dict, decls: dict) -> dict:
    """``params`` (the policy's, this device's shards) with the reference copy added, each leaf
    a copy in its declared dtype."""
    want = dict(leaves_with_paths(decls[REFERENCE]))
    leaves, spec = tree_flatten(params)
    paths = [p for p, _ in leaves_with_paths(params)]
    copies = [x.replace(data=x.data.detach().to(want[p].dtype, copy=True)) for p, x in zip(paths, leaves)]
    return {**params, REFERENCE: tree_unflatten(spec, copies)}


def sync_reference(params: dict, alpha: float) -> None:
    """TR-DPO's reference update (TRL's ``SyncRefModelCallback``), in place on this device's
    shards: ``reference = alpha * policy + (1 - alpha) * reference``, leaf by leaf (the copy is
    declared and sharded like the policy)."""
    import torch
    policy = {k: v for k, v in params.items() if k != REFERENCE}
    ref_leaves, pol_leaves = tree_flatten(params[REFERENCE])[0], tree_flatten(policy)[0]
    if len(ref_leaves) != len(pol_leaves):
        raise ValueError(f"sync_reference: the reference has {len(ref_leaves)} leaves, the policy {len(pol_leaves)}")
    with torch.no_grad():
        for ref, pol in zip(ref_leaves, pol_leaves):
            target = ref.data
            target.mul_(1.0 - alpha).add_(pol.data.to(target.dtype), alpha=alpha)


def load_pairs(cfg: TrainConfig):
    """The run's :class:`~functional_pp.app.inputs.RunData` of preference pairs, ``val_set_size``
    of them held out (chosen by the seed), or (``rl: kto``) of unpaired completions, or a reward
    model's pairs / stepwise rows (app/reward_run.py)."""
    from functional_pp.app.reward_run import is_reward_run, load_reward_data
    if is_reward_run(cfg):
        return load_reward_data(cfg)
    from functional_pp.app.inputs import RunData, load_tokenizer
    from functional_pp.data.pairs import build_pairs
    from functional_pp.data.unpaired import build_completions
    tok = load_tokenizer(cfg)
    try:
        if str(cfg.rl).lower() == "kto":
            return RunData(build_completions(cfg.datasets, tok, seq_len=cfg.sequence_len,
                                             deduplicate=cfg.dataset_exact_deduplication), None, tok)
        pairs = build_pairs(cfg.datasets, tok, seq_len=cfg.sequence_len, chat_template=cfg.chat_template,
                            chat_template_jinja=cfg.chat_template_jinja, deduplicate=cfg.dataset_exact_deduplication)
        if not cfg.val_set_size:
            return RunData(pairs, None, tok)
        from functional_pp.data.formats import split_held_out
        return RunData(*split_held_out(pairs, cfg.val_set_size, cfg.seed, "pairs"), tok)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"datasets: {exc}") from exc


def pair_steps(pairs: Any, global_batch: int, cfg: TrainConfig) -> int:
    """Steps per epoch of the pairs; :class:`ConfigError` when they cannot fill one batch."""
    from functional_pp.data.pair_loader import PairLoader
    try:
        return len(PairLoader(pairs, global_batch_size=global_batch, seq_len=cfg.sequence_len, seed=cfg.seed))
    except ValueError as exc:
        raise ConfigError(f"datasets: {exc}") from exc
