"""What a compiled layer saves for backward (plan/partition.py, ``estimate(compiled=True)``)
against torch.compile itself: our Llama layer compiled with inductor on the CPU, the tensors
its compiled autograd function keeps for backward (``grad_fn.saved_tensors``: what AOTAutograd's
partitioner passes from the forward graph to the backward graph) against the dry-run's replay
of the partitioner on the layer's recorded ops (docs/planning.md, "Compiled layers")."""
import functools
import types

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from functional_pp import ops, plan
from functional_pp.compile.selective import SAVED_OPS
from functional_pp.core.mesh import Mesh
from functional_pp.core.tree import leaves_with_paths, map_with_path
from functional_pp.models import llama
from functional_pp.ops.layer import remat
from functional_pp.parallel.named import wrap
from functional_pp.plan.tracker import MemoryTracker

LAYER = llama.layer.__wrapped_layer__
#: (hidden, heads, kv heads, mlp, batch, seq): torchtitan's 8B block's proportions, scaled down
SHAPES = ((64, 4, 2, 160, 2, 24), (96, 6, 2, 256, 1, 40))
RNG_STATE = torch.get_rng_state().numel()     # checkpoint keeps the CPU generator's state (bytes, not activations)


def _inputs(cfg, batch, seq, dtype, device):
    decls = llama.init(cfg, dtype)["layers"][0]
    g = torch.Generator().manual_seed(0)
    tree = map_with_path(lambda path, d: wrap((torch.randn(d.shape, generator=g) * 0.1).to(dtype).to(device)
                                              .requires_grad_(), d.dims), decls)
    x = wrap(torch.randn(batch, seq, cfg.hidden, generator=g).to(dtype).to(device).requires_grad_(),
             ("batch", "res_seq", "hidden"))
    return tree, x, ops.positions("seq", seq, device=device)


def _policy(ctx, func, *args, **kwargs):
    """torchtitan's way of selective checkpointing under compile: keep the matmuls' and attention's results."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _torchtitan_op_policy():
    """torchtitan's op policy as it writes it (``_custom_policy``): keep what ``_policy`` keeps, except
    every second ``aten.mm`` of the region, counted per run (forward and recomputation)."""
    meta: dict = {}

    def custom(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[key] = meta.get(key, 0) + 1
        second_mm = func == torch.ops.aten.mm.default and meta[key] % 2 == 0
        return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS and not second_mm else CheckpointPolicy.PREFER_RECOMPUTE
    return custom


def _torchtitan_contexts():
    """torchtitan's ``selective_checkpointing_context_fn``: a fresh count for each region."""
    return create_selective_checkpoint_contexts(_torchtitan_op_policy())


