"""DoRA (``LoraConfig(dora=True)``, peft's ``use_dora``) against peft + transformers: a tiny random
Llama built from a config, the same adapters (B nonzero, magnitudes off the weights' norms), fp32:
the loss, every adapter gradient (the magnitudes' included) and the adapters after one AdamW step
equal peft's; the magnitudes' initialisation equals peft's; DP, FSDP, TP and FSDP x TP (simulated)
equal one device; the PEFT directory loads in ``peft`` and the merged model in ``transformers``
with logits equal to ours (docs/adapters.md "DoRA")."""
import functools

import pytest
import torch
import torch.nn.functional as F
from harness import assert_adapter_layouts_equal_one_device, make_batch, train_adapters

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.adapters import peft_dir
from functional_pp.checkpoint import hf
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

HF = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LC = adapters.LoraConfig(r=4, alpha=8, target_modules=TARGETS, dora=True)
LR, WD = 1e-2, 0.1


def _names(sd):
    """peft's parameter names -> its adapter file's (no adapter name, the magnitude without .weight)."""
    return {k.replace(".default", "").replace("lora_magnitude_vector.weight", "lora_magnitude_vector"): v
            for k, v in sd.items()}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS),
                                                    use_dora=True))
    init_magnitudes = {k: v.clone() for k, v in get_peft_model_state_dict(pm).items() if "magnitude" in k}
    with torch.no_grad():             # B nonzero: A's gradients and the norms' dependence on B are exercised
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("dora")
    pm.get_base_model().config.save_pretrained(d)
    from safetensors.torch import save_file
    save_file(base_state, str(d / "model.safetensors"))
    cfg = hf.config_from_hf(d)
    decls = adapters.init(llama.init(cfg), LC)
    base = hf.load_hf_params(d, cfg)
    full = adapters.joined(base, peft_dir.from_peft({k: v.detach().clone() for k, v in
                                                     get_peft_model_state_dict(pm).items()}, decls))
    return pm, cfg, decls, full, d, init_magnitudes


def test_loss_gradients_and_update_equal_peft(case):
    pm, cfg, decls, full, _, _ = case
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    losses, grads, new = train_adapters(cfg, LC, decls, full, [batch], fpp.Mesh(), fpp.Rules(), LR, WD)[0]
    logits = pm(input_ids=batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    ref.backward()
    params = [p for p in pm.parameters() if p.requires_grad]
    ref_grads = _names({k: p.grad.clone() for k, p in pm.named_parameters() if p.requires_grad})
    torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD).step()
    ref_new = _names({k: p.detach() for k, p in pm.named_parameters() if p.requires_grad})
    assert losses[0] == pytest.approx(ref.item(), rel=1e-5)
    ours_grads, ours_new = peft_dir.to_peft(grads), peft_dir.to_peft(new)
    assert ours_grads.keys() == ref_grads.keys() and len(ref_grads) == 3 * len(TARGETS) * cfg.layers
    for k in ref_grads:
        assert ref_grads[k].abs().max() > 0, k
        torch.testing.assert_close(ours_grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")
        torch.testing.assert_close(ours_new[k], ref_new[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"new {k}: {m}")


def test_magnitudes_initialised_as_peft(case):
    """peft sets each magnitude to ||W|| (B zero); init_magnitudes from our (FSDP x TP) shards too."""
    _, cfg, decls, full, _, want = case
    base, lora = adapters.split(full)
    zero_b = adapters.joined(base, {p: {**ab, "lora_B": torch.zeros_like(ab["lora_B"]),
                                        "lora_magnitude": torch.ones_like(ab["lora_magnitude"])}
                                    for p, ab in lora.items()})
    mesh, rules = fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()

    def device():
        with fpp.use_rules(rules):
            named = sharding.named_tree(sharding.shard(zero_b, decls, mesh, rules, fpp.current_rank()), decls)
            return adapters.split(fpp.gather_tree(adapters.init_magnitudes(named, LC), decls, rules))[1]
    for got in fpp.launch(device, mesh):
        got = {k: v for k, v in peft_dir.to_peft(got).items() if "magnitude" in k}
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_every_layout_equals_one_device(case):
    _, cfg, _, full, _, _ = case
    assert_adapter_layouts_equal_one_device(cfg, LC, full)


def test_peft_directory_and_merged_model_give_our_logits(case, tmp_path):
    pm, cfg, decls, full, d, _ = case
    tokens = make_batch(cfg, batch=2, seq=12, seed=5)["tokens"]
    with torch.no_grad():
        ours = adapters.adapt(llama.forward, LC)(sharding.named_tree(full, decls), fpp.wrap(tokens, "batch seq"),
                                                 cfg).value()
        out = peft_dir.save_adapter(tmp_path / "adapter", adapters.split(full)[1], LC, str(d))
        base = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
        assert loaded.peft_config["default"].use_dora
        torch.testing.assert_close(loaded(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        hf.save_hf_llama(adapters.merge(full, LC), cfg, tmp_path / "merged")
        plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                              attn_implementation="eager")
        torch.testing.assert_close(plain(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        # the adapter directory reads back as the same adapters
        conf = peft_dir.read_config(out)
        assert conf.dora and sorted(conf.target_modules) == sorted(TARGETS) and conf.scale == LC.scale
        back = peft_dir.load_adapter(out, decls)
        for p, ab in adapters.split(full)[1].items():
            for k in ab:
                assert torch.equal(back[p][k], ab[k]), (p, k)


def test_tp_norm_costs_one_output_sized_all_reduce_per_row_parallel_weight():
    """Under TP the DoRA norms of the row-parallel weights (o_proj, down_proj: input split over
    tp) are completed by one all-reduce each of a ``hidden``-sized vector; the column-parallel
    ones need none; the rest of the step's collectives are LoRA's."""
    cfg = llama.Config.tiny(layers=1)
    mesh, rules = fpp.Mesh(tp=2), llama.default_rules(fsdp=False)
    batch = make_batch(cfg, batch=2, seq=8, seed=0)

    def events(lc):
        decls = adapters.init(llama.init(cfg), lc)
        step = fpp.train_step(adapters.adapt(functools.partial(llama.loss, cfg=cfg), lc), fpp.optim.adamw(1e-2),
                              mesh=mesh, rules=rules, trainable=adapters.trainable(lc))

        def device():
            with fpp.use_rules(rules):
                params = adapters.init_magnitudes(fpp.init(lambda: decls, mesh=mesh, rules=rules, seed=0), lc)
                lb = {k: fpp.named(v, "batch seq").data for k, v in batch.items()}
            state = step.init(params)
            with fpp.comm_report() as rep:
                step.gradients(state, lb)
            return [(e.kind, e.backward, e.bytes_sent) for e in rep.events]
        return fpp.launch(device, mesh)[0]
    lora = events(adapters.LoraConfig(r=4, alpha=8, target_linear=True))
    dora = events(adapters.LoraConfig(r=4, alpha=8, target_linear=True, dora=True))
    extra = list(dora)
    for e in lora:
        extra.remove(e)
    assert extra == [("all_reduce", False, 4 * cfg.hidden)] * 2
