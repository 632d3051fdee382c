"""Pipeline and expert-parallel layouts in the planner (docs/planning.md, "Pipelines"): the
schedule's bubble and held activations, the stage-to-stage bytes against a real pipeline step,
the per-micro-batch collectives, torchtitan's 405B 1F1B and interleaved rows, the search."""
import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp import plan
from functional_pp.cli import main
from functional_pp.models import llama
from functional_pp.parallel.pipeline.timing import bubble_formula
from functional_pp.plan import references
from functional_pp.plan.timing import run_components
from functional_pp.step.pipeline import pipeline_step

CFG = llama.Config.tiny(layers=8)
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 16), "batch seq"), "labels": ((8, 16), "batch seq")}
RULES = fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp")
M = 4
#: the device's work alone: these tiny steps would be their host's launches (launch_seconds)
DEVICE = plan.cluster("h100x8").with_(launch_seconds=0.0)


def _stage(layers):
    decls = llama.init(CFG)
    micro = {k: ((2, 16), d) for k, (_, d) in BATCH.items()}
    return plan.estimate(LOSS, {**decls, "layers": decls["layers"][:layers]}, fpp.Mesh(dp_shard=2),
                         fpp.Rules(batch="dp_shard", hidden="dp_shard"), micro)


@pytest.fixture(scope="module")
def stage():
    """One device's stage (2 of 8 layers) on one micro-batch, on the mesh without pp; the
    activations of one layer (2 layers' less 1 layer's)."""
    two = _stage(2)
    return two, two.activation_bytes - _stage(1).activation_bytes


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_pipeline_estimate_from_the_schedule(stage, schedule, v):
    stage, per_layer = stage
    est = plan.estimate(LOSS, llama.init(CFG), fpp.Mesh(pp=4, dp_shard=2), RULES, BATCH, grad_accum=M,
                        schedule=schedule, virtual_stages=v, pp_fsdp_gather="micro")
    pipe = est.pipeline
    assert pipe.bubble == pytest.approx(bubble_formula(schedule, 4, M, v))
    held = {"gpipe": M, "1f1b": 4, "interleaved_1f1b": pipe.timeline.in_flight(0), "zb_h1": 4}[schedule]
    assert pipe.in_flight == held                                  # 1F1B: p micro-batches on the first stage
    # fsdp_gather="micro": the stage's collectives once per micro-batch, exactly; the transfers on top
    others = [e for e in est.comm.events if e.axes != ("pp",)]
    assert len(others) == M * len(stage.comm.events)
    assert sum(e.bytes_sent for e in others) == M * stage.comm.total_bytes
    boundary = 2 // 2 * 16 * CFG.hidden * 4                        # micro-batch rows / dp x seq x hidden x fp32
    assert pipe.boundary_bytes == boundary
    assert est.comm.bytes("permute", "pp") == 2 * M * v * boundary   # a middle device: forward and backward
    # activations: the held (virtual stage, micro-batch) pairs, each 2 / v layers of one micro-batch
    assert est.activation_bytes == stage.activation_bytes + (held - v) * per_layer * 2 // v
    assert est.peak_bytes - stage.peak_bytes == est.activation_bytes - stage.activation_bytes
    t = plan.cost(est, DEVICE)
    comps = [run_components(r, est.mesh, DEVICE) for r in est.runs]
    once = est.extrapolate_values([c.get("critical update", 0) + c.get("weight update", 0) for c in comps])
    busy = t.compute_s + t.exposed_comm_s - once                 # the micro-batches and the transfers
    assert t.bubble_s == pytest.approx(busy * pipe.bubble / (1 - pipe.bubble), rel=1e-9)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.bubble_s + t.update_s)


def _pp2_dp2(rules):
    """A 4-layer tiny Llama on pp 2 x dp_shard 2: ``(cfg, loss, mesh, rules)``."""
    cfg = llama.Config.tiny(layers=4)
    return cfg, functools.partial(llama.loss, cfg=cfg), fpp.Mesh(pp=2, dp_shard=2), rules


