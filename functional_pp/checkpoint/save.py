"""Saving: every device writes one replica of its own shards, rank 0 writes the index and
publishes the checkpoint by renaming its temporary directory, then moves ``latest``."""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.format import CheckpointError
from functional_pp.checkpoint.specs import PER_RANK, SaveLeaf, flatten_for_save, is_param_like
from functional_pp.core.layout import Rules, block_slices, layout_axes
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_context


class _Peers:
    """All ranks of the running launch (or just this process), for agreeing on outcomes."""

    def __init__(self):
        ctx = current_context(required=False)
        self.ctx = ctx
        self.mesh: Mesh | None = ctx.mesh if ctx else None
        self.rank = ctx.rank if ctx else 0
        self.size = ctx.mesh.size if ctx else 1

    def all(self, obj: Any) -> list:
        """Every rank's ``obj`` in rank order (a barrier; not counted as communication)."""
        if self.size == 1:
            return [obj]
        return self.ctx.backend.exchange_objects(obj, tuple(range(self.size)))


def _plan(leaves: list[SaveLeaf], mesh: Mesh | None, rules: Rules, rank: int):
    """What this rank may write (``[(path, tensor, chunk, leaf, writer)]``: ``writer`` when every
    device holds the leaf), the global description of every tensor, the digests of replicated
    leaves (to check that ranks agree), the leaves this rank does not hold (an empty tensor
    for a non-empty block: a pipeline stage's other layers) and the mesh axes each leaf's
    layout uses."""
    writes, entries, digests, unheld, used_axes = [], {}, {}, [], []
    coords = mesh.coords(rank) if mesh else {}
    for n, leaf in enumerate(leaves):
        t = leaf.value
        dtype = fmt.dtype_name(t.dtype)
        local = tuple(t.shape)
        used: tuple = ()
        if is_param_like(leaf.spec):
            shape = tuple(int(s) for s in leaf.spec.shape)
            if mesh is not None:
                layout = rules.resolve(tuple(leaf.spec.dims), shape, mesh, name=leaf.path)
                slices = block_slices(shape, layout, mesh, rank)
                used = layout_axes(layout)
                writer = all(c == 0 for a, c in coords.items() if a not in used)
            else:
                layout = tuple(() for _ in shape)
                slices = tuple(slice(0, n) for n in shape)
                writer = True
            block = tuple(s.stop - s.start for s in slices)
            held = not (t.numel() == 0 and fmt.numel(block) > 0)
            if not held:
                unheld.append(n)
            if held and local != block:
                raise CheckpointError(
                    f"{leaf.path}: this device's tensor has shape {local}, but global shape "
                    f"{shape} with axes {tuple(leaf.spec.dims)} under layout {layout} gives rank "
                    f"{rank} a block of shape {block} (wrong rules, or a full tensor where a "
                    f"shard was expected?)")
            entries[leaf.path] = {"kind": "sharded", "shape": list(shape), "dtype": dtype,
                                  "axes": list(leaf.spec.dims),
                                  "layout": [list(a) for a in layout]}
            start, stop = [s.start for s in slices], [s.stop for s in slices]
            if not held:
                entries[leaf.path]["dtype"] = dtype
                used_axes.append(used)
                continue
        else:
            per_rank = leaf.spec is PER_RANK
            entries[leaf.path] = {"kind": "per_rank" if per_rank else "replicated",
                                  "shape": list(local), "dtype": dtype, "axes": None,
                                  "layout": None}
            writer = per_rank or rank == 0
            start, stop = [0] * len(local), list(local)
            if not per_rank and mesh is not None and mesh.size > 1:
                digests[leaf.path] = (list(local), dtype, fmt.crc32(t))
        used_axes.append(used)
        chunk = {"file": fmt.rank_file(rank), "start": start, "stop": stop}
        if leaf.spec is PER_RANK:
            chunk["rank"] = rank
        writes.append((leaf.path, t, chunk, n, writer))
    return writes, entries, digests, unheld, used_axes


