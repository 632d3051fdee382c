"""The start-up summary of a run (device, mesh, rules, model, memory per device, batch,
optimizer, data, output) and the text of the first step's communication report.

The memory line counts the parameters each device holds times the bytes of its training
state (docs/memory.md). The peak with activations and temporaries is
:func:`functional_pp.plan.estimate`'s dry run of the config's own step (:func:`planned_memory`,
``functional-pp validate --memory``): not at every start, as it costs about one to five
CPU-seconds even for the tiny test model on the 2-core machine."""
from __future__ import annotations

import math
from typing import Any

from functional_pp.app.row_tokens import row_tokens
from functional_pp.app.world import World
from functional_pp.config import TrainConfig, model_family
from functional_pp.core.layout import local_shape
from functional_pp.core.tree import count_params, leaves_with_paths

__all__ = ["describe", "param_memory", "planned_memory", "planned_estimate", "run_model", "compute_dtype", "mesh_label",
           "comm_report_text"]


def param_memory(decls: Any, mesh, rules, ends: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
                 virtual_stages: int = 1) -> tuple[int, int]:
    """(global parameter count, parameters held by each device) for ``decls`` under the rules
    (every device holds equal blocks). With a ``pp`` axis: those of the device holding the most
    (its stages' ``layers`` and, of the parameters outside them, ``ends`` = (first-stage only,
    last-stage only) as ``pipeline_step`` places them)."""
    p = mesh.shape.get("pp", 1)
    counts = [0] * p
    for path, d in leaves_with_paths(decls):
        n = math.prod(local_shape(d.shape, rules.resolve(d.dims, d.shape, mesh, name=path), mesh))
        for device in range(p):
            counts[device] += n if _held_by_stage(path, device, p, virtual_stages, decls, ends) else 0
    return count_params(decls), max(counts)


