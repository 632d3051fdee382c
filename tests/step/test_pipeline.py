"""Pipeline parallelism equals one device: a tiny Llama whose layers are split over ``pp``
(the rule ``layers="pp"``), trained two AdamW steps with every schedule, on pp = 2 and 4 and
composed with DP, FSDP, TP, CP and all of them (5-D), against ``train_step`` with the same
micro-batches on one device (losses, updated parameters; gradients through SGD's update); on
gloo processes against the simulation; the bytes between stages; resuming on another pp size."""
import collections
import functools

import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp._torch import cached_graph_count
from functional_pp.checkpoint import format as ck_format
from functional_pp.models import llama
from functional_pp.parallel.raw_collectives import raw_all_gather
from functional_pp.step.pipeline import FewMicroBatchesWarning, PipelineSchedule, pipeline_step

CFG = llama.Config.tiny(layers=4)
DTYPE = torch.float64
M = 4                                       # micro-batches


def _data(steps=2, batch=8, seq=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        t = torch.randint(0, CFG.vocab, (batch, seq + 1), generator=g)
        labels = t[:, 1:].contiguous()
        labels[:3, :5] = -100                # ignored labels: micro-batches of unequal token counts
        out.append({"tokens": t[:, :-1].contiguous(), "labels": labels})
    return out


def _opt(kind):
    return fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=0.5) if kind == "adamw" else fpp.optim.sgd(1.0)


def _run(mesh, rules, data, opt="adamw", processes=False, cfg=CFG, **pp):
    """Per device: losses, its held parameters (numpy, by path) after ``len(data)`` steps and
    the collectives of the first step."""
    loss = functools.partial(llama.loss, cfg=cfg)
    if pp:
        step = pipeline_step(loss, _opt(opt), mesh=mesh, rules=rules, grad_accum=M, **pp)
    else:
        step = fpp.train_step(loss, _opt(opt), mesh=mesh, rules=rules, grad_accum=M)
    return _run_with(step, data, processes=processes, cfg=cfg)


def _run_with(step, data, processes=False, simulate=None, cfg=CFG, init=None):
    mesh, rules = step.mesh, step.rules
    init = init or functools.partial(fpp.init, llama.init, cfg, DTYPE, seed=0)

    def device():
        state = step.init(init(mesh=mesh, rules=rules))
        losses, events = [], None
        for b in data:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            losses.append(m["loss"])
            events = rep.events if events is None else events
        return losses, _held_and_gathered(state["params"], mesh, rules, cfg), events
    kw = {"processes": True, "timeout": 300} if processes else {"simulate": simulate}
    return fpp.launch(device, mesh, **kw)


def _held_and_gathered(params, mesh, rules, cfg=CFG):
    """The parameters this device holds (its stages' layers and those outside the layers), each
    gathered from its shards (tensor parallel, FSDP) as ``sharding.gather`` does."""
    decls = dict(fpp.leaves_with_paths(llama.init(cfg, DTYPE)))
    out = {}
    for path, x in fpp.leaves_with_paths(params):
        if x.numel():
            for dim, axes in enumerate(rules.resolve(decls[path].dims, decls[path].shape, mesh, name=path)):
                x = raw_all_gather(x, axes, dim) if axes else x
            out[path] = x.numpy().copy()
    return out


@pytest.fixture(scope="module")
def reference():
    data = _data()
    return data, {opt: _run(fpp.Mesh(), fpp.Rules(), data, opt)[0][:2] for opt in ("adamw", "sgd")}


def _assert_equal(ref, results, rtol=1e-12, atol=1e-13):
    ref_losses, ref_params = ref
    seen = {}
    for losses, params, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=atol)
        for path, x in params.items():
            np.testing.assert_allclose(x, ref_params[path], rtol=rtol, atol=atol, err_msg=path)
            seen[path] = True
    assert seen.keys() == ref_params.keys()          # every parameter held by some stage


@pytest.mark.parametrize("schedule,pp,v", [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("zb_h1", 4, 1),
                                           ("interleaved_1f1b", 2, 2), ("gpipe", 4, 1)])
