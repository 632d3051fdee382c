"""Frozen parameters (TrainStep(trainable=...)): no gradient, no optimizer state and no
gradient collective for them; under FSDP still sharded and gathered per layer (their own
units), never reduce-scattered; every layout equals one device (docs/adapters.md)."""
import functools

import pytest
import torch
from harness import assert_same_run, local_batch, make_batch

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=8, seq=16, seed=i) for i in range(2)]
TRAINS = fpp.optim.mask_by_path(lambda path, x: "mlp" in path or path[-1] == "norm")   # the rest frozen


def _trains(path: str) -> bool:
    return ".mlp." in path or path == "norm"


def _run(mesh, rules, trainable=TRAINS, **kw):
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(3e-3, weight_decay=0.1),
                          mesh=mesh, rules=rules, trainable=trainable, **kw)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=mesh, rules=rules, seed=0))
        n_state = len(fpp.leaves_with_paths(state["opt_state"]))
        losses, events = [], []
        for b in DATA:
            with fpp.use_rules(rules):
                local = {k: v.data for k, v in local_batch(b, mesh, rules).items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            losses.append(m["loss"])
            events.append(rep.events)
        with fpp.use_rules(rules):
            full = fpp.gather_tree(state["params"], llama.init(CFG, torch.float64), rules)
        return losses, {p: x.numpy() for p, x in fpp.leaves_with_paths(full)}, events, n_state
    return fpp.launch(device, mesh)


@pytest.fixture(scope="module")
def one():
    return _run(fpp.Mesh(), fpp.Rules())[0]


def test_frozen_leaves_keep_their_values_and_get_no_state(one):
    init = fpp.init(llama.init, CFG, torch.float64, seed=0)
    start = {p: x.data for p, x in fpp.leaves_with_paths(init)}
    n_trained = sum(_trains(p) for p in start)
    assert 0 < n_trained < len(start)
    for p, x in one[1].items():
        same = torch.equal(torch.from_numpy(x), start[p])
        assert same != _trains(p), p
    # AdamW state: mu and nu of the trained leaves only (and the step count)
    assert one[3] == 2 * n_trained + 1


@pytest.mark.parametrize("name, mesh, rules", [
    ("dp", fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard")),
    ("fsdp", fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)),
    ("tp", fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
    ("fsdp_tp", fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()),
    ("fsdp_remat", fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)),
])
def test_every_layout_equals_one_device_with_no_reduction_of_frozen_grads(one, name, mesh, rules):
    kw = {"remat": True} if name.endswith("remat") else {}
    runs = _run(mesh, rules, **kw)
    for r in runs:
        assert_same_run(r[:3], one[:3], rtol=1e-9, atol=1e-11)
    events = runs[0][2][0]
    reductions = [e for e in events if e.backward and e.kind in ("all_reduce", "reduce_scatter") and e.shape != ()]
    full = _run(mesh, rules, trainable=None, **kw)[0][2][0]
    full_reductions = [e for e in full if e.backward and e.kind in ("all_reduce", "reduce_scatter") and e.shape != ()]
    data = ("dp_shard",)
    ours = sum(e.bytes_sent for e in reductions if e.axes == data)
    theirs = sum(e.bytes_sent for e in full_reductions if e.axes == data)
    if name == "tp":
        assert ours == theirs == 0
        return
    # the gradient reductions over the data axis carry the trained parameters' gradients only
    P = {p: x.size for p, x in one[1].items()}
    trained = sum(n for p, n in P.items() if _trains(p))
    total = sum(P.values())
    tp = mesh.shape.get("tp", 1)
    assert 0 < ours < theirs
    if name == "dp":     # all-reduce of every trained gradient: 2 (n-1)/n bytes each
        assert ours == 2 * (2 - 1) * trained * 8 // 2 and theirs == 2 * (2 - 1) * total * 8 // 2
    if name.startswith("fsdp"):   # frozen weights are still gathered per layer, never reduce-scattered
        gathers = [e for e in events if e.kind == "all_gather" and e.axes == data and len(e.shape) == 1]
        assert len(gathers) >= 2 * 2 * CFG.layers // tp   # per layer a frozen and a trained unit, fwd + bwd
        assert all(e.kind != "reduce_scatter" or e.shape[0] * 2 <= trained for e in reductions)


def test_nothing_trainable_is_refused():
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3),
                          trainable=fpp.optim.mask_by_path(lambda path, x: False))
    with pytest.raises(Exception, match="no parameter is trainable"):
        fpp.launch(lambda: step.init(fpp.init(llama.init, CFG, seed=0)), fpp.Mesh())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_bf16_frozen_base_stays_bf16_and_trains_as_its_fp32_copy(precision):
    """Frozen parameters keep their dtype in the state (no fp32 master copy: half the bytes of
    a bf16 base); the step sees them in the compute dtype exactly as it saw the fp32 copy of the
    same bf16 values, so both runs agree bitwise (bf16 and fp32 compute)."""
    def run(frozen_dtype):
        step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(3e-3), trainable=TRAINS,
                              precision=precision)

        def device():
            params = fpp.init(llama.init, CFG, torch.float32, seed=0)
            params = fpp.core.tree.map_with_path(
                lambda p, x: x if _trains(p) else x.replace(data=x.data.to(torch.bfloat16).to(frozen_dtype)), params)
            state = step.init(params)
            dtypes = {p: x.dtype for p, x in fpp.leaves_with_paths(state["params"])}
            losses = []
            for b in DATA:
                state, m = step(state, {k: v.data for k, v in local_batch(b, fpp.Mesh(), fpp.Rules()).items()})
                losses.append(m["loss"])
            return losses, dtypes, {p: x.clone() for p, x in fpp.leaves_with_paths(state["params"])}
        return fpp.launch(device, fpp.Mesh())[0]
    (l16, d16, p16), (l32, d32, p32) = run(torch.bfloat16), run(torch.float32)
    assert {p: d for p, d in d16.items() if not _trains(p)} == {p: torch.bfloat16 for p in d16 if not _trains(p)}
    assert all(d == torch.float32 for p, d in d16.items() if _trains(p))
    assert l16 == l32
    for p in p32:
        assert torch.equal(p16[p].float(), p32[p]), p
