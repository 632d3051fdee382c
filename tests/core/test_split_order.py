"""The order of a split dimension belongs to its rule (contiguous or load-balanced) and every
gather, slice, named(), rename, reshape, positions and the ops that mix along a dimension
follow it; derived names (inherit) and the ops a model author reaches for."""
import threading
import warnings

import pytest
import torch

import functional_pp as fpp
from functional_pp.core.observers import on_saved_for_backward
from functional_pp.data import shard_sequence

S = 16


def launch(fn, **mesh):
    return fpp.launch(fn, fpp.Mesh(**mesh))


@pytest.mark.parametrize("balanced", [True, False])
def test_named_takes_the_block_the_rule_orders_and_gathers_back(balanced):
    rules = fpp.Rules(seq=fpp.balanced("cp") if balanced else "cp")
    full = torch.arange(2 * S).reshape(2, S)

    def fn():
        with fpp.use_rules(rules):
            x = fpp.named(full, "batch seq")
            pos = fpp.ops.positions("seq", S)
            return x.data, pos.data, fpp.gather_tree(x)
    for i, (block, pos, back) in enumerate(launch(fn, cp=4)):
        assert torch.equal(block, shard_sequence(full, 1, 4, i, balanced))
        assert torch.equal(pos, shard_sequence(torch.arange(S), 0, 4, i, balanced))
        assert torch.equal(back, full)


def _mix_and_cumsum(rules, mesh_kw):
    """A token-mixing einsum over seq and a cumulative sum along seq, with gradients."""
    g = torch.Generator().manual_seed(0)
    xf = torch.randn(2, S, 3, generator=g, dtype=torch.float64)
    wf = torch.randn(S, S, generator=g, dtype=torch.float64)

    def fn():
        with fpp.use_rules(rules.replace(seq_in=())):          # seq_in whole, on purpose
            xl = xf.clone().requires_grad_()
            x = fpp.named(xl, "batch seq hidden")
            w = fpp.named(wf, "seq seq_in")
            mixed = fpp.ops.einsum("batch seq_in hidden, seq seq_in -> batch seq hidden", fpp.ops.rename(x, seq="seq_in"), w)
            c = fpp.ops.cumsum(mixed, "seq")
            loss = fpp.ops.sum(c * c * fpp.named(torch.arange(S, dtype=torch.float64), "seq"))
            value = loss.value()
            value.backward()
            return value.detach(), fpp.gather_tree(c), xl.grad
    return fpp.launch(fn, fpp.Mesh(**mesh_kw))


@pytest.mark.parametrize("rules,mesh_kw", [
    (fpp.Rules(seq=fpp.balanced("cp")), dict(cp=4)),
    (fpp.Rules(seq="cp"), dict(cp=4)),
    (fpp.Rules(batch="dp_replicate", seq=fpp.balanced("dp_shard")), dict(dp_replicate=2, dp_shard=2)),
    (fpp.Rules(seq=fpp.balanced(("cp", "tp"))), dict(cp=2, tp=2)),
], ids=["cp-balanced", "cp-contiguous", "dp_shard-balanced", "cp+tp-balanced"])
def test_mixing_along_a_split_sequence_equals_one_device(rules, mesh_kw):
    (loss0, c0, g0), = _mix_and_cumsum(fpp.Rules(), {})
    for loss, c, g in _mix_and_cumsum(rules, mesh_kw):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        torch.testing.assert_close(c, c0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12)


