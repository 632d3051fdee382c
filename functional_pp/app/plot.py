"""``loss.png``: training loss (and its running mean), held-out loss, the learning rate in a
second panel, integer step ticks, and a dashed line where a run was resumed."""
from __future__ import annotations

import os

from functional_pp.core.optional import available, require

__all__ = ["plot_losses"]


def plot_losses(metrics: list[dict], path: str | os.PathLike, title: str = "") -> bool:
    """Write the loss-curve PNG from ``metrics.jsonl`` lines; False when matplotlib is missing."""
    if not available("matplotlib"):
        return False
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "plot", "loss.png").FigureCanvasAgg
    Figure = require("matplotlib.figure", "plot", "loss.png").Figure
    MaxNLocator = require("matplotlib.ticker", "plot", "loss.png").MaxNLocator
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    lrs = [m for m in train if "lr" in m]
    fig = Figure(figsize=(7, 5.5 if lrs else 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if lrs else fig.add_subplot(1, 1, 1)
    steps = [m["step"] for m in train]
    ax.plot(steps, [m["loss"] for m in train], lw=1.2, label="train loss")
    if len(train) >= 20:
        k = max(len(train) // 20, 2)
        window = [train[max(0, i - k + 1):i + 1] for i in range(len(train))]
        ax.plot(steps, [sum(m["loss"] for m in w) / len(w) for w in window], lw=2,
                label=f"train, mean of {k}")
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", lw=1.5,
                label="held-out loss")
    resumes = [m["resumed_from"] for m in train if "resumed_from" in m]
    for i, r in enumerate(resumes):
        ax.axvline(r, color="grey", ls="--", lw=1, label="resumed" if i == 0 else None)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if lrs:
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
        ax2.plot([m["step"] for m in lrs], [m["lr"] for m in lrs], color="tab:green", lw=1.2)
        ax2.set_ylabel("learning rate")
        ax2.grid(alpha=0.3)
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(str(path))
    return True
