"""The dry-run knows selective checkpointing (``remat="selective"``, docs/planning.md): it runs
the step's own selective checkpoint on meta tensors, so the activations it predicts are the
matmul and attention results the layers keep, and its backward counts the recomputed kernels
but no recomputed matmul."""
import functools
import sys
from pathlib import Path

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compile"))
from test_selective_remat import CFG, eager_forward_backward  # noqa: E402

BATCH = {k: ((4, 32), "batch seq") for k in ("tokens", "labels")}
MODES = (False, "selective", "selective_alternate", True)


def _estimate(remat):
    return plan.estimate(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), fpp.Mesh(), fpp.Rules(),
                         BATCH, remat=remat, timeline=False)


@pytest.fixture(scope="module")
def estimates():
    return {mode: _estimate(mode) for mode in MODES}


def test_predicted_activations_match_what_a_real_forward_keeps(estimates):
    """The dry-run's activation bytes (3 layers, extrapolated from runs of 1 and 2) against the
    bytes a real eager forward leaves allocated on the CPU (the same model and batch). The
    real forward also keeps each checkpointed layer's input, which the dry-run does not count
    as an activation (the region holds it, not autograd): 8 KB per layer here, hence 2%."""
    predicted = {mode: est.activation_bytes for mode, est in estimates.items()}
    assert predicted[False] > predicted["selective"] > predicted["selective_alternate"] > predicted[True]
    for mode in ("selective", "selective_alternate"):
        measured = eager_forward_backward(mode)[2]
        assert predicted[mode] == pytest.approx(measured, rel=0.02), (mode, predicted, measured)
    assert predicted[False] == pytest.approx(eager_forward_backward(False)[2], rel=0.01)


def test_recomputation_is_counted_in_backward(estimates):
    def backward(est, what):
        return est.extrapolate(lambda r: getattr(r, what).get("backward", 0.0))
    flops = {mode: backward(est, "linear_flops") for mode, est in estimates.items()}
    attention = {mode: backward(est, "attention_flops") for mode, est in estimates.items()}
    traffic = {mode: backward(est, "traffic") for mode, est in estimates.items()}
    assert flops["selective"] == flops[False] < flops[True]       # no matmul is recomputed,
    assert attention["selective"] == attention[False] < attention[True]     # nor attention;
    # the memory-bound kernels are, as full checkpointing recomputes them (its extra work is
    # the matmuls' and attention's FLOPs, which are not traffic)
    assert traffic[False] < traffic["selective"] == traffic[True]
    assert estimates["selective"].settings["remat"] == "selective"
    # torchtitan's policy recomputes every second matmul of a layer: the FLOPs the time model adds
    # for it on a run without checkpointing (selective_ac="op"), and the same kernels
    every_other = estimates[False].extrapolate(lambda r: r.every_other_mm_forward)
    assert every_other > 0
    assert flops["selective_alternate"] == pytest.approx(flops[False] + every_other, rel=1e-9)
    assert attention["selective_alternate"] == attention[False]
    assert traffic["selective_alternate"] == traffic["selective"]     # (a matmul's work is FLOPs, not traffic)


def test_time_model_refuses_to_add_torchtitans_recomputation_twice(estimates):
    with pytest.raises(ValueError, match="already counts"):
        plan.cost(estimates["selective"], "h100x8", selective_ac="op")
    assert plan.cost(estimates[False], "h100x8", selective_ac="op").step_s > 0


def test_a_searched_selective_candidate_is_named_so():
    from functional_pp.plan.search import Candidate, _name
    names = {r: _name(Candidate(fpp.Mesh(dp_shard=2), fpp.Rules(), label="fsdp", remat=r)) for r in MODES}
    assert names == {False: "dp_shard=2 fsdp", "selective": "dp_shard=2 fsdp remat=selective",
                     "selective_alternate": "dp_shard=2 fsdp remat=selective_alternate", True: "dp_shard=2 fsdp remat"}


@pytest.mark.parametrize("strategy", ["exhaustive", "beam"])
def test_a_layout_that_fits_only_with_every_second_matmul_recomputed_is_found(strategy):
    """``"selective_alternate"`` is one more memory lever of the search: under a limit between what
    it and ``"selective"`` reserve, the layouts without it or with every matmul kept do not fit,
    and the search chooses it over whole-layer recomputation (less recomputed, faster)."""
    from functional_pp.plan.search import beam, exhaustive
    space = plan.Space(remat=MODES, fsdp=((),), orders="default")
    batch = {k: ((8, 256), "batch seq") for k in ("tokens", "labels")}    # activations over the allocator's segments

    def ranked(limit=None, search=exhaustive):
        return plan.search(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), 1, batch, cluster="h100x8",
                           space=space, memory_limit_bytes=limit, strategy=search)
    reserved = {e.settings["remat"]: e.reserved_bytes for e in ranked()}
    assert reserved[False] > reserved["selective"] > reserved["selective_alternate"] > reserved[True], reserved
    chosen = ranked((reserved["selective"] + reserved["selective_alternate"]) / 2,
                    exhaustive if strategy == "exhaustive" else beam(1))[0]
    assert chosen.settings["fits"] and chosen.settings["remat"] == "selective_alternate"


def test_torchtitans_recomputation_is_counted_afresh_in_each_micro_step():
    """torchtitan's policy counts a block's matmuls per run: with two micro-steps the FLOPs the time
    model adds for it (``selective_ac="op"``) are the ones the dry-run recomputes under it (Llama's 7
    matmuls a layer: a count running on across micro-steps would recompute q, v, gate and down in the
    second one instead of k, o and up)."""
    def run(remat):
        return plan.estimate(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), fpp.Mesh(), fpp.Rules(),
                             BATCH, remat=remat, timeline=False, grad_accum=2)
    plain, alternate = run(False), run("selective_alternate")

    def backward_flops(est):
        return est.extrapolate(lambda r: r.linear_flops.get("backward", 0.0))
    every_other = plain.extrapolate(lambda r: r.every_other_mm_forward)
    assert backward_flops(alternate) - backward_flops(plain) == pytest.approx(every_other, rel=1e-9)
