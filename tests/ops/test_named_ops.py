"""Each named op under split layouts equals the same op on one device (values and gradients)."""
import pytest
import torch

import functional_pp as fpp
from functional_pp import ops

MESH = fpp.Mesh(dp_shard=2, tp=2)
RULES = fpp.Rules(batch="dp_shard", hidden="tp", vocab="tp", mlp=("dp_shard", "tp"))


def check(fn, *shapes_dims, mesh=MESH, rules=RULES, rtol=1e-10, values=None):
    """fn(*named inputs) -> named output; compare output and input gradients with one device
    (``values``: the inputs, random by default)."""
    g = torch.Generator().manual_seed(0)
    inputs = values or [torch.randn(shape, generator=g, dtype=torch.float64) for shape, _ in shapes_dims]

    def run():
        xs = [x.clone().requires_grad_() for x in inputs]
        out = fn(*[fpp.named(x, dims) for x, (_, dims) in zip(xs, shapes_dims)])
        w = fpp.named(torch.linspace(-1, 1, _numel(out), dtype=torch.float64)
                      .reshape(tuple(out.shape.values())), list(out.dims))
        loss = ops.sum(out * w)
        value = loss.value()
        value.backward()
        return value.detach(), [x.grad for x in xs]

    ref_loss, ref_grads = run()                       # one device: no launch
    with_rules = lambda: _in_rules(rules, run)        # noqa: E731
    for loss, grads in fpp.launch(with_rules, mesh):
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)


def _numel(x):
    n = 1
    for s in x.shape.values():
        n *= s
    return n


def _in_rules(rules, fn):
    with fpp.use_rules(rules):
        return fn()


X = ((4, 6, 8), "batch seq hidden")


@pytest.mark.parametrize("op", ["sum", "mean", "max", "logsumexp", "softmax"])
def test_reductions_over_split_dims(op):
    f = {"sum": lambda x: ops.sum(x, "hidden"), "mean": lambda x: ops.mean(x, ("batch", "hidden")),
         "max": lambda x: ops.max(x, "hidden"), "logsumexp": lambda x: ops.logsumexp(x, "hidden"),
         "softmax": lambda x: ops.softmax(x, "hidden")}[op]
    check(f, X)


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_split_ties_like_one_device(op):
    """The extreme held three times over a dimension split on tp=2, twice on one half and once
    on the other: every layout gives each tied entry a third of the cotangent, as torch's amax
    on one device (a layout must not change the gradient, ties included)."""
    x = torch.randn(4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sign = 1 if op == "max" else -1
    x[..., [1, 2, 6]] = 5.0 * sign                    # hidden split 4 + 4 over tp
    x[0, 0, 3] = 7.0 * sign                           # (one row with a single extreme)
    f = {"max": lambda v: ops.max(v, "hidden"), "min": lambda v: ops.min(v, "hidden")}[op]
    check(f, X, values=[x])
    check(f, X, values=[x], rules=fpp.Rules(batch="dp_shard", hidden=("dp_shard", "tp")))
    check(lambda v: f(v) if op == "max" else ops.min(v, ("batch", "hidden")), X, values=[x])
    check(lambda v: ops.max(v, ("batch", "hidden")), X, values=[x])


def test_norms_with_split_and_whole_dimension():
    check(lambda x, w: ops.rms_norm(x, w, "hidden"), X, ((8,), "hidden"))
    check(lambda x, w, b: ops.layer_norm(x, w, b, "hidden"), X, ((8,), "hidden"), ((8,), "hidden"))
    check(lambda x, w: ops.rms_norm(x, w, "hidden"), X, ((8,), "hidden"), rules=fpp.Rules(batch="dp_shard"))


def test_broadcasting_by_name_and_einsum_contractions():
    check(lambda x, y: x * y + x / (y * y + 1), X, ((6, 8), "seq hidden"))
    check(lambda x, w: ops.einsum("batch seq hidden, hidden mlp -> batch seq mlp", x, w), X, ((8, 4), "hidden mlp"))
    check(lambda x, w: ops.einsum("batch seq hidden, hidden mlp -> seq mlp", x, w), X, ((8, 4), "hidden mlp"))
    check(lambda x, w: ops.einsum("batch seq hidden, mlp hidden -> batch mlp", x, w), X, ((4, 8), "mlp hidden"))


def test_rename_split_merge_rearrange():
    check(lambda x: ops.rename(x, hidden="vocab"), X)
    check(lambda x: ops.split_dim(x, "hidden", {"heads": 2, "head_dim": 4}), X,
          rules=fpp.Rules(batch="dp_shard", heads="tp"))
    check(lambda x: ops.merge_dims(ops.split_dim(x, "hidden", {"heads": 4, "head_dim": 2}), ("heads", "head_dim"), "hidden"),
          X, rules=fpp.Rules(batch="dp_shard", heads="tp", hidden="tp"))
    check(lambda x: ops.rearrange(x, "batch seq hidden -> seq batch hidden"), X)


def test_embedding_and_vocab_parallel_cross_entropy():
    ids = torch.randint(0, 16, (4, 6))
    labels = torch.randint(0, 16, (4, 6))
    labels[0, :3] = ops.IGNORE_INDEX
    check(lambda t: ops.embed(t, fpp.named(ids, "batch seq")), ((16, 8), "vocab hidden"))
    check(lambda logits: ops.cross_entropy(logits, fpp.named(labels, "batch seq")), ((4, 6, 16), "batch seq vocab"))


def test_cross_entropy_matches_torch():
    logits = torch.randn(4, 6, 16, dtype=torch.float64)
    labels = torch.randint(0, 16, (4, 6))
    labels[1, 2:] = -100
    ours = ops.cross_entropy(fpp.named(logits, "batch seq vocab"), fpp.named(labels, "batch seq")).value()
    torch.testing.assert_close(ours, torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1)))