def _writers(planned, unheld: list[list[int]], mesh: Mesh | None, rank: int) -> list:
    """The writes of this rank: a slice every device holds by the lowest rank that holds it
    (coordinate 0 on the axes its layout does not use); a slice some devices do not hold (a
    pipeline's layers, each held by one stage) by the lowest rank that does."""
    writes, entries, _, mine, used_axes = planned
    partial = {n for r in unheld for n in r}
    if not partial:
        return [(path, t, chunk) for path, t, chunk, _, writer in writes if writer]
    size = mesh.size if mesh is not None else 1
    coords = [mesh.coords(r) if mesh is not None else {} for r in range(size)]

    def same_slice(n: int) -> list[int]:
        return [r for r in range(size) if all(coords[r][a] == coords[rank][a] for a in used_axes[n])]
    for n in mine:
        if all(n in unheld[r] for r in same_slice(n)):
            raise CheckpointError(f"{list(entries)[n]}: no device holds rank {rank}'s slice of it (each passed an "
                                  f"empty tensor); pass every leaf with its data on the device that holds it")
    out = []
    for path, t, chunk, n, writer in writes:
        if n in partial:
            writer = not any(n not in unheld[r] for r in same_slice(n) if r < rank)
        if writer:
            out.append((path, t, chunk))
    return out


def save_checkpoint(directory: str | os.PathLike, step: int, tree: dict[str, Any],
                    specs: dict[str, Any] | None = None, *, rules: Rules | None = None,
                    metadata: dict | None = None, config: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Save a train state as ``directory/step-NNNNNN`` and point ``directory/latest`` at it.

    Call it on every device inside :func:`functional_pp.launch` (or once, outside, for a
    single device). ``tree`` is a dict of pytrees (``{"params": ..., "opt": ..., "rng": ...}``)
    holding this device's shards; ``specs`` mirrors it with Param-like leaves (sharded under
    ``rules``), ``None`` (replicated: written once by rank 0) or ``PER_RANK``; entries absent
    from ``specs`` are replicated. ``metadata`` (e.g. the data-loader position) and ``config``
    are JSON-able dicts. Only the lowest rank holding each distinct slice writes it. The
    checkpoint appears atomically once every rank has written; ``keep_last`` then deletes older
    ones. Returns the checkpoint directory.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    peers = _Peers()
    root = Path(directory)
    final = root / fmt.step_dir_name(step)

    # 1. plan on every rank; rank 0 makes the temporary directory
    error, tmp_name, planned = None, None, ([], {}, {}, [], [])
    try:
        fmt.check_json(metadata, "metadata")
        fmt.check_json(config, "config")
        leaves, skeleton = flatten_for_save(tree, specs)
        planned = _plan(leaves, peers.mesh, rules or Rules(), peers.rank)
        if peers.rank == 0:
            tmp_name = f"{final.name}.tmp-{secrets.token_hex(4)}"
            try:
                root.mkdir(parents=True, exist_ok=True)
                (root / tmp_name).mkdir()
            except OSError as exc:
                raise CheckpointError(f"could not create checkpoint directory {root / tmp_name}: "
                                      f"{exc.strerror or exc} (errno {exc.errno})") from exc
    except Exception as exc:  # noqa: BLE001 - agreed on below, then re-raised everywhere
        error = exc
    replies = peers.all((_describe(error), tmp_name, planned[3]))
    tmp = root / replies[0][1] if replies[0][1] else None
    _raise_if_failed([r[0] for r in replies], error, peers, tmp, step, root)

    # 2. every rank writes its file
    _, entries, digests, _, _ = planned
    error, report = None, None
    try:
        writes = _writers(planned, [r[2] for r in replies], peers.mesh, peers.rank)
        chunks: dict[str, list] = {}
        size = 0
        if writes:
            for _, t, chunk in writes:
                chunk["crc32"] = fmt.crc32(t)
            items = [(path, t.dtype, tuple(t.shape), (lambda t=t: t)) for path, t, _ in writes]
            # what each tensor of this file is, so a loader can cross-check index.json
            recorded = {path: [chunk["start"], chunk["stop"]] for path, _, chunk in writes}
            size = fmt.write_safetensors(tmp / fmt.rank_file(peers.rank), items,
                                         {"format": "pt", "step": str(step),
                                          fmt.CHUNKS_KEY: json.dumps(recorded, separators=(",", ":"))})
            for path, _, chunk in writes:
                chunks.setdefault(path, []).append(chunk)
        report = {"chunks": chunks, "digests": digests, "size": size,
                  "entries": {p: (e["kind"], e["shape"], e["dtype"]) for p, e in entries.items()}}
    except Exception as exc:  # noqa: BLE001
        error = exc
    replies = peers.all((_describe(error), report))
    _raise_if_failed([r[0] for r in replies], error, peers, tmp, step, root)

    # 3. rank 0 checks agreement, writes the index and publishes
    error = None
    if peers.rank == 0:
        try:
            reports = [r[1] for r in replies]
            index = _build_index(step, entries, skeleton, reports, peers, rules, metadata, config)
            index[fmt.DIGEST] = fmt.index_digest(index)
            fmt.write_text_atomic(tmp / fmt.INDEX, json.dumps(index, indent=1))
            fmt.fsync_dir(tmp)
            _publish(root, tmp, final)
            fmt.write_text_atomic(root / fmt.LATEST, final.name + "\n")
            _prune(root, keep_last, step)
        except Exception as exc:  # noqa: BLE001
            error = exc
    replies = peers.all(_describe(error))
    _raise_if_failed(replies, error, peers, tmp, step, root)
    return final


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_if_failed(errors: list, mine: BaseException | None, peers: _Peers, tmp: Path | None,
                     step: int, root: Path) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if peers.rank == 0 and tmp is not None and tmp.exists():
        fmt.remove_tree(tmp)
    if mine is not None:
        raise CheckpointError(f"saving step {step} to {root} failed on rank {peers.rank}: "
                              f"{_describe(mine)}; the previous checkpoint is untouched") from mine
    r, e = failed[0]
    raise CheckpointError(f"saving step {step} to {root} failed on rank {r}: {e}; the previous "
                          f"checkpoint is untouched")


