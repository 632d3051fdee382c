"""The command line's planning: ``functional-pp plan CONFIG.yaml --devices N --cluster NAME``
ranks the layouts of a training config, and ``layout: auto`` (or ``--layout auto``) picks
the best one for a training run and says why (docs/planning.md, "Command line")."""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from textwrap import indent
from typing import IO

from functional_pp.app.report import human_bytes
from functional_pp.app.row_tokens import row_tokens, step_tokens

from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.cluster import PRESETS, describe_presets
from functional_pp.plan.search import GIB, Ranking, Space, beam, exhaustive, search
from functional_pp.plan.timing import cost

LAYOUT_MODES = ("manual", "auto")


def _model(cfg):
    """``(loss, declarations, trainable mask)`` of the run, as ``train`` builds them (adapters,
    frozen parameters, a quantized base), the weights in the compute dtype (a frozen base is
    held in it; trained weights get fp32 masters in the step's state)."""
    from functional_pp.app.report import compute_dtype, run_model
    from functional_pp.config import model_config
    return run_model(cfg, model_config(cfg), compute_dtype(cfg))     # base_model's config.json, or the preset


#: the loss-chunk counts ``plan`` tries where the config leaves ``loss_chunks`` free (Axolotl's
#: cut_cross_entropy and chunked_cross_entropy default: 8)
LOSS_CHUNKS = (8,)


def chunkable(cfg) -> bool:
    """Whether ``cfg``'s model takes ``loss_chunks`` (config/models.py ``loss_chunking_refused``:
    a chunked head loss, logits not soft-capped, scaled or biased, the next-token objective)."""
    from functional_pp.config import model_config
    from functional_pp.config.models import loss_chunking_refused
    return loss_chunking_refused(cfg, model_config(cfg)) is None


def _loss_for(cfg):
    """``loss_for(chunks)`` for :func:`~functional_pp.plan.search`: the run's loss with the model
    config's ``loss_chunks`` set to ``chunks`` (as training with ``loss_chunks: chunks`` builds it)."""
    from functional_pp.app.report import compute_dtype, run_model
    from functional_pp.config import model_config

    def loss_for(chunks: int):
        model = dataclasses.replace(model_config(cfg), loss_chunks=chunks, loss_chunk_bytes=None)
        return run_model(cfg, model, compute_dtype(cfg))[0]
    return loss_for


def global_batch_for(cfg, n_devices: int) -> int:
    """Sequences per step under ``layout: auto``: ``global_batch_size``, or
    micro_batch_size x gradient_accumulation_steps x the device count (all data parallel)."""
    if cfg.global_batch_size is not None:
        return cfg.global_batch_size
    return cfg.micro_batch_size * cfg.gradient_accumulation_steps * n_devices


#: context parallelism is searched up to the size that leaves each device this many tokens of a sequence
CP_MIN_TOKENS = 1024