def test_attention_matches_torch_sdpa_single_device():
    q, k, v = (torch.randn(2, 8, h, 4, dtype=torch.float64) for h in (4, 2, 2))
    out = ops.attention(fpp.named(q, "batch seq heads head_dim"), fpp.named(k, "batch seq kv_heads head_dim"),
                        fpp.named(v, "batch seq kv_heads head_dim"), causal=True, batch="batch", seq="seq",
                        heads="heads", kv_heads="kv_heads", head_dim="head_dim").value()
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_attention_with_the_keys_own_segment_ids():
    """``kv_segments``: queries (the last of the keys, a cache's new token) see the keys of their
    segment only, as SDPA under that mask; without ``segments`` it is refused."""
    q, k, v = torch.randn(2, 1, 4, 4, dtype=torch.float64), *(torch.randn(2, 6, 2, 4, dtype=torch.float64) for _ in "kv")
    qseg, kseg = torch.ones(2, 1, dtype=torch.long), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]])

    def attend(**kw):
        return ops.attention(fpp.named(q, "batch seq heads head_dim"), fpp.named(k, "batch seq kv_heads head_dim"),
                             fpp.named(v, "batch seq kv_heads head_dim"), causal=False, batch="batch", seq="seq",
                             heads="heads", kv_heads="kv_heads", head_dim="head_dim", **kw)
    out = attend(segments=fpp.named(qseg, "batch seq"), kv_segments=fpp.named(kseg, "batch seq")).value()
    mask = (kseg == 1)[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="kv_segments needs segments"):
        attend(kv_segments=fpp.named(kseg, "batch seq"))


def test_rotary_matches_reference_formula():
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    pos = torch.arange(5)
    out = ops.rotary(fpp.named(x, "batch seq heads head_dim"), fpp.named(pos, "seq"), theta=100.0, head_dim="head_dim").value()
    inv = 1.0 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    ang = pos[:, None].double() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    rot = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(out, x * cos.float().double() + rot * sin.float().double())


