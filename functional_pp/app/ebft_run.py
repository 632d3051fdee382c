"""What ``rl: ebft`` changes in a run (docs/preference.md "EBFT"): the ``ebft:`` section, the
documents, the objective (one weighted sum of token log-probabilities,
:func:`~functional_pp.preference.weighted_logps.weighted_logps_objective`) with the frozen
feature model (the reference of DPO / GRPO: the base without the adapters, or a frozen copy),
and before each step the strided rollout: every device samples the step's blocks with the
policy's current parameters (in-process, under the run's layout), the feature model scores
them, and the device takes its rows of the batch. Used by :mod:`functional_pp.app.loop`."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from functional_pp.config import ConfigError, TrainConfig

__all__ = ["is_ebft", "ebft_settings", "ebft_objective_of", "load_documents", "steps_per_epoch", "summary_line",
           "EBFTSampler", "feature_pass"]


def is_ebft(cfg: TrainConfig) -> bool:
    return cfg.rl is not None and str(cfg.rl).lower() == "ebft"


def ebft_settings(cfg: TrainConfig):
    """The run's :class:`~functional_pp.preference.ebft_spec.EBFTSpec`."""
    from functional_pp.preference.ebft_spec import ebft_spec
    try:
        return ebft_spec(cfg.ebft)
    except ValueError as exc:
        raise ConfigError(f"rl: ebft: {exc}") from exc


def ebft_objective_of(cfg: TrainConfig, spec: Any, family: Any, model_cfg: Any, lora: Any, base_decls: Any) -> tuple:
    """``(loss, declarations, trainable mask, policy, features)``: ``features(params, tokens,
    **layout)`` the frozen model's hidden states at ``ebft.feature_layers`` (a list, ``batch seq
    hidden``) of block-parallel rows (``layout``: their segments, position ids and prefix)."""
    from functional_pp.app.preference_run import policy_and_reference
    from functional_pp.preference.ebft import feature_layer_indices
    from functional_pp.preference.weighted_logps import weighted_logps_objective
    if family.layer_states is None:
        raise ConfigError(f"rl: ebft: model family {family.name!r} gives no hidden states of chosen layers; register "
                          f"it with ModelFamily(layer_states=...)")
    why = "no block-parallel rows (ModelFamily.prefix_refusal)" if family.prefix_refusal is None else \
        family.prefix_refusal(model_cfg)
    if why:
        raise ConfigError(f"rl: ebft scores each document's samples in one block-parallel row (continuations "
                          f"packed after their shared context), which this model cannot take: {why}")
    layers = feature_layer_indices(spec.feature_layers, len(base_decls["layers"]))
    states = functools.partial(family.layer_states, cfg=model_cfg, layers=layers)
    policy, features, decls, trainable = policy_and_reference(
        cfg, True, family, model_cfg, lora, base_decls, reference_fn=lambda p, t, **layout: states(p, t, **layout))
    return weighted_logps_objective(policy), decls, trainable, policy, features


def load_documents(cfg: TrainConfig):
    """The run's :class:`~functional_pp.app.inputs.RunData` of documents (no held-out set)."""
    from functional_pp.app.inputs import RunData, load_tokenizer
    from functional_pp.data.ebft_documents import build_documents
    from functional_pp.data.formats import ByteTokenizer
    from functional_pp.data.reward_data import pad_id_of
    tok = load_tokenizer(cfg) or ByteTokenizer()
    try:
        docs = build_documents(cfg.datasets, tok, seq_len=cfg.sequence_len, pad_id=pad_id_of(tok))
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"datasets: {exc}") from exc
    return RunData(docs, None, tok)


