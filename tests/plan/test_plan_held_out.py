"""The time and memory models against every published row (plan/references.py): the rows the
presets were fitted on within 5%, the rows no fit has seen (held out) within the tolerance each
states (5%, or the one achieved and why), the fit a function of the fitted rows alone, and the
peak reserved memory by the caching allocator's model (docs/planning.md, "Calibration")."""
import pytest

from functional_pp import plan
from functional_pp.plan import references


@pytest.fixture(scope="module")
def predicted():
    return {r.name: references.predict(r)[0] for r in references.ROWS}


def test_the_split_is_explicit_and_the_fitted_rows_are_held_to_five_percent():
    assert set(references.FITTED) | set(references.HELD_OUT) == set(references.ROWS)
    assert not set(references.FITTED) & set(references.HELD_OUT)
    assert len(references.HELD_OUT) >= 8 and len(references.FITTED) == 13
    for r in references.ROWS:
        assert r.cluster in plan.PRESETS and r.source, r.name
        assert r.tolerance == 0.05 or r.why, f"{r.name}: a tolerance over 5% must say why"
    assert all(r.tolerance == 0.05 for r in references.FITTED)


@pytest.mark.parametrize("row", references.ROWS, ids=lambda r: r.name)
def test_every_row_is_predicted_within_its_tolerance(row, predicted):
    error = predicted[row.name] / row.tokens_per_s_per_gpu - 1
    assert abs(error) <= row.tolerance, f"{row.name}: {error:+.1%} (tolerance {row.tolerance:.0%})"


def test_the_tolerances_are_the_ones_achieved(predicted):
    """A stated tolerance is not slack: each wider one is within 3 points of the row's error
    (a model that improves must tighten it, one that degrades fails the test above)."""
    for r in references.ROWS:
        if r.tolerance > 0.05:
            error = abs(predicted[r.name] / r.tokens_per_s_per_gpu - 1)
            assert r.tolerance - error < 0.03, f"{r.name}: {error:.1%} achieved, {r.tolerance:.0%} stated"


def test_the_hosts_launches_move_no_row():
    """The host term (an eager step's launches at ``Cluster.launch_seconds``) hides under the
    device's work on every row: the eager ones' predictions are the device's (the 8B rows' host
    time is 4% of their step, the H200 1B row's a quarter), the compiled ones are not charged. The
    H200 row's 38 ms of idle GPU per step would need 4x the measured cost per launch."""
    for r in references.ROWS:
        tps, t = references.predict(r)
        device = plan.cluster(r.cluster).with_(launch_seconds=0.0)
        assert tps == references.predict(r, device)[0], r.name
        assert (t.host_s > 0) == (not r.compiled), r.name
    (own,) = references.OWN_GPU
    t = references.predict(own)[1]
    launches = t.host_s / plan.cluster(own.cluster).launch_seconds
    assert 0.2 < t.host_s / t.step_s < 0.3
    measured = own.local_batch * own.seq / own.tokens_per_s_per_gpu
    assert measured / launches > 4 * plan.cluster(own.cluster).launch_seconds


def _samples(rows):
    """(estimate, measured step seconds, cost options) of each row: its data-parallel ranks' tokens
    over its devices' rate."""
    def dp(r):
        return dict(r.mesh).get("dp_shard", 1) * dict(r.mesh).get("dp_replicate", 1)
    return [(references.reference_estimate(r), r.local_batch * r.seq * dp(r) / r.devices / r.tokens_per_s_per_gpu,
             r.cost_options()) for r in rows]


def test_the_fit_sees_only_the_fitted_rows_and_the_preset_is_its_result():
    """The preset's three bf16 numbers are the fit's fixed point on the fitted 8B rows alone:
    refitted on them, they stay (within 1%), so no held-out row moved them. (From a start
    far off, 0.4 / 0.9 / 0.7, eight sweeps land within 1% too: not run here, 11 s.)"""
    bf16 = [r for r in references.FITTED if r in references.LLAMA3_8B]
    preset = plan.cluster("h100x8-gt")
    fitted = plan.fit_cluster(preset, _samples(bf16), fit=("compute_efficiency", "compiled_traffic", "overlap"),
                              rounds=2)
    for k in ("compute_efficiency", "compiled_traffic", "overlap"):
        assert getattr(fitted, k) == pytest.approx(getattr(preset, k), rel=0.01), k
    assert not set(bf16) & set(references.HELD_OUT)


