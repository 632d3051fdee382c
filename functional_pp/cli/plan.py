"""The command line's planning: ``functional-pp plan CONFIG.yaml --devices N --cluster NAME``
ranks the layouts of a training config, and ``layout: auto`` (or ``--layout auto``) picks
the best one for a training run and says why (docs/planning.md, "Command line")."""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import IO

from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.search import Ranking, Space, beam, exhaustive, search
from functional_pp.plan.timing import cost

LAYOUT_MODES = ("manual", "auto")


def _model(cfg):
    """``(loss, declarations, trainable mask)`` of the run, as ``train`` builds them (adapters,
    frozen parameters, a quantized base), the weights in the compute dtype (a frozen base is
    held in it; trained weights get fp32 masters in the step's state)."""
    from functional_pp.app.report import compute_dtype, run_model
    from functional_pp.config import model_config
    return run_model(cfg, model_config(cfg), compute_dtype(cfg))     # base_model's config.json, or the preset


def global_batch_for(cfg, n_devices: int) -> int:
    """Sequences per step under ``layout: auto``: ``global_batch_size``, or
    micro_batch_size x gradient_accumulation_steps x the device count (all data parallel)."""
    if cfg.global_batch_size is not None:
        return cfg.global_batch_size
    return cfg.micro_batch_size * cfg.gradient_accumulation_steps * n_devices


def rank_layouts(cfg, n_devices: int, cluster="h100x8", *, memory_gb: float | None = None,
                 strategy: str = "auto", orders: str = "default", space: Space | None = None,
                 stream: IO[str] | None = None, float8: bool = False) -> Ranking:
    """Rank the layouts of training config ``cfg`` on ``n_devices`` of ``cluster`` (``float8``:
    costed with Float8 linear layers, ``plan.cost(..., float8=True)``)."""
    _check_searchable(cfg)
    loss, decls, trainable = _model(cfg)
    gb = global_batch_for(cfg, n_devices)
    batch = {"tokens": ((gb, cfg.sequence_len), "batch seq"), "labels": ((gb, cfg.sequence_len), "batch seq")}
    prec = cfg.resolved_precision()
    space = space or Space(orders=orders, precision=prec, grad_accum=(cfg.gradient_accumulation_steps,))
    strat = {"exhaustive": exhaustive, "beam": beam(4), "auto": None}[strategy]
    out = stream or sys.stderr

    def progress(i, n, name):
        print(f"\r  estimating {i + 1}/{n}: {name[:60]:<60}", end="", file=out, flush=True)
    ranking = search(loss, decls, n_devices, batch, cluster=cluster, space=space, strategy=strat,
                     memory_limit_bytes=memory_gb * 1e9 if memory_gb else None, progress=progress,
                     trainable=trainable, pp_fsdp_gather=cfg.pp_fsdp_gather,
                     cost_model=functools.partial(cost, float8=float8))
    print("\r" + " " * 90 + "\r", end="", file=out, flush=True)
    return ranking


def explain(ranking: Ranking, top: int = 3) -> str:
    """Why the first layout won: its numbers against the runners-up."""
    if not ranking:
        return "no layout could be estimated:\n" + "\n".join(f"  {m}: {w}" for m, w in ranking.rejected[:10])
    best = ranking[0]
    t = best.time
    lines = [f"chose {best.describe()}: step {t.step_s:.4g} s (compute {t.compute_s:.4g}, exposed communication "
             f"{t.exposed_comm_s:.4g}, hidden {t.hidden_comm_s:.4g}), MFU {t.mfu:.2f}, peak memory "
             f"{best.peak_bytes / 1e9:.4g} GB of {ranking.memory_limit_bytes / 1e9:.0f} GB"
             f"; axes {', '.join(f'{a}: {w}-node' for a, w in t.placement.items()) or 'none'}"]
    busiest = sorted(t.by_collective.items(), key=lambda kv: -kv[1])[:4]
    if busiest:
        lines.append("  its collectives (s per step): " + ", ".join(f"{k} {v:.3g}" for k, v in busiest))
    parts = sorted(best.memory.items(), key=lambda kv: -kv[1])[:5]
    lines.append("  its peak memory (GB): " + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in parts)
                 + f" (at {best.runs[-1].peak_at})")
    for e in ranking[1:top]:
        over = " (over memory)" if e.peak_bytes > (ranking.memory_limit_bytes or float("inf")) else ""
        lines.append(f"  vs {e.describe()}: {e.time.step_s:.4g} s, {e.peak_bytes / 1e9:.4g} GB{over}")
    return "\n".join(lines)


