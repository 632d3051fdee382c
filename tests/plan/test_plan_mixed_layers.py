"""The dry-run of models whose layers differ in shape (docs/planning.md, "Layers that differ"):
Gemma 4's full-attention layers (their own head width and k/v heads, v the k projection),
DeepSeek's first dense layers before the MoE ones, Llama 4's dense/MoE interleave. The layers
are grouped by their parameter declarations, the first n layers run for the few n that tell
each kind's share, and parameters, state, saved activations, peak (by category), FLOPs and
every collective equal a dry-run of the whole model (``repeated=None``), byte for byte."""
import functools
from fractions import Fraction

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama
from functional_pp.plan.dryrun import layer_kinds, layer_plan

BATCH = {"tokens": ((4, 16), "batch seq"), "labels": ((4, 16), "batch seq")}
L = 12


def gemma4(layers: int = L) -> llama.Config:
    """Sliding and full layers alternating (the last full), as tests/models/test_gemma4_text.py."""
    return llama.Config.tiny(layers=layers, head_dim=16, global_head_dim=32, global_kv_heads=2, k_eq_v=True,
                             v_norm=True, sliding_window=4,
                             layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(layers)))


def deepseek(layers: int = L) -> llama.Config:
    """Two dense layers, then MoE layers (first_k_dense_replace=2)."""
    return llama.Config.tiny(layers=layers, experts=4, experts_top_k=2, moe_mlp=32, moe_layers=tuple(range(2, layers)))


def llama4(layers: int = L) -> llama.Config:
    """Dense and MoE layers interleaved (interleave_moe_layer_step=2)."""
    return llama.Config.tiny(layers=layers, experts=4, experts_top_k=1, moe_mlp=32,
                             moe_layers=tuple(range(1, layers, 2)))


MODELS = {"gemma4": gemma4, "deepseek": deepseek, "llama4": llama4,
          "uniform moe": lambda: llama.Config.tiny(layers=4, experts=4, experts_top_k=2, moe_mlp=32)}
LAYOUT = (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True))


def _same(fast, full):
    assert (fast.param_bytes, fast.state_bytes, fast.activation_bytes, fast.peak_bytes) == \
        (full.param_bytes, full.state_bytes, full.activation_bytes, full.peak_bytes)
    assert fast.memory == full.memory
    assert fast.flops == full.flops
    assert fast.comm.by_axis() == full.comm.by_axis()
    assert sorted(map(repr, fast.comm.events)) == sorted(map(repr, full.comm.events))


@pytest.mark.parametrize("name", list(MODELS))
def test_estimate_equals_the_whole_model(name):
    cfg = MODELS[name]()
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg)
    fast = plan.estimate(loss, decls, *LAYOUT, BATCH)
    full = plan.estimate(loss, decls, *LAYOUT, BATCH, repeated=None)
    assert len(full.runs) == 1 and fast.layers == cfg.layers
    if name == "uniform moe":          # (its routing counts: one all-reduce of a row per layer)
        assert fast.layer_runs is None and len(fast.runs) == 2
    else:                               # fewer layers run than the model has
        assert sum(fast.layer_runs) < cfg.layers and len(fast.runs) == len(fast.layer_runs) > 2
        assert any("kinds" in n for n in fast.notes)
        assert plan.trace(fast)["layers_in_run"] == fast.layer_runs[-1]
    _same(fast, full)
    assert plan.cost(fast, plan.cluster("h100x8")).step_s > 0


def test_micro_steps_and_mixed_layers_together():
    """7+ micro-steps run as 2 and 3, each at the layer counts the kinds need."""
    cfg = deepseek()
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg)
    batch = {k: ((16, 16), d) for k, (_, d) in BATCH.items()}
    fast = plan.estimate(loss, decls, *LAYOUT, batch, grad_accum=8)
    full = plan.estimate(loss, decls, *LAYOUT, batch, grad_accum=8, repeated=None, extrapolate_micro_steps=False)
    assert fast.micro_steps == (8, 2, 3) and len(fast.runs) == 2 * len(fast.layer_runs)
    _same(fast, full)


@pytest.mark.parametrize("remat", [False, "selective", "selective_alternate", True])
def test_a_full_layer_every_third_and_the_last_sliding(remat):
    """The peak in backward (256-token rows): with selective recomputation it falls in the last
    layer's backward, a sliding one, which the runs' last-layer terms account for; recomputing
    whole layers it falls in the last *full* layer's, not a sum over layers: the model runs whole."""
    n = 24
    cfg = llama.Config.tiny(layers=n, head_dim=16, global_head_dim=32, global_kv_heads=2, k_eq_v=True, v_norm=True,
                            sliding_window=4, layer_types=tuple("sliding_attention" if (i + 1) % 3 else
                                                                "full_attention" for i in range(n - 1))
                            + ("sliding_attention",))
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg)
    batch = {k: ((8, 256), d) for k, (_, d) in BATCH.items()}
    fast = plan.estimate(loss, decls, *LAYOUT, batch, remat=remat)
    full = plan.estimate(loss, decls, *LAYOUT, batch, remat=remat, repeated=None)
    assert full.runs[0].peak_at.startswith("backward" if remat else "forward")
    if remat is True:
        assert len(fast.runs) == 1 and any("recomputed whole" in n for n in fast.notes)
    else:
        assert fast.layer_runs == (1, 2, 3, 4, 6)
    _same(fast, full)


def test_the_old_extrapolation_missed_the_full_layers():
    """f(1) + (L-1)(f(2) - f(1)) from the first two layers (a sliding and a full one) counts the
    wrong parameters and FLOPs; the layers are of two kinds by their declarations."""
    cfg = gemma4()
    decls = llama.init(cfg)
    assert layer_kinds(decls["layers"]) == [0, 1] * (L // 2)
    loss = functools.partial(llama.loss, cfg=cfg)
    one, two = (plan.estimate(loss, {**decls, "layers": decls["layers"][:n]}, *LAYOUT, BATCH) for n in (1, 2))
    full = plan.estimate(loss, decls, *LAYOUT, BATCH)
    old = lambda f: f(one) + (L - 1) * (f(two) - f(one))     # noqa: E731
    assert old(lambda e: e.param_bytes) != full.param_bytes
    assert old(lambda e: e.flops) != full.flops


def test_layer_plan():
    assert layer_plan([0] * 9) == ((1, 2), None)
    runs, w = layer_plan([0, 0] + [1] * 10)                      # DeepSeek: 2 dense, 10 MoE
    assert runs == (1, 2, 3, 4)
    assert all(isinstance(x, Fraction) for x in w) and sum(w) == 1
    # the weights take the runs' layer counts to the model's
    dense = [sum(1 for k in [0, 0, 1, 1][:m] if k == 0) for m in runs]
    moe = [m - d for m, d in zip(runs, dense)]
    assert sum(a * b for a, b in zip(w, dense)) == 2 and sum(a * b for a, b in zip(w, moe)) == 10
    assert layer_plan([0, 1, 0, 1]) == ((4,), None)               # as long as the model: run it all
