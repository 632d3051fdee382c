"""The cross-entropy's own backward (functional_pp/ops/xent/rows.py, docs/compile.md "The
cross-entropy's own backward"): loss and logits' gradient equal autograd of the plain formula
(``torch.nn.functional.cross_entropy``), with ignored labels, on one device (eager and
traced) and with the vocabulary split over simulated devices."""
import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp import ops
from functional_pp._torch import trace_backward
from functional_pp._torch.grad_leaves import differentiable, grad_seed

B, V, S = 4, 16, 6       # logits "batch vocab seq": the vocabulary is not the last dimension


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, S, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = ops.IGNORE_INDEX
    labels[2, 5] = ops.IGNORE_INDEX
    return logits, labels


def _reference(logits, labels, scale=1.0):
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=ops.IGNORE_INDEX) * scale     # class dim 1
    loss.backward()
    return loss.detach(), x.grad


def _ours(logits, labels, scale=1.0):
    x = logits.clone().requires_grad_()
    loss = ops.cross_entropy(fpp.named(x, "batch vocab seq"), fpp.named(labels, "batch seq")).value() * scale
    loss.backward()
    return loss.detach(), x.grad


def test_one_device_eager_equals_autograd_of_the_plain_formula():
    logits, labels = _inputs()
    loss, grad = _ours(logits, labels)
    ref_loss, ref_grad = _reference(logits, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert grad[0, :, :4].abs().max() == 0          # ignored labels: no gradient


@pytest.mark.timeout(600)
def test_one_device_traced_equals_autograd_of_the_plain_formula():
    """The backward's traced branch (one fused expression), differentiated inside the
    compiled function as a training step is."""
    logits, labels = _inputs()

    def loss_and_grad(x, lab, seed):           # as the step makes its leaves (a seed on torch 2.11)
        x = differentiable(x, seed)
        loss = ops.cross_entropy(fpp.named(x, "batch vocab seq"), fpp.named(lab, "batch seq")).data * 0.5
        return loss.detach(), torch.autograd.grad(loss, x)[0]
    torch._dynamo.reset()
    with trace_backward():
        loss, grad = torch.compile(loss_and_grad, backend="aot_eager", fullgraph=True)(
            logits, labels, grad_seed(logits.device, True))
    ref_loss, ref_grad = _reference(logits, labels, 0.5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mesh,rules", [
    (fpp.Mesh(tp=2), fpp.Rules(vocab="tp")),
    (fpp.Mesh(dp_shard=2, tp=2), fpp.Rules(batch="dp_shard", vocab="tp")),
], ids=["tp2", "dp2xtp2"])
def test_vocabulary_split_over_simulated_devices_equals_autograd_of_the_plain_formula(mesh, rules):
    """Each device holds a block of the vocabulary (and of the batch): its loss is the global
    one and its logits' gradient (gathered to the whole tensor) the plain formula's."""
    logits, labels = _inputs()
    ref_loss, ref_grad = _reference(logits, labels)

    def run():
        with fpp.use_rules(rules):
            return _ours(logits, labels)
    for loss, grad in fpp.launch(run, mesh):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_the_rows_function_alone_eager_whole_vocabulary():
    """``nll_rows`` called eagerly with the whole vocabulary (the in-place backward) equals the
    plain formula's rows and gradient, with a weight per row."""
    from functional_pp.ops.xent.rows import nll_rows
    logits, labels = _inputs()
    x = logits.movedim(1, -1).reshape(-1, V)
    lab = labels.reshape(-1).clamp(0, V - 1)
    w = torch.linspace(-1, 2, x.shape[0], dtype=x.dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    rows = nll_rows(a, lab, torch.logsumexp(a, -1))
    (rows * w).sum().backward()
    ref = F.cross_entropy(b, lab, reduction="none")
    (ref * w).sum().backward()
    torch.testing.assert_close(rows, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eager_loss_in_row_chunks_equals_one_chunk_bitwise_and_torch(monkeypatch, dtype):
    """The eager loss (``nll_rows_wide``: torch's fused ``log_softmax`` forward and ``softmax``
    backward, 16-bit logits widened inside them, the gradient written in their dtype) gives
    the same loss and gradient, bitwise, whether the logits are worked on whole or a chunk of
    rows at a time, and those of ``F.cross_entropy`` of the fp32-widened logits with ignored
    labels (torch's tolerances for the dtype): odd row counts and a vocabulary that is no
    multiple of the vector width included."""
    from functional_pp.ops.xent import rows
    g = torch.Generator().manual_seed(1)
    for b, s, v in ((2, 33, 1000), (3, 7, 250), (1, 1, 64)):
        logits = (torch.randn(b, s, v, generator=g) * 3).to(dtype)
        labels = torch.randint(0, v, (b, s), generator=g)
        labels[0, :1] = ops.IGNORE_INDEX if b * s > 1 else labels[0, :1]     # (all ignored: torch's nan)
        results = []
        for min_chunk_bytes in (2**30, 1):              # whole, then chunks
            monkeypatch.setattr(rows, "MIN_CHUNK_BYTES", min_chunk_bytes)
            assert rows._one_chunk(logits) == (min_chunk_bytes > 1 or b * s <= 2)
            if min_chunk_bytes == 1 and b * s > 2:
                assert len(rows._row_chunks(b * s, v)) > 1
            a = logits.clone().requires_grad_()
            loss = ops.cross_entropy(fpp.named(a, "batch seq vocab"), fpp.named(labels, "batch seq")).value() * 0.7
            loss.backward()
            assert loss.dtype == torch.float32 and a.grad.dtype == dtype
            results.append((loss.detach(), a.grad))
        (whole, whole_grad), (chunked, chunked_grad) = results
        assert torch.equal(whole, chunked) and torch.equal(whole_grad, chunked_grad), (b, s, v)
        w = logits.clone().requires_grad_()
        ref = F.cross_entropy(w.float().view(-1, v), labels.view(-1), ignore_index=ops.IGNORE_INDEX) * 0.7
        ref.backward()
        torch.testing.assert_close(whole, ref.detach(), msg=lambda m: f"{(b, s, v)}: {m}")
        torch.testing.assert_close(whole_grad, w.grad, msg=lambda m: f"{(b, s, v)}: {m}")


def test_logits_widened_whole_as_a_compiled_step_does(monkeypatch):
    """Eager 16-bit logits are widened by row chunks; inside ``logits_widened_whole`` (what a
    dry-run of a whole-step compile runs) they are widened whole, as the traced step does
    (``torch.logsumexp`` and the written-out backward): the same loss and gradient, to torch's
    tolerances for bf16."""
    from functional_pp.ops import loss as loss_module
    chunked = []
    wide = loss_module.nll_rows_wide
    monkeypatch.setattr(loss_module, "nll_rows_wide", lambda *a: chunked.append(1) or wide(*a))
    logits, labels = _inputs()
    logits = logits.to(torch.bfloat16).movedim(1, -1).contiguous()          # vocab last

    def run():
        x = logits.clone().requires_grad_()
        loss = ops.cross_entropy(fpp.named(x, "batch seq vocab"), fpp.named(labels, "batch seq")).value()
        loss.backward()
        return loss.detach(), x.grad
    eager = run()
    assert chunked == [1]
    with loss_module.logits_widened_whole():
        whole = run()
    assert chunked == [1]
    torch.testing.assert_close(whole[0], eager[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(whole[1], eager[1])
