"""QLoRA (adapters/lora.py over quant/ + ops/quantized.py): LoRA adapters on a frozen base whose
linear weights are NF4 (or int8) codes. The oracle: the same LoRA step with the base replaced by
its dequantized weights (one device), and FSDP x 2 equal to one device, with the quantized bytes
(not the weights) all-gathered."""
import functools
import math

import optree
import pytest
import torch
from harness import make_batch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core.tree import map_with_path
from functional_pp.models import llama
from functional_pp.models.quantize import ROW_SCALE, quantize_linear_weights
from functional_pp.parallel import sharding
from functional_pp.quant.weights import QuantizedWeight, dequantize

CFG = llama.Config.tiny()
LC = adapters.LoraConfig(r=4, alpha=8, target_linear=True)
BLOCK = 16          # (the tiny model's head_dim: o_proj's blocks run along it)


def _is_q(x):
    return isinstance(x, QuantizedWeight)


@functools.lru_cache(maxsize=None)
def _case(kind, double_quant=False, cfg=CFG):
    decls = adapters.init(llama.init(cfg), LC)
    g = torch.Generator().manual_seed(1)
    flat = {p: (0.1 * torch.randn(x.data.shape, generator=g) if p.endswith("lora_B") else x.data)
            for p, x in fpp.leaves_with_paths(fpp.init(lambda: decls, seed=0))}
    full = map_with_path(lambda p, d: flat[p], decls)
    qp, qd = quantize_linear_weights(full, decls, kind, block=BLOCK, double_quant=double_quant)
    dq = optree.tree_map(lambda x: dequantize(x) if _is_q(x) else x, qp, is_leaf=_is_q, none_is_leaf=False)
    return decls, qp, qd, dq


def _train(params, decls, data, mesh, rules, cfg=CFG):
    """Two steps; per device the losses, the first step's adapter gradients, the updated
    adapters, the trained paths and the bytes all-gathered in the first forward."""
    loss = adapters.adapt(functools.partial(llama.loss, cfg=cfg), LC)
    step = fpp.train_step(loss, fpp.optim.adamw(1e-2), mesh=mesh, rules=rules, trainable=adapters.trainable(LC))

    def device():
        with fpp.use_rules(rules):
            local = sharding.shard(params, decls, mesh, rules, fpp.current_rank())
            state = step.init(sharding.named_tree(local, decls))
        grads, losses, gathered = None, [], None
        for b in data:
            with fpp.use_rules(rules):
                lb = {k: v.data for k, v in {k: fpp.named(v, "batch seq") for k, v in b.items()}.items()}
            if grads is None:
                with fpp.comm_report() as rep:
                    _, g = step.gradients(state, lb)
                gathered = sum(e.bytes_sent for e in rep.events if e.kind == "all_gather" and not e.backward)
                with fpp.use_rules(rules):
                    grads = adapters.split(fpp.gather_tree(g))[1]
            state, m = step(state, lb)
            losses.append(float(m["loss"]))
        with fpp.use_rules(rules):
            lora = adapters.split(fpp.gather_tree(state["params"], decls, rules))[1]
        trained = [p for p, x in fpp.leaves_with_paths(step.spec.trainable_tree(decls))]
        return losses, grads, lora, trained, gathered, state["params"]
    return fpp.launch(device, mesh)


def _assert_adapters_equal(got, want, linears=7 * CFG.layers, **tol):
    assert got.keys() == want.keys() and len(want) == linears
    for p in want:
        for k in ("lora_A", "lora_B"):
            torch.testing.assert_close(got[p][k], want[p][k], msg=lambda m: f"{p}.{k}: {m}", **tol)


DATA = [make_batch(CFG, batch=4, seq=8, seed=3)] * 2      # (one batch twice: the loss falls)