def config_space(cfg, *, orders: str = "default", pp: tuple[int, ...] = (1,), ep: tuple[int, ...] = (1,),
                 max_axis: dict | None = None) -> Space:
    """The layouts ``plan`` and ``layout: auto`` search for ``cfg``: what the config fixes is
    fixed (``activation_checkpointing``, ``micro_batch_size``, ``reshard_after_forward``
    when given), what it leaves free is searched (no, selective and whole-layer checkpointing;
    every micro-batch size that divides the local batch; FSDP re-gathering or not; the LM head and
    loss whole or over :data:`LOSS_CHUNKS` token chunks where the model takes ``loss_chunks``,
    :func:`chunkable`, and the config gives neither it nor ``loss_chunk_bytes``), with the
    mesh, FSDP axes and sequence parallelism; only options a config can express (so the chosen
    layout can be pasted: :func:`layout_keys`). ``max_axis`` caps axis sizes (default: cp up to
    :data:`CP_MIN_TOKENS` tokens per device, a shorter split only adds ring steps; a model whose layers are
    a recurrence along the sequence is searched too: the time model runs their blocks device after device,
    ``plan.timing.run_components``)."""
    given = cfg._given
    remat = (cfg.activation_checkpointing,) if "activation_checkpointing" in given else (False, "selective", "selective_alternate", True)
    micro = (cfg.micro_batch_size,) if "micro_batch_size" in given else "all"
    keep = (not cfg.reshard_after_forward,) if "reshard_after_forward" in given else (False, True)
    if cfg.loss_chunk_bytes or not chunkable(cfg):
        chunks = (None,)        # (loss_chunk_bytes: the config's loss chunks it by bytes)
    elif "loss_chunks" in given or cfg.loss_chunks is not None:
        chunks = (cfg.loss_chunks or None,)
    else:
        chunks = (None, *LOSS_CHUNKS)
    return Space(orders=orders, precision=cfg.resolved_precision(), remat=remat, micro_batch_sizes=micro,
                 loss_chunks=chunks,
                 keep_gathered=keep, regather_activations=(False,), cp_attention=("ring",), pp=pp, ep=ep,
                 offload_params=(cfg.offload_params,), activation_offloading=(cfg.activation_offloading,),
                 max_axis={"cp": max(1, row_tokens(cfg) // CP_MIN_TOKENS), **(max_axis or {})})


def rank_layouts(cfg, n_devices: int, cluster="h100x8", *, memory_gb: float | None = None,
                 memory_gib: float | None = None,
                 strategy: str = "auto", orders: str = "default", space: Space | None = None,
                 stream: IO[str] | None = None, float8: bool = False, jobs: int | None = None) -> Ranking:
    """Rank the layouts of training config ``cfg`` on ``n_devices`` of ``cluster`` (``float8``:
    costed with Float8 linear layers, ``plan.cost(..., float8=True)``, their buffers in the
    memory, ``plan.estimate(..., float8=True)``). Each layout is estimated
    as ``validate --memory`` estimates the config (its optimizer, precision, trained parameters);
    progress goes to ``stream`` (default stderr), rewritten in place only on a terminal; ``jobs``:
    worker processes for the dry-runs (default one per core; the ranking is the same)."""
    from functional_pp.app.held_models import step_batch
    from functional_pp.app.optimizer import optimizer_from_config
    from functional_pp.app.report import add_rollout, as_compiled, compiled_layers
    from functional_pp.config import model_config
    _check_searchable(cfg)
    loss, decls, trainable = _model(cfg)
    gb = global_batch_for(cfg, n_devices)
    space = space or config_space(cfg, orders=orders)
    row = row_tokens(cfg, multiple=_cp_multiple(n_devices, space.max_axis.get("cp", n_devices)))
    batch = step_batch(cfg, gb, row)       # (a pair objective's chosen and rejected rows)
    strat = {"exhaustive": exhaustive, "beam": beam(4), "auto": None}[strategy]
    out = stream or sys.stderr
    live = out.isatty() if hasattr(out, "isatty") else False

    def progress(i, n, name):
        if live:
            print(f"\r  estimating {i + 1}/{n}: {name[:60]:<60}", end="", file=out, flush=True)
    started = time.perf_counter()
    limit = memory_gib * GIB if memory_gib else memory_gb * 1e9 if memory_gb else None
    with as_compiled(cfg):      # (the same dry-run as validate --memory's)
        ranking = search(loss, decls, n_devices, batch, cluster=cluster, space=space, strategy=strat,
                         memory_limit_bytes=limit, progress=progress, trainable=trainable,
                         pp_fsdp_gather=cfg.pp_fsdp_gather, optimizer=optimizer_from_config(cfg)[0],
                         compiled=compiled_layers(cfg), cost_model=functools.partial(cost, float8=float8),
                         float8=float8,
                         amend=functools.partial(add_rollout, cfg, model_config(cfg), gb),
                         tokens_per_step=step_tokens(cfg, gb, row), jobs=jobs, loss_for=_loss_for(cfg))
    print(("\r" + " " * 90 + "\r" if live else "") + f"  estimated {len(ranking) + len(ranking.rejected)} layouts "
          f"in {time.perf_counter() - started:.0f} s", file=out, flush=True)
    return ranking


def _cp_multiple(n_devices: int, max_cp: int) -> int:
    """A row length every searched context-parallel size splits in load-balanced chunks: the least
    common multiple of 2 x cp over the cp sizes (divisors of ``n_devices``, at most ``max_cp``)."""
    return math.lcm(*(2 * c for c in range(1, min(max_cp, n_devices) + 1) if n_devices % c == 0))


def explain(ranking: Ranking, cfg=None, top: int = 3) -> str:
    """Why the first layout that fits won: its numbers against the runners-up, and (with the
    training config ``cfg``) the config keys that train it; or, when none fits, the nearest
    layout and what would make it fit."""
    if not ranking:
        return "no layout could be estimated:\n" + "\n".join(f"  {m}: {w}" for m, w in ranking.rejected[:10])
    fitting = ranking.fitting()
    if not fitting:
        return no_fit(ranking, cfg)
    best = fitting[0]
    t = best.time
    lines = [f"chose {best.describe()}:",
             f"  step {t.step_s:.4g} s, {ranking.tokens_per_s_per_device(best):,.0f} tokens/s per device, MFU "
             f"{t.mfu:.2f} (compute {t.compute_s:.4g} s, exposed communication {t.exposed_comm_s:.4g} s, hidden "
             f"{t.hidden_comm_s:.4g} s); peak memory {human_bytes(best.peak_bytes)} (reserved "
             f"{human_bytes(best.reserved_bytes)}) of "
             f"{human_bytes(ranking.memory_limit_bytes)} per device"
             + (f", host memory {human_bytes(best.host_bytes)} per device" if best.host_bytes else ""),
             f"  axes: {', '.join(f'{a} {w}-node' for a, w in t.placement.items()) or 'none'}"]
    busiest = sorted(t.by_collective.items(), key=lambda kv: -kv[1])[:4]
    if busiest:
        lines.append("  its collectives (s per step): " + ", ".join(f"{k} {v:.3g}" for k, v in busiest))
    parts = sorted(best.memory.items(), key=lambda kv: -kv[1])[:5]
    lines.append("  its peak memory: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in parts)
                 + f" (at {best.runs[-1].peak_at})")
    for e in fitting[1:top]:
        lines.append(f"  vs {e.describe()}: {e.time.step_s:.4g} s, {ranking.tokens_per_s_per_device(e):,.0f} "
                     f"tokens/s per device, {human_bytes(e.peak_bytes)}")
    if cfg is not None:
        lines.append("to train it, set in the config:\n" + indent(layout_yaml(cfg, best, ranking.devices), "  "))
    return "\n".join(lines)


def no_fit(ranking: Ranking, cfg=None) -> str:
    """No layout is within the memory limit: say so, name the nearest and what would make it fit."""
    limit = ranking.memory_limit_bytes
    near = min(ranking, key=lambda e: e.reserved_bytes)
    over = near.reserved_bytes - limit
    lines = [f"NO LAYOUT FITS: none of the {len(ranking)} layouts estimated is within {human_bytes(limit)} per "
             f"device. The nearest is {near.describe()} at {human_bytes(near.reserved_bytes)} reserved (peak "
             f"{human_bytes(near.peak_bytes)}; {human_bytes(over)} over; state {human_bytes(near.state_bytes)}, activations at the peak "
             f"{human_bytes(near.memory.get('activations', 0))}). What would make it fit:"]
    given = cfg._given if cfg is not None else set()
    if near.settings.get("remat") is not True:
        why = " (the config fixes activation_checkpointing; remove it to let plan search it)" \
            if "activation_checkpointing" in given else ""
        lines.append(f"  - whole-layer activation checkpointing: activation_checkpointing: true{why}")
    if (cfg is not None and not near.settings.get("loss_chunks") and not cfg.loss_chunk_bytes
            and not any(e.settings.get("loss_chunks") for e in ranking) and chunkable(cfg)):
        why = " (the config fixes loss_chunks; remove it to let plan search it)" if "loss_chunks" in given else ""
        lines.append(f"  - the LM head and loss over token chunks, the full logits never stored: loss_chunks: "
                     f"{LOSS_CHUNKS[0]}{why}")
    if cfg is not None and "micro_batch_size" in given and cfg.micro_batch_size > 1:
        lines.append(f"  - a smaller micro-batch: micro_batch_size: 1 (now {cfg.micro_batch_size}; gradient "
                     f"accumulation keeps the global batch)")
    rest = near.reserved_bytes - near.state_bytes
    if rest < limit and near.state_bytes > 0:
        factor = near.state_bytes / (limit - rest)
        per_node = PRESETS[ranking.cluster].devices_per_node if ranking.cluster in PRESETS else 1
        need = -(-math.ceil(ranking.devices * factor) // per_node) * per_node
        lines.append(f"  - more devices: about {need} (FSDP over all of them shrinks its state, "
                     f"{human_bytes(near.state_bytes)} now; the rest, {human_bytes(rest)}, does not shrink)")
    else:
        lines.append(f"  - more devices alone do not help: its activations and temporaries ({human_bytes(rest)}) "
                     f"exceed the limit; split them with cp or tp (more devices), or a shorter sequence_len")
    if all(e.mesh.shape.get("pp", 1) == 1 for e in ranking):
        lines.append("  - pipeline stages: --pp 2,4,8 (each stage holds its share of the layers)")
    lines.append("  - a device with more memory (--cluster help lists them), or --memory-gib if the limit is too low")
    return "\n".join(lines)


def layout_keys(cfg, est, n_devices: int) -> dict:
    """The config keys (as ``TrainConfig`` names them) that train the layout of estimate
    ``est``: mesh sizes, pipeline schedule, sequence parallelism, the FSDP axes where they
    differ from the model's default rules, activation checkpointing, re-gathering, the loss
    chunks where chunked, and the batch as micro-batch x accumulation at the global batch."""
    s = est.mesh.shape
    gb = global_batch_for(cfg, n_devices)
    dp = s.get("dp_replicate", 1) * s.get("dp_shard", 1) * s.get("ep", 1)
    ga = est.settings.get("grad_accum", 1)
    keys = {"dp_replicate_size": s.get("dp_replicate", 1), "dp_shard_size": s.get("dp_shard", 1),
            "cp_size": s.get("cp", 1), "tp_size": s.get("tp", 1)}
    if s.get("pp", 1) > 1 or cfg.pp_size != 1:
        keys.update(pp_size=s.get("pp", 1), pp_schedule=est.settings.get("pp_schedule") or cfg.pp_schedule,
                    pp_virtual_stages=est.settings.get("virtual_stages") or 1)
    if s.get("ep", 1) > 1 or cfg.ep_size != 1:
        keys["ep_size"] = s.get("ep", 1)
    keys.update(sequence_parallel="tp" in est.rules["res_seq"], global_batch_size=gb, micro_batch_size=gb // (dp * ga),
                gradient_accumulation_steps=ga, activation_checkpointing=est.settings.get("remat") or False,
                reshard_after_forward=not est.settings.get("keep_gathered", False))
    keys.update({k: True for k in ("offload_params", "activation_offloading") if est.settings.get(k)})
    if est.settings.get("loss_chunks"):
        keys["loss_chunks"] = est.settings["loss_chunks"]
    plain = dataclasses.replace(cfg, **{k: v for k, v in keys.items() if k != "rules"})
    default = plain.build_rules(est.mesh)
    if _fsdp_axes(default, s) != _fsdp_axes(est.rules, s):
        hidden = [a for a in (est.rules.table.get("hidden") or ()) if s.get(a, 1) > 1]
        keys["rules"] = {**cfg.rules, "hidden": hidden or None}
    return keys


def _fsdp_axes(rules, shape) -> tuple:
    return tuple(a for a in (rules.table.get("hidden") or ()) if shape.get(a, 1) > 1)


def layout_yaml(cfg, est, n_devices: int) -> str:
    """:func:`layout_keys` as YAML lines to paste into the config (a note where the mesh order
    differs from the config's)."""
    import yaml
    text = yaml.safe_dump(layout_keys(cfg, est, n_devices), sort_keys=False, default_flow_style=False).rstrip()
    default = [a for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if est.mesh.shape.get(a, 1) > 1]
    if [a for a in est.mesh.axis_names if est.mesh.shape[a] > 1] != default:
        text += f"\n# note: this layout orders the mesh axes {est.mesh.axis_names}; a config orders them {default}"
    return text


def apply_layout(cfg, est, n_devices: int):
    """A copy of ``cfg`` that trains with the layout of estimate ``est`` (:func:`layout_keys`)."""
    return dataclasses.replace(cfg, layout="manual", **layout_keys(cfg, est, n_devices))


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


def auto_layout(cfg, n_devices: int, cluster="h100x8", stream: IO[str] | None = None, jobs: int | None = None):
    """``layout: auto``: search, print the choice and why (the lines ``plan`` prints), return
    the config to train with; a ConfigError naming the nearest layout when none fits. ``jobs``:
    the search's worker processes (default one per core)."""
    out = stream or sys.stdout
    space = config_space(cfg)
    if cfg.compile:
        space.remat = tuple(r for r in space.remat if r is False) or space.remat
    cl = as_cluster(cluster)
    print(f"layout: auto — ranking layouts of {n_devices} devices on {cl.name}", file=out)
    ranking = rank_layouts(cfg, n_devices, cl, space=space, jobs=jobs)
    if not ranking.fitting():
        from functional_pp.config import ConfigError
        raise ConfigError("layout: auto: " + explain(ranking, cfg))
    print(explain(ranking, cfg), file=out)
    return apply_layout(cfg, ranking.fitting()[0], n_devices)


def add_parser(sub) -> None:
    """The ``plan`` subcommand's arguments."""
    p = sub.add_parser("plan", help="rank the layouts of a config without running it",
                       description="Dry-run the layouts of N devices (meshes x rules x memory levers x micro-batch "
                                   "sizes) on one representative device with meta tensors and rank them by a time "
                                   "model of the cluster; prints the table, the choice and the config keys that "
                                   "train it (and JSON with --json). --cluster help describes the presets.")
    p.add_argument("config", nargs="?", help="YAML training config (model, batch, sequence length; "
                                             "activation_checkpointing and micro_batch_size when given are kept)")
    p.add_argument("--devices", type=int, default=None, metavar="N", help="number of devices (required)")
    p.add_argument("--cluster", default="h100x8", help="cluster preset: h100x8, h100x8-gt, h200x8, a100x8, l40sx4; "
                                                       "'help' describes them")
    p.add_argument("--memory-gib", type=float, default=None, help="memory limit per device in GiB "
                                                                  "(default: the cluster's)")
    p.add_argument("--memory-gb", type=float, default=None, help="the same in GB (10^9 bytes)")
    p.add_argument("--strategy", choices=("auto", "exhaustive", "beam"), default="auto")
    p.add_argument("--orders", choices=("default", "all"), default="default",
                   help="also try every order of the mesh axes (which axes stay inside a node)")
    p.add_argument("--pp", default="1", metavar="SIZES",
                   help="pipeline sizes to try, e.g. 1,2,4 (1F1B and interleaved 1F1B)")
    p.add_argument("--ep", default="1", metavar="SIZES", help="expert-parallel sizes to try (MoE models), e.g. 1,2")
    p.add_argument("--max-axis", default="", metavar="AXIS=N,...",
                   help=f"largest size of mesh axes, e.g. tp=8,cp=16 (default: cp up to a row's tokens / "
                        f"{CP_MIN_TOKENS})")
    p.add_argument("--float8", action="store_true",
                   help="cost the layers' linear matmuls in Float8 (torchtitan's Float8 training; FP8 peak of the cluster)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes for the dry-runs (default: one per core; the ranking is the same)")
    p.add_argument("--top", type=int, default=20, help="rows to print")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the ranking as JSON (its folder is checked before the search)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as for train and validate")


def run(args) -> int:
    """``functional-pp plan``: returns the exit status (2: bad arguments, 1: no layout fits)."""
    from functional_pp.cli.targets import check_file_target
    from functional_pp.config import ConfigError, TrainConfig
    if args.cluster == "help":
        print(describe_presets())
        return 0
    try:
        if args.config is None or args.devices is None:
            raise ConfigError("plan needs a config and --devices N, e.g. functional-pp plan CONFIG.yaml --devices 64 "
                              "--cluster h100x8")
        json_path = check_file_target(args.json, "--json") if args.json else None
        cfg = TrainConfig.from_yaml(args.config, list(args.overrides))
        if args.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {args.devices}")
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs must be >= 1 (1 runs the dry-runs in this process), got {args.jobs}")
        cl = as_cluster(args.cluster)
        pp, ep = _sizes("--pp", args.pp), _sizes("--ep", args.ep)
        max_axis = _max_axis(args.max_axis)
        if args.float8 and not cl.peak_fp8_flops:
            raise ValueError(f"--float8: cluster {cl.name!r} has no FP8 matmuls; choose one with FP8 (h100x8, "
                             f"h100x8-gt, h200x8, l40sx4)")
    except (ConfigError, ValueError) as exc:
        print(f"functional-pp: {exc}", file=sys.stderr)
        return 2
    ranking = rank_layouts(cfg, args.devices, cl, memory_gb=args.memory_gb, memory_gib=args.memory_gib,
                           strategy=args.strategy,
                           space=config_space(cfg, orders=args.orders, pp=pp, ep=ep, max_axis=max_axis),
                           float8=args.float8, jobs=args.jobs)
    print(f"{len(ranking)} layouts of {args.devices} devices on {cl.name} (memory limit "
          f"{human_bytes(ranking.memory_limit_bytes)} per device), best first:")
    print(ranking.table(args.top))
    print(explain(ranking, cfg))
    front = ranking.pareto()
    print("Pareto front (time, memory):\n" + "\n".join(
        f"  {e.describe()}: {e.time.step_s:.4g} s, {human_bytes(e.peak_bytes)}" for e in front))
    if ranking.rejected:
        print(f"{len(ranking.rejected)} layouts rejected, e.g. {ranking.rejected[0][0]}: {ranking.rejected[0][1]}")
    if json_path is not None:
        with open(json_path, "w") as f:
            f.write(ranking.to_json())
        print(f"wrote {args.json}")
    return 0 if ranking.fitting() else 1


def _max_axis(text: str) -> dict:
    """``--max-axis tp=8,cp=16`` as {axis: size}."""
    axes = (*Space().axes, "pp", "ep")
    out = {}
    for item in filter(None, str(text).split(",")):
        axis, _, size = item.partition("=")
        if axis.strip() not in axes or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--max-axis takes AXIS=N pairs over {', '.join(axes)}, "
                             f"e.g. --max-axis tp=8,cp=16; got {item!r}")
        out[axis.strip()] = int(size)
    return out


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
    ``--simulate N``; the chosen layout replaces the config's mesh and rules. Under torchrun each
    process of a node searches with its share of the node's cores."""
    import os

    from functional_pp.config import ConfigError
    from functional_pp.devices.launch import under_torchrun
    from functional_pp.plan.workers import default_jobs
    n = int(os.environ["WORLD_SIZE"]) if under_torchrun() else simulate
    if n is None:
        raise ConfigError("layout: auto needs the device count: run under torchrun or pass --simulate N")
    share = max(1, default_jobs() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if under_torchrun() else None
    return auto_layout(cfg, n, cluster, jobs=share)
