"""``compile="per_layer"`` with FSDP: a compiled layer keeps its weights' shards for backward and
gathers them again there (ZeRO-3), as eager does, instead of AOT autograd's partitioner saving
every gathered weight from the layer's forward to its backward (compile/recompute.py
``regather_in_backward``; docs/compile.md, "Per-layer compilation"). The inductor layer's kept
bytes against the dry-run: tests/plan/test_compiled_layers.py; equality with eager:
tests/compile/test_compile_per_layer.py."""
import functools
import math
import types

import pytest
import torch

import functional_pp as fpp
from functional_pp import optim
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models import llama
from functional_pp.parallel.init import init
from functional_pp.parallel.named import configure
from functional_pp.plan.dryrun import Instrumented

CFG = llama.Config.tiny(layers=2, hidden=64, mlp=160)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _layer_weight_bytes() -> int:
    """The bytes of one layer's gathered weights (fp32)."""
    decls = llama.init(CFG, torch.float32)["layers"][0]
    return 4 * sum(math.prod(d.shape) for _, d in leaves_with_paths(decls))


def _kept(keep_gathered: bool, shape=(4, 24)) -> int:
    """On one device: the bytes the compiled layers of a step keep for backward (autograd's saved
    tensors while a layer runs; the parameters' own storage aside)."""
    torch._dynamo.reset()                   # (keep_gathered changes the layer's trace)
    decls = llama.init(CFG, torch.float32)
    loss = Instrumented(functools.partial(llama.loss, cfg=CFG), "layers")     # tells which layer runs
    loss.tracker = types.SimpleNamespace(layer=None, phase=None, begin_forward=lambda: None)
    step = fpp.train_step(loss, optim.adamw(1e-4), mesh=MESH, rules=RULES, compile="per_layer:aot_eager")
    with fpp.use_rules(RULES):
        state = step.init(init(lambda: decls, mesh=MESH, rules=RULES, seed=0))
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, CFG.vocab, (shape[0], shape[1] + 1), generator=g)
        batch = {"tokens": fpp.named(data[:, :-1], "batch seq"), "labels": fpp.named(data[:, 1:], "batch seq")}
    params = {getattr(x, "data", x).untyped_storage().data_ptr() for _, x in leaves_with_paths(state["params"])}
    kept: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if loss.tracker.layer is not None and ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t
    with configure(keep_gathered=keep_gathered):
        step(state, batch)                  # (compiles)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(state, batch)
    return sum(kept.values())


def _both() -> dict:
    return {keep: _kept(keep) for keep in (True, False)}


def _check(runs: list[dict]) -> None:
    """Keeping the gathered weights (``keep_gathered=True``: what the partitioner chose on its own
    before) keeps every layer's whole weights on top of what the re-gathering step keeps: the same
    activations, and the shards (parameters) instead of the gathered weights."""
    weights = _layer_weight_bytes()
    for run in runs:
        assert run[True] - run[False] == pytest.approx(CFG.layers * weights, rel=0.01), (run, weights)


def test_compiled_layers_keep_shards_not_gathered_weights_on_simulated_devices():
    _check(fpp.launch(_both, MESH))


@pytest.mark.multiprocess
def test_compiled_layers_keep_shards_not_gathered_weights_on_gloo_processes():
    _check(fpp.launch(_both, MESH, processes=True, timeout=300))
