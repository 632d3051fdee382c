"""Every layout family on fake CUDA (functional_pp/_torch/fake_cuda.py; docs/gpu.md): "cuda"
tensors that carry metadata only, on a CPU-only build, over the simulated mesh. An op mixing a
fake cuda tensor with a CPU one raises, and so does a host read (``.item()``, ``bool()``), so a
forward that completes created nothing on another device and read nothing back.

What this build cannot run: a backward of fake cuda tensors (the autograd engine asks for the
CUDA accelerator and aborts the process; tests/_torch/test_touch_points.py watches that), so
the whole train step and its compiled form are checked on real GPUs only (benchmarks/gpu.py)."""
from __future__ import annotations

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functional_pp as fpp
from functional_pp._torch.fake_cuda import fake_cuda, is_fake
from functional_pp.data.loader import to_device
from functional_pp.models import llama
from functional_pp.ops import attention_kernels
from functional_pp.ops.token_ids import deferred_checks

CFG = llama.Config(vocab=64, hidden=16, layers=2, heads=2, kv_heads=2, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)
R = fpp.Rules
LAYOUTS = {
    "dp": (dict(dp_replicate=2), R(batch=("dp_replicate", "dp_shard")), {}),
    "fsdp": (dict(dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"), {}),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"), {}),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True), {}),
    "cp_ring": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="ring")),
    "cp_allgather": (dict(cp=2), llama.default_rules(tp=False), dict(cp_attention="allgather")),
}


class OutputDevices(TorchDispatchMode):
    """The devices of every tensor an aten op returns (0-dim CPU tensors aside: CUDA takes
    them as scalars)."""

    def __init__(self):
        super().__init__()
        self.devices, self.attention = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__ or "sdp" in func.__name__:
            self.attention.add(func.__name__.split(".")[0])
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and not (x.device.type == "cpu" and x.dim() == 0):
                self.devices.add((str(x.device), func.__name__) if x.device.type != "cuda" else "cuda")
        return out


def _forward(layout: str, deferred: bool = True):
    """Per device: the loss's device and dtype, the devices of every op's output, the
    attention kernels chosen."""
    mesh_kw, rules, options = LAYOUTS[layout]
    mesh = fpp.Mesh(**mesh_kw)
    chosen = []
    select = attention_kernels.select_attention_kernel

    def spy(*a, **k):
        chosen.append(select(*a, **k))
        return chosen[-1]

    with fake_cuda() as fc, pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_kernels, "select_attention_kernel", spy)

        def device():
            params = fpp.init(llama.init, CFG, torch.bfloat16, mesh=mesh, rules=rules, seed=0)  # host init
            ids = torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
            with fc.device(), fpp.configure(**options), fpp.use_rules(rules):
                params, ids = fc.to_cuda(params), fc.to_cuda(ids)
                batch = {"tokens": fpp.named(ids[:, :-1], "batch seq"), "labels": fpp.named(ids[:, 1:], "batch seq")}
                with OutputDevices() as seen, (deferred_checks() if deferred else _nothing()):
                    loss = llama.loss(params, batch, CFG).value()
                return is_fake(loss), str(loss.device), seen.devices, seen.attention
        return fpp.launch(device, mesh), set(chosen)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_of_every_layout_stays_on_cuda_and_selects_flash(layout):
    results, kernels = _forward(layout)
    for rank, (fake, device, devices, attention_ops) in enumerate(results):
        assert fake and device == "cuda:0", (rank, device)
        assert devices == {"cuda"}, f"rank {rank}: outputs off the GPU: {devices - {'cuda'}}"
        # bf16, head_dim 8, sm90: ring attention runs the flash kernel ops/attention_kernels.py
        # chose; elsewhere F.scaled_dot_product_attention chooses its kernel inside torch, which
        # a CPU-only build cannot show (docs/gpu.md)
        if layout == "cp_ring":
            assert attention_ops == {"_scaled_dot_product_flash_attention"}, attention_ops
    assert kernels == ({"cuda_flash"} if layout == "cp_ring" else set()), kernels