def _one_pipeline_step(cfg, loss, mesh, rules, read, **launch):
    """``read(comm report)`` of one 1F1B pipeline step (M micro-batches) on every device: the
    second, as the estimate counts a step (the first also probes the model's shapes once, a
    forward without layers cached per micro-batch shape)."""
    step = pipeline_step(loss, fpp.optim.sgd(0.1), mesh=mesh, rules=rules, grad_accum=M, schedule="1f1b")
    tokens = torch.randint(0, cfg.vocab, (8, 16), generator=torch.Generator().manual_seed(0))

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float32, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            local = {k: fpp.named(tokens, "batch seq").data for k in ("tokens", "labels")}
        state, _ = step(state, local)
        with fpp.comm_report() as rep:
            step(state, local)
        return read(rep)
    return fpp.launch(device, mesh, **launch)


def test_fsdp_gathered_once_per_step_equals_a_real_pipeline_step():
    """pp 2 x dp_shard 2 with FSDP, ``pp_fsdp_gather="step"`` (pipeline_step's default): the
    stage's units gathered in fp32 and reduce-scattered once per step, not per micro-batch (each
    device's bytes: without ``ends`` every stage holds the parameters outside the layers, as
    the estimate counts them), and held for the whole step: the units gathered and their unsharded gradients, (n-1)/n of the
    stage's parameters each, on top of the one-micro-batch peak."""
    cfg, loss, mesh, rules = _pp2_dp2(fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp"))
    real = _one_pipeline_step(
        cfg, loss, mesh, rules, lambda rep: {k: rep.bytes(k, "dp_shard") for k in ("all_gather", "reduce_scatter")})
    est = plan.estimate(loss, llama.init(cfg), mesh, rules, BATCH, grad_accum=M, precision="bf16")
    micro = plan.estimate(loss, llama.init(cfg), mesh, rules, BATCH, grad_accum=M, precision="bf16",
                          pp_fsdp_gather="micro")
    for kind in ("all_gather", "reduce_scatter"):
        assert all(est.comm.bytes(kind, "dp_shard") == r[kind] for r in real)
        assert micro.comm.bytes(kind, "dp_shard") > 2 * est.comm.bytes(kind, "dp_shard")   # per micro-batch
    assert all(e.dtype == "float32" for e in est.comm.events if e.kind == "all_gather")   # the fp32 masters
    stage = {**llama.init(cfg), "layers": llama.init(cfg)["layers"][:2]}
    sharded = sum(torch.Size(d.shape).numel() for _, d in fpp.leaves_with_paths(stage) if "hidden" in d.dims)
    assert est.peak_bytes - micro.peak_bytes == 2 * sharded * 4 // 2
    t_step, t_micro = plan.cost(est, DEVICE), plan.cost(micro, DEVICE)
    assert t_step.compute_s == pytest.approx(t_micro.compute_s) and t_step.step_s < t_micro.step_s


def test_stage_to_stage_bytes_equal_a_real_pipeline_step():
    cfg = llama.Config.tiny(layers=4)
    loss = functools.partial(llama.loss, cfg=cfg)
    mesh, rules = fpp.Mesh(pp=4), fpp.Rules(layers="pp")
    step = pipeline_step(loss, fpp.optim.sgd(0.1), mesh=mesh, rules=rules, grad_accum=M, schedule="1f1b")
    tokens = torch.randint(0, cfg.vocab, (8, 16), generator=torch.Generator().manual_seed(0))

    def device():
        state = step.init(fpp.init(llama.init, cfg, torch.float32, mesh=mesh, rules=rules, seed=0))
        with fpp.comm_report() as rep:
            step(state, {"tokens": tokens, "labels": tokens})
        return sum(e.bytes_sent for e in rep.events if e.kind == "permute")
    sent = fpp.launch(device, mesh)
    est = plan.estimate(loss, llama.init(cfg), mesh, rules, BATCH, grad_accum=M)
    assert est.comm.bytes("permute", "pp") == max(sent)


@pytest.mark.multiprocess
def test_estimate_equals_a_pipeline_step_on_gloo_processes():
    """pp 2 x dp_shard 2, 1F1B, on four gloo processes: the stage-to-stage bytes are the
    estimate's; the data-parallel gradient sums are the last stage's plus, m times, the
    embedding's, which the estimate counts on that stage too (docs/planning.md)."""
    cfg, loss, mesh, rules = _pp2_dp2(fpp.Rules(batch="dp_shard", layers="pp"))
    real = _one_pipeline_step(cfg, loss, mesh, rules,
                              lambda rep: (rep.bytes("permute", "pp"), rep.bytes("all_reduce", "dp_shard")),
                              processes=True, timeout=300)
    est = plan.estimate(loss, llama.init(cfg), mesh, rules, BATCH, grad_accum=M)
    assert all(sent == est.comm.bytes("permute", "pp") for sent, _ in real)
    embedding = cfg.vocab * cfg.hidden * 4
    assert est.comm.bytes("all_reduce", "dp_shard") == real[-1][1] + M * embedding


def test_torchtitans_405b_rows_within_15_percent():
    """torchtitan, Llama 3.1 405B on 512 H100s (FSDP 8 x TP 8 x PP 8): 100 tokens/s/GPU with
    1F1B, 128 with interleaved 1F1B, compiled, Float8, async TP, full AC: each row and their
    ratio within 15% (docs/planning.md, "Pipelines")."""
    one, inter = references.LLAMA3_405B
    (t1, s1), (t2, s2) = references.predict(one, "h100x8-gt"), references.predict(inter, "h100x8-gt")
    assert t2 / t1 == pytest.approx(inter.tokens_per_s_per_gpu / one.tokens_per_s_per_gpu, rel=0.15)
    assert t1 == pytest.approx(one.tokens_per_s_per_gpu, rel=0.15)
    assert t2 == pytest.approx(inter.tokens_per_s_per_gpu, rel=0.15)
    assert s1.bubble_s > s2.bubble_s > 0 and s1.p2p_s < s2.p2p_s           # interleaving: less bubble, more sends


def test_search_includes_pipeline_and_expert_layouts():
    space = plan.Space(pp=(1, 2), ep=(1, 2), fsdp=(("dp_shard",),), sequence_parallel=(False,),
                       regather_activations=(False,), remat=(False,), keep_gathered=(False,),
                       max_axis={"cp": 1, "tp": 1, "dp_replicate": 1})
    cfg = llama.Config.tiny(layers=4, experts=4, experts_top_k=2, moe_mlp=32)
    res = plan.search(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), 4, BATCH, cluster="h100x8",
                      space=space)
    names = [e.describe() for e in res]
    assert any("pp=2" in n and "pp_schedule=1f1b" in n for n in names)
    assert any("pp=2" in n and "interleaved_1f1b" in n and "virtual_stages=2" in n for n in names)
    ep = [e for e in res if e.mesh.shape.get("ep", 1) == 2]
    assert ep and all(e.comm.bytes("all_to_all") > 0 for e in ep)
    assert all(e.time.step_s > 0 for e in res)


