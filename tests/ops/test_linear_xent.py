"""The LM head and cross-entropy over token chunks (functional_pp/ops/xent/linear.py,
docs/compile.md "The LM head and cross-entropy over token chunks"): loss, gradients and updated parameters
equal the unchunked ``cross_entropy(einsum(...))`` on one device, under simulated layouts
(vocabulary split over tp, tokens over dp/cp, FSDP-sharded and tied head weights), compiled,
and on real gloo processes; no full logits buffer in eager."""
import pytest
import torch
from harness import assert_same_run, local_batch, make_batch, parallel, single_device, train_steps
from memtrack import peak_memory

import functional_pp as fpp
from functional_pp import ops
from functional_pp._torch import trace_backward
from functional_pp._torch.grad_leaves import differentiable, grad_seed
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.ops.xent import linear as linear_xent
from functional_pp.parallel import sharding

N_B, N_S, H, V = 4, 6, 16, 40           # 24 token rows: chunks of 5 rows leave a short last one


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_B, N_S, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(H, V, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N_B, N_S), generator=g)
    labels[0, :3] = ops.IGNORE_INDEX
    labels[2, 5] = ops.IGNORE_INDEX
    return x, w, labels


def _loss_and_grads(x, w, labels, chunk_bytes, w_dims="hidden vocab"):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ops.linear_cross_entropy(fpp.named(x, "batch seq hidden"), fpp.named(w, w_dims),
                                    fpp.named(labels, "batch seq"), chunk_bytes=chunk_bytes).value()
    loss.backward()
    return loss.detach(), x.grad, w.grad


def _unchunked(x, w, labels, w_dims="hidden vocab"):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = ops.einsum("batch seq hidden, hidden vocab -> batch seq vocab",
                        fpp.named(x, "batch seq hidden"), fpp.named(w, w_dims))
    loss = ops.cross_entropy(logits, fpp.named(labels, "batch seq")).value()
    loss.backward()
    return loss.detach(), x.grad, w.grad


def _assert_close(got, want, rtol=1e-12, atol=1e-12):
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("w_dims", ["hidden vocab", "vocab hidden"], ids=["head", "tied_layout"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 24, 100])
def test_one_device_chunks_equal_the_unchunked_loss(w_dims, chunk_rows):
    x, w, labels = _inputs()
    if w_dims == "vocab hidden":
        w = w.t().contiguous()
    got = _loss_and_grads(x, w, labels, chunk_rows * V * 4, w_dims)
    _assert_close(got, _unchunked(x, w, labels, w_dims))
    assert got[1][0, :3].abs().max() == 0           # ignored labels: no gradient to their rows


def test_bf16_close_to_the_unchunked_loss_and_reduced_in_fp32():
    x, w, labels = _inputs(torch.bfloat16)
    got = _loss_and_grads(x, w, labels, 4 * V * 4)
    want = _unchunked(x, w, labels)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    _assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_without_gradient_the_loss_is_the_same_and_no_gradient_work_is_saved():
    x, w, labels = _inputs()
    with torch.no_grad():
        loss = ops.linear_cross_entropy(fpp.named(x, "batch seq hidden"), fpp.named(w, "hidden vocab"),
                                        fpp.named(labels, "batch seq"), chunk_bytes=4 * V * 4).value()
    torch.testing.assert_close(loss, _unchunked(x, w, labels)[0], rtol=1e-12, atol=0)
    assert not loss.requires_grad


def test_a_second_backward_through_the_same_loss_is_refused():
    """The gradients are formed in forward and handed over (scaled in place) by the first
    backward: a second one (``retain_graph``) would be wrong, so it raises."""
    x, w, labels = _inputs()
    x.requires_grad_()
    loss = ops.linear_cross_entropy(fpp.named(x, "batch seq hidden"), fpp.named(w, "hidden vocab"),
                                    fpp.named(labels, "batch seq"), chunk_bytes=5 * V * 4).value()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through the same loss"):
        loss.backward()


