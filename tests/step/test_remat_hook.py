"""The public remat hook: any model marks its layer with @fpp.layer and train_step(remat=True)
recomputes it (docs/compile.md) -- not only Llama."""
import torch

import functional_pp as fpp


@fpp.layer
def block(p, x):
    h = fpp.ops.einsum("tok d, d f -> tok f", x, p["w_in"])
    return x + fpp.ops.einsum("tok f, f d -> tok d", fpp.ops.silu(h) * h, p["w_out"])


def loss_fn(params, batch):
    x = batch["x"]
    for p in params["blocks"]:
        x = block(p, x)
    return fpp.ops.mean(x * x, ("tok", "d"))


def decls():
    return {"blocks": [{"w_in": fpp.param((8, 32), "d f", init="normal", scale=0.2, dtype=torch.float64),
                        "w_out": fpp.param((32, 8), "f d", init="normal", scale=0.2, dtype=torch.float64)}
                       for _ in range(3)]}


def train(remat):
    step = fpp.train_step(loss_fn, fpp.optim.sgd(0.1), remat=remat, batch_dims={"x": "tok d"})
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def device():
        state = step.init(fpp.init(decls, seed=0))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            state, m = step(state, {"x": x})
        return m["loss"], state["params"], sum(saved)
    return fpp.launch(device, fpp.Mesh())[0]


def test_a_declared_layer_of_any_model_is_recomputed_under_remat():
    loss, params, saved = train(remat=False)
    loss_r, params_r, saved_r = train(remat=True)
    assert loss_r == loss
    for (path, a), (_, b) in zip(fpp.leaves_with_paths(params_r), fpp.leaves_with_paths(params)):
        assert torch.equal(a, b), path
    # each block keeps only its input (16 x 8) instead of its activations (several 16 x 32)
    assert saved_r < saved / 3, (saved_r, saved)

