"""The functional Mamba2 mixer (models/mamba2.py) against transformers' ``NemotronHMamba2Mixer``
(its ``torch_forward`` path: in_proj split into z / xBC / dt, the causal depthwise conv1d, the
chunked SSD scan, the gated RMSNorm over groups, out_proj): fp64 outputs and every gradient, with
several chunks and a padded last chunk; packed documents each as alone; the same under tensor
parallelism sharding the groups with their heads, or the heads of each group, on simulated devices;
the sequence split over cp (balanced or contiguous, packed or not) equal to one device."""
import math

import pytest
import torch

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import mamba2
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
from transformers.models.nemotron_h import modeling_nemotron_h as nh  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, K, CHUNK = 32, 8, 4, 2, 8, 4, 4
M = mamba2.Mamba2(heads=HEADS, head_dim=HEAD_DIM, groups=GROUPS, state=STATE, conv_kernel=K, chunk=CHUNK,
                  dt_limit=(0.0, 0.5), eps=1e-5)


def hf_mixer(seed: int = 0):
    cfg = transformers.NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM,
                                       n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=K, chunk_size=CHUNK,
                                       time_step_limit=(0.0, 0.5), layer_norm_epsilon=1e-5,
                                       layers_block_type=["linear_attention"], vocab_size=64)
    torch.manual_seed(seed)
    mod = nh.NemotronHMamba2Mixer(cfg, layer_idx=0).double()
    with torch.no_grad():                    # every parameter away from its initial value
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5))
        mod.D.add_(1.0)
        mod.norm.weight.add_(1.0)
    return mod.train()


def ours_from_hf(mod) -> dict:
    """Our tree of the HF mixer's tensors (the layout checkpoint import writes, llama_hf's kinds)."""
    G, H, P, N = GROUPS, HEADS // GROUPS, HEAD_DIM, STATE
    inner = HEADS * HEAD_DIM
    z, x, b, c, dt = mod.in_proj.weight.split([inner, inner, G * N, G * N, HEADS])
    cx, cb, cc = mod.conv1d.weight[:, 0].split([inner, G * N, G * N])
    bx, bb, bc = mod.conv1d.bias.split([inner, G * N, G * N])
    return {"z_proj": z.T.reshape(HIDDEN, G, H, P), "x_proj": x.T.reshape(HIDDEN, G, H, P),
            "b_proj": b.T.reshape(HIDDEN, G, N), "c_proj": c.T.reshape(HIDDEN, G, N),
            "dt_proj": dt.T.reshape(HIDDEN, G, H), "conv_x": cx.reshape(G, H, P, K), "conv_b": cb.reshape(G, N, K),
            "conv_c": cc.reshape(G, N, K), "conv_x_bias": bx.reshape(G, H, P), "conv_b_bias": bb.reshape(G, N),
            "conv_c_bias": bc.reshape(G, N), "A_log": mod.A_log.reshape(G, H), "D": mod.D.reshape(G, H),
            "dt_bias": mod.dt_bias.reshape(G, H), "norm": mod.norm.weight.reshape(G, H, P),
            "out_proj": mod.out_proj.weight.T.reshape(G, H, P, HIDDEN)}


def inputs(seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, seq, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(2, seq, HIDDEN, generator=g, dtype=torch.float64))


def _hf_grads(mod) -> dict:
    class View:
        pass
    v = View()
    v.in_proj = type("L", (), {"weight": mod.in_proj.weight.grad})()
    v.conv1d = type("L", (), {"weight": mod.conv1d.weight.grad, "bias": mod.conv1d.bias.grad})()
    v.out_proj = type("L", (), {"weight": mod.out_proj.weight.grad})()
    v.norm = type("L", (), {"weight": mod.norm.weight.grad})()
    v.A_log, v.D, v.dt_bias = mod.A_log.grad, mod.D.grad, mod.dt_bias.grad
    return ours_from_hf(v)


def hf_reference(mod, h, r):
    """transformers' output and gradients, its scan's and gated norm's float32 casts kept in float64
    so the two agree to rounding (with them: ~1e-6)."""
    h = h.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        real = torch.Tensor.float
        mp.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else real(t))
        to = torch.Tensor.to            # (and the gated norm's .to(torch.float32))
        mp.setattr(torch.Tensor, "to", lambda t, *a, **kw: t if t.dtype == torch.float64 and a == (torch.float32,)
                   else to(t, *a, **kw))
        out = mod(h)
    (out * r).sum().backward()
    return out.detach(), h.grad, _hf_grads(mod)


