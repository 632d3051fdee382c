"""Pytree flattening inside torch.compile (functional_pp/core/tree.py; docs/compile.md "Tracing
time"): plain trees (dicts with str keys, lists, tuples, None, tensor leaves) are flattened by the
package's own few lines while traced, in optree's order, and rebuilt with the original key order;
any other tree goes to optree. The results must equal optree's, traced or not."""
from collections import namedtuple

import optree
import torch

from functional_pp.core import tree as T

Pair = namedtuple("Pair", "a b")


def _plain():
    return {"b": torch.ones(1), "a": [torch.zeros(2), None, (torch.ones(3),)],
            "c": {"z": torch.full((4,), 2.0), "y": torch.arange(5.0)}}


def _compiled(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_a_traced_flatten_equals_optrees_and_rebuilds_the_same_tree():
    tree = _plain()
    ref_leaves, ref_spec = optree.tree_flatten(tree, none_is_leaf=False)

    def roundtrip(t):
        leaves, spec = T.tree_flatten(t)
        assert isinstance(spec, T.PlainSpec)          # the traced path was taken
        return leaves, T.tree_unflatten(spec, [x * 2 for x in leaves]), T.tree_leaves(t)

    leaves, rebuilt, leaves2 = _compiled(roundtrip)(tree)
    assert [x.tolist() for x in leaves] == [x.tolist() for x in ref_leaves]
    assert [x.tolist() for x in leaves2] == [x.tolist() for x in ref_leaves]
    expected = optree.tree_unflatten(ref_spec, [x * 2 for x in ref_leaves])
    assert optree.tree_structure(rebuilt, none_is_leaf=False) == ref_spec
    assert list(rebuilt) == list(expected) == ["b", "a", "c"] and list(rebuilt["c"]) == ["z", "y"]
    for a, b in zip(optree.tree_leaves(rebuilt), optree.tree_leaves(expected)):
        assert torch.equal(a, b)


def test_a_tree_that_is_not_plain_goes_to_optree_when_traced():
    tree = {"p": Pair(torch.ones(2), torch.zeros(3)), 1: torch.ones(1)}     # namedtuple, int key

    def roundtrip(t):
        leaves, spec = T.tree_flatten(t)
        assert not isinstance(spec, T.PlainSpec)
        return T.tree_unflatten(spec, [x + 1 for x in leaves])

    out = _compiled(roundtrip)(tree)
    assert type(out["p"]) is Pair and torch.equal(out["p"].b, torch.ones(3)) and torch.equal(out[1], torch.full((1,), 2.0))


def test_eager_flatten_is_optrees_and_unflatten_checks_the_leaf_count():
    leaves, spec = T.tree_flatten(_plain())
    assert not isinstance(spec, T.PlainSpec)          # eager: optree itself
    plain = T.PlainSpec(_plain())
    try:
        plain.unflatten([torch.ones(1)] * 6)
    except ValueError as e:
        assert "more leaves" in str(e)
    else:
        raise AssertionError("six leaves for a five-leaf tree were accepted")
