"""The chunked linear recurrence (``ops.linear_scan``, Mamba (v1)'s selective scan) against the
loop written out position by position, in float64: every state and the gradients of the decays,
inputs and start state, at lengths that run the loop (short), one level of chunks, chunks with
padding and chunk ends chunked again; decays of zero (a document's first position) and ones that
underflow; a bad input refused by name."""
import pytest
import torch

from functional_pp.ops.linear_scan import linear_scan


def _loop(a, u, start):
    h, out = start, []
    for t in range(u.shape[1]):
        h = u[:, t] if h is None else a[:, t] * h + u[:, t]
        out.append(h)
    return torch.stack(out, 1)


@pytest.mark.parametrize("seq", [1, 3, 9, 16, 70, 300])
@pytest.mark.parametrize("with_start", [False, True])
def test_states_and_gradients_equal_the_loop(seq, with_start):
    g = torch.Generator().manual_seed(seq)
    a = torch.rand(2, seq, 3, 4, generator=g, dtype=torch.float64)
    a[0, seq // 2] = 0.0                                     # (a document starts: nothing flows past)
    a[1, seq // 3, 0] = 1e-300                               # (its products underflow)
    u = torch.randn(2, seq, 3, 4, generator=g, dtype=torch.float64)
    start = torch.randn(2, 3, 4, generator=g, dtype=torch.float64) if with_start else None
    ours = [t.clone().requires_grad_() for t in (a, u) + ((start,) if with_start else ())]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    got = linear_scan(ours[0], ours[1], 1, ours[2] if with_start else None)
    want = _loop(theirs[0], theirs[1], theirs[2] if with_start else None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    for mine, ref in zip(ours, theirs):
        if ref.grad is None:                                 # (one position from zero: no decay used)
            assert mine.grad is None or not mine.grad.any()
            continue
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_another_dimension_and_a_bad_input():
    g = torch.Generator().manual_seed(0)
    a, u = torch.rand(40, 5, generator=g, dtype=torch.float64), torch.randn(40, 5, generator=g, dtype=torch.float64)
    torch.testing.assert_close(linear_scan(a.T, u.T, 1), _loop(a.T, u.T, None), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"linear_scan: decays \(40, 5\) and inputs \(40, 4\) must have one shape"):
        linear_scan(a, u[:, :4], 0)


def test_the_benchmark_smoke_run_measures_both_forms_and_they_agree():
    """benchmarks/mamba1_scan.py --smoke: the loop it replaced and the chunked scan agree in float64,
    and the chunked scan keeps less for backward (the states once, not twice)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import mamba1_scan
    out = mamba1_scan.main(["--smoke"])
    assert out["agreement"] < 1e-12
    (row,) = out["rows"]
    assert row["loop_s"] > 0 and row["chunked_s"] > 0
    assert row["memory"]["chunked"][1] < row["memory"]["loop"][1]
