"""Command line: ``functional-pp train CONFIG.yaml`` (or ``python -m functional_pp train ...``).

Examples::

    functional-pp train examples/configs/fsdp.yaml                 # simulated devices on a CPU machine
    functional-pp train cfg.yaml --simulate 8 --max-steps 20 --output runs/try
    functional-pp train cfg.yaml --sim-mode batched                 # all simulated devices in one batched run
    functional-pp train cfg.yaml --set learning_rate=1e-3 --set data.path=corpus.txt
    functional-pp train cfg.yaml --resume                           # continue from the newest checkpoint
    torchrun --nproc_per_node 8 -m functional_pp train cfg.yaml     # one process per device
    functional-pp generate runs/try --prompt "Once upon a time"     # try what a run trained
"""
from __future__ import annotations

import argparse
import sys

from functional_pp.cli.errors import run_reporting_errors
from functional_pp.config import ConfigError, TrainConfig, config_help
from functional_pp.version import __version__

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``functional-pp`` command."""
    parser = argparse.ArgumentParser(
        prog="functional-pp",
        description="Functional training on PyTorch: layouts from named dimensions.")
    parser.add_argument("--version", action="version", version=f"functional-pp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    t = sub.add_parser(
        "train", help="train a model from a YAML config",
        description="Train a model (a preset or a Hugging Face base_model of a supported family) as a YAML config says (Accelerate / Axolotl key names). "
                    "Outside torchrun, on a machine without accelerators, a multi-device mesh "
                    "runs on simulated devices in this process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (generated from functional_pp.config's schema):\n" + config_help())
    t.add_argument("config", help="YAML config file")
    t.add_argument("--simulate", type=int, metavar="N", default=None,
                   help="run the mesh on N simulated devices in this process (default outside "
                        "torchrun without accelerators: the mesh's size)")
    from functional_pp.cli.commands import add_sim_mode_flag
    add_sim_mode_flag(t)
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in the output directory")
    t.add_argument("--max-steps", type=int, metavar="N", default=None,
                   help="override max_steps (also the length of the lr schedule)")
    t.add_argument("--output", metavar="DIR", default=None, help="override logging.output_dir")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (dotted keys for sections, YAML values), "
                        "e.g. --set tp_size=2 --set data.path=corpus.txt; repeatable")
    t.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue even if the config changes the results "
                        "(model, data, optimizer, batch, schedule...)")
    t.add_argument("--overwrite-output", action="store_true",
                   help="with resume_from_checkpoint: PATH elsewhere: write into an output directory "
                        "that holds another run's checkpoints or metrics (default: refused)")
    t.add_argument("--debug", action="store_true",
                   help="print the full traceback of an error (default: one line)")
    t.add_argument("--layout", choices=("manual", "auto"), default=None,
                   help="auto: choose the mesh and rules with functional_pp.plan (prints why)")
    t.add_argument("--cluster", default="h100x8",
                   help="cluster preset the auto layout is chosen for (h100x8, h200x8, a100x8, l40sx4)")
    from functional_pp.cli.commands import add_commands
    add_commands(sub)
    from functional_pp.cli.plan import add_parser as add_plan_parser
    add_plan_parser(sub)
    from functional_pp.cli.generate import add_parser as add_generate_parser
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 runtime error, 2 config error,
    3 training stopped on non-finite values; see :mod:`functional_pp.cli.errors`)."""
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return run_reporting_errors(lambda: _train(args), debug=getattr(args, "debug", False))
    if args.command == "plan":            # behind the one-line error handler too
        from functional_pp.cli.plan import run as plan_run
        return run_reporting_errors(lambda: plan_run(args), debug=getattr(args, "debug", False))
    if args.command == "generate":
        from functional_pp.cli.generate import run as generate_run
        return run_reporting_errors(lambda: generate_run(args), debug=getattr(args, "debug", False))
    from functional_pp.cli.commands import run_command
    status = run_reporting_errors(lambda: run_command(args), debug=getattr(args, "debug", False))
    return 2 if status is None else status  # pragma: no cover - argparse rejects unknown commands


def _train(args: argparse.Namespace) -> int:
    from functional_pp.app.loop import train
    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"max_steps={args.max_steps}")
    if args.output is not None:
        overrides.append(f"logging.output_dir={args.output}")
    if args.sim_mode is not None:
        overrides.append(f"simulation={args.sim_mode}")
    try:
        cfg = TrainConfig.from_yaml(args.config, overrides)
        if (args.layout or cfg.layout) == "auto":
            from functional_pp.cli.plan import auto_layout_for_run
            cfg = auto_layout_for_run(cfg, args.simulate, args.cluster)
        train(cfg, simulate=args.simulate, resume=args.resume,
              allow_config_change=args.allow_config_change, overwrite_output=args.overwrite_output)
    except ConfigError as exc:
        print(f"functional-pp: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