def test_plan_command_searches_pipelines(capsys):
    assert main(["plan", "examples/configs/dp.yaml", "--devices", "2", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "pp=2" in text and "pp_schedule=1f1b" in text
    assert "rejected" in text and "2 layers do not split into 2 stages x 2" in text    # interleaved: v = 2
    assert main(["plan", "examples/configs/dp.yaml", "--devices", "4", "--pp", "two"]) == 2
    assert "--pp takes sizes >= 1" in capsys.readouterr().err


def test_clear_errors():
    decls = llama.init(CFG)
    with pytest.raises(ValueError, match="layers='pp'"):
        plan.estimate(LOSS, decls, fpp.Mesh(pp=2), fpp.Rules(), BATCH, grad_accum=2)
    with pytest.raises(ValueError, match="8 layers do not split into 4 stages x 4"):
        plan.estimate(LOSS, decls, fpp.Mesh(pp=4), fpp.Rules(layers="pp"), BATCH, grad_accum=4,
                      schedule="interleaved_1f1b", virtual_stages=4)
    with pytest.raises(ValueError, match="unknown schedule '1f1f'"):
        plan.estimate(LOSS, decls, fpp.Mesh(pp=2), fpp.Rules(layers="pp"), BATCH, grad_accum=2, schedule="1f1f")
    with pytest.raises(ValueError, match="not divisible into grad_accum=3"):
        plan.estimate(LOSS, decls, fpp.Mesh(pp=2), fpp.Rules(layers="pp"), BATCH, grad_accum=3)
