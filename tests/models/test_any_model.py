"""A second model family (examples/gpt2.py, written only from public ops with its own dimension
names) against a plain-PyTorch implementation + torch.optim.AdamW, then against one device on
the equivalence-suite layouts (non-power-of-two meshes, CP ring and all-gather, the token-mixing
block under CP, a sequence split over dp_shard), compiled against eager, communication against
GUIDE §3's formulas, and on real gloo processes."""
import functools
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.parallel import sharding

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import gpt2  # noqa: E402  (examples/gpt2.py: the model under test)

CFG = gpt2.Config(vocab=64, embd=24, layers=2, heads=4, ff=48, max_pos=16)
DECLS = gpt2.init(CFG, torch.float64)
FULL = fpp.init_params(DECLS, seed=0)
BATCH_SIZE, SEQ = 12, 16


def make_batch(seed=0, batch=BATCH_SIZE, seq=SEQ, vocab=CFG.vocab):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


DATA = make_batch()


def run(mesh, rules, cfg=CFG, full=FULL, data=DATA, options=None, seed=0):
    """Loss, full gradients and comm report of every device (value_and_grad + gather_tree)."""
    decls = gpt2.init(cfg, torch.float64)
    loss_fn = functools.partial(gpt2.loss, cfg=cfg, seed=seed)

    def fn():
        with fpp.use_rules(rules), fpp.configure(**(options or {})):
            params = sharding.named_tree(sharding.shard(full, decls, mesh, rules, fpp.current_rank()), decls)
            batch = {k: fpp.named(v, gpt2.BATCH_DIMS[k]) for k, v in data.items()}
            with fpp.comm_report() as rep:
                loss, grads = fpp.value_and_grad(loss_fn, params, batch)
            return loss, fpp.gather_tree(grads), rep
    return fpp.launch(fn, mesh)


REF = run(fpp.Mesh(), fpp.Rules())[0]


def assert_matches(results, ref=REF):
    loss0, grads0, _ = ref
    for rank, (loss, grads, _) in enumerate(results):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank} loss: {m}")
        for (p, g), (_, g0) in zip(fpp.leaves_with_paths(grads), fpp.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} grad {p}: {m}")


# ------------------------------------------------------------------ plain PyTorch oracle
def torch_loss(P, batch, cfg=CFG):
    tokens, labels = batch["tokens"], batch["labels"]
    S, E = tokens.shape[1], cfg.embd

    def ln(x, p):
        return F.layer_norm(x, (E,), p["weight"], p["bias"], eps=cfg.eps)
    x = P["wte"][tokens] + P["wpe"][:S]
    for p in P["h"]:
        h = ln(x, p["ln_1"])
        a = p["attn"]
        qkv = torch.einsum("bse,eqhd->bsqhd", h, a["c_attn"]["weight"]) + a["c_attn"]["bias"]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        o = torch.einsum("bshd,hm->bsmd", o, a["mix"])
        x = x + torch.einsum("bshd,hde->bse", o, a["c_proj"]["weight"]) + a["c_proj"]["bias"]
        m = p["mlp"]
        h = F.gelu(ln(x, p["ln_2"]) @ m["c_fc"]["weight"] + m["c_fc"]["bias"], approximate="tanh")
        x = x + h @ m["c_proj"]["weight"] + m["c_proj"]["bias"]
        if cfg.token_mixing:
            w = p["mixer"]["weight"][:S, :S] * torch.tril(torch.ones(S, S, dtype=x.dtype))
            x = x + torch.einsum("bse,ts->bte", ln(x, p["ln_3"]), w) + p["mixer"]["bias"][:S]
    logits = ln(x, P["ln_f"]) @ (P["wte"].T if cfg.tie else P["lm_head"])
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))


