"""What goes into and comes out of a training step besides the state: batch checks, the
micro-batch split, the one device-to-host read of the metrics (docs/eager_overhead.md), and
the peak-memory figure."""
from __future__ import annotations

import resource
import sys

import torch


def read_step_metrics(m: dict, step: torch.Tensor, id_checks: list) -> tuple[dict, bool]:
    """The step's metrics as Python numbers and whether a token-id check failed, read from the
    device in one transfer after all of the step's work is enqueued (docs/eager_overhead.md)."""
    values = one_transfer([*m.values(), step, *[summary[0] for summary, _ in id_checks]])
    metrics = dict(zip(m, values))
    metrics["step"] = int(values[len(m)])
    return metrics, any(values[len(m) + 1:])


def one_transfer(values: list[torch.Tensor]) -> list:
    """The 0-dim (or one-element) tensors among ``values`` as Python numbers and the longer
    ones (vectors a loss reports, core/step_values.py) as lists, in one device-to-host transfer
    (per-step metrics here, deferred ones in step/deferred_metrics.py)."""
    device = values[0].device
    values = [v if v.ndim == 0 and not v.requires_grad else v.detach().reshape(-1 if v.numel() != 1 else ())
              for v in values]
    values = [v if v.device == device else v.to(device) for v in values]
    if all(v.ndim == 0 for v in values):
        # stack(out=float64) converts each value exactly (int64 counters included), in one op
        return torch.stack(values, out=torch.empty(len(values), dtype=torch.float64, device=device)).tolist()
    flat = torch.cat([v.reshape(-1).to(torch.float64) for v in values]).tolist()
    out, at = [], 0
    for v in values:
        n = 1 if v.ndim == 0 else v.numel()
        out.append(flat[at] if v.ndim == 0 else flat[at:at + n])
        at += n
    return out


def nonfinite_what(metrics: dict) -> str:
    """What was not finite in a skipped step, for messages."""
    values = f"loss {metrics['loss']} / gradient norm {metrics['grad_norm']}"
    if metrics.get("nonfinite_loss") or metrics.get("nonfinite_grad"):
        return values                    # (the update follows from them)
    if metrics.get("update_held"):       # deferred metrics: a held in-place update is not redone
        return (f"in-place optimizer update (with a finite {values}; it could not be shown finite, so "
                f"it was held back unwritten: docs/eager_overhead.md \"Host synchronisation\")")
    return f"optimizer update (with a finite {values})"


def unwrap_batch(batch: dict, batch_dims: dict) -> dict:
    """The step's batch as plain tensors, each read with the dimension names ``batch_dims`` gives
    its key. A named value whose names differ from them is refused: the step would read its
    dimensions by position, so ``fpp.named(x, "seq batch")`` would be trained as ``batch seq``
    (a transposed batch) and a misspelt ``"batchh seq"`` as ``batch seq``, silently."""
    from functional_pp.parallel.named import Named
    out = {}
    for k, v in batch.items():
        want = batch_dims.get(k)
        want = tuple(want.split() if isinstance(want, str) else want) if want is not None else None
        if isinstance(v, Named):
            if want is not None and tuple(v.dims) != want:
                raise ValueError(
                    f"batch[{k!r}] is named {' '.join(v.dims)!r} but this train_step reads it as "
                    f"{' '.join(want)!r} (its batch_dims); name it so (fpp.named(x, {' '.join(want)!r}), "
                    f"transposing the data if its dimensions are in another order) or pass "
                    f"train_step(..., batch_dims={{{k!r}: {' '.join(v.dims)!r}, ...}})")
            v = v.data
        elif want is not None and isinstance(v, torch.Tensor) and v.ndim != len(want):
            raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)} but this train_step reads it as "
                             f"{' '.join(want)!r} ({len(want)} dimensions, its batch_dims); reshape it "
                             f"(one row: x[None]) or pass train_step(..., batch_dims={{{k!r}: ...}})")
        out[k] = v
    return out


def check_batch(batch: dict) -> None:
    """Refuse empty batches before any work (they would give a 0/0 loss)."""
    if not batch:
        raise ValueError("the batch is empty: pass a dict such as {'tokens': ..., 'labels': ...}")
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"batch[{k!r}] is a {type(v).__name__}, not a tensor")
        if v.numel() == 0:
            raise ValueError(f"batch[{k!r}] is empty (shape {tuple(v.shape)}): every device needs at "
                             f"least one row and one position; check the data loader and batch size")


def split_micro(batch: dict, k: int) -> list[dict]:
    if k == 1:
        return [batch]
    out = [dict() for _ in range(k)]
    for key, v in batch.items():
        if key == "positions":
            for o in out:
                o[key] = v
            continue
        if v.shape[0] % k:
            raise ValueError(f"batch[{key!r}] has {v.shape[0]} rows on this device, not divisible by "
                             f"gradient_accumulation_steps={k}")
        for o, part in zip(out, v.chunk(k, dim=0)):
            o[key] = part
    return out


def peak_memory(device: torch.device | None = None) -> int:
    """The peak memory of the device a step ran on: the CUDA caching allocator's peak for a
    CUDA device (``max_memory_allocated``, since the start or the last reset), else the process's
    peak resident set (a CPU step, also on a machine that has a GPU)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