def _held_by_stage(path: str, device: int, p: int, v: int, decls: Any, ends) -> bool:
    if p == 1:
        return True
    parts = path.split(".")
    if parts[0] == "layers":
        per = len(decls["layers"]) // (p * v)
        return (int(parts[1]) // per) % p == device
    first, last = (any(path == n or path.startswith(n + ".") for n in names) for names in ends)
    return device == 0 if first and not last else device == p - 1 if last and not first else True


def run_model(cfg: TrainConfig, model_cfg, dtype: Any = None, *, as_run: bool = True) -> tuple:
    """``(loss, declarations, trainable mask)`` the run trains (adapters and frozen parameters
    included: app/inputs.py ``frozen_and_adapters``), the weights declared in ``dtype``
    (default fp32; the planner passes the compute dtype, in which a frozen base is held).
    ``as_run``: with what the run's step holds beyond the model (app/held_models.py): a pair
    objective's or KTO's own loss (on :func:`~functional_pp.app.held_models.step_batch`'s pairs
    or unpaired completions) and its reference, another objective's frozen copy (GRPO's reference, EBFT's feature
    model) declared frozen under the tree's ``reference`` key as the run declares it, so that a
    dry-run holds it too; False: the trained model alone (the start-up summary's counts)."""
    import functools

    from functional_pp.app.held_models import held_model, own_objective
    from functional_pp.app.inputs import frozen_and_adapters
    from functional_pp.app.preference_run import holding_reference, preference_objective, preference_spec
    family = model_family(cfg)
    decls = family.param_decls(model_cfg) if dtype is None else family.param_decls(model_cfg, dtype)
    if as_run and own_objective(cfg):
        lora = cfg.lora_config()
        if lora is not None and getattr(model_cfg, "score_head", None) is not None:    # (as app/loop.py)
            from functional_pp.app.reward_run import with_head_saved
            lora = with_head_saved(lora, decls)
        return preference_objective(cfg, preference_spec(cfg), family, model_cfg, lora, decls)[:3]
    run = frozen_and_adapters(cfg, cfg.lora_config(), functools.partial(family.loss, cfg=model_cfg), decls)
    copy = held_model(cfg, model_cfg) if as_run else None
    return run if copy is None or copy.decls is None else holding_reference(*run, copy.decls)


def compute_dtype(cfg: TrainConfig) -> Any:
    """The dtype the run computes in (and holds a frozen base in): bf16 / fp16 or fp32."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.resolved_precision(), torch.float32)


def _trained(decls: Any, trainable: Any) -> Any:
    """The declarations of the trained parameters only (the frozen ones left out)."""
    from functional_pp.core.tree import map_with_path
    flags = dict(leaves_with_paths(trainable(decls)))
    return map_with_path(lambda p, d: d if flags[p] else None, decls)


def _frozen_bytes(decls: Any, trainable: Any, mesh, rules, ends, virtual_stages: int) -> tuple[int, str]:
    """(bytes of the frozen parameters each device holds, their bytes per parameter in words):
    weights only, each in its declared dtype (a LoRA base in the compute dtype, quantized codes)."""
    from functional_pp.core.tree import map_with_path
    flags = dict(leaves_with_paths(trainable(decls)))
    sizes = sorted({d.dtype.itemsize for p, d in leaves_with_paths(decls) if not flags[p]}, reverse=True)
    total = 0
    for n in sizes:
        part = map_with_path(lambda p, d: d if not flags[p] and d.dtype.itemsize == n else None, decls)
        total += n * param_memory(part, mesh, rules, ends, virtual_stages)[1]
    return total, " / ".join(f"{n} B" for n in sizes) or "0 B"


def _state_bytes_per_param(cfg: TrainConfig) -> tuple[int, str]:
    if cfg.optimizer == "adamw":
        return 16, "fp32 AdamW: weights 4 + grads 4 + moments 8"
    if cfg.optimizer == "adamw_8bit":
        return 10, "8-bit AdamW: weights 4 + grads 4 + moments 2 (+ 8 bytes of scales per block of 256)"
    if cfg.optimizer == "adamw_4bit":
        return 9, "4-bit AdamW: weights 4 + grads 4 + moments 1 (+ 8 bytes of scales per block of 128)"
    if cfg.momentum:
        return 12, "fp32 SGD with momentum: weights 4 + grads 4 + momentum 4"
    return 8, "fp32 SGD: weights 4 + grads 4"


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"


def describe(cfg: TrainConfig, world: World, mesh, rules, model_cfg, corpus=None, *, verbose_data: bool = False,
             device_text: str | None = None, val=None) -> str:
    """The start-of-run summary: device, mesh, rules, parameter count, per-device parameter
    memory, batch, data and output."""
    family = model_family(cfg)
    _, decls, trainable = run_model(cfg, model_cfg, as_run=False)
    ends = family.pipeline_ends(model_cfg) if family.pipeline_ends is not None else ((), ())
    total, local = param_memory(decls, mesh, rules, ends, cfg.pp_virtual_stages)
    where = "each device" if "pp" not in mesh.shape else "each device of the fullest pipeline stage"
    per, what = _state_bytes_per_param(cfg)
    trained_total, trained_local = (total, local) if trainable is None else param_memory(
        _trained(decls, trainable), mesh, rules)
    frozen_bytes, frozen_what = (0, "") if trainable is None else _frozen_bytes(decls, trainable, mesh, rules, ends,
                                                                                cfg.pp_virtual_stages)
    dp = cfg.dp_size(mesh, rules)
    accum = cfg.grad_accum(mesh, rules)
    gb = cfg.global_batch(mesh, rules)
    row = row_tokens(cfg, mesh, rules)
    mesh_txt = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
    rules_txt = ", ".join(f"{k}={'+'.join(rules[k]) if rules[k] else '-'}" for k in rules.entries())
    model_txt = ", ".join(f"{k}={getattr(model_cfg, k)}" for k in
                          family.summary_fields)
    lines = [
        f"functional_pp train: {cfg.name} on {world.size} device(s) ({world.launcher})",
        f"mesh:       {mesh_txt} = {mesh.size} devices"
        + ("" if not getattr(cfg, "auto_dp", None) else
           f" (no parallelism sizes given: all {cfg.auto_dp} devices are data parallel, "
           f"dp_shard_size: {cfg.auto_dp})"),
        f"rules:      {rules_txt}",
        f"model:      {family.name} {cfg.base_model or cfg.model.preset} ({model_txt}): {total:,} parameters"
        + ("" if trainable is None else f", {trained_total:,} trained (the rest frozen)"),
        f"memory:     {local:,} parameters on {where} x {per} B ({what}) = "
        f"{human_bytes(local * per)} per device (of {human_bytes(total * per)} unsharded)"
        if trainable is None else
        f"memory:     {trained_local:,} trained parameters on {where} x {per} B ({what}) + "
        f"{local - trained_local:,} frozen x {frozen_what} (weights only) = "
        f"{human_bytes(trained_local * per + frozen_bytes)} per device",
        f"batch:      {gb} sequences x {row} tokens = {gb * row:,} tokens/step "
        f"(micro_batch_size {cfg.micro_batch_size} x grad_accum {accum} x dp {dp})"
        + ("" if row == cfg.sequence_len else
           f" (rows of {row} tokens, not sequence_len {cfg.sequence_len}: the objective's layout)"),
        f"optimizer:  {cfg.optimizer}, lr {cfg.learning_rate:g} ({cfg.lr_scheduler}, warmup "
        f"{cfg.warmup()}), {cfg.max_steps} steps"
        + (f" (num_epochs {cfg.num_epochs} x {cfg.steps_per_epoch} steps per epoch)"
           if getattr(cfg, "epochs_derived", False) else "")
        + (f", checkpoint every {cfg.checkpoint.save_every}" if cfg.saves_per_epoch else "")
        + (f", held-out loss every {cfg.eval_steps}" if cfg.evals_per_epoch else "")
        + f", precision {cfg.precision}"
        + ({True: ", activation checkpointing", "selective": ", selective activation checkpointing",
            "selective_alternate": ", selective activation checkpointing (every second matmul recomputed)"}
           .get(cfg.activation_checkpointing, ""))
        + (f", compile={cfg.compile}" if cfg.compile else "")
        + (f", LISA: {cfg.lisa_n_layers} decoder layers trained at a time, drawn every {cfg.lisa_step_interval} "
           f"steps (Axolotl's draws)" if cfg.lisa_n_layers else ""),
    ]
    if cfg.qat:
        q = cfg.qat_config()
        after = (f" after {q.fake_quant_after_n_steps} steps" if q.fake_quant_after_n_steps else "")
        scheme = ("NVFP4 weights and inputs: E2M1 in blocks of 16 inputs, E4M3 block scales, one fp32 scale "
                  "per tensor" if q.weight_dtype == "nvfp4" else
                  f"int4 in groups of {q.group_size} inputs, int8 inputs per token")
        lines.append(f"qat:        linear weights and the head fake-quantized{after} ({scheme}; torchao's "
                     f"numerics); exported unquantized")
    if cfg.adapter == "lora" and cfg.loftq() is not None:
        lq = cfg.loftq()
        kind = "NF4" if lq["bits"] == 4 else "int8"
        lines.append(f"base:       LoftQ (peft.loftq_config): each adapted weight replaced by its {lq['bits']}-bit "
                     f"{kind} round trip and its adapters the rank-{cfg.lora_r} SVD of the rest ({lq['iters']} "
                     f"iteration(s), peft's init); export with --merge-adapter")
    if cfg.do_causal_lm_eval:
        lines.append(f"eval:       do_causal_lm_eval: eval_perplexity of the held-out completions (Axolotl's "
                     f"Perplexity: windows of {cfg.eval_max_new_tokens} tokens every 512) at each evaluation")
    if cfg.gptq:
        lines.append("base:       gptq: the GPTQ linears of base_model (qweight / qzeros / scales / g_idx) read "
                     "dequantized (scale x (code - zero), the scales' dtype), frozen under the adapters; "
                     "--merge-adapter exports them unquantized")
    if cfg.model_quantization_config:
        lines.append("base:       model_quantization_config: Mxfp4Config (dequantize: true): MXFP4 tensors of "
                     "base_model (gpt-oss's experts) read dequantized, trained and exported unquantized")
    if device_text is not None:
        lines.insert(1, f"device:     {device_text}")
    if corpus is not None:
        docs = f", {corpus.documents:,} documents" if hasattr(corpus, "documents") else ""
        held = f"; held out: {len(val):,} {getattr(val, 'unit', 'tokens')}" if val is not None else ""
        unit = getattr(corpus, "unit", "tokens")
        dropped = f" ({corpus.dropped:,} longer than sequence_len left out)" if getattr(corpus, "dropped", 0) else ""
        if getattr(corpus, "duplicates", 0):
            dropped += f" ({corpus.duplicates:,} duplicates left out)"
        lines.append(f"data:       {corpus.name}: {len(corpus):,} {unit}{docs}{dropped}, vocab {corpus.vocab_size}{held}")
        if getattr(corpus, "prepared", ""):
            lines.append(f"  {corpus.prepared}")
        for st in getattr(corpus, "stats", None) or []:     # per dataset: rows, tokens, trained
            lines.append(f"  {st.line()}")
            if st.trained_sample and verbose_data:
                lines.append(f"  trained tokens marked [[...]], one example:\n    {st.trained_sample}")
    for note in cfg.notes:
        lines.append(f"not used:   {note}")
    lines.append(f"output:     {cfg.output_dir()}")
    return "\n".join(lines)


def as_compiled(cfg: TrainConfig):
    """The context a dry-run of ``cfg``'s step runs in: a whole-step compile widens the 16-bit
    logits whole (``ops.loss.logits_widened_whole``), an eager step (or one whose layers alone
    are compiled) by row chunks."""
    from contextlib import nullcontext

    from functional_pp.ops.loss import logits_widened_whole
    whole_step = cfg.compile and not str(cfg.compile).startswith("per_layer")
    return logits_widened_whole() if whole_step else nullcontext()


def compiled_layers(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` compiles each layer on its own (``compile: per_layer``): its layers save what
    AOTAutograd's partitioner keeps (``plan.estimate(compiled=True)``; a whole-step compile traces
    forward and backward into one graph, no partition: the dry-run counts what eager saves)."""
    return str(cfg.compile).startswith("per_layer")


def planned_estimate(cfg: TrainConfig, mesh, rules, model_cfg):
    """:func:`functional_pp.plan.estimate` of one training step of ``cfg`` under ``mesh`` and
    ``rules``: the config's optimizer, precision, accumulation, remat, ``reshard_after_forward``
    and pipeline schedule (``functional-pp validate --memory``; ``plan`` estimates its layouts
    with the same arguments, so both give the same peak)."""
    from functional_pp.app.held_models import step_batch
    from functional_pp.app.optimizer import optimizer_from_config
    from functional_pp.plan import estimate
    gb, row = cfg.global_batch(mesh, rules), row_tokens(cfg, mesh, rules)
    batch = step_batch(cfg, gb, row)
    loss, decls, trainable = run_model(cfg, model_cfg, compute_dtype(cfg))
    options = {"keep_gathered": True} if not cfg.reshard_after_forward else {}
    options.update(cfg.offload_options())
    with as_compiled(cfg):
        est = estimate(loss, decls, mesh, rules, batch, optimizer=optimizer_from_config(cfg)[0],
                       precision=cfg.resolved_precision(), grad_accum=cfg.grad_accum(mesh, rules),
                       remat=cfg.activation_checkpointing, options=options, timeline=False, trainable=trainable,
                       schedule=cfg.pp_schedule, virtual_stages=cfg.pp_virtual_stages,
                       pp_fsdp_gather=cfg.pp_fsdp_gather, compiled=compiled_layers(cfg))
    add_rollout(cfg, model_cfg, gb, est)
    return est


def add_rollout(cfg: TrainConfig, model_cfg, global_batch: int, est) -> None:
    """Count an online run's rollout (GRPO, EBFT: app/rollout_memory.py) in ``est``, a step's
    estimate under its mesh and rules: its peak becomes the larger of the rollout's and the
    step's. Nothing for a run without a rollout."""
    from functional_pp.app.rollout_memory import estimate_rollout, hold_rollout
    gen = estimate_rollout(cfg, est.mesh, est.rules, model_cfg, global_batch, compute_dtype(cfg))
    if gen is not None:
        hold_rollout(est, gen)


def planned_memory(cfg: TrainConfig, mesh, rules, model_cfg) -> str:
    """The ``peak:`` line: the per-device peak of one training step of ``cfg`` and its split,
    from :func:`planned_estimate` (the real step on meta tensors; docs/planning.md)."""
    est = planned_estimate(cfg, mesh, rules, model_cfg)
    held = held_line(cfg, mesh, rules, model_cfg)
    if est.rollout is not None:
        from functional_pp.app.rollout_memory import sets_peak
        held = "\n".join(x for x in (rollout_line(est.rollout, sets_peak(est)), held) if x)
    split = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(est.memory.items(), key=lambda kv: -kv[1]) if v)
    line = f"peak:       {human_bytes(est.peak_bytes)} per device in a training step{' or its rollout' if est.rollout is not None else ''} ({split}; plan.estimate)"
    line += (f"\nreserved:   {human_bytes(est.reserved_bytes)} per device by the CUDA caching allocator (the peak and "
             f"{human_bytes(est.reserved_overhead)} of rounded blocks and cached free blocks; plan/allocator.py)")
    return line + (f"\nhost:       {human_bytes(est.host_bytes)} of host memory per device ({est.notes[-1]})"
                   if est.host_bytes else "") + (f"\n{held}" if held else "")


