"""``functional-pp plan`` of a LoRA / QLoRA config plans the step ``train`` runs: the frozen base
in the compute dtype with no gradient, no optimizer state and no gradient collective (under
FSDP gathered, never reduce-scattered), the adapters trained (fp32 masters + AdamW state), a
4-bit base as its NF4 codes and scales. Oracle: a real simulated step of the same config,
measured (collectives byte for byte, peak memory)."""
from __future__ import annotations

import json

import optree
import pytest
import torch
import yaml

import functional_pp as fpp
from functional_pp.cli import main
from functional_pp.cli.plan import _model, rank_layouts
from functional_pp.config import TrainConfig
from functional_pp.core.layout import local_shape
from functional_pp.core.runtime import current_rank
from functional_pp.core.tree import leaves_with_paths, map_with_path
from functional_pp.models.quantize import quantize_linear_weights
from functional_pp.parallel.named import Named
from functional_pp.parallel.sharding import shard
from functional_pp.plan import Space
from functional_pp.plan.measure import measure

transformers = pytest.importorskip("transformers")

# head_dim 64 and widths of 64: every linear weight holds whole NF4 blocks
HF = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=64, max_position_embeddings=128, tie_word_embeddings=False)
CONFIG = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_linear=True, sequence_len=32,
              micro_batch_size=2, gradient_accumulation_steps=1, bf16=True, optimizer="adamw_torch_fused",
              datasets=[{"path": "unused.jsonl", "type": "alpaca"}])
FSDP2 = Space(fsdp=(("dp_shard",),), sequence_parallel=(False,), regather_activations=(False,), remat=(False,),
              keep_gathered=(False,), cp_attention=("ring",), max_axis={"tp": 1, "cp": 1, "dp_replicate": 1},
              precision="bf16")


def _cfg(base_dir, tmp_path, **kw) -> tuple[TrainConfig, object]:
    path = tmp_path / f"{kw.get('adapter', 'lora') or 'full'}.yaml"
    d = {**CONFIG, "base_model": str(base_dir), **kw}
    if d["adapter"] is None:           # a full fine-tune: no LoRA keys
        d = {k: v for k, v in d.items() if not k.startswith(("lora_", "adapter"))}
    path.write_text(yaml.safe_dump(d))
    return TrainConfig.from_yaml(str(path), []), path


def _quantized_params(lora_decls, mesh, rules):
    """This device's shards of a NF4 base quantized from whole weights (as ``train`` loads a
    Hugging Face base) and the adapters, in their declared dtypes."""

    def make():
        full = optree.tree_map(lambda x: x.data, fpp.init(lambda: lora_decls, seed=0))
        q, decls = quantize_linear_weights(map_with_path(lambda p, x: x.float(), full), lora_decls, "nf4",
                                           double_quant=True)
        q = map_with_path(lambda p, x, d: x.to(d.dtype), q, decls)
        local = shard(q, decls, mesh, rules, current_rank())
        return map_with_path(lambda p, x, d: Named(x.clone(), d.dims, rules.resolve(d.dims, d.shape, mesh, name=p),
                                                    sizes=d.shape, is_param=True), local, decls)
    return make


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_planned_lora_and_qlora_equal_a_real_step(base_dir, tmp_path, kind):
    extra = {"adapter": "qlora", "load_in_4bit": True} if kind == "qlora" else {}
    cfg, _ = _cfg(base_dir, tmp_path, **extra)
    (est,) = rank_layouts(cfg, 2, "h100x8", space=FSDP2)
    loss, decls, trainable = _model(cfg)
    flat = dict(leaves_with_paths(decls))
    assert all(d.dtype == torch.bfloat16 for p, d in flat.items() if ".lora." in f".{p}.")  # declared; fp32 masters
    if kind == "qlora":
        assert any(d.dtype == torch.uint8 for d in flat.values())              # NF4 codes
    batch = {k: ((4, 32), "batch seq") for k in ("tokens", "labels")}
    run, rep, _ = measure(loss, decls, est.mesh, est.rules, batch, precision="bf16", trainable=trainable,
                          params=_quantized_params(_model(_cfg(base_dir, tmp_path)[0])[1], est.mesh, est.rules) if kind == "qlora" else None)
    assert est.comm.by_axis() == rep.by_axis()
    assert abs(est.peak_bytes / run.peak_bytes - 1) < 0.10, (est.memory, run.peak_breakdown)
    # the gradient collectives are the adapters' only: fp32, each adapter reduce-scattered once
    trained = {p for p, t in leaves_with_paths(trainable(decls)) if t}
    assert trained and all(".lora." in f".{p}." for p in trained)
    adapter_elems = sum(torch.Size(flat[p].shape).numel() for p in trained)
    grads = [e for e in est.comm.events if e.backward and e.kind == "reduce_scatter"]
    assert grads and all(e.dtype == "float32" for e in grads)
    assert sum(e.bytes_sent for e in grads) <= adapter_elems * 4 // 2      # at most each adapter's half, fp32
    # state: the frozen base's shards in its own dtypes, the adapters' fp32 masters + gradients + 2 moments
    local = {p: torch.Size(local_shape(d.shape, est.rules.resolve(d.dims, d.shape, est.mesh, p), est.mesh)).numel()
             for p, d in flat.items()}
    frozen = sum(local[p] * d.dtype.itemsize for p, d in flat.items() if p not in trained)
    assert est.state_bytes == pytest.approx(frozen + 16 * sum(local[p] for p in trained), abs=64)


def test_plan_command_counts_adapters(base_dir, tmp_path, capsys):
    """The command on the full, LoRA and QLoRA configs: the planned state shrinks as
    docs/adapters.md's table says (frozen bf16 base, then 4-bit codes)."""
    state = {}
    for kind, extra in [("full", {"adapter": None}), ("lora", {}), ("qlora", {"adapter": "qlora", "load_in_4bit": True})]:
        _, path = _cfg(base_dir, tmp_path, **extra)
        out = tmp_path / f"{kind}.json"
        assert main(["plan", str(path), "--devices", "1", "--json", str(out)]) == 0
        capsys.readouterr()
        state[kind] = json.loads(out.read_text())["layouts"][0]["state_GB"]
    assert state["full"] > 3 * state["lora"] > 3 * state["qlora"] > 0
    # --float8 (the full fine-tune): the same layouts, costed with Float8 linear layers (on a model this
    # small their casts cost more than the matmuls save), their fp8 copies counted; refused on a
    # cluster without FP8
    full, fast = tmp_path / "full.json", tmp_path / "fp8.json"
    assert main(["plan", str(tmp_path / "full.yaml"), "--devices", "1", "--float8", "--json", str(fast)]) == 0
    rows = {r["layout"].replace(" float8", ""): r for r in json.loads(fast.read_text())["layouts"]}
    old = {r["layout"]: r for r in json.loads(full.read_text())["layouts"]}
    assert rows.keys() == old.keys()
    assert all(r["peak_GB"] >= old[k]["peak_GB"] and r["compute_s"] > old[k]["compute_s"] for k, r in rows.items())
    assert main(["plan", str(path), "--devices", "1", "--float8", "--cluster", "a100x8"]) == 2
    assert "'a100x8' has no FP8 matmuls" in capsys.readouterr().err