def test_one_device_equals_plain_pytorch_with_torch_adamw():
    steps = [make_batch(seed=i) for i in range(3)]
    params = tree.tree_map(lambda x: x.clone().requires_grad_(), FULL)
    opt = torch.optim.AdamW(optree_leaves(params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_losses = []
    for b in steps:
        opt.zero_grad()
        loss = torch_loss(params, b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    step = fpp.train_step(functools.partial(gpt2.loss, cfg=CFG), fpp.optim.adamw(3e-3, weight_decay=0.1),
                          mesh=fpp.Mesh(), rules=fpp.Rules(), batch_dims=gpt2.BATCH_DIMS)

    def device():
        state = step.init(fpp.init(gpt2.init, CFG, torch.float64, seed=0))
        losses = []
        for b in steps:
            state, m = step(state, b)
            losses.append(m["loss"])
        return losses, state["params"]
    losses, final = fpp.launch(device, fpp.Mesh())[0]
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for (p, a), (_, b) in zip(fpp.leaves_with_paths(final), fpp.leaves_with_paths(params)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12, msg=lambda m: f"{p}: {m}")


def optree_leaves(t):
    return [x for _, x in fpp.leaves_with_paths(t)]


# ------------------------------------------------------------------ every layout == one device
R = gpt2.rules
LAYOUTS = {
    "dp4": (dict(dp_replicate=4), R(tp=False, fsdp=False)),
    "fsdp4": (dict(dp_shard=4), R(tp=False)),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), R(tp=False)),
    "tp2_sp": (dict(tp=2), R(fsdp=False, sequence_parallel=True)),
    "tp4": (dict(tp=4), R(fsdp=False)),
    "cp4_ring": (dict(cp=4), R(tp=False, fsdp=False)),
    "fsdp_cp_tp_sp": (dict(dp_shard=2, cp=2, tp=2), R(sequence_parallel=True)),
    "3": (dict(dp_shard=3), R(tp=False)),
    "6": (dict(dp_shard=3, tp=2), R()),
    "12": (dict(dp_shard=3, cp=2, tp=2), R(sequence_parallel=True)),
    "cp_contiguous": (dict(dp_shard=2, cp=2), R(tp=False).replace(tok="cp")),
    "seq_over_dp_shard": (dict(dp_replicate=2, dp_shard=2),
                          fpp.Rules(batch="dp_replicate", tok=fpp.balanced("dp_shard"), res_tok=fpp.inherit("tok"),
                                    kv_head=fpp.inherit("head"), head_mix=fpp.inherit("head"), tok_in=None)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(name):
    mesh_kw, rules = LAYOUTS[name]
    assert_matches(run(fpp.Mesh(**mesh_kw), rules))


def test_cp_allgather_attention_and_keep_gathered():
    assert_matches(run(fpp.Mesh(dp_shard=2, cp=2), R(tp=False), options=dict(cp_attention="allgather",
                                                                            keep_gathered=True)))


@pytest.mark.slow
def test_sixteen_devices_all_axes_with_sequence_parallelism():
    assert_matches(run(fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2), R(sequence_parallel=True)))


def test_token_mixing_alone_under_cp_balanced_and_contiguous():
    """The MLP-mixer block mixes over the whole sequence outside attention: under CP it
    must see the tokens in their natural order whatever the split's order."""
    cfg = gpt2.Config(vocab=64, embd=24, layers=1, heads=4, ff=48, max_pos=16)
    full = fpp.init_params(gpt2.init(cfg, torch.float64), seed=3)
    ref = run(fpp.Mesh(), fpp.Rules(), cfg=cfg, full=full)[0]
    for rules in (R(tp=False, fsdp=False), R(tp=False, fsdp=False).replace(tok="cp")):
        assert_matches(run(fpp.Mesh(cp=4), rules, cfg=cfg, full=full), ref)


def test_dropout_is_layout_independent():
    cfg = gpt2.Config(vocab=64, embd=24, layers=2, heads=4, ff=48, max_pos=16, dropout=0.25)
    ref = run(fpp.Mesh(), fpp.Rules(), cfg=cfg, seed=5)[0]
    no_drop = run(fpp.Mesh(), fpp.Rules(), seed=5)[0]
    assert abs(ref[0] - no_drop[0]) > 1e-6          # dropout really dropped something
    for mesh_kw, rules in (LAYOUTS["fsdp_cp_tp_sp"], LAYOUTS["6"]):
        assert_matches(run(fpp.Mesh(**mesh_kw), rules, cfg=cfg, seed=5), ref)


# ------------------------------------------------------------------ compiled == eager, 5 runs
def _train(mesh, rules, compile_, steps=2, cfg=CFG):
    step = fpp.train_step(functools.partial(gpt2.loss, cfg=cfg), fpp.optim.adamw(3e-3, weight_decay=0.1),
                          mesh=mesh, rules=rules, compile=compile_, batch_dims=gpt2.BATCH_DIMS)
    data = [make_batch(seed=i) for i in range(steps)]

    def device():
        state = step.init(fpp.init(gpt2.init, cfg, torch.float64, mesh=mesh, rules=rules, seed=0))
        losses = []
        for b in data:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, gpt2.BATCH_DIMS[k]).data for k, v in b.items()}
            state, m = step(state, local)
            losses.append(m["loss"])
        with fpp.use_rules(rules):
            return losses, fpp.gather_tree(state["params"], gpt2.init(cfg, torch.float64))
    return step, device


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager_on_two_devices_five_runs(backend):
    """Five runs of the compiled step (one compile per simulated device) against five eager
    steps: a collective race shows up as a run that differs, or devices that disagree."""
    mesh, rules = fpp.Mesh(dp_shard=2), R(tp=False)
    cfg = gpt2.Config(vocab=64, embd=24, layers=1, heads=4, ff=48, max_pos=16)   # cheap to compile
    ref = fpp.launch(_train(mesh, rules, False, steps=5, cfg=cfg)[1], mesh)[0]
    for rank, (losses, params) in enumerate(fpp.launch(_train(mesh, rules, backend, steps=5, cfg=cfg)[1], mesh)):
        assert losses == pytest.approx(ref[0], rel=1e-9), (backend, rank)
        for (p, a), (_, b) in zip(fpp.leaves_with_paths(params), fpp.leaves_with_paths(ref[1])):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"rank {rank} {p}: {m}")


