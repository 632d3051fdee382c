"""Expert parallelism derived from a rule: ``experts`` split over mesh axes. A Qwen3-MoE-style
decoder (q/k norms, renormalised top-2 of 4 experts, the auxiliary loss on) equals one device
in loss and every gradient for EP borrowed from the batch's axis, EP on its own ``ep`` axis the
batch also uses x FSDP, EP on an ``ep`` axis the batch does not use (a pending sum) x FSDP,
EP x TP (``mlp`` over ``tp``) and EP borrowed from dp_shard x cp (torchtitan's, with ring attention); three AdamW steps of ``train_step`` give one device's losses and
parameters. The uneven all-to-all and its transpose are exact, the batched simulator refuses it
by name, and the comm report counts the dispatch and the combine at tokens x top_k x hidden x
bytes x (ep-1)/ep each."""
import pytest
import torch
from harness import assert_same_run, make_batch, parallel, single_device, train_steps

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.core.layout import Rules, balanced, block_slices, inherit
from functional_pp.models import llama
from functional_pp.ops.experts import experts
from functional_pp.parallel import collectives as C
from functional_pp.parallel import sharding
from functional_pp.parallel.named import settle

CFG = llama.Config.tiny(model_type="qwen3_moe", qk_norm=True, experts=4, experts_top_k=2, moe_mlp=32,
                        norm_topk_prob=True, router_aux_loss_coef=0.1)
TP = dict(heads="tp", kv_heads="tp", vocab="tp", mlp="tp")
LAYOUTS = {
    "ep_borrows_dp_shard": (fpp.Mesh(dp_shard=2), Rules(batch="dp_shard", experts="dp_shard")),
    "ep_axis_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")),
    "ep_replicated_batch_x_fsdp": (fpp.Mesh(dp_shard=2, ep=2), Rules(batch="dp_shard", experts="ep", hidden="dp_shard")),
    "ep_x_tp": (fpp.Mesh(dp_shard=2, tp=2), Rules(batch="dp_shard", experts="dp_shard", **TP)),
    # torchtitan's borrowing: the experts over dp_shard x cp, the sequence load-balanced over cp
    "ep_borrows_dp_shard_x_cp": (fpp.Mesh(dp_shard=2, cp=2), Rules(batch="dp_shard", seq=balanced("cp"),
                                                                   res_seq=inherit("seq"), experts=("dp_shard", "cp"),
                                                                   hidden=("dp_shard", "cp"))),
}


@pytest.fixture(scope="module")
def oracle():
    full = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = make_batch(CFG, batch=4, seq=8, seed=1)
    return full, batch, single_device(CFG, full, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_device(oracle, layout):
    full, batch, (loss0, grads0) = oracle
    mesh, rules = LAYOUTS[layout]
    results = parallel(CFG, full, batch, mesh, rules)
    for rank, (loss, grads, rep) in enumerate(results):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-9 * g0.abs().max().item(),
                                       msg=lambda m: f"{layout} rank {rank} {p}: {m}")
    moved = results[0][2].bytes("all_to_all")
    assert (moved > 0) == (layout != "ep_replicated_batch_x_fsdp")   # no dispatch where tokens are equal