def rollout_line(gen: Any, sets_peak: bool) -> str:
    """The ``rollout:`` line of ``validate --memory``: the rollout's key / value cache and forward,
    its scoring forward (``gen``, app/rollout_memory.py) and whether it sets the peak."""
    return (f"rollout:    key / value cache {human_bytes(gen.cache_bytes)} per device ({gen.batch} rows x "
            f"({gen.prompt} prompt + {gen.new_tokens} new) positions) + forward {human_bytes(gen.forward_bytes)}"
            + (f" + the trained weights in the compute dtype {human_bytes(gen.cast_bytes)}" if gen.cast_bytes else "")
            + (f" + the whole model gathered over pp {human_bytes(gen.gathered_bytes)}" if gen.gathered_bytes else "")
            + (f"; then its {gen.shape.scoring} {human_bytes(gen.scoring_bytes)} ({gen.shape.scored[0]} rows x "
               f"{gen.shape.scored[1]} positions)" if gen.scoring is not None else "")
            + ", "
            f"held with the weights and optimizer state before each step "
            f"({'it sets the peak above' if sets_peak else 'the step peak above is higher'})")


def held_line(cfg: TrainConfig, mesh, rules, model_cfg) -> str | None:
    """The ``reference model:`` (``feature model:``) line of ``validate --memory``: the bytes of
    the frozen copy each device holds (counted in the peak above), or why none is held; None
    when the objective needs no such model (app/held_models.py)."""
    from functional_pp.app.held_models import held_model
    copy = held_model(cfg, model_cfg)
    if copy is None:
        return None
    label = f"{copy.name}:".ljust(11) + " "
    if copy.decls is None:
        return f"{label}{copy.why}"
    family = model_family(cfg)
    ends = family.pipeline_ends(model_cfg) if family.pipeline_ends is not None else ((), ())
    held, _ = _frozen_bytes(copy.decls, lambda tree: _all(tree, False), mesh, rules, ends, cfg.pp_virtual_stages)
    dtypes = "/".join(sorted({str(d.dtype).removeprefix("torch.") for _, d in leaves_with_paths(copy.decls)}))
    return (f"{label}{human_bytes(held)} per device (frozen, {dtypes}, sharded like the policy; weights only, "
            f"in the peak above)")


def _all(tree: Any, value: bool) -> Any:
    from functional_pp.core.tree import tree_map
    return tree_map(lambda _: value, tree)


def mesh_label(mesh) -> str:
    """``dp_shard=2 x tp=2`` (axes of size > 1) or ``1 device``."""
    parts = [f"{a}={s}" for a, s in mesh.shape.items() if s > 1]
    return " x ".join(parts) or "1 device"


def comm_report_text(rep, step: int, mesh, cfg: TrainConfig) -> str:
    head = f"communication of training step {step} on device 0 ({mesh_label(mesh)}), per mesh axis:"
    if cfg.compile:
        head += ("\n(note: compiled steps are not counted; set compile: false to see every "
                 "collective)")
    return head + "\n" + rep.table()