# ------------------------------------------------------------------ communication (GUIDE §3)
B = 8


def _sizes(cfg):
    decls = gpt2.init(cfg, torch.float64)
    sharded = replicated = 0
    for _, d in fpp.leaves_with_paths(decls):
        n = 1
        for s in d.shape:
            n *= s
        if "embd" in d.dims:
            sharded += n
        else:
            replicated += n
    return sharded, replicated


def _comm(mesh_kw, rules, cfg):
    full = fpp.init_params(gpt2.init(cfg, torch.float64), seed=0)
    reps = [rep for _, _, rep in run(fpp.Mesh(**mesh_kw), rules, cfg=cfg, full=full)]
    assert len({r.total_bytes for r in reps}) == 1
    return reps[0]


def test_dp_all_reduces_every_gradient_once():
    n = 4
    rep = _comm(dict(dp_replicate=n), R(tp=False, fsdp=False), CFG)
    P = fpp.count_params(DECLS)
    assert rep.bytes("all_reduce", "dp_replicate", backward=True) == 2 * (n - 1) * P * B // n
    assert rep.bytes("all_gather") == rep.bytes("reduce_scatter") == 0


@pytest.mark.parametrize("tie", [True, False])
def test_fsdp_tied_and_untied(tie):
    """FSDP over n along embd: parameters with an embd dimension (P_s) are all-gathered in
    forward, re-gathered in backward and reduce-scattered: 3(n-1)/n·P_s·B, except (documented)
    that backward re-gathers only weights whose gradient needs them: not biases, not the
    position table (embedding lookups need no weight in backward) and, untied, not wte
    (re-gathered only as the tied output head).
    Parameters without embd (P_r: qkv/ff biases, head mixer, token mixer) are replicated and
    all-reduced like DP: 2(n-1)/n·P_r·B. A tied wte is gathered once for both use sites."""
    n = 4
    cfg = gpt2.Config(vocab=64, embd=24, layers=2, heads=4, ff=48, max_pos=16, tie=tie)
    Ps, Pr = _sizes(cfg)
    rep = _comm(dict(dp_shard=n), R(tp=False), cfg)
    E, L = cfg.embd, cfg.layers
    no_regather = cfg.max_pos * E + L * 2 * E + (0 if tie else cfg.vocab * E)   # wpe, c_proj biases, [wte]
    no_regather += L * (3 if cfg.token_mixing else 2) * E + E                     # LayerNorm biases
    no_regather += L * cfg.max_pos * E if cfg.token_mixing else 0                 # token-mixer biases
    assert rep.bytes("all_gather", "dp_shard", backward=False) == (n - 1) * Ps * B // n
    assert rep.bytes("reduce_scatter", "dp_shard") == (n - 1) * Ps * B // n
    assert rep.bytes("all_gather", "dp_shard", backward=True) == (n - 1) * (Ps - no_regather) * B // n
    grads_ar = rep.bytes("all_reduce", "dp_shard", backward=True)
    assert grads_ar == 2 * (n - 1) * Pr * B // n