def measured(cfg, shape, dtype, mode) -> tuple[int, int]:
    """Bytes torch.compile's layer keeps for backward (parameters and the generator state aside)
    and the eager layer's (autograd's saved tensors), on real CPU tensors."""
    batch, seq = shape[4:]
    tree, x, pos = _inputs(cfg, batch, seq, dtype, "cpu")
    if mode is None:
        body = LAYER
    elif mode == "selective":
        body = lambda *a: checkpoint(LAYER, *a, use_reentrant=False,                   # noqa: E731
                                     context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
    elif mode == "selective_alternate":
        body = lambda *a: checkpoint(LAYER, *a, use_reentrant=False,                   # noqa: E731
                                     context_fn=_torchtitan_contexts)
    else:
        body = lambda *a: checkpoint(LAYER, *a, use_reentrant=False)                    # noqa: E731
    params = {t.data.untyped_storage().data_ptr() for _, t in leaves_with_paths(tree)}
    out = torch.compile(body, backend="inductor", fullgraph=True, dynamic=False)(tree, x, pos, cfg)
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in out.data.grad_fn.saved_tensors
            if t.untyped_storage().data_ptr() not in params and not (t.dtype == torch.uint8 and t.numel() == RNG_STATE)}
    eager: dict = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            eager[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LAYER(tree, x, pos, cfg)
    return sum(kept.values()), sum(eager.values())


def planned(cfg, shape, dtype, mode, needed=None):
    """The dry-run's bytes a compiled layer keeps: the layer run on meta tensors under the tracker
    (selectively checkpointed: after a run without, which tells what backward reads)."""
    if mode in ("selective", "selective_alternate") and needed is None:
        needed = _tracked(cfg, shape, dtype, None).needed_positions
    return _tracked(cfg, shape, dtype, mode, needed).compiled_layer_saved[0]


def _tracked(cfg, shape, dtype, mode, needed=None):
    batch, seq = shape[4:]
    tree, x, pos = _inputs(cfg, batch, seq, dtype, "meta")
    tracker = MemoryTracker({}, [t.data for _, t in leaves_with_paths(tree)], compiled=True, needed=needed,
                            selective=mode if isinstance(mode, str) else "selective")
    tracker.layer = 0
    body = LAYER if mode is None else remat(LAYER, selective=mode if isinstance(mode, str) else False)
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        body(tree, x, pos, cfg)
    return tracker.run


CASES = [(SHAPES[0], torch.float32, None), (SHAPES[0], torch.bfloat16, None), (SHAPES[1], torch.float32, None),
         (SHAPES[1], torch.bfloat16, None), (SHAPES[0], torch.float32, True), (SHAPES[1], torch.bfloat16, True),
         (SHAPES[0], torch.bfloat16, "selective"), (SHAPES[1], torch.float32, "selective"),
         (SHAPES[0], torch.bfloat16, "selective_alternate"), (SHAPES[1], torch.float32, "selective_alternate")]


@pytest.mark.parametrize("shape,dtype,mode", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_the_dry_run_keeps_what_torch_compile_keeps(shape, dtype, mode):
    """Without checkpointing the partitioner recomputes the norms' products, the SiLU, the
    rotary and the residual sums (a fifth of eager's bytes); the dry-run's replay keeps the same
    bytes within 2%. Checkpointed, both keep the layer's input (and positions); selectively
    checkpointed, the policy's matmul and attention results."""
    cfg = llama.Config.tiny(hidden=shape[0], heads=shape[1], kv_heads=shape[2], mlp=shape[3])
    compiled, eager = measured(cfg, shape, dtype, mode)
    got = planned(cfg, shape, dtype, mode)
    assert got == pytest.approx(compiled, rel=0.02), (got, compiled, eager)
    if mode is None:
        assert compiled < 0.85 * eager            # (the test can tell a replay that keeps eager's tensors)


def test_the_estimate_follows_the_compiled_layers():
    """``estimate(compiled=True)``: without checkpointing the peak and the saved activations fall by
    what the partitioner recomputes, about the same for every layer;
    checkpointed layers keep their inputs either way, so the estimate is eager's."""
    cfg = llama.Config.tiny(layers=3)
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16)
    mesh = Mesh(dp_shard=2)
    rules = llama.default_rules(tp=False)
    batch = {k: ((8, 128), "batch seq") for k in ("tokens", "labels")}   # activations over the state
    run = functools.partial(plan.estimate, loss, decls, mesh, rules, batch, precision="bf16", timeline=False)
    eager, compiled = run(), run(compiled=True)
    assert compiled.activation_bytes < 0.85 * eager.activation_bytes
    assert compiled.peak_bytes < eager.peak_bytes
    # (what the compiled layers keep and eager still holds at the peak, the positions, counts once)
    dropped = eager.activation_bytes - compiled.activation_bytes
    assert dropped <= eager.peak_bytes - compiled.peak_bytes <= 1.01 * dropped
    assert compiled.comm.events == eager.comm.events and compiled.flops == eager.flops
    one, two = (r.compiled_layer_saved for r in compiled.runs)
    assert one[0] == two[0]
    assert two[1] == pytest.approx(two[0], rel=0.02)   # (the later layers also keep the rotary tables the first made)
    a, b = run(remat=True), run(remat=True, compiled=True)
    assert (a.peak_bytes, a.activation_bytes) == (b.peak_bytes, b.activation_bytes)
    # selectively checkpointed, the one kept result backward never reads, the last matmul's (added to the
    # residual), is not saved: one bf16 batch x seq x hidden per layer (4 x 128 x 64 per device)
    a, b = run(remat="selective"), run(remat="selective", compiled=True)
    drop = cfg.layers * 4 * 128 * cfg.hidden * 2
    assert (a.peak_bytes - b.peak_bytes, a.activation_bytes - b.activation_bytes) == (drop, drop)


def _saved_per_step(cfg, mesh, rules, batch_shape) -> int:
    """On each gloo process: the bytes the layers of a ``compile="per_layer"`` step keep for backward."""
    import functional_pp as fpp
    from functional_pp import optim
    from functional_pp.parallel.init import init
    from functional_pp.plan.dryrun import Instrumented
    decls = llama.init(cfg, torch.float32)
    loss = Instrumented(functools.partial(llama.loss, cfg=cfg), "layers")     # tells which layer runs
    loss.tracker = types.SimpleNamespace(layer=None, phase=None, begin_forward=lambda: None)
    step = fpp.train_step(loss, optim.adamw(1e-4), mesh=mesh, rules=rules, compile="per_layer")
    with fpp.use_rules(rules):
        state = step.init(init(lambda: decls, mesh=mesh, rules=rules, seed=0))
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, cfg.vocab, (batch_shape[0], batch_shape[1] + 1), generator=g)
        batch = {"tokens": fpp.named(data[:, :-1], "batch seq"), "labels": fpp.named(data[:, 1:], "batch seq")}
    step(state, batch)             # (compiles)
    # the parameters' own storage aside (their shards, which backward gathers again): everything
    # else the compiled layers keep, no gathered weight among it (compile/recompute.py regather_in_backward)
    params = {x.data.untyped_storage().data_ptr() for _, x in leaves_with_paths(state["params"])}
    kept: dict = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and loss.tracker.layer is not None:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(state, batch)
    return sum(kept.values())


def test_a_per_layer_compiled_step_on_gloo_processes_saves_what_the_estimate_says():
    """FSDP over two gloo processes, fp32: the real ``compile="per_layer"`` step's layers keep for
    backward (their compiled functions' saved tensors, through autograd's hooks while a layer
    runs) what the dry-run's compiled layers keep, within 2%: activations and no gathered weight
    (ZeRO-3; a layer's gathered weights, 172.5 kB here, would be 49% over)."""
    import functional_pp as fpp
    cfg = llama.Config.tiny(layers=2, hidden=64, mlp=160)
    mesh, rules, shape = Mesh(dp_shard=2), llama.default_rules(tp=False), (4, 24)
    got = fpp.launch(functools.partial(_saved_per_step, cfg, mesh, rules, shape), mesh, processes=True, timeout=300)
    loss, decls = functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.float32)
    batch = {k: (shape, "batch seq") for k in ("tokens", "labels")}
    est = plan.estimate(loss, decls, mesh, rules, batch, timeline=False, compiled=True)
    layers = sum(est.runs[-1].compiled_layer_saved.values())
    for real in got:
        assert layers == pytest.approx(real, rel=0.02), (layers, real)