def test_pipeline_equals_one_device(reference, schedule, pp, v):
    data, ref = reference
    mesh, rules = fpp.Mesh(pp=pp), fpp.Rules(layers="pp")
    _assert_equal(ref["adamw"], _run(mesh, rules, data, schedule=schedule, virtual_stages=v))


def test_pipeline_gradients_equal_one_device(reference):
    data, ref = reference                            # SGD(lr=1): the update is the gradient
    _assert_equal(ref["sgd"], _run(fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, "sgd", schedule="1f1b"))


ENDS = dict(first_stage=("embed_tokens",), last_stage=("norm", "lm_head"))


@pytest.mark.parametrize("mesh,rules", [(fpp.Mesh(pp=4), fpp.Rules(layers="pp")),
                                        (fpp.Mesh(pp=2, dp_shard=2),
                                         fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp"))])
def test_embedding_on_the_first_stage_head_on_the_last(reference, mesh, rules):
    """first_stage / last_stage: the embedding only on the first stage, the final norm and the
    head only on the last (the other stages hold them empty), still equal to one device."""
    data, ref = reference
    results = _run(mesh, rules, data, schedule="1f1b", **ENDS)
    _assert_equal(ref["adamw"], results)
    p = mesh.shape["pp"]
    for rank, (_, params, _) in enumerate(results):
        stage = mesh.coords(rank)["pp"]
        assert ("embed_tokens" in params) == (stage == 0)
        assert ("lm_head" in params) == ("norm" in params) == (stage == p - 1)


def test_tied_embedding_on_both_ends(reference):
    """A tied embedding is the first stage's table and the last stage's head: named in both,
    every stage holds it and its gradients are summed over pp."""
    data, _ = reference
    tied = llama.Config.tiny(layers=4, tie_embeddings=True)
    ref = _run(fpp.Mesh(), fpp.Rules(), data, cfg=tied)[0][:2]
    results = _run(fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, cfg=tied, schedule="1f1b",
                   first_stage=("embed_tokens",), last_stage=("norm", "embed_tokens"))
    _assert_equal(ref, results)
    assert all("embed_tokens" in params for _, params, _ in results)


def test_layer_norm_and_head_biases_on_the_last_stage(reference):
    """GPT-NeoX's and Phi's switches (attention and MLP in parallel from two LayerNorms with
    biases, a GELU MLP with biases, partial rotary, an LM-head bias) on PP 2 with the model's
    pipeline_ends: the final norm's bias and the head's bias only on the last stage, equal to
    one device."""
    data, _ = reference
    cfg = llama.Config.tiny(layers=4, parallel_block=True, parallel_mlp_norm=True, norm_kind="layer", norm_bias=True,
                            mlp_gated=False, mlp_bias=True, mlp_act="gelu", partial_rotary_factor=0.5,
                            lm_head_bias=True)
    ref = _run(fpp.Mesh(), fpp.Rules(), data, cfg=cfg)[0][:2]
    first, last = llama.pipeline_ends(cfg)
    results = _run(fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, cfg=cfg, schedule="1f1b", first_stage=first,
                   last_stage=last)
    _assert_equal(ref, results)
    for rank, (_, params, _) in enumerate(results):
        assert ("norm_bias" in params) == ("lm_head_bias" in params) == (rank == 1)


def test_learned_positions_on_the_first_stage(reference):
    """GPT-2's table of positions (``learned_positions``) on PP 2 with the model's pipeline_ends:
    only the first stage holds it, the losses and parameters equal one device's."""
    data, _ = reference
    cfg = llama.Config.tiny(layers=4, learned_positions=True, norm_kind="layer", norm_bias=True, mlp_gated=False,
                            mlp_bias=True, mlp_act="gelu_tanh", qkv_bias=True, o_bias=True, max_seq=64)
    ref = _run(fpp.Mesh(), fpp.Rules(), data, cfg=cfg)[0][:2]
    first, last = llama.pipeline_ends(cfg)
    assert "embed_positions" in first
    results = _run(fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, cfg=cfg, schedule="1f1b", first_stage=first,
                   last_stage=last)
    _assert_equal(ref, results)
    for rank, (_, params, _) in enumerate(results):
        assert ("embed_positions" in params) == (rank == 0)


TP = dict(heads="tp", kv_heads="tp", mlp="tp", vocab="tp")


@pytest.mark.parametrize("what,mesh,rules,schedule", [
    ("dp", fpp.Mesh(pp=2, dp_shard=2), fpp.Rules(batch="dp_shard", layers="pp"), "1f1b"),
    ("fsdp", fpp.Mesh(pp=2, dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp"), "zb_h1"),
    ("tp", fpp.Mesh(pp=2, tp=2), fpp.Rules(layers="pp", **TP), "interleaved_1f1b"),
    ("remat", fpp.Mesh(pp=2), fpp.Rules(layers="pp"), "zb_h1"),
    ("cp", fpp.Mesh(pp=2, cp=2), fpp.Rules(seq=fpp.balanced("cp"), res_seq=fpp.inherit("seq"), layers="pp"), "gpipe"),
    # 5-D: pp 2 x dp_shard 2 x cp 2 x tp 2 on 16 devices, Llama's default rules (FSDP over dp_shard x cp)
    ("5-D", fpp.Mesh(pp=2, dp_shard=2, cp=2, tp=2), llama.default_rules().replace(layers="pp"), "1f1b")])
def test_pipeline_composes(reference, what, mesh, rules, schedule):
    data, ref = reference
    v = 2 if schedule == "interleaved_1f1b" else 1
    # float64 throughout; CP's ring adds the attention blocks in another order than one device,
    # and AdamW's normalised update magnifies that rounding near zero (seen: 1.2e-13 absolute)
    tol = dict(rtol=1e-10, atol=1e-12) if "cp" in mesh.shape else {}
    _assert_equal(ref["adamw"], _run(mesh, rules, data, schedule=schedule, virtual_stages=v,
                                     remat=what == "remat"), **tol)


@pytest.mark.parametrize("policy", ["step", "micro"])
def test_fsdp_gather_policies(reference, policy):
    """FSDP under pp 2 x dp_shard 2, the embedding on the first stage and the norm and head on
    the last: both gather policies equal one device, and each step's FSDP collectives per
    device are the policy's formula (docs/communication.md). A device holds L/p layers (units)
    and u parameters outside them that its forward uses (first stage: the embedding; last: the
    norm and the head). "step": one all-gather and one reduce-scatter per unit, the ends one
    unit: L/p + 1 of each. "micro": per micro-batch, each layer gathered in forward and again
    in backward, each end parameter gathered once (kept to backward), and every one of them
    reduce-scattered: m (L/p + u) forward gathers, m L/p backward ones, m (L/p + u)
    reduce-scatters."""
    data, ref = reference
    mesh = fpp.Mesh(pp=2, dp_shard=2)
    rules = fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp")
    results = _run(mesh, rules, data, schedule="1f1b", fsdp_gather=policy, **ENDS)
    _assert_equal(ref["adamw"], results)
    units = CFG.layers // 2
    for rank, (_, _, events) in enumerate(results):
        ends = 1 if mesh.coords(rank)["pp"] == 0 else 2
        counts = collections.Counter((e.kind, e.backward) for e in events
                                     if e.axes == ("dp_shard",) and e.kind != "all_reduce")   # (token counts)
        if policy == "step":
            want = {("all_gather", False): units + 1, ("reduce_scatter", True): units + 1}
        else:
            want = {("all_gather", False): M * (units + ends), ("all_gather", True): M * units,
                    ("reduce_scatter", True): M * (units + ends)}
        assert dict(counts) == want


def _compiled_against_eager(reference, cfg, processes=False, **pp):
    """Compiled stages (aot_eager) against the eager pipeline and one device; returns how many
    stage graphs each device's process compiled."""
    data, _ = reference
    ref = _run(fpp.Mesh(), fpp.Rules(), data, cfg=cfg)[0][:2]
    mesh, rules = fpp.Mesh(pp=2), fpp.Rules(layers="pp")
    eager = _run(mesh, rules, data, cfg=cfg, **pp)
    step = pipeline_step(functools.partial(llama.loss, cfg=cfg), _opt("adamw"), mesh=mesh, rules=rules,
                         grad_accum=M, compile="aot_eager", **pp)
    before = cached_graph_count(PipelineSchedule._stage_forward.__code__)

    def device():      # (a process counts its own graphs: its cache is not the parent's)
        start = cached_graph_count(PipelineSchedule._stage_forward.__code__) if processes else before
        state = step.init(fpp.init(llama.init, cfg, DTYPE, mesh=mesh, rules=rules, seed=0))
        losses = []
        for b in data:
            state, m = step(state, b)
            losses.append(m["loss"])
        graphs = cached_graph_count(PipelineSchedule._stage_forward.__code__) - start
        return losses, _held_and_gathered(state["params"], mesh, rules, cfg), graphs
    compiled = fpp.launch(device, mesh, **({"processes": True, "timeout": 300} if processes else {}))
    _assert_equal(ref, compiled)
    # (the eager loss is torch's fused log_softmax/softmax, the traced one logsumexp and its
    # written-out backward: the last bits differ, as against one device)
    for (le, pe, _), (lc, pc, _) in zip(eager, compiled):
        np.testing.assert_allclose(lc, le, rtol=1e-12, atol=1e-13)
        for path, x in pc.items():
            np.testing.assert_allclose(x, pe[path], rtol=1e-12, atol=1e-13, err_msg=path)
    return [graphs for _, _, graphs in compiled]


def test_compiled_interleaved_stages_equal_eager_and_one_device(reference):
    """compile="aot_eager", interleaved 1F1B on pp 2 x v 2: each virtual stage's forward one
    graph (its backward AOT autograd's), four in all (simulated devices share them); the same
    losses and parameters as the eager pipeline and as one device."""
    graphs = _compiled_against_eager(reference, llama.Config.tiny(layers=4), schedule="interleaved_1f1b",
                                     virtual_stages=2)
    assert graphs == [4, 4]


@pytest.mark.multiprocess
def test_compiled_1f1b_stages_on_gloo_processes(reference):
    """Compiled 1F1B stages on two gloo processes, each compiling its own stage's graph: the
    eager pipeline and one device."""
    assert _compiled_against_eager(reference, llama.Config.tiny(layers=2), processes=True,
                                   schedule="1f1b") == [1, 1]


@pytest.mark.parametrize("pp", [2, 4])
def test_stage_to_stage_bytes(reference, pp):
    """Per micro-batch and stage boundary: the activation forward and its gradient backward,
    micro-batch x seq x hidden x bytes each (docs/communication.md), nothing else over pp
    but the one all-reduce of the gradients of the parameters outside the layers."""
    data, _ = reference
    results = _run(fpp.Mesh(pp=pp), fpp.Rules(layers="pp"), data[:1], schedule="1f1b")
    rows, seq = data[0]["tokens"].shape
    boundary = rows // M * seq * CFG.hidden * DTYPE.itemsize
    for d, (_, _, events) in enumerate(results):
        sent = [e for e in events if e.kind == "permute"]
        assert {e.axes for e in sent} == {("pp",)}
        forward = sum(e.bytes_sent for e in sent if not e.backward)
        assert forward + sum(e.bytes_sent for e in sent if e.backward) == M * boundary * ((d > 0) + (d < pp - 1))
        assert {e.kind for e in events if e.axes == ("pp",)} == {"permute", "all_reduce"}


@pytest.mark.multiprocess
def test_gloo_processes_equal_simulation():
    """pp 2 x FSDP 2 with 1F1B on four real gloo processes (each stage's units gathered and
    reduce-scattered once per step): the simulated run, bit for bit."""
    data = _data()
    mesh, rules = fpp.Mesh(pp=2, dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp")
    simulated = _run(mesh, rules, data, schedule="1f1b")
    real = _run(mesh, rules, data, processes=True, schedule="1f1b")
    for (ls, ps, _), (lr, pr, _) in zip(simulated, real):
        assert ls == lr
        assert ps.keys() == pr.keys() and all(np.array_equal(ps[k], pr[k]) for k in ps)


def test_bf16_equals_one_device_within_bf16_rounding():
    """bf16 compute with fp32 master weights: the stages cast, accumulate and sum in train_step's
    order (micro-batches ascending). Bits are not demanded: the CPU's bf16 matmul kernels (oneDNN:
    AMX, AVX2) round differently for the stage's and the whole model's operand shapes, so the
    step-2 loss differs in its 7th digit on such CPUs (bit equality where the arithmetic is the same:
    the float64 tests above). The bounds are ~10x the rounding seen on an AMX Xeon; one
    micro-batch's gradient 2% off on one stage moves the step-2 loss by 9e-5 relative, 45x the bound."""
    data = _data()
    loss = functools.partial(llama.loss, cfg=CFG)
    kw = dict(grad_accum=M, precision="bf16")
    one = fpp.train_step(loss, _opt("adamw"), mesh=fpp.Mesh(), **kw)
    pp = pipeline_step(loss, _opt("adamw"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), **kw)
    init = functools.partial(fpp.init, llama.init, CFG, torch.float32, seed=0)
    start = {k: np.asarray(getattr(v, "data", v)) for k, v in fpp.leaves_with_paths(init())}
    (ref_losses, ref_params, _), = _run_with(one, data, init=init)
    for losses, params, _ in _run_with(pp, data, init=init):
        assert losses[0] == ref_losses[0]                     # step 1's forward: the same bits
        assert losses == pytest.approx(ref_losses, rel=2e-6)  # seen: 2.6e-7 (AMX), 0 elsewhere
        for k, x in params.items():
            update = np.abs(ref_params[k] - start[k]).mean()
            assert np.abs(x - ref_params[k]).mean() <= 0.01 * update, k   # seen: <= 0.0009 x update


def test_clear_errors():
    loss = functools.partial(llama.loss, cfg=CFG)
    with pytest.raises(ValueError, match="add the rule layers='pp'"):
        pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(), grad_accum=4)
    with pytest.raises(ValueError, match="unknown schedule 'onef1b'"):
        pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=4,
                      schedule="onef1b")
    typo = pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=2,
                         first_stage=("embed",))
    with pytest.raises(Exception, match="no parameter at 'embed'"):
        _run_with(typo, _data(1))
    with pytest.raises(ValueError, match=r"fsdp_gather='once'\): choose one of 'step', 'micro'"):
        pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=4,
                      fsdp_gather="once")
    batched = pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=2)
    with pytest.raises(Exception, match="cannot run in a batched simulation"):
        _run_with(batched, _data(1), simulate="batched")
    with pytest.warns(FewMicroBatchesWarning, match="2 micro-batches on 4 stages"):
        pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=4), rules=fpp.Rules(layers="pp"), grad_accum=2)
    step = pipeline_step(loss, _opt("sgd"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=4,
                         schedule="interleaved_1f1b", virtual_stages=4)
    with pytest.raises(Exception, match="4 layers do not split into 2 stages x 4 virtual"):   # at init, on every device
        fpp.launch(lambda: step.init(fpp.init(llama.init, CFG, DTYPE, mesh=step.mesh, rules=step.rules, seed=0)),
                   step.mesh)


def _states(step, data, start=None):
    """Launchable: ``len(data)`` steps from a fresh state, or from ``start`` (a whole state) cut
    to this device's stages; returns the whole state (numpy leaves) and the losses."""
    def device():
        state = step.init(fpp.init(llama.init, CFG, DTYPE, mesh=step.mesh, rules=step.rules, seed=0))
        if start is not None:
            whole = fpp.core.tree.tree_map(torch.from_numpy, start)
            state = step.stage_state({**state, **whole}) if hasattr(step, "stage_state") else {**state, **whole}
        losses = []
        for b in data:
            state, m = step(state, b)
            losses.append(m["loss"])
        whole = step.logical_state(state) if hasattr(step, "logical_state") else state
        keep = {k: whole[k] for k in ("params", "opt_state")}
        return fpp.core.tree.tree_map(lambda x: x.numpy().copy(), keep), losses
    return fpp.launch(device, step.mesh)


def test_a_pp4_state_resumes_on_pp2_and_on_one_device(reference):
    """logical_state: the pp = 4 state after one step, parameters and Adam moments, equals one
    device's; cut to pp = 2 (stage_state) or used as is on one device, the second step equals
    one device's two steps."""
    data, _ = reference
    loss = functools.partial(llama.loss, cfg=CFG)
    one = fpp.train_step(loss, _opt("adamw"), mesh=fpp.Mesh(), grad_accum=M)
    pp = {n: pipeline_step(loss, _opt("adamw"), mesh=fpp.Mesh(pp=n), rules=fpp.Rules(layers="pp"), grad_accum=M)
          for n in (2, 4)}
    (ref1, _), = _states(one, data[:1])
    (ref2, ref_losses), = _states(one, data)
    after_pp4 = _states(pp[4], data[:1])
    for whole, _ in after_pp4:                      # every stage holds the same whole state
        for (path, a), (_, b) in zip(fpp.leaves_with_paths(whole), fpp.leaves_with_paths(ref1)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=path)
    start = after_pp4[0][0]
    for step in (pp[2], one):
        for whole, losses in _states(step, data[1:], start):
            np.testing.assert_allclose(losses, ref_losses[1:], rtol=1e-12)
            for (path, a), (_, b) in zip(fpp.leaves_with_paths(whole), fpp.leaves_with_paths(ref2)):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=path)