def test_the_megatron_preset_is_fitted_on_its_one_row_and_predicts_the_held_out_ones():
    """``h100x8-te``'s matmul efficiency is the fit on Megatron's 1.7B row alone (data parallel
    only): refitted from h100x8's 0.56 it lands on the preset's 0.69; the tensor-parallel rows
    (7.1B-32B) are held out, and each comes within 5% only with both of Megatron's overlaps
    modelled: without the distributed optimizer or without the TP overlap the 32B row is off by
    more (the mechanisms are what carries the held-out rows, not the fitted number)."""
    (one,) = [r for r in references.MEGATRON_GPT if r.split == "fitted"]
    assert dict(one.mesh).get("tp", 1) == 1
    samples = [(references.reference_estimate(one), one.local_batch * one.seq / one.tokens_per_s_per_gpu,
                one.cost_options())]
    fitted = plan.fit_cluster(plan.cluster("h100x8"), samples, fit=("compute_efficiency",), rounds=2)
    assert fitted.compute_efficiency == pytest.approx(plan.cluster("h100x8-te").compute_efficiency, abs=0.005)
    (big,) = [r for r in references.MEGATRON_GPT if r.name == "Megatron GPT 32B, DP 48 x TP 8"]
    assert big.split == "held_out" and dict(big.mesh)["tp"] == 8
    for drop in ("distributed_optimizer", "tp_comm_overlap"):
        options = {**big.cost_options(), drop: False}
        t = plan.cost(references.reference_estimate(big), big.cluster, **options)
        error = big.local_batch * big.seq / 8 / t.step_s / big.tokens_per_s_per_gpu - 1
        assert error < -0.05, (drop, error)


@pytest.mark.parametrize("row", [r for r in references.ROWS if r.memory_gib], ids=lambda r: r.name)
def test_published_peak_memory_is_predicted_within_its_tolerance(row):
    """torchtitan's rows log the allocator's peak reserved bytes; this project's GPU run the
    allocated peak. Within 10%, or the tolerance achieved and why."""
    got = references.predicted_memory(row) / 2 ** 30
    error = got / row.memory_gib - 1
    settings = references.memory_estimate(row).settings     # Float8 rows: with Float8's buffers
    assert (settings["float8"], settings["float8_all_gather"]) == (row.float8, row.float8_all_gather)
    assert abs(error) <= row.memory_tolerance, f"{row.name}: {got:.1f} GiB, {error:+.1%}"
    assert row.memory_tolerance == 0.10 or row.memory_why
    if row.memory_tolerance > 0.10:
        assert row.memory_tolerance - abs(error) < 0.03, f"{row.name}: {error:+.1%} achieved"


def test_reserved_memory_is_the_peak_and_the_allocators_overhead():
    """The allocator model adds what rounding and cached blocks cost, FSDP2's all-gather
    stream's pool (its flat buffers, two units held at a time) and its reduce-scatter stream's
    (the step's sharded fp32 gradients, held until the next step's ``zero_grad``): positive, a
    few GiB on the 8B rows (the allocated peak alone is 17% below the measured 82.4 GiB)."""
    for r in references.LLAMA3_8B:
        est = references.memory_estimate(r)
        assert est.reserved_bytes == est.peak_bytes + est.reserved_overhead
        assert 2 * 2 ** 30 < est.reserved_overhead < 14 * 2 ** 30, r.name
        assert 2 ** 30 < est.runs[-1].reserved_by_stream["all_gather"] < est.reserved_overhead, r.name


def test_fsdp2s_sharded_gradients_are_the_8b_rows_missing_reserved_memory():
    """docs/planning.md, "Reserved memory": FSDP2's sharded gradients (fp32, as the masters) are
    its reduce-scatter outputs, on its reduce-scatter stream, held until the next step's
    ``zero_grad``; that stream's pool keeps them cached while the next step's forward and loss
    run. On the 8B rows it is the whole model's fp32 shards (3.74 GiB at FSDP 8, 0.23 at 128, to
    each unit's 2 MiB rounding or its share of a 20 MiB segment), where the dry-run's own
    per-weight outputs, freed as they were used, left 0.25 and 0.02: the FSDP 8 rows' error,
    -6.3% and -4.9% without it, is -2.0% and -0.3%."""
    for r in references.LLAMA3_8B:
        est = references.memory_estimate(r)
        run = est.runs[-1]
        pool = est.reserved_overhead + run.peak_bytes - (run.peak_reserved - run.reserved_by_stream["reduce_scatter"])
        assert est.param_bytes <= pool < est.param_bytes + 33 * 20 * 2 ** 20, r.name
        assert run.reserved_by_stream["reduce_scatter"] < pool / 10, r.name
        if dict(r.mesh)["dp_shard"] == 8:
            assert abs(references.predicted_memory(r) / 2 ** 30 / r.memory_gib - 1) < 0.025, r.name


def test_the_8b_rows_peak_holds_fsdp2s_gathered_root_and_last_layer():
    """docs/planning.md, "Reserved memory": at the loss's peak FSDP2 holds the root unit (the
    embedding and head, not resharded after forward) and torchtitan's last layer (not resharded
    either) gathered, 1.96 + 0.41 GiB in bf16 at any FSDP degree (the H200 rows' last layer in
    fp8: 0.20), and no bf16 copies of the shards."""
    for r in references.LLAMA3_8B + references.LLAMA3_8B_H200:
        held = references.memory_estimate(r).memory["weights in flight"] / 2 ** 30
        assert held == pytest.approx(2.16 if r.float8_all_gather else 2.36, abs=0.01), r.name