def _build_index(step, entries, skeleton, reports, peers: _Peers, rules, metadata, config) -> dict:
    mine = reports[0]["entries"]
    for r, rep in enumerate(reports[1:], start=1):
        if rep["entries"] != mine:
            diff = sorted(p for p in set(rep["entries"]) | set(mine)
                          if rep["entries"].get(p) != mine.get(p))
            raise CheckpointError(f"rank {r} saves a different tree than rank 0 (paths, shapes or "
                                  f"dtypes differ at {diff[:5]})")
        for path, digest in rep["digests"].items():
            if digest != reports[0]["digests"].get(path):
                raise CheckpointError(
                    f"{path} has no spec (so it is saved once, as replicated) but its value on "
                    f"rank {r} differs from rank 0's; give it a Param spec if it is sharded, or "
                    f"PER_RANK if every device keeps its own value")
    tensors = {}
    for path, entry in entries.items():
        chunks = [c for rep in reports for c in rep["chunks"].get(path, [])]
        tensors[path] = dict(entry, chunks=chunks)
    files = {fmt.rank_file(r): {"bytes": rep["size"]} for r, rep in enumerate(reports)
             if rep["size"]}
    return {
        "format": fmt.FORMAT, "version": fmt.VERSION, "step": step,
        "world_size": peers.size, "mesh": dict(peers.mesh.shape) if peers.mesh else None,
        "rules": {k: list(v) for k, v in rules.table.items()} if rules else None,
        "created": time.time(), "torch": torch.__version__,
        "metadata": metadata, "config": config,
        "structure": skeleton, "files": files, "tensors": tensors,
    }


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to ``final`` (replacing an older save of it)."""
    old = None
    try:
        if final.exists():
            old = root / f"{final.name}.old-{secrets.token_hex(4)}"
            os.rename(final, old)
        os.rename(tmp, final)
    except OSError as exc:
        raise CheckpointError(f"could not rename {tmp} to {final}: {exc.strerror or exc}") from exc
    fmt.fsync_dir(root)
    if old is not None:
        fmt.remove_tree(old)


def _prune(root: Path, keep_last: int | None, step: int) -> None:
    """Delete leftovers of crashed saves and, with ``keep_last``, all but the newest K."""
    for child in root.iterdir():
        if fmt.TMP_RE.match(child.name) and child.is_dir():
            fmt.remove_tree(child)
        elif fmt.FILE_TMP_RE.match(child.name) and child.is_file():   # an interrupted pointer write
            try:
                child.unlink()
            except OSError:
                pass
    if keep_last is None:
        return
    steps = fmt.complete_steps(root)
    keep = set(list(steps)[-keep_last:]) | {step}
    for s, path in steps.items():
        if s not in keep:
            fmt.remove_tree(path)
