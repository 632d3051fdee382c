"""Memoised meta kernels (functional_pp/_torch/meta_cache.py): the dry-run answers repeated ops
from memory, and what it estimates is exactly what running every meta kernel estimates."""
import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functional_pp as fpp
from functional_pp import plan
from functional_pp._torch import meta_cache
from functional_pp.models import llama

CFG = llama.Config.tiny(layers=3, hidden=128, mlp=256)
LOSS = functools.partial(llama.loss, cfg=CFG)
BATCH = {"tokens": ((8, 64), "batch seq"), "labels": ((8, 64), "batch seq")}


def _estimate():
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    return plan.estimate(LOSS, llama.init(CFG), mesh, llama.default_rules(sequence_parallel=True), BATCH,
                         precision="bf16", remat="selective", grad_accum=2)


def _fields(est) -> dict:
    out = {f.name: getattr(est, f.name) for f in dataclasses.fields(est)}
    out["comm"] = out["comm"].events          # (the report compares by identity; its events by value)
    return out


def test_memoised_dry_run_equals_every_kernel_run():
    with meta_cache.disabled():
        reference = _fields(_estimate())
    meta_cache.clear()
    first = _fields(_estimate())
    misses = meta_cache.stats["misses"]
    hits = meta_cache.stats["hits"]
    second = _fields(_estimate())
    assert meta_cache.stats["misses"] == misses            # the second run: every memoisable op remembered
    assert meta_cache.stats["hits"] > hits
    for name, value in reference.items():
        assert first[name] == value, name
        assert second[name] == value, name


class _Calls(TorchDispatchMode):
    """A mode that answers through ``call_meta``, as the dry-run's tracker does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return meta_cache.call_meta(func, args, kwargs or {})


def test_repeats_get_fresh_tensors_and_views_stay_views():
    meta_cache.clear()
    x = torch.empty(4, 6, device="meta")
    with _Calls():
        a, b = x * 2, x * 2
        v = x.t()
        s = torch.ops.aten.split.Tensor(x, 2, 1)
        x2 = x.add_(1)
    before = meta_cache.stats["hits"]
    with _Calls():
        c = x * 2
    assert meta_cache.stats["hits"] == before + 1
    for t in (a, b, c):
        assert (t.shape, t.stride(), t.dtype) == ((4, 6), (6, 1), torch.float32)
    storages = {t.untyped_storage()._cdata for t in (x, a, b, c)}
    assert len(storages) == 4                                # a repeat is a new tensor
    # views are never answered from memory: they share the input's storage
    assert v.untyped_storage()._cdata == x.untyped_storage()._cdata and v.stride() == (1, 6)
    assert all(p.untyped_storage()._cdata == x.untyped_storage()._cdata for p in s)
    assert x2 is x


def test_a_repeated_in_place_or_out_op_returns_its_own_argument_without_the_kernel():
    meta_cache.clear()
    x, y = torch.empty(4, 6, device="meta"), torch.empty(6, device="meta")
    out = torch.empty(4, device="meta")
    with _Calls():
        x.add_(y)                                      # remembered: nothing changed, returned self
        torch.logsumexp(x, 1, out=out)                 # remembered: out's metadata as it was
        torch._foreach_mul_([x, y], 2.0)               # remembered: returns nothing
    hits = meta_cache.stats["hits"]
    x3, out3, y3 = torch.empty(4, 6, device="meta"), torch.empty(4, device="meta"), torch.empty(6, device="meta")
    with _Calls():
        assert x3.add_(y3) is x3
        assert torch.logsumexp(x3, 1, out=out3) is out3
        torch._foreach_mul_([x3, y3], 2.0)
    assert meta_cache.stats["hits"] == hits + 3
    with _Calls():                                     # a new shape: the kernel checks it, and refuses
        with pytest.raises(RuntimeError):
            torch.empty(4, 5, device="meta").add_(y3)


def test_an_out_op_that_resizes_its_output_is_run_each_time():
    meta_cache.clear()
    x = torch.empty(4, 6, device="meta")
    with _Calls():
        for _ in range(2):
            out = torch.empty(0, device="meta")
            uncached = meta_cache.stats["uncached"]
            assert torch.logsumexp(x, 1, out=out) is out and out.shape == (4,)
            assert meta_cache.stats["uncached"] == uncached + 1


def test_another_mode_beneath_sees_the_real_op():
    seen = []

    class Beneath(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.empty(3, 5, device="meta")
    with _Calls():
        x.exp()                       # remembered
    with Beneath(), _Calls():
        x.exp()
    assert torch.ops.aten.exp.default in seen and torch.ops.aten.empty_strided.default not in seen