@pytest.mark.multiprocess
def test_per_stage_checkpoint_writes_load_on_pp2_and_one_device(tmp_path):
    """On four gloo processes (pp = 4, the embedding on the first stage, the norm and head on
    the last) each rank writes only its stage's layers and ends, parameters and Adam moments
    under their logical names; the checkpoint loads bitwise on one device and on pp = 2."""
    data = _data(1)
    loss = functools.partial(llama.loss, cfg=CFG)
    decls = llama.init(CFG, DTYPE)

    def specs(state):
        return {"params": decls, "opt": ck.state_specs(state["opt_state"], decls)}

    def saved():
        step = pipeline_step(loss, _opt("adamw"), mesh=fpp.Mesh(pp=4), rules=fpp.Rules(layers="pp"),
                             grad_accum=M, **ENDS)
        state = step.init(fpp.init(llama.init, CFG, DTYPE, mesh=step.mesh, rules=step.rules, seed=0))
        state, _ = step(state, data[0])
        ck.save_checkpoint(tmp_path, 1, {"params": state["params"], "opt": state["opt_state"]},
                                       specs(state), rules=step.rules)
        whole = step.logical_state(state)
        return fpp.core.tree.tree_map(lambda x: x.numpy().copy(), {"params": whole["params"],
                                                                   "opt": whole["opt_state"]})
    whole = fpp.launch(saved, fpp.Mesh(pp=4), processes=True, timeout=300)[0]
    files = {}
    for path, t in ck_format.read_index(tmp_path / "step-000001")["tensors"].items():
        files[path] = {c["file"] for c in t["chunks"]}
    for path, where in files.items():
        if ".layers." in f".{path}":
            layer = int(path.split("layers.")[1].split(".")[0])
            assert where == {ck_format.rank_file(layer)}, path     # layer i on stage i
        elif "embed_tokens" in path:
            assert where == {ck_format.rank_file(0)}, path
        elif "lm_head" in path or path.split(".")[-1] == "norm" or ".norm" in path:
            assert where == {ck_format.rank_file(3)}, path

    def same(tree, held_only=False):
        for (path, a), (_, b) in zip(fpp.leaves_with_paths(tree), fpp.leaves_with_paths(whole)):
            if not (held_only and a.numel() == 0):
                assert np.array_equal(a.numpy(), b), path

    one = ck.load_checkpoint(tmp_path, specs(fpp.core.tree.tree_map(torch.from_numpy, {
        "opt_state": whole["opt"]})))
    same(one.tree)

    def on_pp2():
        step = pipeline_step(loss, _opt("adamw"), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"),
                             grad_accum=M, **ENDS)
        state = step.init(fpp.init(llama.init, CFG, DTYPE, mesh=step.mesh, rules=step.rules, seed=0))
        tree = ck.load_checkpoint(tmp_path, specs(state), rules=step.rules).tree
        mine = step.stage_state({**state, "params": tree["params"], "opt_state": tree["opt"]})
        return {"params": mine["params"], "opt": mine["opt_state"]}
    for tree in fpp.launch(on_pp2, fpp.Mesh(pp=2)):
        same(tree, held_only=True)
