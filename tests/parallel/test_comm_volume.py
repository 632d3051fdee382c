"""Communication per step equals the analytic formulas of docs/communication.md, byte for byte.

Per device, ring algorithms, B bytes per element (fp64 here: B = 8). Where the code moves a
different amount than a formula, the reason is stated next to the assertion."""
import pytest
import torch
from harness import make_batch, parallel

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny()
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
P = fpp.count_params(llama.init(CFG))
B = 8
BATCH, SEQ = 8, 16
DATA = make_batch(CFG, batch=BATCH, seq=SEQ)
H, L = CFG.hidden, CFG.layers
H_KV = CFG.kv_heads * CFG.dim_head
EMB = CFG.vocab * CFG.hidden
R = fpp.Rules


def report(mesh_kw, rules, **options):
    mesh = fpp.Mesh(**mesh_kw)
    results = parallel(CFG, FULL, DATA, mesh, rules, options=options, gather=False)
    reps = [rep for _, _, rep in results]
    # every device of these symmetric layouts sends the same bytes
    assert len({r.total_bytes for r in reps}) == 1
    return reps[0]


def numel(e):
    n = 1
    for s in e.shape:
        n *= s
    return n


def test_dp_gradient_all_reduce():
    n = 4
    rep = report(dict(dp_replicate=n), R(batch="dp_replicate"))
    grads = [e for e in rep.events if numel(e) > 1]
    assert all(e.kind == "all_reduce" and e.backward for e in grads)
    assert sum(e.bytes_sent for e in grads) == 2 * (n - 1) * P * B // n
    # besides: the loss sum and the token count, one scalar each
    assert [e.shape for e in rep.events if numel(e) == 1] == [(), ()]


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_fsdp(keep_gathered):
    n = 4
    rep = report(dict(dp_shard=n), R(batch="dp_shard", hidden="dp_shard"), keep_gathered=keep_gathered)
    fwd_gather = rep.bytes("all_gather", "dp_shard", backward=False)
    bwd_gather = rep.bytes("all_gather", "dp_shard", backward=True)
    scatter = rep.bytes("reduce_scatter", "dp_shard")
    assert fwd_gather == (n - 1) * P * B // n
    assert scatter == (n - 1) * P * B // n
    if keep_gathered:
        assert bwd_gather == 0                                   # 2(n-1)/n P B in all
    else:
        # 3(n-1)/n P B, less the embedding table: an embedding's backward needs only the
        # indices, so its gathered table is never needed again and is not re-gathered.
        assert bwd_gather == (n - 1) * (P - EMB) * B // n
    assert all(numel(e) == 1 for e in rep.events if e.kind == "all_reduce")   # loss, token count


def test_hsdp():
    f, r = 2, 2
    rep = report(dict(dp_replicate=r, dp_shard=f), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard"))
    shard_bytes = rep.bytes("all_gather", "dp_shard") + rep.bytes("reduce_scatter", "dp_shard")
    assert shard_bytes == 3 * (f - 1) * P * B // f - (f - 1) * EMB * B // f   # embedding: see test_fsdp
    replicate = [e for e in rep.events if e.axes == ("dp_replicate",) and numel(e) > 1]
    # the replicate all-reduce runs on the reduce-scattered shards: 2(r-1)/r (P/f) B
    assert sum(e.bytes_sent for e in replicate) == 2 * (r - 1) * (P // f) * B // r


def test_tp_megatron():
    t = 2
    rep = report(dict(tp=t), llama.default_rules(fsdp=False))
    b, s = BATCH, SEQ
    act = [e for e in rep.events if e.shape == (b, s, H)]
    assert all(e.kind == "all_reduce" and e.axes == ("tp",) for e in act)
    per_layer = 8 * (t - 1) * b * s * H * B // t
    # plus the vocab-parallel embedding's sum (forward) and the LM head's f (backward)
    extra = 2 * (2 * (t - 1) * b * s * H * B // t)
    assert sum(e.bytes_sent for e in act) == L * per_layer + extra
    # the vocab-parallel loss reduces only per-token scalars (max, sum of exponentials, label logit)
    assert {e.shape for e in rep.events if e not in act and e.axes == ("tp",)} == {(b, s), (b, s, 1)}


def test_tp_sequence_parallel():
    t = 2
    rep = report(dict(tp=t), llama.default_rules(fsdp=False, sequence_parallel=True))
    b, s = BATCH, SEQ
    act = [e for e in rep.events if e.kind in ("all_gather", "reduce_scatter")]
    assert {e.shape for e in act} == {(b, s // t, H), (b, s, H)}
    per_layer = 8 * (t - 1) * b * s * H * B // t          # same volume as Megatron TP
    extra = 4 * ((t - 1) * b * s * H * B // t)             # embedding scatter, final gather, and their transposes
    assert sum(e.bytes_sent for e in act) == L * per_layer + extra
    norm_grads = [e for e in rep.events if e.kind == "all_reduce" and e.shape == (H,)]
    assert len(norm_grads) == 2 * L + 1                    # norm weights meet tp-split activations


def _kv_events(rep, kind):
    c_local = SEQ // 4
    return [e for e in rep.events if e.kind == kind and e.axes == ("cp",)
            and e.shape == (BATCH, CFG.kv_heads, c_local, CFG.dim_head)]


def test_cp_allgather():
    c = 4
    rep = report(dict(cp=c), R(seq="cp"), cp_attention="allgather")
    per_layer = (c - 1) * 2 * BATCH * SEQ * H_KV * B // c
    assert sum(e.bytes_sent for e in _kv_events(rep, "all_gather")) == L * per_layer
    scatter = [e for e in rep.events if e.kind == "reduce_scatter"]
    assert sum(e.bytes_sent for e in scatter) == L * per_layer           # the same again, backward
    grads = [e for e in rep.events if e.kind == "all_reduce" and numel(e) > 1]
    assert sum(e.bytes_sent for e in grads) == 2 * (c - 1) * P * B // c   # weights replicated over cp


def test_cp_ring():
    c = 4
    rep = report(dict(cp=c), R(seq="cp"))
    per_layer = (c - 1) * 2 * BATCH * SEQ * H_KV * B // c
    fwd = [e for e in rep.events if e.kind == "permute" and not e.backward]
    assert sum(e.bytes_sent for e in fwd) == L * per_layer             # c-1 permutes of K and V
    # Backward passes K and V around again (c-1 permutes, recomputing instead of keeping every
    # block) and sends the travelling dK/dV accumulators c times: (2c-1)/(c-1) x the forward.
    bwd = [e for e in rep.events if e.kind == "permute" and e.backward]
    assert sum(e.bytes_sent for e in bwd) == L * per_layer * (2 * c - 1) // (c - 1)