@pytest.mark.parametrize("kind, double_quant", [("nf4", True), ("nf4", False), ("int8", False)])
def test_qlora_step_equals_lora_on_the_dequantized_base(kind, double_quant):
    decls, qp, qd, dq = _case(kind, double_quant)
    q = _train(qp, qd, DATA, fpp.Mesh(), fpp.Rules())[0]
    ref = _train(dq, decls, DATA, fpp.Mesh(), fpp.Rules())[0]
    assert q[0] == pytest.approx(ref[0], rel=1e-6) and q[0][1] < q[0][0]
    _assert_adapters_equal(q[1], ref[1], rtol=1e-5, atol=1e-7)
    _assert_adapters_equal(q[2], ref[2], rtol=1e-5, atol=1e-7)
    # only the adapters train; the frozen base stays codes (no fp32 master copy, untouched)
    assert q[3] and all(".lora." in p for p in q[3])
    base = adapters.split(q[5])[0]
    codes = [x for x in optree.tree_leaves(base, is_leaf=_is_q, none_is_leaf=False) if _is_q(x)]
    assert len(codes) == 7 * CFG.layers
    want_codes = [x for x in optree.tree_leaves(qp, is_leaf=_is_q, none_is_leaf=False) if _is_q(x)]
    for a, b in zip(codes, want_codes):
        assert a.codes.data.dtype in (torch.uint8, torch.int8) and torch.equal(a.codes.data, b.codes)


def test_qlora_of_the_new_families_switches_equals_lora_on_the_dequantized_base():
    """GPT-NeoX / Phi's switches (LayerNorms with biases, a GELU MLP that is not gated: six
    linear weights a layer, biases kept in full precision, partial rotary, an LM-head bias)."""
    cfg = llama.Config.tiny(parallel_block=True, parallel_mlp_norm=True, norm_kind="layer", norm_bias=True,
                            mlp_gated=False, mlp_bias=True, mlp_act="gelu", partial_rotary_factor=0.5, qkv_bias=True,
                            o_bias=True, lm_head_bias=True)
    decls, qp, qd, dq = _case("nf4", True, cfg)
    q = _train(qp, qd, DATA, fpp.Mesh(), fpp.Rules(), cfg)[0]
    ref = _train(dq, decls, DATA, fpp.Mesh(), fpp.Rules(), cfg)[0]
    assert q[0] == pytest.approx(ref[0], rel=1e-6) and q[0][1] < q[0][0]
    _assert_adapters_equal(q[2], ref[2], 6 * cfg.layers, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_fsdp_equals_one_device_and_gathers_the_quantized_bytes(kind):
    """(NF4 with double quantization: the tiny model's scales are double-quantized one block per
    row, a last dimension of size 1 that stays whole (models.quantize.ROW_SCALE) while FSDP
    splits the weight's)"""
    decls, qp, qd, dq = _case(kind, kind == "nf4")
    mesh, rules = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
    one = _train(qp, qd, DATA, fpp.Mesh(), fpp.Rules())[0]
    runs = _train(qp, qd, DATA, mesh, rules)
    for run in runs:
        assert run[0] == pytest.approx(one[0], rel=1e-5)
        _assert_adapters_equal(run[2], one[2], rtol=1e-4, atol=1e-6)
    full = _train(dq, decls, DATA, mesh, rules)[0]
    # the base's weights move as codes and scales (each device sends its half of each split
    # component): the forward's all-gathers carry exactly those bytes in place of the fp32 weights
    paths, leaves, _ = optree.tree_flatten_with_path(qp, is_leaf=_is_q, none_is_leaf=False)
    qs = [(".".join(map(str, p)), x) for p, x in zip(paths, leaves) if _is_q(x)]
    comp = dict(fpp.leaves_with_paths(qd))
    sent = sum(c.numel() * c.element_size() for p, x in qs for i, c in enumerate(x) if c is not None
               and any(rules.resolve(comp[f"{p}.{i}"].dims, comp[f"{p}.{i}"].shape, mesh))) // 2
    weights = sum(4 * math.prod(x.shape) for _, x in qs) // 2
    assert runs[0][4] == full[4] - weights + sent and weights - sent > full[4] / 3
    if kind == "nf4":           # (some double-quantized scales kept whole, one per row)
        assert any(comp[f"{p}.2"].dims[-1] == ROW_SCALE for p, _ in qs)