def test_a_host_read_inside_the_forward_is_caught():
    """Outside a training step the token-id check reads its flag at once (by design): on fake
    cuda that read raises, which is what makes the test above a check of host reads."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    with pytest.raises(fpp.DeviceError) as info:
        _forward("dp", deferred=False)
    assert isinstance(info.value.original, DataDependentOutputException)


def test_attention_kernel_by_device_dtype_and_capability():
    with fake_cuda() as fc, fc.device():
        def qkv(dtype, d=64, device="cuda"):
            x = torch.empty(1, 4, 16, d, dtype=dtype, device=device)
            return x, x, x
        assert attention_kernels.select_attention_kernel(*qkv(torch.bfloat16)) == "cuda_flash"
        assert attention_kernels.select_attention_kernel(*qkv(torch.float32)) == "cuda_efficient"
        assert attention_kernels.select_attention_kernel(*qkv(torch.bfloat16, d=12)) == "math"
        assert attention_kernels.select_attention_kernel(*qkv(torch.bfloat16, device="cpu")) == "cpu_flash"
        with pytest.MonkeyPatch.context() as mp:       # Turing (sm75): no flash attention
            mp.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
            assert attention_kernels.select_attention_kernel(*qkv(torch.bfloat16)) == "cuda_efficient"


def test_optimizer_state_and_update_stay_on_cuda():
    opt = fpp.optim.adamw(1e-3, weight_decay=0.1, clip_norm=1.0)
    params = fpp.init_params(llama.init(CFG, torch.float32), seed=0)
    with fake_cuda() as fc, fc.device(), OutputDevices() as seen:
        params = fc.to_cuda(params)
        state = opt.init(params)
        grads = optree.tree_map(torch.ones_like, params)
        updates, state = opt.update(grads, state, params)
    assert seen.devices == {"cuda"}, seen.devices


def test_host_batches_go_to_cuda_through_pinned_memory(monkeypatch):
    pinned = []

    def pin_memory(self):
        pinned.append(tuple(self.shape))
        return self
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long)}
    assert to_device(batch, "cpu")["tokens"] is batch["tokens"] and to_device(batch, None)["labels"] is batch["labels"]
    with fake_cuda() as fc, fc.device():
        fake = fc.mode.from_tensor
        host = {k: fake(v) for k, v in batch.items()}
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        out = to_device(host, torch.device("cuda"))
    assert pinned == [(2, 8), (2, 8)]
    assert {str(v.device) for v in out.values()} == {"cuda:0"}


def test_offloaded_state_lives_on_the_host_the_forward_on_cuda_and_the_update_on_the_host(monkeypatch):
    """``train_step(offload_params=True)`` under FSDP: ``step.init`` puts the master shards and
    the optimizer state in pinned host memory; a step runs the forward on cuda (the shards
    copied there), brings the gradients to the host and updates there, returning a host state.
    Autograd cannot run on fake cuda (module docstring): the step runs without recording a
    graph, its backward replaced by zero gradients of the device leaves, on the device as
    autograd would give them; the metrics are not read (fake values cannot be)."""
    import functools
    pinned = []

    def pin_memory(self):
        pinned.append(tuple(self.shape))
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.autograd, "grad", lambda loss, leaves, **kw: tuple(torch.zeros_like(x) for x in leaves))
    mesh_kw, rules, _ = LAYOUTS["fsdp"]
    mesh = fpp.Mesh(**mesh_kw)
    adamw = fpp.optim.adamw(1e-3, weight_decay=0.1, clip_norm=1.0)
    forward, update = OutputDevices(), OutputDevices()

    def loss_fn(params, batch):
        with forward:
            return llama.loss(params, batch, CFG)

    def update_fn(grads, state, params=None):
        grad_devices = {str(g.device) for g in optree.tree_leaves(grads)}
        with update:
            return (*adamw.update(grads, state, params), grad_devices)

    optimizer = fpp.optim.GradientTransformation(adamw.init, lambda g, s, p=None: update_fn(g, s, p)[:2])
    devices_seen = []
    step = fpp.train_step(loss_fn, optimizer, mesh=mesh, rules=rules, precision="bf16", offload_params=True)
    # the step's one read of its metrics cannot read fake values: a finite step's numbers instead
    from functional_pp.step import metrics_modes
    monkeypatch.setattr(metrics_modes, "read_step_metrics", lambda m, step, checks: ({**{k: 0.0 for k in m}, "step": 1}, False))
    with fake_cuda() as fc:
        def device():
            params = fpp.init(llama.init, CFG, torch.float32, mesh=mesh, rules=rules, seed=0)
            ids = torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
            with fc.device(), fpp.use_rules(rules):
                params = fc.to_cuda(params)
                state = step.init(params)
                devices_seen.append({str(x.device) for x in optree.tree_leaves(state)})
                ids = fc.to_cuda(ids)
                batch = {"tokens": fpp.named(ids[:, :-1], "batch seq").data,
                         "labels": fpp.named(ids[:, 1:], "batch seq").data}
                with torch.no_grad():
                    state, _ = step(state, batch)
                devices_seen.append({str(x.device) for x in optree.tree_leaves(state)})
        fpp.launch(device, mesh)
    assert devices_seen == [{"cpu"}] * 4                 # per device: after init and after the step
    n_state = len(optree.tree_leaves(llama.init(CFG)))
    assert len(pinned) >= 2 * n_state                    # master shards and the AdamW moments, pinned
    assert forward.devices == {"cuda"}, forward.devices
    assert update.devices and all(d[0] == "cpu" for d in update.devices if d != "cuda"), update.devices
    assert "cuda" not in update.devices, update.devices