def test_rotary_with_positions_per_row_equals_each_row_rotated_alone():
    """Positions ``seq batch`` (left-padded rows in generation): row b equals the row rotated by
    its own 1-D positions; the batch split over dp_shard equals one device; a dimension x lacks
    is refused."""
    x = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    shift = torch.tensor([0, 2, 4])
    pos = torch.arange(5)[:, None] - shift[None, :]                     # seq batch

    def rotary(xn, pn):
        return ops.rotary(xn, pn, theta=100.0, head_dim="head_dim")
    out = rotary(fpp.named(x, "batch seq heads head_dim"), fpp.named(pos, "seq batch")).value()
    for b in range(3):
        alone = rotary(fpp.named(x[b:b + 1], "batch seq heads head_dim"), fpp.named(pos[:, b], "seq")).value()
        torch.testing.assert_close(out[b:b + 1], alone, rtol=0, atol=0)
    assert not torch.allclose(out[1], out[0])

    def device():
        with fpp.use_rules(fpp.Rules(batch="dp_shard")):
            return rotary(fpp.named(x, "batch seq heads head_dim"), fpp.named(pos, "seq batch")).value()
    for i, got in enumerate(fpp.launch(device, fpp.Mesh(dp_shard=3))):
        torch.testing.assert_close(got, out[i:i + 1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"only dimensions of x"):
        rotary(fpp.named(x, "batch seq heads head_dim"), fpp.named(pos, "seq rows"))


def test_positions_follow_the_load_balanced_layout():
    def fn():
        with fpp.use_rules(fpp.Rules(seq=fpp.balanced("cp"), res_seq=fpp.inherit("seq", "tp"))):
            return ops.positions("seq", 16).data.tolist(), ops.positions("res_seq", 16).data.tolist()
    out = fpp.launch(fn, fpp.Mesh(cp=2, tp=2))
    assert out[0][0] == [0, 1, 2, 3, 12, 13, 14, 15] and out[2][0] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert out[0][1] == [0, 1, 2, 3] and out[1][1] == [12, 13, 14, 15]


def test_incompatible_layouts_raise():
    def fn():
        with fpp.use_rules(fpp.Rules(hidden="tp")):
            x = fpp.wrap(torch.ones(2, 4), "batch hidden", split=((), ("tp",)))
            return ops.rename(x, hidden="vocab").data
    # renaming to an unsplit name gathers: fine
    assert fpp.launch(fn, fpp.Mesh(tp=2))[0].shape == (2, 8)
    with pytest.raises(TypeError, match="cannot combine a named array with an unnamed tensor of shape"):
        fpp.named(torch.ones(2), "hidden") + torch.ones(2)
    with pytest.raises(ValueError, match="dimension 'hidden' has size 2 and 3"):
        fpp.named(torch.ones(2), "hidden") + fpp.named(torch.ones(3), "hidden")


def test_unreconcilable_layouts_name_the_op_dimension_and_axis():
    def fn():
        with fpp.use_rules(fpp.Rules(batch="tp", hidden="tp")):
            # an explicit layout that splits hidden over tp meets rules that want batch over tp
            x = fpp.wrap(torch.ones(4, 3), "batch hidden", split=((), ("tp",)))
            y = fpp.wrap(torch.ones(4, 6), "batch hidden", split=((), ()))
            return ops.einsum("batch hidden, batch hidden -> batch", x, y)
    out = fpp.launch(fn, fpp.Mesh(tp=2))          # reconcilable: gathered, then re-split by batch
    assert out[0].split == (("tp",),)
    with pytest.raises(fpp.DeviceError, match=r"einsum 'batch hidden -> batch' output: dim 'batch' has "
                                              r"size 3, which is not divisible by its mesh axes \('tp',\)"):
        fpp.launch(_odd_batch, fpp.Mesh(tp=2))


def _odd_batch():
    with fpp.use_rules(fpp.Rules(batch="tp")):
        x = fpp.wrap(torch.ones(3, 2), "batch hidden", split=((), ()))
        return ops.einsum("batch hidden -> batch", x)
