"""``--resume`` compares the config saved with the checkpoint with the new one
(docs/bad_inputs.md §7): a change that would make the continued run differ from an
uninterrupted one (model, data, optimizer, batch, schedule, precision, mesh...) is refused,
naming every changed key, unless the user allows it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from functional_pp.config import ConfigError, TrainConfig

# Keys that change where outputs go or how the run is watched, never the numbers.
NEUTRAL = ("logging.", "checkpoint.", "collective_timeout", "simulation", "max_consecutive_skips", "on_nonfinite",
           "loss_watchdog_threshold", "loss_watchdog_patience", "early_stopping_patience",
           "peak_flops_per_device", "resume_from_checkpoint",
           "dataset_prepared_path")   # where to resume from (Axolotl's keys)
# Keys that only reshard the same computation (any mesh loads any checkpoint; a checkpoint holds
# every layer whatever the pipeline); the batch keys
# are per data-parallel rank, so the global batch (compared instead) is what must not change.
RESHARD = ("pp_size", "pp_schedule", "pp_virtual_stages", "pp_fsdp_gather", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "ep_size", "sequence_parallel", "rules.",
           "reshard_after_forward", "offload_params", "activation_offloading",
           "micro_batch_size", "gradient_accumulation_steps", "global_batch_size")


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _neutral(key: str, saved: dict, new: dict) -> bool:
    if any(key == n or (n.endswith(".") and key.startswith(n)) for n in NEUTRAL + RESHARD):
        return True
    # a longer run with a constant learning rate continues exactly
    return key == "max_steps" and new.get("lr_scheduler") == saved.get("lr_scheduler") == "constant"


def config_changes(saved: dict | None, new: dict, saved_derived: dict | None = None,
                   new_derived: dict | None = None) -> list[str]:
    """``"key: checkpoint X, now Y"`` for each key whose change breaks exact resumption;
    ``*_derived`` hold values computed from the configs (the global batch size)."""
    if not isinstance(saved, dict):
        return []
    a, b = flatten(saved), flatten(new)
    if saved_derived is not None and new_derived is not None:
        a.update(saved_derived)
        b.update(new_derived)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        old, now = a.get(key, missing), b.get(key, missing)
        if old == now or _neutral(key, a, b):
            continue
        if (old is missing or now is missing) and not key.startswith("model."):
            continue            # a key one functional_pp version does not write
        old = "<preset default>" if old is missing else old
        now = "<preset default>" if now is missing else now
        out.append(f"{key}: checkpoint {old!r}, now {now!r}")
    return out


def check_resume_config(ckpt: Path, cfg: TrainConfig, global_batch: int) -> None:
    """Refuse a resume whose config changes what the run computes (docs/bad_inputs.md §7)."""
    from functional_pp.checkpoint.format import read_index
    index = read_index(ckpt)
    saved = index.get("config")
    try:                                 # the saved run's global batch, on its own world size
        old = TrainConfig.from_dict(saved)
        old_mesh = old.mesh(index.get("world_size"))
        derived = ({"global batch (sequences per step)": old.global_batch(old_mesh, old.build_rules(old_mesh))},
                   {"global batch (sequences per step)": global_batch})
    except Exception:  # noqa: BLE001 - an older or foreign config: compare the keys as written
        derived = (None, None)
    changes = config_changes(saved, cfg.to_dict(), *derived)
    if changes:
        raise ConfigError(f"--resume: the config differs from the one saved in {ckpt} in "
                          f"{len(changes)} key(s) that change the results: " + "; ".join(changes)
                          + ". Restore them, or pass --allow-config-change to continue anyway "
                            "(the run will not equal an uninterrupted one)")


def check_resume_tokens(ckpt: Path, corpus: Any) -> None:
    """Refuse a resume on other training tokens than the checkpoint's (its loader state's
    ``tokens_sha256``): a data file edited at the same size, another tokenizer or template
    continued at step N of other data, silently. Checkpoints without the hash pass."""
    from functional_pp.checkpoint.format import read_index
    from functional_pp.data.loader import corpus_digest
    saved = (read_index(ckpt).get("metadata") or {}).get("loader") or {}
    if "tokens_sha256" not in saved:
        return
    now, n_tokens = corpus_digest(corpus)
    if now != saved["tokens_sha256"]:
        raise ConfigError(f"--resume: the training tokens differ from the ones {ckpt} was trained on "
                          f"({saved.get('num_tokens')} tokens, sha256 {saved['tokens_sha256']} then; {n_tokens} "
                          f"tokens, sha256 {now} now): a data file, the tokenizer or a data setting changed since "
                          f"it was saved, and the run would continue at its step on other data. Restore the data, "
                          f"start a new run (another output_dir), or pass --allow-config-change to continue anyway")
