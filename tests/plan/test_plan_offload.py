"""The planner counts the offload levers (plan.estimate options ``offload_params``,
``activation_offloading``; docs/memory.md) from the same dry run: with offload_params the
device holds no master weights, optimizer state or update and the host holds them; with
activation_offloading the saved activations are on the host but one layer's."""
import functools

import pytest

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.plan import estimate

CFG = llama.Config.tiny(layers=4)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
BATCH = {k: ((4, 64), "batch seq") for k in ("tokens", "labels")}


def _estimate(**options):
    return estimate(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), MESH, RULES, BATCH, precision="bf16",
                    options=options, repeated="layers", timeline=False)


@pytest.fixture(scope="module")
def plain():
    return _estimate()


def test_offload_params_moves_weights_optimizer_state_and_update_to_the_host(plain):
    off = _estimate(offload_params=True)
    opt_state, weights = plain.memory["optimizer state"], plain.memory["weights"]
    assert off.host_bytes >= weights + opt_state            # the masters and AdamW's moments, at least
    assert off.peak_bytes <= plain.peak_bytes - opt_state   # none of it on the device
    assert "weights" not in off.memory and "optimizer state" not in off.memory
    assert off.settings["offload_params"] and off.row()["host_GB"] == off.host_bytes / 1e9
    assert plain.host_bytes == 0


def test_activation_offloading_keeps_one_layers_activations_on_the_device(plain):
    off = _estimate(activation_offloading=True)
    per_layer = {}
    for t in off.runs[-1].saved:
        if t.category == "activations":
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.nbytes
    assert off.host_bytes >= plain.activation_bytes - max(per_layer.values()) > 0
    assert off.peak_bytes < plain.peak_bytes
    both = _estimate(offload_params=True, activation_offloading=True)
    assert both.peak_bytes < min(off.peak_bytes, _estimate(offload_params=True).peak_bytes)


def test_the_time_model_counts_the_host_copies_and_the_host_update(plain):
    """offload_params: the fp32 shards in and the bf16 gradients out over the host link, the
    update at host memory bandwidth; activation_offloading: the activations back in backward (the
    device's time: launch_seconds 0, or the tiny step would be its host's launches)."""
    cl = fpp.plan.cluster("h100x8").with_(launch_seconds=0.0)
    base = fpp.plan.cost(plain, cl)
    off = fpp.plan.cost(_estimate(offload_params=True), cl)
    copies = 1.5 * plain.param_bytes / cl.host_bandwidth
    assert off.by_collective["host copies (offload)"] == pytest.approx(copies)
    assert off.update_s == pytest.approx(3 * plain.state_bytes / cl.host_memory_bandwidth)
    assert off.step_s == pytest.approx(base.step_s - base.update_s + off.update_s + copies)
    acts = fpp.plan.cost(_estimate(activation_offloading=True), cl)
    assert acts.by_collective["host copies (offload)"] == pytest.approx(plain.activation_bytes / cl.host_bandwidth)
