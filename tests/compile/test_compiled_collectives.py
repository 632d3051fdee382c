"""A compiled step groups its collectives as the eager step does (docs/compile.md, "Collectives
of a compiled step"): FSDP weights gathered and their gradients reduce-scattered with one flat
collective per layer unit (functional_pp/parallel/fsdp/units.py, traced), data-parallel
gradients all-reduced in buckets (functional_pp/parallel/buckets/, the eager policy). The
communication report counts no more collectives compiled than eager, and the step still
equals one device."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.parallel import buckets
from functional_pp.models import llama
from functional_pp.ops.loss import logits_widened_whole

CFG = llama.Config.tiny(layers=2, hidden=32, heads=4, kv_heads=2, mlp=64, vocab=64)
# (pure FSDP: the gloo test below and tests/compile/test_compile_step.py)
LAYOUTS = {
    "dp": (fpp.Mesh(dp_replicate=2), fpp.Rules(batch="dp_replicate")),
    "fsdp_tp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()),
}


def _train(mesh, rules, compile, processes=False):
    """One SGD step; per device the loss, the gathered parameters and the step's collectives."""
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.5), mesh=mesh,
                          rules=rules, compile=compile)
    full = make_batch(CFG, batch=4, seq=8)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=mesh, rules=rules, seed=0))
        with fpp.use_rules(rules):
            batch = {k: v.data for k, v in local_batch(full, mesh, rules).items()}
        # (eager too the loss as a traced step computes it: the two compare bitwise)
        with fpp.comm_report() as rep, logits_widened_whole():
            state, m = step(state, batch)
        with fpp.use_rules(rules):
            params = fpp.gather_tree(state["params"], llama.init(CFG, torch.float64), rules)
        return float(m["loss"]), params, [(e.kind, e.axes, e.bytes_sent) for e in rep.events]
    return fpp.launch(device, mesh, processes=processes, timeout=1500)


@pytest.fixture(scope="module")
def one_device():
    return _train(fpp.Mesh(), fpp.Rules(), False)[0]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request):
    mesh, rules = LAYOUTS[request.param]
    return request.param, _train(mesh, rules, False), _train(mesh, rules, "aot_eager")


def _assert_equal_params(a, b, rtol=0.0, atol=0.0):
    for (path, x), (_, y) in zip(fpp.leaves_with_paths(a), fpp.leaves_with_paths(b)):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")


def test_compiled_step_issues_no_more_collectives_than_eager_and_equals_one_device(runs, one_device):
    name, eager, compiled = runs
    for (l_e, p_e, ev_e), (l_c, p_c, ev_c) in zip(eager, compiled):
        # grouped like eager: no more collectives, the same weights and gradients moved (a few
        # scalar sums of the step's bookkeeping are float32 compiled, float64 eager)
        assert len(ev_c) <= len(ev_e), (name, len(ev_c), len(ev_e))
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            sent_c, sent_e = (sum(b for k, _, b in ev if k == kind) for ev in (ev_c, ev_e))
            assert sent_c == sent_e if kind != "all_reduce" else sent_c <= sent_e, (name, kind, sent_c, sent_e)
        assert l_c == l_e, name
        _assert_equal_params(p_c, p_e)
        assert abs(l_c - one_device[0]) <= 1e-12
        _assert_equal_params(p_c, one_device[1], rtol=1e-10, atol=1e-12)


def test_fsdp_units_and_buckets_are_one_collective_each_in_the_compiled_step(runs):
    name, eager, compiled = runs
    counts = {}
    for kind, axes, _ in compiled[0][2]:
        counts[kind, axes] = counts.get((kind, axes), 0) + 1
    if name == "dp":       # every gradient in one bucket (25 MB), beside the loss's small sums
        eager_counts = {}
        for kind, axes, _ in eager[0][2]:
            eager_counts[kind, axes] = eager_counts.get((kind, axes), 0) + 1
        assert counts == eager_counts, (counts, eager_counts)
    else:                  # per layer: a gather, a re-gather in backward and a reduce-scatter
        root = 3           # the embedding, the final norm and the LM head: gathered per weight
        assert counts[("all_gather", ("dp_shard",))] == 2 * CFG.layers + root, counts
        assert counts[("reduce_scatter", ("dp_shard",))] == CFG.layers + root, counts


def test_bucket_policy_is_shared_and_checked():
    assert buckets.bucket_capacity(1) == 1024 * 1024
    with pytest.raises(ValueError, match="bucket_mb must be a size in megabytes"):
        fpp.train_step(lambda p, b: None, fpp.optim.sgd(0.1), compile="aot_eager", bucket_mb=-1)


# Real processes: a layout with both (FSDP units over the MLP weights, every other gradient
# all-reduced), compiled, on two gloo processes (torch.distributed's functional collectives)
MIXED = (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard", mlp="dp_shard"))


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_compiled_grouped_collectives_on_gloo_processes_equal_the_simulation():
    mesh, rules = MIXED
    real = _train(mesh, rules, "aot_eager", processes=True)
    sim = _train(mesh, rules, "aot_eager")
    eager = _train(mesh, rules, False)
    for (l_r, p_r, ev_r), (l_s, p_s, ev_s), (_, _, ev_e) in zip(real, sim, eager):
        assert l_r == l_s
        _assert_equal_params(p_r, p_s)
        assert sorted(ev_r) == sorted(ev_s)             # the same grouped collectives
        assert len(ev_r) <= len(ev_e), (len(ev_r), len(ev_e))
        kinds = [k for k, _, _ in ev_r]
        assert kinds.count("reduce_scatter") == CFG.layers        # one per unit
