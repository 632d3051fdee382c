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
MODES = (False, "selective", True)


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
    assert predicted[False] > predicted["selective"] > predicted[True]
    measured = eager_forward_backward("selective")[2]
    assert predicted["selective"] == pytest.approx(measured, rel=0.02), (predicted, measured)
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


def test_time_model_refuses_to_add_torchtitans_recomputation_twice(estimates):
    with pytest.raises(ValueError, match="already counts"):
        plan.cost(estimates["selective"], "h100x8", selective_ac="op")
    assert plan.cost(estimates[False], "h100x8", selective_ac="op").step_s > 0


def test_a_searched_selective_candidate_is_named_so():
    from functional_pp.plan.search import Candidate, _name
    names = {r: _name(Candidate(fpp.Mesh(dp_shard=2), fpp.Rules(), label="fsdp", remat=r)) for r in MODES}
    assert names == {False: "dp_shard=2 fsdp", "selective": "dp_shard=2 fsdp remat=selective",
                     True: "dp_shard=2 fsdp remat"}
