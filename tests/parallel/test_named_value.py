"""The named value is immutable and self-describing (docs/named_value.md); the eager fast paths
(einsum as one matrix product, memoised plans and rotary tables, one metrics read per step)
give the same numbers as the general ones (docs/eager_overhead.md)."""
import importlib

import optree
import pytest
import torch

import functional_pp as fpp
from functional_pp import ops
from functional_pp.ops.einsum import _matmul_depth
from functional_pp.parallel.named import Named, memo_table
from functional_pp.step.io import read_step_metrics


def test_every_field_is_read_only_and_the_error_names_it():
    x = Named(torch.ones(2, 3), ("a", "b"))
    for field in ("data", "dims", "split", "vary", "partial", "is_param", "tied", "gathered_from"):
        with pytest.raises(AttributeError, match=f"cannot set {field!r}.*replace"):
            setattr(x, field, None)
    with pytest.raises(AttributeError):
        x.anything_else = 1
    assert x.dims == ("a", "b") and x.is_param is False


def test_replace_returns_a_changed_copy_and_validates():
    x = Named(torch.ones(2, 3), ("a", "b"))
    y = x.replace(is_param=True)
    assert y.is_param and not x.is_param and y.data is x.data and y.shape == {"a": 2, "b": 3}
    z = x.replace(data=torch.zeros(4, 3))
    assert z.shape == {"a": 4, "b": 3} and x.shape == {"a": 2, "b": 3}
    with pytest.raises(TypeError, match="unknown field 'colour'"):
        x.replace(colour="red")
    with pytest.raises(ValueError, match="3 dimensions but 2 names"):
        x.replace(data=torch.ones(2, 3, 4))


def test_global_sizes_are_fixed_at_construction():
    x = Named(torch.ones(2, 3), ("a", "b"), (("dp",), ()), sizes=(8, 3))
    assert x.shape == {"a": 8, "b": 3}          # no mesh knows 'dp' here: the given sizes hold
    assert x.vary == frozenset({"dp"})           # the splitting axis is in the type
    with pytest.raises(ValueError, match="one entry per dimension"):
        Named(torch.ones(2, 3), ("a", "b"), sizes=(2,))


def test_named_is_a_pytree_node_in_the_package_namespace_only():
    tree = {"w": Named(torch.ones(2, 3), ("a", "b"), is_param=True), "n": [Named(torch.ones(4), ("c",))]}
    assert all(isinstance(leaf, Named) for leaf in optree.tree_leaves(tree))   # default: a leaf
    leaves = optree.tree_leaves(tree, namespace="functional_pp")
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves) and len(leaves) == 2
    doubled = optree.tree_map(lambda t: t * 2, tree, namespace="functional_pp")
    assert isinstance(doubled["w"], Named) and doubled["w"].is_param and doubled["w"].dims == ("a", "b")
    assert torch.equal(doubled["w"].data, torch.full((2, 3), 2.0))


@pytest.mark.parametrize("pattern,shapes,depth", [
    ("b s h, h n d -> b s n d", [(2, 3, 4), (4, 5, 6)], 1),
    ("b s n d, n d h -> b s h", [(2, 3, 5, 6), (5, 6, 4)], 2),
    ("b s h, h v -> b s v", [(2, 3, 4), (4, 7)], 1),
    ("b s h, v h -> b s v", [(2, 3, 4), (7, 4)], 0),            # b's contracted dim is last
    ("b s h, h v -> b v s", [(2, 3, 4), (4, 7)], 0),            # output not in a-then-b order
    ("b n s d, b n t d -> b n s t", [(2, 3, 4, 5), (2, 3, 6, 5)], 0),
    ("h, h v -> v", [(4,), (4, 7)], 1),                         # no leading dimension
    ("s a b, a b -> s", [(3, 4, 5), (4, 5)], 2),               # nothing left of the second operand
    ("s a b, a b v w -> s v w", [(3, 4, 5), (4, 5, 2, 6)], 2),
])
def test_einsum_as_a_matrix_product_equals_torch_einsum(pattern, shapes, depth):
    ins, out = pattern.split("->")
    dims = [tuple(p.split()) for p in ins.split(",")]
    assert _matmul_depth(tuple(dims), tuple(out.split())) == depth
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    y = ops.einsum(pattern, *[Named(t, d) for t, d in zip(ts, dims)])
    letters = {d: chr(97 + i) for i, d in enumerate(dict.fromkeys(sum(dims, ())))}
    spec = ",".join("".join(letters[d] for d in ds) for ds in dims) + "->" + "".join(letters[d] for d in out.split())
    ref = torch.einsum(spec, *ts)
    assert y.dims == tuple(out.split()) and torch.allclose(y.data, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(y.data.sum(), ts)
    refs = torch.autograd.grad(ref.sum(), ts)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(grads, refs))


def test_rotary_tables_are_built_once_per_positions_value():
    importlib.import_module("functional_pp.ops.attention")._OUTSIDE_A_MESH.clear()
    pos = ops.positions("seq", 8)
    g = torch.Generator().manual_seed(0)
    q = Named(torch.randn(2, 8, 4, 6, generator=g), ("batch", "seq", "heads", "head_dim"))
    k = Named(torch.randn(2, 8, 2, 6, generator=g), ("batch", "seq", "kv_heads", "head_dim"))
    rq, rk = ops.rotary(q, pos, head_dim="head_dim"), ops.rotary(k, pos, head_dim="head_dim")
    assert len([key for key in memo_table(pos) if key[0] == "rotary"]) == 1
    assert ops.positions("seq", 8) is pos               # eager: one positions value per layout
    fresh = Named(torch.arange(8), ("seq",))            # same positions, nothing memoised
    assert torch.equal(ops.rotary(q, fresh, head_dim="head_dim").data, rq.data) and torch.equal(
        ops.rotary(k, fresh, head_dim="head_dim").data, rk.data)


def test_metrics_are_read_in_one_exact_transfer():
    m = {"loss": torch.tensor(2.5, dtype=torch.float32), "tokens": torch.tensor(128.0, dtype=torch.float64),
         "skipped": torch.tensor(0, dtype=torch.int64)}
    failed = (torch.tensor([1, 0, 7]), ("seq",))           # (summary: failed?, ...; dims)
    metrics, bad = read_step_metrics(m, torch.tensor(2 ** 40 + 1, dtype=torch.int64), [failed])
    assert metrics == {"loss": 2.5, "tokens": 128.0, "skipped": 0.0, "step": 2 ** 40 + 1} and bad
    _, bad = read_step_metrics(m, torch.tensor(3), [(torch.tensor([0, 0, 7]), ("seq",))])
    assert not bad


def test_a_tiny_llama_step_gives_the_same_loss_twice_from_the_same_state():
    from functional_pp.models import llama
    cfg = llama.Config(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=32, max_seq=16,
                       tie_embeddings=False, rope_scaling=None)
    params = fpp.init(llama.init, cfg, seed=0)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:]}
    losses = []
    for _ in range(2):     # the second run hits every memoised plan: same numbers
        step = fpp.train_step(lambda p, b: llama.loss(p, b, cfg), fpp.optim.adamw(1e-2))
        state = step.init(params)
        state, m1 = step(state, batch)
        state, m2 = step(state, batch)
        losses.append((m1["loss"], m2["loss"]))
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]
