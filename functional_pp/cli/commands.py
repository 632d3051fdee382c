"""The ``validate`` and ``export`` subcommands of ``functional-pp`` (``train`` is in
:mod:`functional_pp.cli`)::

    functional-pp validate CONFIG.yaml [--simulate N]     # check, print the resolved plan, no training
    functional-pp export RUN_DIR|CHECKPOINT OUT_DIR        # a Hugging Face directory
"""
from __future__ import annotations

import argparse
import sys

from functional_pp.config import ConfigError, TrainConfig, model_family

__all__ = ["add_commands", "run_command", "add_sim_mode_flag"]


def add_sim_mode_flag(parser: argparse.ArgumentParser) -> None:
    """``--sim-mode`` (of ``train`` and ``validate``): the config's ``simulation`` key (app/sim_mode.py)."""
    parser.add_argument("--sim-mode", choices=("threaded", "batched", "auto"), default=None,
                        help="how simulated devices run (config key simulation): threaded = one "
                             "thread per device (default), batched = all devices in one batched "
                             "run (same numbers, faster), auto = batched unless the config needs "
                             "threads (compile)")


def add_commands(sub) -> None:
    """Register ``validate`` and ``export`` on the ``functional-pp`` subparsers."""
    v = sub.add_parser("validate", help="check a config and print the resolved plan without training",
                       description="Check a config (keys, values, mesh against the world size, "
                                   "model, data) and print the start-up summary: device, mesh, "
                                   "rules, memory per device, batch, data. Nothing is trained or "
                                   "written.")
    v.add_argument("config", help="YAML config file")
    v.add_argument("--simulate", type=int, metavar="N", default=None,
                   help="check against N devices (default: the mesh's size)")
    add_sim_mode_flag(v)
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as for train")
    v.add_argument("--output", metavar="DIR", default=None, help="override logging.output_dir")
    v.add_argument("--memory", action="store_true",
                   help="also dry-run one training step (functional_pp.plan.estimate) and print the "
                        "peak memory per device with activations and temporaries (a few seconds)")
    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory",
                       description="Export the newest checkpoint of RUN_DIR (or a checkpoint "
                                   "directory) as config.json + safetensors shards with an index "
                                   "+ the base model's tokenizer files, loadable by transformers.")
    e.add_argument("source", help="run directory, checkpoint root or step directory")
    e.add_argument("out", help="output directory")
    e.add_argument("--step", type=int, default=None, help="export this step (default: the newest)")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast the weights (default: as saved, fp32)")
    e.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    e.add_argument("--merge-adapter", action="store_true",
                   help="a LoRA run: merge the adapters into the weights and write a plain Hugging Face "
                        "model (default: the PEFT adapter directory, adapter_config.json + "
                        "adapter_model.safetensors)")


def run_command(args: argparse.Namespace) -> int | None:
    """Run ``validate`` / ``export``; None for other commands."""
    if args.command == "validate":
        return _validate(args)
    if args.command == "export":
        return _export(args)
    return None


def _validate(args: argparse.Namespace) -> int:
    from functional_pp.app.inputs import check_batches, load_data, model_config
    from functional_pp.app.report import describe, planned_memory
    from functional_pp.app.world import describe_device, resolve_world, select_device
    from functional_pp.devices.launch import under_torchrun
    try:
        overrides = list(args.overrides)
        if args.output is not None:
            overrides.append(f"logging.output_dir={args.output}")
        if args.sim_mode is not None:
            overrides.append(f"simulation={args.sim_mode}")
        cfg = TrainConfig.from_yaml(args.config, overrides)
        world = resolve_world(cfg, args.simulate)
        cfg.validate(world.size, launcher=world.launcher)
        mesh = cfg.mesh(world.size)
        rules = cfg.build_rules(mesh)
        from functional_pp.app import ebft_run, grpo_run
        from functional_pp.app.reward_run import is_reward_run
        grpo = grpo_run.grpo_settings(cfg) if grpo_run.is_grpo(cfg) else None
        ebft = ebft_run.ebft_settings(cfg) if ebft_run.is_ebft(cfg) else None
        pairs = cfg.rl is not None or is_reward_run(cfg)     # (a reward model's data: pairs or stepwise rows)
        if not pairs:
            data = load_data(cfg)
        elif grpo is not None:         # prompts and reward functions (docs/preference.md "GRPO")
            grpo_run.reward_functions(cfg, grpo)
            data = grpo_run.load_prompts(cfg, grpo)
        elif ebft is not None:         # documents (docs/preference.md "EBFT")
            data = ebft_run.load_documents(cfg)
        else:                          # preference pairs / KTO completions / reward-model data
            from functional_pp.app.preference_run import load_pairs, pair_steps, preference_spec
            preference_spec(cfg)
            data = load_pairs(cfg)
        model_cfg = model_config(cfg)
        vocab = model_family(cfg).vocab_size(model_cfg)
        if data.vocab_size > vocab:
            raise ConfigError(f"the data has vocabulary {data.vocab_size} but the model only {vocab}")
        gb = cfg.global_batch(mesh, rules)
        if grpo is not None:
            per_step = grpo_run.prompts_per_step(gb, grpo, data.train)
            cfg.set_epochs(grpo_run.steps_per_epoch(data.train, per_step, grpo))
        elif ebft is not None:
            cfg.set_epochs(ebft_run.steps_per_epoch(data.train, gb))
        else:
            cfg.set_epochs(check_batches(cfg, data, gb) if not pairs else pair_steps(data.train, gb, cfg))
        from functional_pp.app.optimizer import optimizer_from_config
        optimizer_from_config(cfg)     # the optimizer's own range checks (adam_beta2: 1.5), as train makes them
        device = select_device(world.simulate, world.size, under_torchrun())
        print(describe(cfg, world, mesh, rules, model_cfg, data.train,
                       device_text=describe_device(device, world.simulate, world.size, world.sim_mode),
                       val=data.val, verbose_data=True))
        if grpo is not None:
            print(grpo_run.summary_line(grpo, per_step))
        if ebft is not None:
            print(ebft_run.summary_line(ebft, gb, model_cfg.layers))
        if args.memory:
            print(planned_memory(cfg, mesh, rules, model_cfg))
    except ConfigError as exc:
        print(f"functional-pp: config error: {exc}", file=sys.stderr)
        return 2
    print(f"config ok: {args.config} (nothing was trained or written)")
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from functional_pp.app.export import export_run
    from functional_pp.checkpoint import CheckpointError
    try:
        out, what = export_run(args.source, args.out, step=args.step, max_shard_size=args.max_shard_size,
                               dtype=getattr(torch, args.dtype) if args.dtype else None,
                               merge_adapter=args.merge_adapter, described=True)
    except (CheckpointError, ValueError) as exc:
        print(f"functional-pp export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.source} to {out} ({what})")
    return 0
