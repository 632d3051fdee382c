"""The generic ops name nothing of any model: no parameter defaults to a dimension name; a
dimension not given is read from the operands when exactly one fits, else a clear error."""
import inspect

import pytest
import torch

import functional_pp as fpp
from functional_pp import ops

MODEL_NAMES = {"batch", "seq", "hidden", "heads", "kv_heads", "head_dim", "vocab", "mlp", "layers", "experts"}


def test_no_op_defaults_to_a_dimension_name():
    found = []
    for name in ops.__all__:
        fn = getattr(ops, name)
        if not callable(fn) or isinstance(fn, type):
            continue
        for p in inspect.signature(fn).parameters.values():
            if isinstance(p.default, str) and set(p.default.split()) & MODEL_NAMES:
                found.append(f"ops.{name}({p.name}={p.default!r})")
    assert not found, f"ops that default to a model's dimension names: {found}"


def test_dimensions_read_from_the_operands():
    x = fpp.named(torch.randn(2, 3, 8, dtype=torch.float64), "b s embd")
    w = fpp.named(torch.rand(8, dtype=torch.float64) + 0.5, "embd")
    torch.testing.assert_close(ops.rms_norm(x, w).value(), ops.rms_norm(x, w, "embd").value())
    logits = fpp.named(torch.randn(2, 3, 5, dtype=torch.float64), "b s classes")
    labels = fpp.named(torch.randint(0, 5, (2, 3)), "b s")
    torch.testing.assert_close(ops.cross_entropy(logits, labels).value(),
                               ops.cross_entropy(logits, labels, vocab="classes").value())
    head = fpp.named(torch.randn(8, 5, dtype=torch.float64), "embd classes")
    torch.testing.assert_close(ops.linear_cross_entropy(x, head, labels).value(),
                               ops.linear_cross_entropy(x, head, labels, vocab="classes", contract="embd").value())
    table = fpp.named(torch.randn(5, 8, dtype=torch.float64), "tokens embd")
    assert ops.embed(table, labels).dims == ("b", "s", "embd")


def test_an_unnamed_dimension_that_cannot_be_read_is_refused_by_name():
    x = fpp.named(torch.randn(2, 8), "b embd")
    with pytest.raises(ValueError, match=r"rms_norm: name the normalised dimension \(dim="):
        ops.rms_norm(x)
    logits = fpp.named(torch.randn(2, 3, 5), "b s classes")
    with pytest.raises(ValueError, match=r"cross_entropy: cannot tell which dimension is vocab .*'s', 'classes'"):
        ops.cross_entropy(logits, fpp.named(torch.randint(0, 5, (2,)), "b"))
    with pytest.raises(TypeError, match="head_dim"):
        ops.rotary(fpp.named(torch.randn(1, 4, 2, 8), "b s h d"), ops.positions("s", 4))