# ------------------------------------------------------------------ real gloo processes
# (ring attention on gloo waits for the torch.distributed ppermute of issue 10; the CP case
# here all-gathers K/V, which still exercises the balanced sequence order on real processes)
GLOO_LAYOUTS = {"fsdp_tp_sp": (dict(dp_shard=2, tp=2), R(sequence_parallel=True), {}),
                "fsdp_cp_allgather": (dict(dp_shard=2, cp=2), R(tp=False), dict(cp_attention="allgather"))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(GLOO_LAYOUTS))
def test_gpt2_on_four_gloo_processes_matches_one_device(name):
    mesh_kw, rules, options = GLOO_LAYOUTS[name]
    mesh = fpp.Mesh(**mesh_kw)
    decls = gpt2.init(CFG, torch.float64)
    loss_fn = functools.partial(gpt2.loss, cfg=CFG)

    def fn():
        with fpp.use_rules(rules), fpp.configure(**options):
            params = sharding.named_tree(sharding.shard(FULL, decls, mesh, rules, fpp.current_rank()), decls)
            batch = {k: fpp.named(v, gpt2.BATCH_DIMS[k]) for k, v in DATA.items()}
            loss, grads = fpp.value_and_grad(loss_fn, params, batch)
            return loss.item(), {p: g.numpy() for p, g in fpp.leaves_with_paths(fpp.gather_tree(grads))}
    loss0, grads0, _ = REF
    for loss, grads in fpp.launch(fn, mesh, processes=True, timeout=300):
        assert loss == pytest.approx(loss0.item(), rel=1e-12)
        for (p, g0) in fpp.leaves_with_paths(grads0):
            torch.testing.assert_close(torch.from_numpy(grads[p]), g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"{p}: {m}")


def test_step_gradients_are_the_reduced_gradients():
    """step.gradients(state, batch): what the training step hands its optimizer, per device,
    laid out like the parameters; gathered they equal one device's gradients."""
    mesh, rules = LAYOUTS["fsdp_cp_tp_sp"]
    mesh = fpp.Mesh(**mesh)
    step = fpp.train_step(functools.partial(gpt2.loss, cfg=CFG), fpp.optim.sgd(0.1), mesh=mesh, rules=rules,
                          batch_dims=gpt2.BATCH_DIMS)

    def device():
        state = step.init(fpp.init(gpt2.init, CFG, torch.float64, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            local = {k: fpp.named(v, gpt2.BATCH_DIMS[k]).data for k, v in DATA.items()}
            loss, grads = step.gradients(state, local)
            return loss, fpp.gather_tree(grads), None
    assert_matches(fpp.launch(device, mesh))
