"""Tests for functional_pp.ops.attention_kernels: kernels vs math oracle, LSE merge, ring attention."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import threading

import pytest
import torch

try:
    from functional_pp.ops import attention_kernels as ak
except Exception:  # package __init__ not importable yet: load the module by path
    _path = pathlib.Path(__file__).resolve().parents[2] / "functional_pp" / "ops" / "attention_kernels.py"
    _spec = importlib.util.spec_from_file_location("_attention_kernels_under_test", _path)
    ak = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ak)

B, H, D = 2, 4, 8
SEQ = 32
TOL64 = dict(rtol=1e-9, atol=1e-10)
TOL32 = dict(rtol=1e-4, atol=1e-5)


def _qkv(heads=H, kv_heads=H, lq=SEQ, lk=SEQ, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, kv_heads, lk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, kv_heads, lk, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _sdpa_reference(q, k, v, scale, causal):
    """Independent oracle: torch's SDPA math path on float64 with explicit GQA expansion."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ----------------------------------------------------------------------------- single-block kernels


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_with_lse_matches_math_and_autograd(causal, kv_heads, dtype):
    tol = TOL64 if dtype == torch.float64 else TOL32
    lk = SEQ if causal else 24
    q, k, v = _qkv(kv_heads=kv_heads, lq=SEQ, lk=lk, dtype=dtype, seed=1)
    scale = 0.37
    assert ak.select_attention_kernel(q, k, v) == "cpu_flash"

    out, lse = ak.attention_with_lse(q, k, v, scale=scale, causal=causal)
    out_m, lse_m = ak._math_attention_with_lse(q, k, v, scale=scale, causal=causal)
    assert out.shape == (B, H, SEQ, D) and lse.shape == (B, H, SEQ)
    assert out.dtype == dtype and lse.dtype == ak._acc_dtype(dtype)
    torch.testing.assert_close(out, out_m, **tol)
    torch.testing.assert_close(lse, lse_m, **tol)
    torch.testing.assert_close(out_m.double(), _sdpa_reference(q.double(), k.double(), v.double(), scale, causal),
                               **tol)
    # lse is really the log-sum-exp of the scaled, masked scores.
    kk = k.double().repeat_interleave(H // kv_heads, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(SEQ, lk, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), **tol)

    g = torch.randn_like(out)
    grads_k = ak.attention_with_lse_backward(g, q, k, v, out, lse, scale=scale, causal=causal)
    grads_m = ak.attention_with_lse_backward(g, q, k, v, out, lse, scale=scale, causal=causal, kernel="math")
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out_a, _ = ak._math_attention_with_lse(qa, ka, va, scale=scale, causal=causal)
    grads_a = torch.autograd.grad((out_a * g).sum(), (qa, ka, va))
    for gk, gm, ga, ref in zip(grads_k, grads_m, grads_a, (q, k, v)):
        assert gk.shape == ref.shape and gk.dtype == ref.dtype
        torch.testing.assert_close(gk, ga, **tol)
        torch.testing.assert_close(gm, ga, **tol)


def test_attention_with_lse_validates_inputs():
    q, k, v = _qkv(lq=8, lk=12)
    with pytest.raises(ValueError):
        ak.attention_with_lse(q, k, v, scale=1.0, causal=True)
    q3, k3, v3 = _qkv(heads=4, kv_heads=3)
    with pytest.raises(ValueError):
        ak.attention_with_lse(q3, k3, v3, scale=1.0, causal=False)


@pytest.mark.parametrize("name,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
def test_cuda_kernel_plumbing_on_meta(name, dtype):
    """Shapes/signatures of the CUDA branch, checked through the ops' meta kernels (no GPU needed)."""
    L = 40  # not a multiple of 32: exercises the efficient-attention lse padding/slicing
    q = torch.empty(2, 4, L, 64, dtype=dtype, device="meta")
    kv = torch.empty(2, 2, L, 64, dtype=dtype, device="meta")
    try:
        out, lse = ak.attention_with_lse(q, kv, kv, scale=0.125, causal=True, kernel=name)
        grads = ak.attention_with_lse_backward(out, q, kv, kv, out, lse, scale=0.125, causal=True, kernel=name)
        half = slice(L // 2, L)
        part = ak.attention_with_lse_backward(out[:, :, half], q[:, :, half], kv, kv, out[:, :, half],
                                              lse[:, :, half], scale=0.125, causal=False, kernel=name)
    except NotImplementedError as e:  # pragma: no cover - torch build without meta kernels
        pytest.skip(str(e))
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, L) and lse.dtype == torch.float32
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(kv.shape), tuple(kv.shape)]
    assert [tuple(g.shape) for g in part] == [(2, 4, L // 2, 64), tuple(kv.shape), tuple(kv.shape)]


# ----------------------------------------------------------------------------- merge


@pytest.mark.parametrize("causal_first", [False, True])
def test_merge_partials_equals_full_attention(causal_first):
    q, k, v = _qkv(lq=16, lk=16, seed=3)
    scale = 0.3
    k2, v2 = _qkv(lq=16, lk=16, seed=4)[1:]
    out_a, lse_a = ak.attention_with_lse(q, k, v, scale=scale, causal=causal_first)
    out_b, lse_b = ak.attention_with_lse(q, k2, v2, scale=scale, causal=False)
    out, lse = ak.merge_partials(out_a, lse_a, out_b, lse_b)
    # reference: attention over the concatenated keys, masking the causal part of the first block
    kc, vc = torch.cat([k, k2], 2), torch.cat([v, v2], 2)
    s = q @ kc.transpose(-1, -2) * scale
    if causal_first:
        mask = torch.cat([torch.ones(16, 16, dtype=torch.bool).tril(), torch.ones(16, 16, dtype=torch.bool)], 1)
        s = s.masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.softmax(s, -1) @ vc
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    # symmetric
    out2, lse2 = ak.merge_partials(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(out2, out, **TOL64)
    torch.testing.assert_close(lse2, lse, **TOL64)


def test_merge_partials_neg_inf():
    out_a = torch.randn(2, 3, 4, dtype=torch.float64)
    lse_a = torch.randn(2, 3, dtype=torch.float64)
    out_b = torch.full((2, 3, 4), float("nan"), dtype=torch.float64)  # garbage in masked rows
    lse_b = torch.full((2, 3), float("-inf"), dtype=torch.float64)
    out, lse = ak.merge_partials(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a, **TOL64)
    torch.testing.assert_close(lse, lse_a, **TOL64)
    out, lse = ak.merge_partials(torch.zeros_like(out_a), lse_b, out_b, lse_b)
    assert torch.equal(out, torch.zeros_like(out_a))
    assert torch.isneginf(lse).all()
    # huge lse values do not overflow
    out, lse = ak.merge_partials(out_a, lse_a + 1e4, out_a, lse_a + 1e4)
    torch.testing.assert_close(out, out_a, **TOL64)
    torch.testing.assert_close(lse, lse_a + 1e4 + math.log(2), **TOL64)


# ----------------------------------------------------------------------------- ring harness


class Ring:
    """cp_size Python threads in lockstep; ``shift`` = send to rank+1, receive from rank-1."""

    def __init__(self, cp_size: int, timeout: float = 60.0):
        self.cp = cp_size
        self.barrier = threading.Barrier(cp_size, timeout=timeout)
        self.slots: list = [None] * cp_size
        self.calls: list[list[list[tuple]]] = [[] for _ in range(cp_size)]  # per rank: per call

    def shift_for(self, rank: int, corrupt: bool = False):
        def shift(tensors):
            self.calls[rank].append([(tuple(t.shape), t.dtype) for t in tensors])
            self.slots[rank] = [t.detach().clone() for t in tensors]  # what a real send would copy
            self.barrier.wait()
            src = rank if corrupt else (rank - 1) % self.cp
            got = self.slots[src]
            self.barrier.wait()  # nobody overwrites a slot before everyone has read
            return got

        return shift

    def run(self, fn):
        results: list = [None] * self.cp
        errors: list = []

        def body(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _local_index(rank: int, cp: int, seq: int, balanced_causal: bool) -> torch.Tensor:
    if balanced_causal:
        c = seq // (2 * cp)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    c = seq // cp
    return torch.arange(rank * c, (rank + 1) * c)


def _run_ring(cp, mode, kv_heads, dtype=torch.float64, kernel="auto", corrupt=False, seed=7):
    causal = mode != "full"
    balanced = mode == "balanced"
    scale = 1.0 / math.sqrt(D)
    q, k, v = _qkv(kv_heads=kv_heads, dtype=dtype, seed=seed)
    w = torch.randn(B, H, SEQ, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    ring = Ring(cp)
    idx = [_local_index(r, cp, SEQ, causal and balanced) for r in range(cp)]

    def worker(rank):
        ql, kl, vl = (t[:, :, idx[rank]].detach().clone().requires_grad_() for t in (q, k, v))
        out = ak.ring_attention(ql, kl, vl, scale=scale, causal=causal, cp_size=cp, cp_rank=rank,
                                balanced=balanced, shift=ring.shift_for(rank, corrupt), kernel=kernel)
        n_fwd = len(ring.calls[rank])
        (out * w[:, :, idx[rank]]).sum().backward()
        return out.detach(), ql.grad, kl.grad, vl.grad, n_fwd

    res = ring.run(worker)
    # reassemble in global order
    outs = torch.empty(B, H, SEQ, D, dtype=dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for r, (o, gq, gk, gv, _) in enumerate(res):
        outs[:, :, idx[r]] = o
        dq[:, :, idx[r]], dk[:, :, idx[r]], dv[:, :, idx[r]] = gq, gk, gv
    # reference: full single-device math attention + autograd
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = ak._math_attention_with_lse(qa, ka, va, scale=scale, causal=causal)
    (ref * w).sum().backward()
    return dict(out=outs, dq=dq, dk=dk, dv=dv, ref=ref.detach(), rdq=qa.grad, rdk=ka.grad, rdv=va.grad,
                ring=ring, res=res, k_local_shape=(B, kv_heads, SEQ // cp, D))


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mode", ["balanced", "contiguous", "full"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_matches_single_device(cp, mode, kv_heads):
    r = _run_ring(cp, mode, kv_heads)
    torch.testing.assert_close(r["out"], r["ref"], **TOL64)
    torch.testing.assert_close(r["dq"], r["rdq"], **TOL64)
    torch.testing.assert_close(r["dk"], r["rdk"], **TOL64)
    torch.testing.assert_close(r["dv"], r["rdv"], **TOL64)

    # documented communication pattern
    kv = (r["k_local_shape"], torch.float64)
    for rank in range(cp):
        calls = r["ring"].calls[rank]
        n_fwd = r["res"][rank][4]
        assert n_fwd == cp - 1
        assert calls[:n_fwd] == [[kv, kv]] * (cp - 1)
        bwd = calls[n_fwd:]
        assert bwd == ([[kv, kv, kv, kv]] * (cp - 1) + [[kv, kv]] if cp > 1 else [])
    fwd_b, bwd_b = ak.ring_attention_comm_bytes(torch.empty(r["k_local_shape"], dtype=torch.float64),
                                                torch.empty(r["k_local_shape"], dtype=torch.float64), cp)
    per = 2 * math.prod(r["k_local_shape"]) * 8
    assert (fwd_b, bwd_b) == (((cp - 1) * per, (2 * cp - 1) * per) if cp > 1 else (0, 0))


@pytest.mark.parametrize("mode", ["balanced", "full"])
def test_ring_attention_float32_and_math_kernel(mode):
    r = _run_ring(4, mode, 2, dtype=torch.float32)
    for a, b in (("out", "ref"), ("dq", "rdq"), ("dk", "rdk"), ("dv", "rdv")):
        torch.testing.assert_close(r[a], r[b], **TOL32)
    r = _run_ring(2, mode, 2, kernel="math")
    for a, b in (("out", "ref"), ("dq", "rdq"), ("dk", "rdk"), ("dv", "rdv")):
        torch.testing.assert_close(r[a], r[b], **TOL64)


def test_ring_attention_detects_broken_shift():
    # negative control: if shift does not move data around the ring the result must differ
    r = _run_ring(2, "balanced", 2, corrupt=True)
    assert not torch.allclose(r["out"], r["ref"], **TOL64)


def test_ring_attention_rejects_odd_balanced_seq():
    q, k, v = _qkv(lq=5, lk=5)
    with pytest.raises(ValueError):
        ak.ring_attention(q, k, v, scale=1.0, causal=True, cp_size=2, cp_rank=0, balanced=True,
                          shift=lambda ts: ts)


def test_ring_attention_noncausal_cross_lengths():
    # non-causal: q and k/v shards may have different lengths (e.g. cross attention)
    cp, lq, lk = 2, 16, 32  # k shard longer than q shard
    q, _, _ = _qkv(lq=lq, lk=lq, seed=11)
    _, k, v = _qkv(kv_heads=2, lq=lk, lk=lk, seed=12)
    w = torch.randn(B, H, lq, D, dtype=torch.float64)
    ring = Ring(cp)
    iq = [torch.arange(r * lq // cp, (r + 1) * lq // cp) for r in range(cp)]
    ik = [torch.arange(r * lk // cp, (r + 1) * lk // cp) for r in range(cp)]

    def worker(rank):
        ql = q[:, :, iq[rank]].clone().requires_grad_()
        kl, vl = (t[:, :, ik[rank]].clone().requires_grad_() for t in (k, v))
        out = ak.ring_attention(ql, kl, vl, scale=0.3, causal=False, cp_size=cp, cp_rank=rank,
                                balanced=False, shift=ring.shift_for(rank))
        (out * w[:, :, iq[rank]]).sum().backward()
        return out.detach(), ql.grad, kl.grad, vl.grad

    res = ring.run(worker)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = ak._math_attention_with_lse(qa, ka, va, scale=0.3, causal=False)
    (ref * w).sum().backward()
    torch.testing.assert_close(torch.cat([r[0] for r in res], 2), ref.detach(), **TOL64)
    torch.testing.assert_close(torch.cat([r[1] for r in res], 2), qa.grad, **TOL64)
    torch.testing.assert_close(torch.cat([r[2] for r in res], 2), ka.grad, **TOL64)
    torch.testing.assert_close(torch.cat([r[3] for r in res], 2), va.grad, **TOL64)
