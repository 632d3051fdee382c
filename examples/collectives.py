"""Manual-mode collectives on 8 simulated devices: a data-parallel, tensor-parallel linear
layer whose gradients match the single-device run."""
import torch

import functional_pp as fpp

mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
X = torch.randn(8, 16, dtype=torch.float64)
W = torch.randn(16, 4, dtype=torch.float64)


def device_loss(x, w):                    # x: this device's rows; w: its rows of W (row-parallel)
    dp = ("dp_shard", "cp")
    # the pvary is the explicit style: without it the matmul inserts the same cast (JAX's
    # shard_map(check_vma=True); docs/manual_mode.md)
    y = fpp.psum(x @ fpp.pvary(w, dp), "tp")           # contract the tp-split dimension
    return fpp.psum((y ** 2).sum(), dp) / X.shape[0]   # sum over the batch shards


def run():
    w = W.clone().requires_grad_()
    with fpp.comm_report() as report:
        loss = fpp.shard_map(device_loss, (fpp.P(("dp_shard", "cp"), "tp"), fpp.P("tp")), fpp.P())(X, w)
        loss.backward()
    return loss, w.grad, report


results = fpp.launch(run, mesh)
W0 = W.clone().requires_grad_()
reference = ((X @ W0) ** 2).sum() / X.shape[0]
reference.backward()
loss, grad, report = results[0]
print(f"loss on 8 devices {loss.item():.12f}  single device {reference.item():.12f}")
print(f"max gradient difference {(grad - W0.grad).abs().max().item():.2e}")
print("communication of device 0:")
print(report)
