"""``compile="per_layer"``: one compilation of the declared layer runs every layer
(functional_pp/compile/layer_compile.py, docs/compile.md), equal to eager exactly (aot_eager)."""

import pytest
import torch
from harness import assert_same_run, launch_steps
from torch._dynamo.utils import counters

import functional_pp as fpp
from functional_pp.compile.layer_compile import split_mode
from functional_pp.models import llama


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled layer graphs stay in dynamo's cache: later tests of the suite start clean."""
    yield
    torch._dynamo.reset()


def _train(cfg, compile, mesh=None, rules=None, remat=False, processes=False):
    return launch_steps(cfg, compile, mesh, rules, remat=remat, processes=processes)


def _assert_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert_same_run(a, b)


def test_split_mode():
    assert split_mode("per_layer") == (False, True)
    assert split_mode("per_layer:aot_eager") == (False, "aot_eager")
    assert split_mode("aot_eager") == ("aot_eager", False) and split_mode(True) == (True, False)


@pytest.mark.slow
def test_per_layer_compiles_one_graph_for_all_layers_and_equals_eager():
    cfg = llama.Config.tiny(layers=3)
    eager = _train(cfg, False)
    counters.clear()
    per_layer = _train(cfg, "per_layer:aot_eager")
    _assert_equal(per_layer, eager)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # with remat: the compiled layer is checkpointed, recomputed by the same compiled graph
    _assert_equal(_train(cfg, "per_layer:aot_eager", remat=True), _train(cfg, False, remat=True))


@pytest.mark.slow
def test_per_layer_on_a_composed_mesh_equals_eager():
    cfg = llama.Config.tiny()
    mesh, rules = fpp.Mesh(dp_replicate=2, tp=2), llama.default_rules(sequence_parallel=True)
    _assert_equal(_train(cfg, "per_layer:aot_eager", mesh, rules), _train(cfg, False, mesh, rules))


@pytest.mark.slow
def test_per_layer_with_fsdp_shards_equals_eager_fsdp():
    """FSDP x TP+SP on simulated devices: the devices compile their layer graphs one after the
    other while the others run eager code, which must not take the traced branch
    (torch_private.is_tracing; docs/compile.md). Bitwise equal to the eager FSDP step."""
    cfg = llama.Config.tiny()
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)
    _assert_equal(_train(cfg, "per_layer:aot_eager", mesh, rules), _train(cfg, False, mesh, rules))


def _fsdp_on_gloo(compile):
    cfg = llama.Config.tiny()
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
    return _train(cfg, compile, mesh, rules, processes=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_layer_with_fsdp_on_gloo_processes_equals_eager():
    _assert_equal(_fsdp_on_gloo("per_layer:aot_eager"), _fsdp_on_gloo(False))
