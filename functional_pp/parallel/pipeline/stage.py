"""One virtual stage of a model, cut at its layer boundary (``functional_pp.layer``).

The model function runs unchanged on every stage. While a :class:`StageRun` is active on a
device thread, the ``i``-th layer call runs only when ``i`` is one of the stage's layers;
the other calls pass their residual stream (the layer's second argument) through. At the
stage's first layer the residual stream is replaced by the activation received from the
previous stage (its gradient flows back to that tensor); after the stage's last layer the
rest of the model is cut short by :class:`StageOutput`, carrying the activation to send on.
The last stage runs to the loss (docs/pipelines.md).

A loss may run the layers several times per micro-batch (*passes*: a preference loss's policy
and reference forwards): call ``n`` is layer ``n mod layers`` of pass ``n div layers``; each
pass takes its own received activation, and a cut stage ends after the last pass, sending
every pass's activation. A probe (``seen``) runs no layer and records each call's residual
stream, which gives the passes and their shapes."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from functional_pp.core.runtime import per_thread

_local = per_thread("parallel.pipeline.stage")


class StageOutput(Exception):
    """The stage's last layer has run: ``value`` (a Named) is what goes to the next stage."""

    @property
    def value(self) -> Any:        # (no __init__ of its own: torch.compile traces the raise)
        return self.args[0]


@dataclass
class StageRun:
    """The layers ``first .. last`` (layer indices) of one forward; ``x_in`` the received
    activation of each pass (None on the first stage); ``cut`` whether the model stops after
    ``last`` of the last pass; ``layers`` the layers of one pass (0: calls are not counted in
    passes); ``seen`` (a probe): run no layer, record each call's residual stream."""
    first: int
    last: int
    x_in: tuple[torch.Tensor, ...] | None
    cut: bool
    layers: int = 0
    passes: int = 1
    calls: int = 0
    sent: list = field(default_factory=list)
    seen: list | None = None

    def layer(self, run: Callable[..., Any], args: tuple) -> Any:
        i = self.calls
        self.calls += 1
        if len(args) < 2:
            raise TypeError(f"pipeline: layer {i} was called with {len(args)} argument(s); a pipelined "
                            f"layer is fn(params, x, ...) -> x, x the residual stream it passes on")
        if self.cut and self.last < self.first:       # no layers: stop at the first (a probe)
            raise StageOutput(args[1])
        if self.seen is not None:                     # a probe: record, run nothing
            self.seen.append(args[1])
            return args[1]
        n, i = divmod(i, self.layers) if self.layers else (0, i)
        if not self.first <= i <= self.last:
            return args[1]
        x = args[1]
        if i == self.first and self.x_in is not None:
            if n >= len(self.x_in):
                raise ValueError(f"pipeline: the model ran its layers {n + 1} times in this forward but "
                                 f"{len(self.x_in)} times when probed; run them equally often in every forward")
            if tuple(self.x_in[n].shape) != tuple(x.data.shape):
                raise ValueError(f"pipeline: layer {i} receives an activation of shape "
                                 f"{tuple(self.x_in[n].shape)} but its residual stream here has shape "
                                 f"{tuple(x.data.shape)}")
            x = x.replace(data=self.x_in[n], tied=False, gathered_from=None)
            args = (args[0], x, *args[2:])
        out = run(*args)
        if i == self.last and self.cut:
            meta_in, meta_out = (x.dims, x.split, x.vary, x.partial), (out.dims, out.split, out.vary, out.partial)
            if meta_in != meta_out:
                raise ValueError(f"pipeline: layer {i} returns a value laid out as {meta_out} but takes its "
                                 f"residual stream as {meta_in}; a stage boundary needs a layer whose result "
                                 f"is laid out like its input")
            if self.passes == 1:
                raise StageOutput(out)
            self.sent.append(out)
            if n == self.passes - 1:
                raise StageOutput(tuple(self.sent))
        return out


def current_stage() -> StageRun | None:
    """The stage being run on this device thread, if any."""
    return _local.__dict__.get("run")


def layer_call(run: Callable[..., Any], args: tuple) -> Any:
    """One call of a declared layer (``functional_pp.layer``): ``run(*args)``, unless a stage
    is active on this device thread; then the stage decides (:meth:`StageRun.layer`: run it,
    pass the residual stream through, or cut the model short), and layers called inside the
    layer are not the stage's."""
    stage = current_stage()
    if stage is None:
        return run(*args)
    with running_stage(None):
        return stage.layer(run, args)


@contextmanager
def running_stage(run: StageRun) -> Iterator[StageRun]:
    """Run the model as the stage ``run`` inside the block."""
    before = current_stage()
    _local.run = run
    try:
        yield run
    finally:
        _local.run = before