def apply_layout(cfg, est, n_devices: int):
    """A copy of ``cfg`` that trains with the layout of estimate ``est`` (mesh sizes,
    sequence parallelism, FSDP axes, activation checkpointing, micro batch)."""
    s = est.mesh.shape
    hidden = tuple(est.rules.table.get("hidden") or ())
    sp = "tp" in est.rules["res_seq"]     # sequence parallelism: the residual also split over tp
    gb = global_batch_for(cfg, n_devices)
    dp = s.get("dp_replicate", 1) * s.get("dp_shard", 1)
    ga = est.settings.get("grad_accum", 1)
    rules = dict(cfg.rules)
    rules["hidden"] = list(hidden) if hidden else None
    return dataclasses.replace(cfg, layout="manual", dp_replicate_size=s.get("dp_replicate", 1),
                               dp_shard_size=s.get("dp_shard", 1), cp_size=s.get("cp", 1), tp_size=s.get("tp", 1),
                               sequence_parallel=sp, rules=rules, global_batch_size=gb,
                               micro_batch_size=gb // (dp * ga), gradient_accumulation_steps=ga,
                               activation_checkpointing=est.settings.get("remat") or False)


# the dimension names the search's rules split (plan/search.py's rules for Llama-named models)
SEARCHED_DIMS = ("batch", "seq", "res_seq", "hidden", "heads", "kv_heads", "mlp", "vocab")


def _check_searchable(cfg) -> None:
    """``layout: auto`` needs a model whose dimensions are named as the search's rules expect."""
    from functional_pp.config import ConfigError
    from functional_pp.config.checks import known_dims
    missing = [d for d in SEARCHED_DIMS if d not in known_dims(cfg)]
    if missing:
        raise ConfigError(f"layout: auto ranks rules over Llama's dimension names; model family "
                          f"{cfg.model.family!r} has no {', '.join(missing)}: give the mesh sizes and "
                          f"rules by hand (layout: manual)")


def auto_layout(cfg, n_devices: int, cluster="h100x8", stream: IO[str] | None = None):
    """``layout: auto``: search, print the choice and why, return the config to train with."""
    out = stream or sys.stdout
    space = Space(precision=cfg.resolved_precision(), grad_accum=(cfg.gradient_accumulation_steps,),
                  keep_gathered=(False,), cp_attention=("ring",),
                  remat=(False,) if cfg.compile else (False, True))
    cl = as_cluster(cluster)
    print(f"layout: auto — ranking layouts of {n_devices} devices on {cl.name}", file=out)
    ranking = rank_layouts(cfg, n_devices, cl, space=space, stream=out)
    fitting = [e for e in ranking if e.settings.get("fits", True)]
    if not fitting:
        from functional_pp.config import ConfigError
        raise ConfigError(f"layout: auto found no layout of {n_devices} devices within {cl.memory_bytes / 1e9:.0f} GB "
                          f"per device (smallest peak: {min((e.peak_bytes for e in ranking), default=0) / 1e9:.1f} GB); "
                          f"use more devices, a smaller micro batch or activation_checkpointing")
    print(explain(ranking), file=out)
    return apply_layout(cfg, fitting[0], n_devices)