def steps_per_epoch(documents: Any, per_step: int) -> int:
    if len(documents) < per_step:
        raise ConfigError(f"datasets: {len(documents)} documents are fewer than one step's {per_step} (the global "
                          f"batch: micro_batch_size x gradient_accumulation_steps x data-parallel size); add "
                          f"documents or lower the batch")
    return max(1, len(documents) // per_step)


def summary_line(spec: Any, per_step: int, n_layers: int) -> str:
    """The start-up summary's EBFT line."""
    from functional_pp.preference.ebft import feature_layer_indices
    return (f"ebft:       strided, {per_step} documents per step; blocks of {spec.generate_max_len} tokens every "
            f"{spec.stride} from {spec.context_length}, {spec.n_samples_per_prompt} samples each (temperature "
            f"{spec.temperature:g}, top_p {spec.top_p:g}); features of layers "
            f"{feature_layer_indices(spec.feature_layers, n_layers)} by {spec.embed_method}"
            f"{', whitened' if spec.use_whitening else ''}; rewards alignment {spec.alignment_coef:g} - diversity "
            f"{spec.diversity_coef:g}, advantages {spec.advantage_estimator}; loss rl_coef {spec.rl_coef:g} x "
            f"REINFORCE + ce_coef {spec.ce_coef:g} x cross-entropy")


@dataclass
class EBFTSampler:
    """Turns a step's documents into this device's EBFT batch (the module docstring)."""

    spec: Any
    policy: Callable                  # policy(params, tokens) -> logits
    features: Callable                # features(params, tokens) -> the feature layers' hidden states
    pad_id: int
    key: int                          # the generation key (checkpointed with the loader)
    accum: int = 1

    def step_batch(self, step_fn: Any, params: Any, loader: Any, step: int, shard: Any) -> tuple[dict, dict]:
        """``(this device's batch, the rollout's metrics)`` of step ``step`` (0-based): the
        loader's next documents sampled with ``params`` (the training state's) as the step's
        loss sees them (``step_fn``'s rules, compute precision and policy), scored by the
        feature model."""
        from functional_pp.app.grpo_run import _sampling_rules
        from functional_pp.parallel.shard_map import use_rules
        from functional_pp.preference.ebft_rollout import ebft_batch, ebft_metrics, ebft_rollout
        docs = next(loader)
        with use_rules(_sampling_rules(step_fn.rules)), step_fn.apply_policy():
            named_params = step_fn.named_params(params)
            r = ebft_rollout(self.policy, named_params, docs, self.spec,
                             functools.partial(self._states, named_params, shard.dp_size), pad_id=self.pad_id,
                             key=self.key, step=step, row_multiple=shard.dp_size)
        whole = ebft_batch(r, self.spec, self.pad_id, row_multiple=shard.dp_size * self.accum,
                           length_multiple=shard.seq_multiple)
        return {k: v.contiguous() for k, v in shard.cut(whole).items()}, ebft_metrics(r)

    def _states(self, named_params: Any, dp_size: int, rows: dict) -> list[torch.Tensor]:
        """The feature model's hidden states of block-parallel ``rows`` (``tokens`` and their
        layout, ``[N, L]`` each; ``[N, L, H]`` each, whole, on the host), the rows padded to a
        multiple of the data-parallel size for the forward."""
        from functional_pp.parallel.reshard import named
        from functional_pp.preference.rollout import params_device
        n = rows["tokens"].shape[0]
        device = params_device(named_params)
        ins = {k: named((torch.cat([v, v[-1:].expand(-n % dp_size, -1)]) if n % dp_size else v).to(device),
                        "batch seq") for k, v in rows.items()}
        return feature_pass(self.features, named_params, ins, lambda h: h.float().cpu()[:n])


def feature_pass(features: Callable, named_params: Any, rows: dict, take: Callable[[torch.Tensor], Any]) -> list:
    """EBFT's feature-model pass over block-parallel ``rows`` (``tokens`` and their layout, ``batch
    seq`` each, laid out by the sampling rules), without gradients: ``take`` of each feature
    layer's hidden states, gathered whole (``[N, L, H]`` on this device; the sampler's copies them
    to the host). The rollout's estimate runs it on meta tensors (app/rollout_memory.py)."""
    from functional_pp.parallel.fsdp.regather import relayout
    ins = dict(rows)
    with torch.no_grad():
        states = features(named_params, ins.pop("tokens"), **ins)
        out = []
        for h in states:
            full = relayout(h, tuple(() for _ in h.dims), "ebft features").value()
            out.append(take(full.permute(*(h.dims.index(d) for d in ("batch", "seq", "hidden")))))
    return out