def test_rename_between_differently_ordered_names_and_reshapes_keep_the_order():
    rules = fpp.Rules(seq=fpp.balanced("cp"), tok="cp", pair="cp")
    full = torch.arange(S * 2, dtype=torch.float64).reshape(S, 2)

    def fn():
        with fpp.use_rules(rules):
            x = fpp.named(full, "seq hidden")
            y = fpp.ops.rename(x, seq="tok")                          # balanced -> contiguous
            z = fpp.ops.split_dim(x, "seq", {"pair": S // 2, "two": 2})   # reshape of a balanced dim
            m = fpp.ops.merge_dims(fpp.named(full.reshape(S // 2, 2, 2), "pair two hidden"), ("pair", "two"), "seq")
            return fpp.gather_tree(y), fpp.gather_tree(z), fpp.gather_tree(m)
    for y, z, m in launch(fn, cp=2):
        assert torch.equal(y, full) and torch.equal(z, full.reshape(S // 2, 2, 2)) and torch.equal(m, full)


def test_refused_layouts_name_the_dimension():
    def odd():
        with fpp.use_rules(fpp.Rules(seq=fpp.balanced("cp"))):
            return fpp.named(torch.ones(12), "seq")
    with pytest.raises(fpp.DeviceError, match=r"'seq' of size 12 is load-balanced over 'cp'.*divisible by 8"):
        launch(odd, cp=4)
    decls = {"pos_table": fpp.param((S, 4), "seq hidden")}
    with pytest.raises(ValueError, match=r"pos_table: dimension 'seq' is split over \('cp',\) in load-balanced order"):
        fpp.init_params(decls, mesh=fpp.Mesh(cp=2), rules=fpp.Rules(seq=fpp.balanced("cp")), rank=0)
    with pytest.raises(ValueError, match="derived names form a cycle"):
        fpp.Rules(a=fpp.inherit("b"), b=fpp.inherit("a"))


def test_inherit_declares_derived_names_and_missing_ones_warn():
    r = fpp.Rules(tok=fpp.balanced("cp"), res_tok=fpp.inherit("tok", "tp"), kv=fpp.inherit("tok"))
    assert r["res_tok"] == ("cp", "tp") and r["kv"] == ("cp",)
    assert r.is_balanced("res_tok") and r.is_balanced("kv") and not r.is_balanced("other")
    assert r.replace(tok="dp_shard")["res_tok"] == ("dp_shard", "tp")
    assert not r.replace(tok="cp").is_balanced("tok")
    mesh = fpp.Mesh(cp=2)
    with pytest.warns(UserWarning, match=r"'res_x' has no rule and stays whole, while 'x' is split.*inherit\('x'\)"):
        fpp.Rules(x="cp").resolve(("batch", "res_x"), None, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fpp.Rules(x="cp", res_x=None).resolve(("batch", "res_x"), None, mesh)      # declared whole
        fpp.Rules(x="cp").resolve(("batch", "res_x"), None, fpp.Mesh(tp=2))        # x not split here


def test_balanced_order_applies_only_over_the_axis_the_rule_names():
    """``seq=balanced("cp")``, ``res_seq=inherit("seq", "tp")`` (sequence parallelism): with
    cp=1 the residual is split over tp alone, contiguously; with cp=2 it is load-balanced over
    cp and each cp block split contiguously over tp (docs/layouts.md)."""
    r = fpp.Rules(seq=fpp.balanced("cp"), res_seq=fpp.inherit("seq", "tp"), both=fpp.balanced(("cp", "tp")))
    assert r.balanced_axis("res_seq") == "cp" and r.balanced_axis("both") == "cp" and r.balanced_axis("x") is None
    assert not r.splits_balanced("res_seq", ("tp",)) and r.splits_balanced("res_seq", ("cp", "tp"))
    assert not r.splits_balanced("both", ("tp",)) and not r.splits_balanced("seq", ())
    full = torch.arange(S)

    def fn():
        with fpp.use_rules(r):
            x = fpp.named(full, "res_seq")
            back = fpp.ops.rename(x, res_seq="seq")          # the SP all-gather: no reorder needed
            return x.data, fpp.ops.positions("res_seq", S).data, fpp.gather_tree(back)
    for j, (block, pos, back) in enumerate(launch(fn, tp=2)):
        assert torch.equal(block, full.chunk(2)[j]) and torch.equal(pos, full.chunk(2)[j])
        assert torch.equal(back, full)
    for rank, (block, pos, back) in enumerate(launch(fn, cp=2, tp=2)):
        i, j = divmod(rank, 2)
        want = shard_sequence(full, 0, 2, i, True).chunk(2)[j]
        assert torch.equal(block, want) and torch.equal(pos, want) and torch.equal(back, full)


# ------------------------------------------------------------------ ops a model author reaches for
def _both(fn, rules, **mesh):
    """fn() on one device and on the mesh: results must agree."""
    (ref,) = fpp.launch(lambda: _with(rules, fn), fpp.Mesh())
    for out in fpp.launch(lambda: _with(rules, fn), fpp.Mesh(**mesh)):
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return ref


def _with(rules, fn):
    with fpp.use_rules(rules):
        return fn()


def test_take_slice_unbind_concat_where_cumsum_on_split_dims():
    """Values of every indexing op on split dimensions, and gradients through the ops whose
    result is split again by the rules (a result left whole after a gather varies over the
    gathered axes, like JAX's all_gather: its sum would not be invariant)."""
    g = torch.Generator().manual_seed(1)
    xf = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)
    rules = fpp.Rules(a="dp_shard", b="tp", c=fpp.balanced("cp"))

    def fn():
        xl = xf.clone().requires_grad_()
        x = fpp.named(xl, "a b c")
        parts = fpp.ops.unbind(x, "a")
        t = fpp.ops.take(x, "c", 5)
        s = fpp.ops.slice_dim(x, "c", 2, 6)
        cat = fpp.ops.concat([x, fpp.ops.transpose(x, "c", "a", "b")], "b")
        w = fpp.ops.where(x.map(lambda d: d > 0), x, fpp.named(torch.ones(8, dtype=torch.float64), "c") * -2.0)
        c = fpp.ops.cumsum(x, "c")
        total = fpp.ops.sum(s * 3.0 * s) + fpp.ops.sum(cat * cat) + fpp.ops.sum(w * x) + fpp.ops.sum(c * c)
        v = total.value()
        v.backward()
        return [v.detach(), xl.grad] + [fpp.gather_tree(y) for y in (t, s, cat, w, c, *parts)]
    ref = _both(fn, rules, dp_shard=2, tp=2, cp=2)
    t, s, cat, w, c, *parts = ref[2:]
    assert torch.equal(t, xf[:, :, 5]) and torch.equal(s, xf[:, :, 2:6])
    assert torch.equal(cat, torch.cat([xf, xf], dim=1)) and torch.equal(c, xf.cumsum(2))
    assert torch.equal(w, torch.where(xf > 0, xf, torch.full_like(xf, -2.0)))
    assert all(torch.equal(p, xf[i]) for i, p in enumerate(parts))
    with pytest.raises(IndexError, match="index 9 is out of range for dimension 'c' of size 8"):
        fpp.ops.take(fpp.named(xf, "a b c"), "c", 9)
    with pytest.raises(ValueError, match="concat: operand 1 has dimensions"):
        fpp.ops.concat([fpp.named(xf, "a b c"), fpp.named(xf[:2], "a b c")], "b")


def test_gelu_tanh_and_dropout():
    x = torch.linspace(-3, 3, 16, dtype=torch.float64).reshape(2, 8)
    got = fpp.ops.gelu(fpp.named(x, "a b"), approximate="tanh").value()
    torch.testing.assert_close(got, torch.nn.functional.gelu(x, approximate="tanh"), rtol=0, atol=0)
    assert not torch.equal(got, torch.nn.functional.gelu(x))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        fpp.ops.gelu(fpp.named(x, "a b"), approximate="fast")

    ones = torch.ones(8, 32, dtype=torch.float64)

    def drop():
        y = fpp.ops.dropout(fpp.named(ones, "a b"), 0.5, seed=7)
        return [fpp.gather_tree(y)]
    (mask,) = _both(drop, fpp.Rules(a=fpp.balanced("cp"), b="tp"), cp=2, tp=2)
    kept = (mask != 0).double().mean().item()
    assert 0.35 < kept < 0.65 and set(mask.unique().tolist()) <= {0.0, 2.0}
    other = fpp.ops.dropout(fpp.named(ones, "a b"), 0.5, seed=8).value()
    assert not torch.equal(other, mask)
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
        fpp.ops.dropout(fpp.named(ones, "a b"), 1.0, seed=0)


# ------------------------------------------------------------------ shape ops keep the parameter flag
_SEEN = threading.local()


@on_saved_for_backward
def _count_saved(t: torch.Tensor) -> None:
    """Bytes of each distinct storage an op's own saved-tensor hook keeps (FSDP re-gathering)."""
    seen = getattr(_SEEN, "d", None)
    if seen is not None:
        base = t._base if t._base is not None else t
        seen.setdefault(id(base), base.numel() * base.element_size())


def _fsdp_weight_through(shape_op):
    """An FSDP weight passed through a shape op before an einsum: comm and saved bytes."""
    mesh, rules = fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard")
    g = torch.Generator().manual_seed(0)
    wf = torch.randn(8, 6, generator=g, dtype=torch.float64)
    xf = torch.randn(4, 8, generator=g, dtype=torch.float64)

    def fn():
        with fpp.use_rules(rules):
            wl = wf.chunk(2)[fpp.current_rank()].clone().requires_grad_()
            w = fpp.Named(wl, ("hidden", "out"), (("dp_shard",), ()), is_param=True)
            x = fpp.named(xf.clone().requires_grad_(), "batch hidden")   # backward needs the weight
            _SEEN.d = {}
            with fpp.comm_report() as rep:
                y = shape_op(x, w)
                saved = sum(_SEEN.d.values())
                y.value().sum().backward()
            _SEEN.d = None
            return rep.bytes("all_gather", backward=True), saved, wl.grad
    return fpp.launch(fn, mesh)


SHAPE_OPS = {
    "rename": lambda x, w: fpp.ops.einsum("batch hidden, hidden o -> batch o", x, fpp.ops.rename(w, out="o")),
    "transpose": lambda x, w: fpp.ops.einsum("batch hidden, out hidden -> batch out", x, fpp.ops.transpose(w, "out", "hidden")),
    "split_dim": lambda x, w: fpp.ops.einsum("batch hidden, hidden o1 o2 -> batch o1 o2", x,
                                         fpp.ops.split_dim(w, "out", {"o1": 2, "o2": 3})),
    "merge_dims": lambda x, w: fpp.ops.einsum("batch hidden, hidden o -> batch o", x,
                                          fpp.ops.merge_dims(fpp.ops.split_dim(w, "out", {"o1": 2, "o2": 3}), ("o1", "o2"), "o")),
}


@pytest.mark.parametrize("name", list(SHAPE_OPS))
def test_shape_ops_keep_the_parameter_flag(name):
    plain = _fsdp_weight_through(lambda x, w: fpp.ops.einsum("batch hidden, hidden out -> batch out", x, w))
    for (bwd_gather, saved, grad), (bwd0, saved0, grad0) in zip(_fsdp_weight_through(SHAPE_OPS[name]), plain):
        # the weight (8x6) is re-gathered in backward, like the input's gradient (4x8) ...
        assert bwd_gather == bwd0 == (8 * 6 + 4 * 8) * 8 // 2
        assert saved == saved0                            # ... so only its shard is saved (ZeRO-3)
        torch.testing.assert_close(grad, grad0, rtol=1e-12, atol=0)