def test_experts_without_tokens():
    """Every token goes to experts 0 and 1, so the devices holding experts 2 and 3 compute on no
    rows: they still run them, so every device issues the same FSDP re-gathers of the experts
    in backward (a data-dependent count would leave the devices waiting on different
    collectives), and the result and the gradients equal one device's."""
    E, H, F_ = 4, 8, 16
    decls = {"router": fpp.param((H, E), "hidden experts"), "gate": fpp.param((E, H, F_), "experts hidden mlp"),
             "up": fpp.param((E, H, F_), "experts hidden mlp"), "down": fpp.param((E, F_, H), "experts mlp hidden")}
    full = tree.tree_map(lambda t: t.double(), fpp.init_params(decls, seed=0))
    full["router"] = torch.zeros(H, E, dtype=torch.float64)
    full["router"][0] = torch.tensor([3.0, 2.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, H, generator=g, dtype=torch.float64).abs() * torch.tensor([4.0] + [0.1] * (H - 1))

    def run(mesh, rules):
        def device():
            with fpp.use_rules(rules):
                local = tree.tree_map(lambda t: t.clone().requires_grad_(),
                                      sharding.shard(full, decls, mesh, rules, fpp.current_rank()))
                p = sharding.named_tree(local, decls)
                out, stats = experts(fpp.named(x, "batch seq hidden"), p["router"], p["gate"], p["up"], p["down"],
                                     top_k=2)
                (out.value() ** 2).sum().backward()
                grads = fpp.gather_tree(tree.tree_map(lambda t: t.grad, local), decls, rules)
                out = settle(out)
                return out.data, block_slices(tuple(x.shape), out.split, mesh, fpp.current_rank()), grads, \
                    stats.tokens_per_expert()
        return fpp.launch(device, mesh)
    (want, _, grads0, counts), = run(fpp.Mesh(), Rules())
    assert counts.tolist() == [16, 16, 0, 0]
    mesh = fpp.Mesh(dp_shard=2, ep=2)
    for out, region, grads, _ in run(mesh, Rules(batch=("dp_shard", "ep"), experts="ep", hidden="dp_shard")):
        torch.testing.assert_close(out, want[region], rtol=1e-12, atol=1e-12)
        for (p, gr), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(gr, g0, rtol=1e-9, atol=1e-12, msg=p)
    assert grads0["gate"][2:].abs().max() == 0 and grads0["gate"][:2].abs().max() > 0


def test_training_steps_equal_one_device():
    data = [make_batch(CFG, batch=4, seq=8, seed=1)] * 3                 # one batch: the loss falls
    mesh, rules = LAYOUTS["ep_axis_x_fsdp"]
    ours = fpp.launch(train_steps(CFG, data, mesh, rules), mesh)
    one = fpp.launch(train_steps(CFG, data, fpp.Mesh(), Rules()), fpp.Mesh())[0]
    for result in ours:
        assert_same_run(result, one, rtol=1e-9, atol=1e-12)
    assert one[0][0] > one[0][-1]                                     # it trains


def test_uneven_all_to_all_and_its_transpose():
    mesh = fpp.Mesh(dp_shard=3)
    # send[i][j]: rows device i sends to device j (some zero, some to itself)
    send = [[2, 0, 1], [1, 3, 0], [0, 2, 2]]

    def device():
        i = fpp.current_rank()
        x = (torch.arange(sum(send[i]) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * i).requires_grad_()
        recv = [send[j][i] for j in range(3)]
        y = C.all_to_all_v(x, "dp_shard", send[i], recv)
        (y * (torch.arange(y.shape[0], dtype=torch.float64)[:, None] + 1)).sum().backward()
        return y.detach(), x.grad
    out = fpp.launch(device, mesh)
    rows = [torch.arange(sum(s) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * i for i, s in enumerate(send)]
    for i in range(3):
        want = torch.cat([rows[j][sum(send[j][:i]):sum(send[j][:i + 1])] for j in range(3)])
        torch.testing.assert_close(out[i][0], want, rtol=0, atol=0)
    for j in range(3):              # the gradient of each row sent is the weight it got where it went
        grad = torch.cat([torch.arange(sum(send[k][i] for k in range(j)), sum(send[k][i] for k in range(j + 1)),
                                       dtype=torch.float64) + 1 for i in range(3)])
        torch.testing.assert_close(out[j][1][:, 0], grad, rtol=0, atol=0)


def test_batched_simulator_refuses_the_uneven_exchange():
    def device():
        return C.all_to_all_v(torch.ones(2, 3), "dp_shard", [1, 1], [1, 1])
    with pytest.raises(Exception, match=r"does not run on the batched simulator.*simulate=True"):
        fpp.launch(device, fpp.Mesh(dp_shard=2), simulate="batched")


def test_comm_report_counts_the_dispatch_and_the_combine():
    """Balanced routing (token t is one-hot at t mod E, the router sends it to experts t and
    t + 1 mod E): each device's tokens meet every expert equally often, so the rows it sends to
    the other devices are exactly tokens x top_k x (ep-1)/ep."""
    E, H, k, T = 4, 8, 2, 8                      # T tokens per device
    mesh = fpp.Mesh(dp_shard=2)
    ep = 2
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.one_hot(torch.arange(4 * 4) % E, H).double().reshape(4, 4, H)
    router = torch.zeros(H, E, dtype=torch.float64)
    for e in range(E):
        router[e, e], router[e, (e + 1) % E] = 3.0, 2.0
    ws = [torch.randn(E, H, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    down = torch.randn(E, 16, H, generator=g, dtype=torch.float64)
    rules = Rules(batch="dp_shard", experts="dp_shard")

    def device():
        with fpp.use_rules(rules):
            with fpp.comm_report() as rep:
                out, _ = experts(fpp.named(x.clone().requires_grad_(), "batch seq hidden"), fpp.named(router, "hidden experts"),
                                 fpp.named(ws[0].clone().requires_grad_(), "experts hidden mlp"),
                                 fpp.named(ws[1], "experts hidden mlp"), fpp.named(down, "experts mlp hidden"),
                                 top_k=k)
                out.value().sum().backward()
        return [e for e in rep.events if e.kind == "all_to_all" and e.dtype == "float64"]
    formula = T * k * H * 8 * (ep - 1) // ep
    for events in fpp.launch(device, mesh):
        assert [e.bytes_sent for e in events if not e.backward] == [formula, formula]     # dispatch, combine
        assert [e.bytes_sent for e in events if e.backward] == [formula, formula]         # their transposes


def test_dry_run_plans_balanced_routing():
    """plan.estimate runs a MoE step on meta tensors, where the routing is unknown: it plans
    balanced routing, so the all-to-all bytes per MoE layer are the formula (dispatch and
    combine, forward and backward), and the FLOPs count the active experts only."""
    import functools

    from functional_pp import plan
    mesh, rules = LAYOUTS["ep_axis_x_fsdp"]
    batch, seq = 8, 16
    shape = {"tokens": ((batch, seq), "batch seq"), "labels": ((batch, seq), "batch seq")}
    est = plan.estimate(functools.partial(llama.loss, cfg=CFG), llama.init(CFG), mesh, rules, shape)
    tokens = batch * seq // 4                                  # per device: batch over dp_shard x ep
    formula = tokens * CFG.experts_top_k * CFG.hidden * 4 * (2 - 1) // 2
    moved = [e.bytes_sent for e in est.comm.events if e.kind == "all_to_all" and e.dtype == "float32"]
    assert moved == [formula] * 4 * CFG.layers
    dense = llama.flops_per_token(llama.Config.tiny(mlp=CFG.moe_mlp * CFG.experts_top_k), seq)
    router = 3 * 2 * CFG.hidden * CFG.experts * CFG.layers
    assert llama.flops_per_token(CFG, seq) == dense + router


def test_compiled_and_batched_runs_are_refused_by_name(monkeypatch):
    """The routing's shapes are data: traced code (a compiled step) and the batched simulator
    are refused, naming what runs it instead, before any wrong number."""
    import functional_pp.ops.experts as experts_module
    cfg = llama.Config.tiny(layers=1, experts=4, moe_mlp=16)
    data = torch.randint(0, 256, (2, 9))
    params = fpp.init_params(llama.init(cfg), seed=0)

    def loss():
        named = sharding.named_tree(params, llama.init(cfg))
        return llama.loss(named, {"tokens": fpp.named(data[:, :-1], "batch seq"),
                                  "labels": fpp.named(data[:, 1:], "batch seq")}, cfg)
    with pytest.raises(Exception, match=r"does not run on the batched simulator.*--sim-mode threads"):
        fpp.launch(loss, fpp.Mesh(dp_shard=2), simulate="batched")
    monkeypatch.setattr(experts_module, "is_tracing", lambda: True)      # as under torch.compile
    with pytest.raises(RuntimeError, match=r"runs eagerly; compile the step without it \(compile: false"):
        loss()