def test_eager_holds_no_full_logits_buffer():
    """Forward + backward with 64-row chunks of a 1024 x 2048 logits problem: the peak
    allocation stays well below one full fp32 logits tensor (8 MiB), which the unchunked
    path allocates (twice: logits and their gradient)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g).requires_grad_()
    w = (torch.randn(16, 2048, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, 2048, (1024,), generator=g)
    full_logits = 1024 * 2048 * 4

    def run(chunk):
        with peak_memory() as peak:
            loss = ops.linear_cross_entropy(fpp.named(x, "tok hidden"), fpp.named(w, "hidden vocab"),
                                            fpp.named(labels, "tok"), chunk_bytes=chunk).value()
            torch.autograd.grad(loss, (x, w))
        return peak.bytes
    assert run(0) >= full_logits
    assert run(64 * 2048 * 4) < full_logits / 4


@pytest.mark.parametrize("mesh_kw,rules", [
    (dict(tp=2), fpp.Rules(vocab="tp")),
    (dict(dp_shard=2, tp=2), fpp.Rules(batch="dp_shard", vocab="tp", hidden="dp_shard")),
    (dict(dp_shard=2, cp=2), fpp.Rules(batch="dp_shard", seq="cp", hidden=("dp_shard", "cp"))),
], ids=["tp_vocab", "fsdp_tp", "dp_cp_fsdp"])
def test_op_under_simulated_layouts_equals_one_device(mesh_kw, rules):
    """The vocabulary split (log-sum-exp completed over tp), tokens split over dp/cp, the
    weight FSDP-sharded along hidden (gathered, its gradient reduce-scattered)."""
    x, w, labels = _inputs()
    want = _unchunked(x, w, labels)

    def run():
        with fpp.use_rules(rules):
            return _loss_and_grads(x, w, labels, 2 * V * 4)
    for got in fpp.launch(run, fpp.Mesh(**mesh_kw)):
        _assert_close(got, want)


def test_pending_sum_layout_takes_the_unchunked_path(monkeypatch):
    """``hidden`` split over tp in both operands makes the logits a pending sum: the op
    computes the unchunked form (the chunked kernel is not called) and the same result."""
    x, w, labels = _inputs()
    want = _unchunked(x, w, labels)

    def refuse(*args, **kw):
        raise AssertionError("the chunked kernel ran on a pending-sum layout")
    monkeypatch.setattr(linear_xent, "linear_xent_sum", refuse)

    def run():
        with fpp.use_rules(fpp.Rules(hidden="tp")):
            return _loss_and_grads(x, w, labels, 2 * V * 4)
    for got in fpp.launch(run, fpp.Mesh(tp=2)):
        _assert_close(got, want)


def test_bad_arguments_are_named():
    x, w, labels = _inputs()
    nx, nw, nl = fpp.named(x, "batch seq hidden"), fpp.named(w, "hidden vocab"), fpp.named(labels, "batch seq")
    with pytest.raises(ValueError, match="chunk_bytes must be a non-negative integer"):
        ops.linear_cross_entropy(nx, nw, nl, chunk_bytes=-1)
    with pytest.raises(ValueError, match=r"weight must have exactly the dimensions \('hidden', 'vocab'\)"):
        ops.linear_cross_entropy(nx, fpp.named(w, "hidden classes"), nl, vocab="vocab")
    with pytest.raises(ValueError, match=r"cannot tell which dimension is contract"):
        ops.linear_cross_entropy(nx, fpp.named(w, "embd vocab"), nl)
    with pytest.raises(ValueError, match="labels have dimensions"):
        ops.linear_cross_entropy(nx, nw, fpp.named(labels[0], "seq"))
    with pytest.raises(TypeError, match="labels is a Tensor"):
        ops.linear_cross_entropy(nx, nw, labels)


# ------------------------------------------------------------------ the llama model

CFG = llama.Config.tiny()
CHUNKED = llama.Config.tiny(loss_chunk_bytes=5 * 256 * 4)        # 5 rows per chunk of 16 or 32
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
BATCH = make_batch(CFG, batch=8, seq=16)
BATCH["labels"][1, :5] = ops.IGNORE_INDEX


def _assert_matches(results, ref):
    loss0, grads0 = ref
    for rank, (loss, grads, *_) in enumerate(results):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank} loss: {m}")
        for (path, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} grad {path}: {m}")


LAYOUTS = {
    "one_device": (dict(), fpp.Rules()),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True)),
    "dp_fsdp_cp_tp": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules()),
}


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_chunked_loss_matches_the_unchunked_single_device(name, tie):
    cfg, chunked = (CFG, CHUNKED) if not tie else (llama.Config.tiny(tie_embeddings=True),
                                                   llama.Config.tiny(tie_embeddings=True, loss_chunk_bytes=5 * 256 * 4))
    full = FULL if not tie else fpp.init_params(llama.init(cfg, torch.float64), seed=1)
    ref = single_device(cfg, full, BATCH)
    mesh_kw, rules = LAYOUTS[name]
    if not mesh_kw:
        _assert_matches([single_device(chunked, full, BATCH)], ref)
    else:
        _assert_matches(parallel(chunked, full, BATCH, fpp.Mesh(**mesh_kw), rules), ref)


def test_llama_training_steps_update_the_parameters_alike():
    """Two AdamW steps (fp64): the chunked loss' losses and updated parameters equal the
    unchunked ones, on one device and with FSDP x tp."""
    data = [make_batch(CFG, batch=4, seq=16, seed=i) for i in range(2)]
    one = fpp.Mesh()
    ref = fpp.launch(train_steps(CFG, data, one, fpp.Rules()), one)[0]
    assert_same_run(fpp.launch(train_steps(CHUNKED, data, one, fpp.Rules()), one)[0], ref, rtol=1e-10, atol=1e-12)
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    for run in fpp.launch(train_steps(CHUNKED, data, mesh, llama.default_rules()), mesh):
        assert_same_run(run, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(600)
def test_compiled_chunks_equal_the_eager_unchunked_loss():
    """Loss and gradients differentiated inside one inductor-compiled graph (fullgraph, as a
    compiled training step does): the traced branch with the in-place weight-gradient
    accumulation (``fpp::addmm_into``, 5 chunks) equals the eager unchunked path."""
    x, w, labels = _inputs(torch.float32)

    def loss_and_grads(x, w, labels, seed):     # as the step makes its leaves (a seed on torch 2.11)
        x, w = differentiable(x, seed), differentiable(w, seed)
        loss = ops.linear_cross_entropy(fpp.wrap(x, "batch seq hidden"), fpp.wrap(w, "hidden vocab"),
                                        fpp.wrap(labels, "batch seq"), chunk_bytes=5 * V * 4).data
        return (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    torch._dynamo.reset()
    with trace_backward():
        got = torch.compile(loss_and_grads, backend="inductor", fullgraph=True)(x, w, labels, grad_seed(x.device, True))
    _assert_close(got, _unchunked(x, w, labels), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_vocabulary_split_on_two_gloo_processes():
    """tp=2 on real processes (the log-sum-exp completed by gloo all-reduces): loss and
    gathered gradients equal the unchunked single-device run."""
    mesh, rules = fpp.Mesh(tp=2), llama.default_rules(fsdp=False)
    decls = llama.init(CHUNKED, torch.float64)

    def fn():
        with fpp.use_rules(rules):
            local = tree.tree_map(lambda p: p.clone().requires_grad_(),
                                  sharding.shard(FULL, decls, mesh, rules, fpp.current_rank()))
            loss = llama.loss(sharding.named_tree(local, decls), local_batch(BATCH, mesh, rules), CHUNKED).value()
            loss.backward()
            grads = fpp.gather_tree(tree.tree_map(lambda p: p.grad, local), decls, rules)
        return loss.detach(), grads
    _assert_matches(fpp.launch(fn, mesh, processes=True, timeout=300), single_device(CFG, FULL, BATCH))


@pytest.mark.parametrize("name", ["one_device", "tp_sp"])
def test_llama_loss_over_a_number_of_chunks_matches_the_unchunked_single_device(name, monkeypatch):
    """``Config.loss_chunks`` (the config's ``loss_chunks``, Axolotl's ``cut_cross_entropy``):
    each device's tokens in that many chunks; the loss and every gradient equal the whole
    logits' on one device, and the chunks are the ones asked for."""
    from functional_pp.ops.xent import linear
    seen = []
    real = linear.chunk_rows
    monkeypatch.setattr(linear, "chunk_rows", lambda n, v, b, c=None: seen.append((n, b, c)) or real(n, v, b, c))
    ref = single_device(CFG, FULL, BATCH)
    mesh_kw, rules = LAYOUTS[name]
    counted = llama.Config.tiny(loss_chunks=3)
    if not mesh_kw:
        _assert_matches([single_device(counted, FULL, BATCH)], ref)
    else:
        _assert_matches(parallel(counted, FULL, BATCH, fpp.Mesh(**mesh_kw), rules), ref)
    assert seen and all(c == 3 and b is None for _, b, c in seen)
    assert real(128, 256, None, 3) == 43 and real(2, 256, None, 3) == 1 and real(128, 256, 1 << 30, 3) == 43


def test_loss_chunks_are_checked():
    x, w, labels = torch.randn(2, 4, 8), torch.randn(8, 16), torch.randint(0, 16, (2, 4))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be a positive integer"):
            ops.linear_cross_entropy(fpp.named(x, "batch seq hidden"), fpp.named(w, "hidden vocab"),
                                     fpp.named(labels, "batch seq"), chunks=bad)
    with pytest.raises(ValueError, match="give one"):
        llama.Config.tiny(loss_chunks=2, loss_chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match="final_softcap with loss_chunks"):
        llama.Config.tiny(final_softcap=30.0, loss_chunks=2)