def add_parser(sub) -> None:
    """The ``plan`` subcommand's arguments."""
    p = sub.add_parser("plan", help="rank the layouts of a config without running it",
                       description="Dry-run every layout of N devices (meshes x rules x options) on one "
                                   "representative device with meta tensors and rank them by a time model "
                                   "of the cluster; prints the table (and JSON with --json).")
    p.add_argument("config", help="YAML training config (the model, batch and sequence length are used)")
    p.add_argument("--devices", type=int, required=True, metavar="N", help="number of devices")
    p.add_argument("--cluster", default="h100x8", help="cluster preset: h100x8, h100x8-gt, h200x8, a100x8, l40sx4")
    p.add_argument("--memory-gb", type=float, default=None, help="memory limit per device (default: the cluster's)")
    p.add_argument("--strategy", choices=("auto", "exhaustive", "beam"), default="auto")
    p.add_argument("--orders", choices=("default", "all"), default="default",
                   help="also try every order of the mesh axes (which axes stay inside a node)")
    p.add_argument("--pp", default="1", metavar="SIZES",
                   help="pipeline sizes to try, e.g. 1,2,4 (1F1B and interleaved 1F1B, as many micro-batches as stages)")
    p.add_argument("--ep", default="1", metavar="SIZES", help="expert-parallel sizes to try (MoE models), e.g. 1,2")
    p.add_argument("--float8", action="store_true",
                   help="cost the layers' linear matmuls in Float8 (torchtitan's Float8 training; FP8 peak of the cluster)")
    p.add_argument("--top", type=int, default=20, help="rows to print")
    p.add_argument("--json", metavar="FILE", default=None, help="write the ranking as JSON")


def run(args) -> int:
    """``functional-pp plan``: returns the exit status."""
    from functional_pp.config import ConfigError, TrainConfig
    try:
        cfg = TrainConfig.from_yaml(args.config, list(getattr(args, "overrides", []) or []))
        if args.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {args.devices}")
        cl = as_cluster(args.cluster)
        pp, ep = _sizes("--pp", args.pp), _sizes("--ep", args.ep)
    except (ConfigError, ValueError) as exc:
        print(f"functional-pp: {exc}", file=sys.stderr)
        return 2
    space = Space(orders=args.orders, precision=cfg.resolved_precision(),
                  grad_accum=(cfg.gradient_accumulation_steps,), pp=pp, ep=ep)
    try:
        if args.float8 and not cl.peak_fp8_flops:
            raise ValueError(f"--float8: cluster {cl.name!r} has no FP8 matmuls; choose one with FP8 (h100x8, "
                             f"h100x8-gt, h200x8, l40sx4)")
    except ValueError as exc:
        print(f"functional-pp: {exc}", file=sys.stderr)
        return 2
    ranking = rank_layouts(cfg, args.devices, cl, memory_gb=args.memory_gb, strategy=args.strategy, space=space,
                           float8=args.float8)
    print(f"{len(ranking)} layouts of {args.devices} devices on {cl.name} "
          f"(memory limit {ranking.memory_limit_bytes / 1e9:.0f} GB per device), best first:")
    print(ranking.table(args.top))
    print(explain(ranking))
    front = ranking.pareto()
    print("Pareto front (time, memory): " + "; ".join(
        f"{e.describe()} {e.time.step_s:.4g} s {e.peak_bytes / 1e9:.4g} GB" for e in front))
    if ranking.rejected:
        print(f"{len(ranking.rejected)} layouts rejected, e.g. {ranking.rejected[0][0]}: {ranking.rejected[0][1]}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(ranking.to_json())
        print(f"wrote {args.json}")
    return 0


def _sizes(flag: str, text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"{flag} takes sizes >= 1 separated by commas, e.g. {flag} 1,2,4; got {text!r}")
    return sizes


def auto_layout_for_run(cfg, simulate: int | None, cluster: str = "h100x8"):
    """``layout: auto`` for ``functional-pp train``: the device count from torchrun or
    ``--simulate N``; the chosen layout replaces the config's mesh and rules."""
    import os

    from functional_pp.config import ConfigError
    from functional_pp.devices.launch import under_torchrun
    n = int(os.environ["WORLD_SIZE"]) if under_torchrun() else simulate
    if n is None:
        raise ConfigError("layout: auto needs the device count: run under torchrun or pass --simulate N")
    return auto_layout(cfg, n, cluster)
