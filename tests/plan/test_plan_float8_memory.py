"""Float8's memory in the dry-run (docs/planning.md, "Float8's memory"): the fp8 copies torchao's
Float8 linear layers make of a layer matmul's operands, and the layers' weights gathered in fp8."""
import pytest
import torch

from functional_pp.plan.tracker import MemoryTracker


def _product(compiled: bool, float8: bool, float8_all_gather: bool = False, gathered: bool = False,
             after: list | None = None) -> int:
    """Peak bytes of one forward matmul of layer 0, x (4 x 16) @ W^T, W (8 x 16) a parameter (fp32
    master) read as it is or through its 16-bit copy (``gathered``: the FSDP gather stands for it);
    ``after`` gets the bytes live after it."""
    w = torch.zeros(8, 16, dtype=torch.float32 if gathered else torch.bfloat16)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)           # made before: not counted
    with MemoryTracker({"weights": w.nbytes}, [w], compiled=compiled, float8=float8,
                       float8_all_gather=float8_all_gather) as tr:
        tr.layer = 0
        weight = w.to(torch.bfloat16) if gathered else w
        y = torch.mm(x, weight.t())
        tr.layer = None
        if after is not None:
            after.append(tr._current)
    assert y.shape == (4, 8)
    return tr.run.peak_bytes


def test_float8_operands_are_cast_to_fp8_copies_live_during_the_product():
    held, out = 8 * 16 * 2, 4 * 8 * 2                      # the bf16 weight, the product's output
    assert _product(compiled=True, float8=False) == held + out
    # compiled (one fused cast kernel each): 1 byte per element of x (64) and of W (128)
    assert _product(compiled=True, float8=True) == held + 64 + 128 + out
    # eager: torchao's tensor.to(float32) * scale and its clamp (4 + 4 bytes per element) live while
    # the cast is written: at W's, x's fp8 copy + 9 bytes per element of W
    after = []
    assert _product(compiled=False, float8=True, after=after) == held + 64 + 9 * 128
    # eager Float8Linear saves W's fp8 copy for backward (the compiled layer recomputes it)
    assert after == [held + out + 128]
    after = []
    _product(compiled=True, float8=True, after=after)
    assert after == [held + out]


def test_float8_all_gather_holds_the_layers_matrices_in_one_byte():
    master = 8 * 16 * 4
    # float8 alone: the 16-bit copy (256) and its fp8 cast (128) with x's (64) and the output (64)
    assert _product(compiled=True, float8=True, gathered=True) == master + 256 + 128 + 64 + 64
    # gathered in fp8: the copy is 1 byte per element and a forward product reads it as it is
    assert _product(compiled=True, float8=True, float8_all_gather=True, gathered=True) == master + 128 + 64 + 64


def test_float8_all_gather_needs_float8():
    from functional_pp.plan import estimate
    with pytest.raises(ValueError, match="needs float8=True"):
        estimate(lambda p, b: 0, {}, None, None, {}, float8_all_gather=True)


@pytest.mark.parametrize("remat", [False, True])
def test_a_float8_step_frees_every_fp8_copy_by_its_end(remat):
    """A whole step of a small Llama under FSDP, eager (the fp8 weight copies kept for backward,
    or under checkpointing the recomputed ones) and compiled: no fp8 copy outlives the step
    (each kept one is freed by its layer's backward) and eager's casts raise the peak."""
    import functools

    import functional_pp as fpp
    from functional_pp import plan
    from functional_pp.models import llama
    cfg = llama.Config.tiny(layers=2, hidden=64, mlp=512, vocab=64)
    batch = {"tokens": ((4, 32), "batch seq"), "labels": ((4, 32), "batch seq")}
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules(fsdp=True)
    for compiled in (False, True):
        runs = {f8: plan.estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), mesh,
                                  rules, batch, precision="bf16", remat=remat, compiled=compiled, float8=f8[0],
                                  float8_all_gather=f8[1]).runs[-1]
                for f8 in ((False, False), (True, False), (True, True))}
        end = {f8: r.timeline[-1][-1] for f8, r in runs.items()}
        assert len(set(end.values())) == 1, (compiled, end)
        assert runs[True, False].peak_bytes >= runs[False, False].peak_bytes, compiled
        if not compiled and not remat:     # (the peak is in the update; eager without checkpointing goes above)
            assert runs[True, False].peak_bytes > runs[False, False].peak_bytes


def test_search_estimates_each_layout_with_float8_buffers():
    """``plan.search(float8=True)`` (``functional-pp plan --float8``): each layout's memory is the
    dry-run with Float8's buffers, its time costed with Float8."""
    import functools

    from functional_pp import plan
    from functional_pp.models import llama
    cfg = llama.Config.tiny(layers=2, hidden=64, mlp=128, vocab=64)
    batch = {"tokens": ((4, 32), "batch seq"), "labels": ((4, 32), "batch seq")}
    space = plan.Space(remat=(False,), keep_gathered=(False,), cp_attention=("ring",), precision="bf16",
                       max_axis={"tp": 1, "cp": 1, "pp": 1})
    res = plan.search(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), 2, batch, cluster="h100x8",
                      space=space, float8=True, cost_model=functools.partial(plan.cost, float8=True))
    assert res and all(e.settings["float8"] for e in res)


def _weight_gradient(float8: bool) -> tuple[int, int, int]:
    """One layer matmul on real tensors, y = x (64 x 16) @ W^T (W 8 x 16, bf16, trained) and
    its backward (x needs no gradient: one product, W's gradient): the forward's peak, the
    bytes live when backward reaches the product, the peak."""
    w = torch.zeros(8, 16, dtype=torch.bfloat16, requires_grad=True)
    x, g = torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(64, 8, dtype=torch.bfloat16)
    with MemoryTracker({"weights": w.nbytes}, [w], float8=float8) as tr:
        tr.layer = 0
        y = torch.mm(x, w.t())
        forward = tr.run.peak_bytes
        y.backward(g)
    before = next(c for _, name, phase, _, c in tr.run.timeline if phase == "backward")
    return forward, before, tr.run.peak_bytes


def test_eager_float8_keeps_the_weight_copy_and_copies_the_weight_gradients_operands():
    plain, float8 = _weight_gradient(False), _weight_gradient(True)
    # forward: x's cast (9 bytes per element at its end) is the peak; W's fp8 copy (128) is kept
    assert float8[0] == 256 + 9 * 64 * 16
    assert float8[1] == plain[1] + 128
    # backward's product g^T @ x: g's cast and its transposed copy (1 + 1 bytes per element),
    # then x's cast (9 bytes per element at its end)
    assert float8[2] == float8[1] + 2 * 64 * 8 + 9 * 64 * 16
