"""A training step keeps every tensor on its parameters' device (docs/gpu.md, "Nothing made on the
host inside a step"). On the first GPU run each simulated device's step made host-to-device
copies and mixed-device adds: scalars made on the CPU inside the step (the loss total, the step
counters of ``step.init``, the learning rate without a schedule, the update's flags) met the
CUDA values. Checked without a GPU on the ``meta`` device, which runs a whole step (backward
included) on metadata only: a dispatch mode sees every aten op of the step, and none may take
or return a tensor on another device (not even a 0-dim one, which CUDA would accept as a
scalar by copying it)."""
from __future__ import annotations

import functools

import optree
import pytest
import torch
from harness import make_batch
from torch.utils._python_dispatch import TorchDispatchMode

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step import io

CFG = llama.Config.tiny()
R = fpp.Rules
LAYOUTS = {
    "one": ({}, R(), {}),
    "fsdp": (dict(dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"), {}),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True), {}),
    "cp_ring": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="ring")),
}


class OtherDevices(TorchDispatchMode):
    """The aten ops that take or return a tensor on a device other than ``device``."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.seen = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [x for x in optree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        others = sorted({str(x.device) for x in tensors if x.device.type != self.device})
        if others:
            self.seen.append((func.__name__, others))
        return out


def _steps(layout: str, metrics: str, simulate=True):
    """Per device: the ops of two steps that touched another device than ``meta``."""
    mesh_kw, rules, options = LAYOUTS[layout]
    mesh = fpp.Mesh(**mesh_kw)
    opt = fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0)
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), opt, mesh=mesh, rules=rules, metrics=metrics)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=mesh, rules=rules, seed=0, device="meta"))
        seen = []
        for s in range(2):
            batch = {k: v.to("meta") for k, v in make_batch(CFG, batch=4, seq=16, seed=s).items()}
            with fpp.configure(**options), fpp.use_rules(rules), OtherDevices("meta") as ops:
                state, _ = step(state, batch)
            seen.append(ops.seen)
        assert all(v.device.type == "meta" for k, v in state.items() if k != "params" and isinstance(v, torch.Tensor))
        return seen
    return fpp.launch(device, mesh, simulate=simulate)


def _no_host_read(monkeypatch):
    """The per-step read (its one device-to-host transfer) as zeros: meta tensors hold no
    values; what it reads must be on the step's device."""
    def read(values):
        bad = [str(v.device) for v in values if v.device.type != "meta"]
        assert not bad, f"the per-step read gets values on {bad}"
        return [0.0 if v.ndim == 0 else [0.0] * v.numel() for v in values]
    monkeypatch.setattr(io, "one_transfer", read)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("metrics", ["deferred", "per_step"])
def test_a_step_touches_no_other_device(layout, metrics, monkeypatch):
    if metrics == "per_step":
        _no_host_read(monkeypatch)
    for rank, steps in enumerate(_steps(layout, metrics)):
        assert steps == [[], []], f"device {rank}: ops on another device per step: {steps}"


@pytest.mark.parametrize("layout", ["fsdp", "cp_ring"])
def test_a_batched_step_touches_no_other_device(layout):
    for rank, steps in enumerate(_steps(layout, "deferred", simulate="batched")):
        assert steps == [[], []], f"device {rank}: ops on another device per step: {steps}"


def _meta(state) -> list:
    """What dynamo guards of each state tensor (and the tree's structure with it)."""
    leaves, spec = optree.tree_flatten(state, none_is_leaf=True)
    return [str(spec)] + [(str(v.device), v.dtype, tuple(v.shape), v.stride(), v.requires_grad)
                          if isinstance(v, torch.Tensor) else type(v).__name__ for v in leaves]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_state_a_step_returns_looks_like_the_state_it_took(layout, precision):
    """A compiled step's guards are on its inputs' devices, dtypes, shapes and strides: a state
    that comes back from a step different in any of them (a counter made on the host, a moment
    in another dtype, a parameter with other strides) makes the second step recompile, as the
    first GPU run's did (19 s at its second step). Checked eagerly on ``meta``: the state
    before step 1, after it and after step 2 are alike, leaf by leaf."""
    mesh_kw, rules, options = LAYOUTS[layout]
    mesh = fpp.Mesh(**mesh_kw)
    opt = fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0)
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), opt, mesh=mesh, rules=rules,
                          metrics="deferred", donate_state=True, precision=precision)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float32, mesh=mesh, rules=rules, seed=0, device="meta"))
        seen = [_meta(state)]
        for s in range(2):
            batch = {k: v.to("meta") for k, v in make_batch(CFG, batch=4, seq=16, seed=s).items()}
            with fpp.configure(**options), fpp.use_rules(rules):
                state, _ = step(state, batch)
            seen.append(_meta(state))
        return seen
    for rank, (before, *after) in enumerate(fpp.launch(device, mesh)):
        for n, seen in enumerate(after, 1):
            diff = [(i, a, b) for i, (a, b) in enumerate(zip(before, seen)) if a != b]
            assert len(before) == len(seen) and not diff, f"device {rank}, after step {n}: {diff[:4]}"
