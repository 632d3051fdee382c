"""torch's cross-entropy as a dry-run of a published run computes it (ops/xent/torch_like.py,
``ops.loss.logits_as_torch_cross_entropy``): the framework's values and gradients, with
torch's buffers (``F.cross_entropy`` over a whole vocabulary, DTensor's loss parallel over a
split one), measured by the planner's tracker on real tensors."""
import pytest
import torch
import torch.nn.functional as F

import functional_pp as fpp
from functional_pp import ops
from functional_pp.ops import loss as loss_module
from functional_pp.plan.tracker import MemoryTracker

N, V = 64, 512                      # rows x vocabulary, fp32: one logits buffer is 128 KiB


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g, dtype=dtype) * 3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:5] = ops.IGNORE_INDEX
    return logits, labels


def _ours(logits, labels):
    x = logits.clone().requires_grad_()
    loss = ops.cross_entropy(fpp.named(x, "batch vocab"), fpp.named(labels, "batch")).value()
    loss.backward()
    return loss.detach(), x.grad


def _reference(logits, labels):
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=ops.IGNORE_INDEX)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("mesh,rules", [
    (None, None),
    (fpp.Mesh(tp=2), fpp.Rules(vocab="tp")),
    (fpp.Mesh(dp_shard=2, tp=2), fpp.Rules(batch="dp_shard", vocab="tp")),
], ids=["one device", "tp2", "dp2xtp2"])
def test_torch_loss_equals_the_plain_formula(mesh, rules):
    """Inside the block the loss and the logits' gradient are the plain formula's, whole and
    with the vocabulary split over simulated devices."""
    logits, labels = _inputs()
    ref_loss, ref_grad = _reference(logits, labels)

    def run():
        with loss_module.logits_as_torch_cross_entropy():
            if rules is None:
                return _ours(logits, labels)
            with fpp.use_rules(rules):
                return _ours(logits, labels)
    for loss, grad in ([run()] if mesh is None else fpp.launch(run, mesh)):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


def _peak_buffers(torch_loss: bool, rules=None) -> float:
    """The peak live bytes of a loss's forward and backward on bf16 logits, in fp32 logits
    buffers of one device (the bf16 logits themselves, held by the caller, not counted)."""
    logits, labels = _inputs(torch.bfloat16)
    x = logits.clone().requires_grad_()
    block = N * V * 4

    def step():
        with (loss_module.logits_as_torch_cross_entropy() if torch_loss else loss_module.logits_widened_whole()), \
                fpp.use_rules(rules or fpp.Rules()):
            xs, ls = fpp.named(x, "batch vocab"), fpp.named(labels, "batch")   # this device's blocks
            with MemoryTracker({}, [xs.data], timeline=False) as tr:
                loss = ops.cross_entropy(xs, ls).value()
                loss.backward()
        return tr.run.peak_bytes / (block // (2 if rules else 1))
    return step() if rules is None else fpp.launch(step, fpp.Mesh(tp=2))[0]


def test_torch_loss_holds_torchs_buffers_whole_vocabulary():
    """``F.cross_entropy``'s backward holds the saved log-probabilities, ``nll_loss``'s zeros and
    ``log_softmax``'s gradient at once (3 fp32 buffers, then the bf16 gradient is a half more at
    the cast), where the framework's one-pass rows hold the widened logits and their gradient (2)."""
    assert _peak_buffers(True) == pytest.approx(3.0, abs=0.1)
    assert _peak_buffers(False) == pytest.approx(2.0, abs=0.1)


def test_torch_loss_holds_loss_parallels_buffers_vocabulary_split():
    """DTensor's loss parallel over a split vocabulary: forward holds the widened block, ``x - max``
    and its ``exp`` (3 block buffers); backward the saved log-probabilities, the zeros with -1 at
    the labels, ``exp`` of the log-probabilities and their sum (4), where the framework's rows
    hold 3 in forward and 2 in backward."""
    assert _peak_buffers(True, fpp.Rules(vocab="tp")) == pytest.approx(4.0, abs=0.1)
    assert _peak_buffers(False, fpp.Rules(vocab="tp")) == pytest.approx(3.0, abs=0.1)
