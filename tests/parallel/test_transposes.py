"""The transposes of docs/collectives.md, one autograd function each (functional_pp/parallel/transposes.py):
every row of the table against the single-device oracle, and the table against the code."""
import inspect
import pathlib
import re

import pytest
import torch

import functional_pp as fpp
from functional_pp.parallel import collectives as C
from functional_pp.parallel import transposes

AXES = ("dp_shard", "tp")
N = 4
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "collectives.md"


def _case(which):
    """(device function, in spec, out spec, single-device reference on the global array)."""
    block, whole = fpp.P(AXES), fpp.P()
    if which == "psum":            # partial blocks summed; invariant result, identity backward
        return lambda a: C.psum(a, AXES), block, whole, lambda a: sum(a.chunk(N, 0))
    if which == "split_invariant":     # free slice; backward all-gathers
        return lambda a: C.split_invariant(a, AXES, 0), whole, block, lambda a: a
    if which == "all_gather_invariant":    # backward takes this device's block
        return (lambda a: C.all_gather(a, AXES, axis=0, tiled=True, invariant=True), block, whole,
                lambda a: a)
    if which == "slice_varying":      # pvary then slice: backward zero-pads, then psums
        return (lambda a: C.slice_varying(C.pvary(a, AXES), AXES, 0), whole, block, lambda a: a)
    if which == "pvary_psum":         # pvary (psum backward) feeding psum (identity backward)
        return (lambda a: C.psum(C.pvary(a, AXES) * (C.axis_index(AXES) + 1.0), AXES), whole, whole,
                lambda a: a * sum(range(1, N + 1)))
    raise ValueError(which)


@pytest.mark.parametrize("which", ["psum", "split_invariant", "all_gather_invariant", "slice_varying",
                                   "pvary_psum"])
def test_transpose_matches_single_device(which):
    device, in_spec, out_spec, reference = _case(which)
    A = torch.randn(16, 4, dtype=torch.float64)
    A0 = A.clone().requires_grad_()
    out0 = reference(A0)
    weight = torch.randn(out0.shape, dtype=torch.float64)
    (out0 * weight).sum().backward()

    def fn():
        a = A.clone().requires_grad_()
        out = fpp.shard_map(device, (in_spec,), out_spec)(a)
        (out * weight).sum().backward()
        return out.detach(), a.grad
    for out, grad in fpp.launch(fn, fpp.Mesh(dp_shard=2, tp=2)):
        torch.testing.assert_close(out, out0.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, A0.grad, rtol=1e-10, atol=1e-12)


def _functions():
    return {name: cls for name, cls in vars(transposes).items()
            if inspect.isclass(cls) and issubclass(cls, torch.autograd.Function)
            and cls.__module__ == transposes.__name__ and name != "_Collective"}


def test_every_function_states_its_transpose_and_is_in_the_table():
    table = DOC.read_text()
    functions = _functions()
    assert len(functions) >= 10, sorted(functions)
    for name, cls in functions.items():
        assert "Transpose:" in (cls.__doc__ or ""), f"{name}'s docstring does not state its transpose"
        assert re.search(rf"`{name}`", table), f"{name} is missing from the table in {DOC.name}"
        assert "backward" in vars(cls), f"{name} does not write out its backward"
