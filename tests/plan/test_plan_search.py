"""The planner's time model, search, trace and command line."""
import functools
import json

import pytest

import functional_pp as fpp
from functional_pp import plan
from functional_pp.cli import main
from functional_pp.models import llama

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 16), "batch seq"), "labels": ((8, 16), "batch seq")}
#: the device's work alone: the tiny model's eager step is the host's (launch_seconds, tests/plan/test_host_launches.py)
DEVICE = plan.cluster("h100x8").with_(launch_seconds=0.0)


def test_axes_are_placed_on_nodes_by_mesh_order():
    cl = plan.cluster("h100x8")
    assert cl.placement(fpp.Mesh(dp_shard=4, tp=8)) == {"dp_shard": "inter", "tp": "intra"}
    assert cl.placement(fpp.Mesh(dp_shard=2, tp=16)) == {"dp_shard": "inter", "tp": "inter"}   # tp=16 spans 2 nodes
    assert cl.placement(fpp.Mesh.from_axes([("tp", 8), ("dp_shard", 4)])) == {"tp": "inter", "dp_shard": "intra"}
    # alpha-beta: ring steps x latency + bytes / bandwidth of the link crossed
    link = cl.link(fpp.Mesh(dp_shard=4, tp=8), ("tp",))
    assert cl.collective_seconds("all_reduce", 450e6, 8, link) == pytest.approx(14 * 5e-6 + 1e-3)
    with pytest.raises(ValueError, match="unknown cluster 'h100'.*h100x8"):
        plan.cluster("h100")


def test_cost_overlaps_weight_traffic_and_charges_tp_on_the_critical_path():
    cl = DEVICE
    fsdp = plan.estimate(LOSS, llama.init(CFG), fpp.Mesh(dp_shard=4), plan.standard_rules(("dp_shard",)), BATCH)
    tp = plan.estimate(LOSS, llama.init(CFG), fpp.Mesh(tp=2), plan.standard_rules((), True), BATCH)
    t_fsdp, t_tp = plan.cost(fsdp, cl), plan.cost(tp, cl)
    weight = [e for e in fsdp.runs[0].events if e.weight_traffic]
    assert weight and all(e.axes == ("dp_shard",) for e in weight)
    assert t_fsdp.hidden_comm_s > 0
    assert all(not e.weight_traffic for e in tp.runs[0].events if e.kind in ("all_gather", "reduce_scatter"))
    assert t_tp.hidden_comm_s < 0.02 * t_tp.exposed_comm_s    # only the norms' gradient sums hide
    for t in (t_fsdp, t_tp):
        assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.update_s)
        assert 0 < t.mfu < 1
    # a slower inter-node link only changes layouts whose collectives cross nodes
    slow = cl.with_(inter_bandwidth=cl.inter_bandwidth / 10)
    assert plan.cost(fsdp, slow).step_s == pytest.approx(t_fsdp.step_s)


def test_fit_cluster_recovers_the_constants_that_made_the_times():
    truth = DEVICE.with_(compute_efficiency=0.42, intra_bandwidth=123e9)
    ests = [plan.estimate(LOSS, llama.init(CFG), m, plan.standard_rules(("dp_shard",) if m.shape["dp_shard"] > 1 else ()), b)
            for m, b in [(fpp.Mesh(dp_shard=2), BATCH), (fpp.Mesh(tp=2), BATCH),
                         (fpp.Mesh(dp_shard=4), {k: ((16, 32), d) for k, (s, d) in BATCH.items()})]]
    fitted = plan.fit_cluster(DEVICE, [(e, plan.cost(e, truth).step_s) for e in ests],
                              fit=("compute_efficiency", "intra_bandwidth"))
    assert fitted.compute_efficiency == pytest.approx(0.42, rel=1e-2)
    assert fitted.intra_bandwidth == pytest.approx(123e9, rel=1e-2)


@pytest.mark.slow
def test_search_prunes_ranks_and_gives_the_pareto_front(tmp_path):
    space = plan.Space(remat=(False, True), keep_gathered=(False,), cp_attention=("ring",), precision="fp32")
    seen = []
    res = plan.search(LOSS, llama.init(CFG), 4, BATCH, cluster="h100x8", space=space,
                      progress=lambda i, n, name: seen.append((i, n)))
    assert seen and seen[-1][0] == seen[-1][1] - 1
    assert any("kv_heads" in why and "tp=4" in name for name, why in res.rejected)   # kv_heads=2: no tp=4
    fits = [e for e in res if e.settings["fits"]]
    times = [e.time.step_s for e in fits]
    assert times == sorted(times)
    front = res.pareto()
    assert front and all(not any(o.time.step_s < f.time.step_s and o.peak_bytes < f.peak_bytes for o in res)
                         for f in front)
    remat = [e for e in res if e.settings["remat"]]
    plain = {e.describe().replace(" remat", ""): e for e in res if not e.settings["remat"]}
    assert remat and all(e.activation_bytes < plain[e.describe().replace(" remat", "")].activation_bytes for e in remat)
    limit = sorted(e.reserved_bytes for e in res)[len(res) // 2]
    limited = plan.search(LOSS, llama.init(CFG), 4, BATCH, cluster="h100x8", space=space, memory_limit_bytes=limit,
                          strategy=plan.beam(2))
    ok = [e.reserved_bytes <= limit for e in limited]
    assert ok == sorted(ok, reverse=True) and any(ok)                     # layouts that fit come first
    data = json.loads(limited.to_json())
    assert data["layouts"][0]["rank"] == 1 and "step_s" in data["layouts"][0]


def test_impossible_layouts_are_rejected_with_the_reason():
    res = plan.search(LOSS, llama.init(CFG), 8, BATCH, cluster="h100x8",
                      rules_for=lambda m: llama.default_rules(), meshes=[fpp.Mesh(tp=8), fpp.Mesh(dp_shard=8)])
    assert len(res) == 1 and res[0].mesh.shape["dp_shard"] == 8
    assert any("kv_heads" in why and "tp=8" in name for name, why in res.rejected)


def test_trace_lists_collectives_saved_tensors_and_a_memory_timeline(tmp_path):
    cfg = llama.Config.tiny(layers=3)
    est = plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), fpp.Mesh(tp=2),
                        llama.default_rules(sequence_parallel=True), BATCH)
    tr = plan.trace(est)
    layers = {c["layer"] for c in tr["collectives"]}
    assert {0, 1} <= layers
    assert all({"kind", "axes", "group_size", "bytes_sent", "op", "phase"} <= set(c) for c in tr["collectives"])
    assert {s["layer"] for s in tr["saved"]} >= {0, 1}
    peak = max(p["live_bytes"] for p in tr["memory_timeline"])
    assert peak == tr["peak"]["bytes"]
    plan.write_trace(est, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["layers_in_model"] == 3


@pytest.mark.slow
def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "examples/configs/dp.yaml", "--devices", "2", "--cluster", "a100x8",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step s" in text and "chose" in text and "a100x8" in text
    assert json.loads(out.read_text())["layouts"]
    assert main(["plan", "examples/configs/dp.yaml", "--devices", "2", "--cluster", "nope"]) == 2


@pytest.mark.slow
def test_layout_auto_trains_with_the_chosen_layout(tmp_path, capsys):
    assert main(["train", "examples/configs/dp.yaml", "--layout", "auto", "--simulate", "2", "--max-steps", "2", "--set", "warmup_steps=1",
                 "--output", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "layout: auto" in text and "chose" in text