def test_the_70b_rows_overhead_is_fragmentation_that_expandable_segments_avoid():
    """docs/planning.md, "Reserved memory": of the sync 70B row's overhead (14.4 GiB), FSDP2's
    all-gather pool is under 1 GiB and its held sharded gradients 1.0 GiB; the rest is freed
    blocks (this framework's fp32 sequence-parallel sums, 4 GiB each) that the loss's 7.8 GiB requests cannot use. Under
    expandable segments (torchtitan's launcher's setting) it falls to 6.2 GiB and the row is
    over 10% under: the agreement within 1% leans on fragmentation torchtitan's run may not have."""
    (row,) = [r for r in references.LLAMA3_70B if not r.async_tp]
    est = references.memory_estimate(row)
    pools = sum(v for k, v in est.runs[-1].reserved_by_stream.items() if k != "compute")
    assert pools < 2 ** 30 and est.reserved_overhead > 12 * 2 ** 30
    grown = references.reference_estimate(row, row.compiled, expandable_segments=True)
    assert grown.peak_bytes == est.peak_bytes and grown.reserved_overhead < est.reserved_overhead / 2
    assert grown.reserved_bytes / 2 ** 30 / row.memory_gib - 1 < -0.10


def test_benchmarks_gpu_results_become_held_out_rows():
    """A ``benchmarks/gpu.py`` JSON gives a row per functional side it timed, on its GPU's
    preset: the kept H200 run timed none (its compiled side failed before the timing), and
    with the tokens/s issue 44 reports, its eager row predicts what the hand-written row does."""
    import json
    import pathlib
    path = pathlib.Path(__file__).parents[2] / "benchmarks/results/gpu_h200_torch2.11_2026-12-04.json"
    result = json.loads(path.read_text())
    assert references.gpu_rows(result) == ()
    result["rows"]["1b"]["functional_eager"]["tokens_per_s"] = 37600.0
    (row,) = references.gpu_rows(result)
    own = references.OWN_GPU[0]
    assert (row.cluster, row.split, row.local_batch, row.seq, row.compiled) == ("h200x8", "held_out", 4, 2048, False)
    assert references.predict(row)[0] == pytest.approx(references.predict(own)[0], rel=1e-9)
    assert references.predicted_memory(row) == references.predicted_memory(own)
    with pytest.raises(ValueError, match="no cluster preset describes 'NVIDIA B200'"):
        references.gpu_rows({**result, "device": "NVIDIA B200"})


def test_maxtext_rows_convert_its_count_of_the_model_the_rows_run():
    """MaxText's TFLOP/s (April 2024: 6 x every parameter + causal attention per token) becomes
    tokens/s with the parameter count of the Llama 2 7B the rows dry-run, and the rows are
    its N-VM scripts' meshes: FSDP 8 in a VM, data parallel across VMs."""
    import math

    import torch
    from functional_pp.core.tree import tree_leaves
    from functional_pp.models import llama
    cfg = references.CONFIGS["llama2_7b"]()
    count = sum(math.prod(d.shape) for d in tree_leaves(llama.init(cfg, torch.bfloat16)))
    assert count == references.LLAMA2_7B_PARAMETERS
    for r in references.MAXTEXT_A3:
        assert dict(r.mesh)["dp_shard"] == 8 and r.devices % 8 == 0
    assert references.MAXTEXT_A3[0].tokens_per_s_per_gpu == pytest.approx(492e12 / (6 * count + 6 * 32 * 128 * 32 * 4096))


def test_the_a3_cross_vm_overlap_is_fitted_on_two_rows_and_carries_the_held_out_ones():
    """``a3x8``'s ``inter_overlap`` (the cross-VM gradient all-reduce hidden under compute over
    GPUDirect-TCPX) is the fit on MaxText's 2- and 16-VM rows alone: refitted there from
    torchtitan's 0.94 it lands on the preset's 0.26. The 1-, 4- and 8-VM rows are held out; the
    mechanisms carry them: with the cross-VM traffic hidden as over torchtitan's RDMA (0.94) the
    4-VM row is >10% optimistic, and without XLA's fusion of what minimal_flash recomputes
    (``fused_recompute``) the 1-VM row is >5% pessimistic."""
    fitted = [r for r in references.MAXTEXT_A3 if r.split == "fitted"]
    assert [r.devices for r in fitted] == [16, 128]
    preset = plan.cluster("a3x8")
    refit = plan.fit_cluster(preset.with_(inter_overlap=None), _samples(fitted), fit=("inter_overlap",), rounds=2)
    assert refit.inter_overlap == pytest.approx(preset.inter_overlap, abs=0.01)
    one, _, four, _, _ = references.MAXTEXT_A3
    rdma = references.predict(four, preset.with_(inter_overlap=None))[0] / four.tokens_per_s_per_gpu - 1
    assert rdma > 0.10, rdma
    t = plan.cost(references.reference_estimate(one), "a3x8", **{**one.cost_options(), "fused_recompute": False})
    assert one.local_batch * one.seq / t.step_s / one.tokens_per_s_per_gpu - 1 < -0.05
