"""The ``generate`` subcommand of ``functional-pp`` (docs/generation.md, "From the command line")::

    functional-pp generate runs/finetune --prompt "What is 2 plus 3?"        # greedy, one device
    functional-pp generate HF_DIR --prompt A --prompt B --chat --temperature 0.7 --top-p 0.9 --seed 1
    functional-pp generate runs/finetune --prompt A --simulate 4 --set tp_size=2 --json
    torchrun --nproc_per_node 2 -m functional_pp generate runs/finetune --prompt A --set tp_size=2
    functional-pp generate runs/finetune --prompt A --compile                 # a compiled decode step
"""
from __future__ import annotations

import argparse
import os
import sys

from functional_pp.config import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Register ``generate`` on the ``functional-pp`` subparsers."""
    g = sub.add_parser("generate", help="generate text from a trained run or a Hugging Face directory",
                       description="Load a training run's newest checkpoint (adapters merged; the run's tokenizer "
                                   "and chat template) or a Hugging Face model directory, generate a completion of "
                                   "each prompt (one left-padded batch) and print them, one per prompt. Stops at "
                                   "the tokenizer's EOS and the chat end-of-turn token.")
    g.add_argument("source", help="run output directory, checkpoint directory, or Hugging Face model directory")
    g.add_argument("--prompt", dest="prompts", action="append", required=True, metavar="TEXT",
                   help="a prompt to complete; repeatable (one batch)")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user turn, rendered with the chat template and its generation prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="new tokens at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely (default 0: all)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed (default 0)")
    g.add_argument("--compile", nargs="?", const=True, default=False, metavar="BACKEND",
                   help="each new token's forward one torch.compile graph over a static cache (default backend "
                        "inductor; or a backend name, e.g. aot_eager)")
    g.add_argument("--memory", action="store_true",
                   help="print the memory per device a generation would hold (weights, key / value cache, one "
                        "forward; a dry run on meta tensors) instead of generating")
    g.add_argument("--step", type=int, default=None, help="a run's checkpoint of this step (default: the newest)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: {completions: [{prompt, completion, completion_ids, finish_reason}]}")
    g.add_argument("--simulate", type=int, metavar="N", default=None,
                   help="generate on N simulated devices (the run's layout, or --set tp_size=...)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a layout key (dp_shard_size, tp_size, dp_replicate_size); repeatable")
    g.add_argument("--debug", action="store_true", help="print the full traceback of an error (default: one line)")


def _layout(overrides: list[str]) -> dict:
    from functional_pp.app.generate_run import LAYOUT_KEYS
    aliases = {"tensor_parallel_size": "tp_size"}
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = aliases.get(key.strip(), key.strip())
        if not sep or key not in LAYOUT_KEYS:
            raise ConfigError(f"--set {item}: generate takes the layout keys {', '.join(LAYOUT_KEYS)} as KEY=N")
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"--set {item}: {key} must be an integer") from None
        if out[key] < 1 and not (key == "dp_shard_size" and out[key] == -1):
            raise ConfigError(f"--set {item}: {key} must be >= 1")
    return out


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:          # (NaN too: it failed inside the sampler, exit 1)
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    from functional_pp.app.generate_run import check_compile
    try:
        check_compile(args.compile)
    except ValueError as e:
        raise ConfigError(f"--compile: {e}") from None
    if args.simulate is not None and args.simulate < 1:
        raise ConfigError(f"--simulate must be >= 1, got {args.simulate}")


def run(args: argparse.Namespace) -> int:
    """Run ``generate``: the completions on stdout (rank 0 only under torchrun); exit status 0."""
    from functional_pp.app.generate_run import (as_json, complete, decode_completion, encode_prompts,
                                                generation_memory, load_model)
    from functional_pp.devices.launch import under_torchrun
    _check(args)
    layout = _layout(args.overrides)
    torchrun = under_torchrun()
    if torchrun and args.simulate is not None:
        raise ConfigError("--simulate: not under torchrun (each process is one device there)")
    model = load_model(args.source, args.step)
    prompt_ids = encode_prompts(model, args.prompts, args.chat, args.max_new_tokens)
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.simulate or 1)
    if args.memory:
        if not torchrun or int(os.environ.get("RANK", "0")) == 0:
            print(generation_memory(model, prompt_ids, max_new_tokens=args.max_new_tokens, world_size=world,
                                    layout=layout))
        return 0
    got = complete(model, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, world_size=world, layout=layout,
                   simulate=not torchrun, compile=args.compile)
    if torchrun and int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(as_json(args.prompts, got, model))
    else:
        for ids in got:
            print(decode_completion(model, ids)[0])
    sys.stdout.flush()
    return 0
