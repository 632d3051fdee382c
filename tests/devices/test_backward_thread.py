"""On CUDA the autograd engine runs a step's backward on its own device thread, not the thread
that ran the forward (docs/gpu.md): per-thread state of the framework (rules, options, FSDP
units, gradient buckets, pending checks) is not there. Emulated on real gloo processes (one
device per process, as under torchrun): ``torch.autograd.grad`` runs on a fresh thread, and
the steps of every layout family must equal the same steps run on one thread, and issue
the same collectives (the comm report of the first step)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from harness import make_batch, train_steps

import functional_pp as fpp
from functional_pp.models import llama

pytestmark = pytest.mark.multiprocess

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=4, seq=16, seed=s) for s in range(2)]
R = fpp.Rules
LAYOUTS = {   # 2 processes each (the bf16 ones: the reduce dtype and the backward collectives)
    "cp": (dict(cp=2), llama.default_rules(tp=False)),
    "fsdp_bf16": (dict(dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"), dict(precision="bf16")),
    "dp_bf16": (dict(dp_replicate=2), R(batch=("dp_replicate", "dp_shard")), dict(precision="bf16")),
}


def _grad_on_another_thread():
    """``torch.autograd.grad`` run on a fresh thread, as CUDA's autograd device thread runs it."""
    original = torch.autograd.grad

    def grad(*args, **kwargs):
        out = {}

        def run():
            try:
                out["value"] = original(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                out["error"] = exc
        t = threading.Thread(target=run, name="autograd-device-thread")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]
    torch.autograd.grad = grad


def _both(layout: str):
    mesh_kw, rules, *step_kw = LAYOUTS[layout]
    step_kw = step_kw[0] if step_kw else {}
    mesh = fpp.Mesh(**mesh_kw)

    def fn():
        same = train_steps(CFG, DATA, mesh, rules, torch.float32 if step_kw else torch.float64, **step_kw)()      # a fresh step each (it learns its FSDP order)
        _grad_on_another_thread()
        return same, train_steps(CFG, DATA, mesh, rules, torch.float32 if step_kw else torch.float64, **step_kw)()
    return fpp.launch(fn, mesh, processes=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backward_on_another_thread_gives_the_same_steps(layout):
    for rank, ((losses, params, events), (losses_t, params_t, events_t)) in enumerate(_both(layout)):
        assert events_t == events, f"rank {rank}: other collectives with backward on another thread"
        assert any(e.backward for e in events)
        np.testing.assert_allclose(losses_t, losses, rtol=1e-12, err_msg=f"rank {rank} losses")
        for path, p in params.items():
            np.testing.assert_allclose(params_t[path], p, rtol=1e-12, atol=1e-14, err_msg=f"rank {rank} {path}")