def ours(params: dict, h: torch.Tensor, r: torch.Tensor, mesh=None, rules=None, segments=None):
    """Our mixer's output, the input's gradient and the parameters' (whole), on one device or a mesh."""
    decls = mamba2.init(M, HIDDEN, torch.float64)

    def run():
        with fpp.use_rules(rules or fpp.Rules()):
            rank = fpp.current_rank() if mesh is not None else 0
            local = tree.tree_map(lambda t: t.detach().clone().requires_grad_(),
                                  sharding.shard(params, decls, mesh, rules, rank) if mesh is not None else params)
            named = sharding.named_tree(local, decls)
            hn = fpp.named(h.clone().requires_grad_(), "batch seq hidden")
            seg = None if segments is None else fpp.named(segments, "batch seq")
            out = mamba2.mixer(named, hn, M, seg)
            loss = fpp.ops.sum(out * fpp.named(r, "batch seq hidden"))
            loss.value().backward()
            grads = tree.tree_map(lambda t: t.grad, local)
            full = fpp.gather_tree(grads, decls, rules) if mesh is not None else grads
            return fpp.gather_tree({"o": out}, {"o": fpp.param(tuple(out.shape.values()), out.dims)}, rules)["o"] \
                if mesh is not None else out.value().detach(), full
    return fpp.launch(run, mesh)[0] if mesh is not None else run()


@pytest.mark.parametrize("seq", [10, 3])          # several chunks, the last padded; one short chunk
def test_mixer_equals_transformers_fp64(seq):
    mod = hf_mixer()
    h, r = inputs(seq)
    want_out, _, want_grads = hf_reference(mod, h, r)
    params = ours_from_hf(mod)
    out, grads = ours({k: v.detach() for k, v in params.items()}, h, r)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for k, g in want_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("rules", [dict(ssm_groups="tp"), dict(ssm_group_heads="tp"),
                                   dict(ssm_groups="tp", batch="dp_shard", hidden="dp_shard")])
def test_mixer_tensor_parallel_equals_one_device(rules):
    mod = hf_mixer(seed=2)
    h, r = inputs(10, seed=3)
    params = {k: v.detach() for k, v in ours_from_hf(mod).items()}
    want_out, want = ours(params, h, r)
    mesh = fpp.Mesh(dp_shard=2, tp=2) if "batch" in rules else fpp.Mesh(tp=2)
    out, grads = ours(params, h, r, mesh, fpp.Rules(**rules))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-9, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rules", [dict(seq=fpp.balanced("cp")), dict(seq="cp"),
                                   dict(seq=fpp.balanced("cp"), ssm_group_heads="tp")])
def test_sequence_split_over_cp_equals_one_device(rules, packed):
    """The sequence split over cp (load-balanced: blocks 0 and 3 on device 0, 1 and 2 on device 1; or
    contiguous; with the heads over tp): each device scans its blocks from the state the block before
    ended in (ops/sequence_chain.py), the state's gradient handed back; blocks of 6 in chunks of 4 (a
    padded chunk), packed documents crossing the blocks' boundaries: output and every gradient equal one
    device's."""
    mod = hf_mixer()
    h, r = inputs(24)
    params = {k: v.detach() for k, v in ours_from_hf(mod).items()}
    seg = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [3] * 24]) if packed else None
    want_out, want = ours(params, h, r, segments=seg)
    mesh = fpp.Mesh(cp=2, tp=2) if "ssm_group_heads" in rules else fpp.Mesh(cp=2)
    out, grads = ours(params, h, r, mesh, fpp.Rules(**rules), segments=seg)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for k in want:
        assert want[k].abs().max() > 0, k
        torch.testing.assert_close(grads[k], want[k], rtol=1e-9, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="n_groups=3 must divide the heads"):
        mamba2.Mamba2(heads=8, head_dim=4, groups=3, state=8)
    with pytest.raises(ValueError, match="time_step_limit"):
        mamba2.Mamba2(heads=8, head_dim=4, groups=2, state=8, dt_limit=(1.0, 0.0))
    assert math.isinf(mamba2.Mamba2(heads=8, head_dim=4, groups=2, state=8).dt_limit[1])


def test_packed_documents_each_as_alone():
    """A row of three packed documents (``segments``; one longer than a chunk, one shorter than the
    convolution) equals transformers' mixer on each document alone: outputs and every gradient."""
    mod = hf_mixer(seed=4)
    lengths = [6, 2, 5]
    h, r = inputs(sum(lengths), seed=5)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1).contiguous()
    outs, grads = [], []
    start = 0
    for n in lengths:                                    # transformers, one document at a time
        mod.zero_grad()
        o, _, g = hf_reference(mod, h[:, start:start + n], r[:, start:start + n])
        outs.append(o)
        grads.append(g)
        start += n
    params = {k: v.detach() for k, v in ours_from_hf(mod).items()}
    out, got = ours(params, h, r, segments=seg)
    torch.testing.assert_close(out, torch.cat(outs, dim=1), rtol=1e-10, atol=1e-10)
    for k in got:
        torch.testing.assert_close(got[k], sum(g[k] for g in grads), rtol=1e-9, atol=1e-10,
                                   msg=lambda m, k=k: f"{k}: {m}")
    plain, _ = ours(params, h, r)                       # (and without segments, the documents mix)
    assert (plain - out).abs().max() > 1e-3
