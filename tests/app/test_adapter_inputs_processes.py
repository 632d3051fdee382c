"""What a LoRA run starts from, on two real gloo processes (FSDP): the frozen Phi-3 base read
slice by slice in bf16 (``bf16: true``), the adapters split out of a peft-made fused adapter
directory (``lora_model_dir``) and its ``modules_to_save`` (``lm_head``) in fp32, each process's
shards equal to the simulated run's (app/inputs.py; docs/adapters.md)."""
import functools

import numpy as np
import pytest
import torch

import functional_pp as fpp

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rms_norm_eps=1e-5, max_position_embeddings=128, pad_token_id=None)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("phi3_inputs")
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**HF)).float()
    model.save_pretrained(d / "base")
    pc = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                         init_lora_weights=False, modules_to_save=["lm_head"])
    pm = peft.get_peft_model(model, pc)
    with torch.no_grad():      # the module trained whole: other values than the base's
        pm.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    pm.save_pretrained(d / "adapter")
    return {"adapter": "lora", "lora_r": 2, "lora_alpha": 4, "base_model": str(d / "base"), "bf16": True,
            "lora_modules_to_save": ["lm_head"],
            "lora_target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
            "lora_model_dir": str(d / "adapter"), "dp_shard_size": 2}


def _device(conf: dict) -> dict:
    from functional_pp.app.inputs import adapter_params, base_params, frozen_and_adapters
    from functional_pp.config import TrainConfig, model_config, model_family
    from functional_pp.core.tree import leaves_with_paths
    cfg = TrainConfig.from_dict(conf)
    cfg.validate(2)
    mesh = cfg.mesh(2)
    rules = cfg.build_rules(mesh)
    family, model_cfg = model_family(cfg), model_config(cfg)
    base_decls = family.param_decls(model_cfg)
    _, decls, _ = frozen_and_adapters(cfg, cfg.lora_config(), None, base_decls)
    params = fpp.adapters.joined(base_params(cfg, model_cfg, base_decls, mesh, rules, None, decls),
                                 adapter_params(cfg, decls, mesh, rules))
    return {p: (str(x.data.dtype), x.data.to(torch.float32).numpy()) for p, x in leaves_with_paths(params)}


def test_base_and_fused_adapter_shards_on_gloo_processes_equal_simulation(run):
    mesh = fpp.Mesh(dp_shard=2)
    real = fpp.launch(functools.partial(_device, run), mesh, processes=True, timeout=300)
    sim = fpp.launch(functools.partial(_device, run), mesh)
    for mine, theirs in zip(real, sim):
        assert mine.keys() == theirs.keys()
        for p, (dtype, x) in mine.items():
            trained = ".lora." in "." + p or p == "lm_head"
            assert dtype == theirs[p][0] == ("torch.float32" if trained else "torch.bfloat16"), p
            assert np.array_equal(x, theirs[p][1]), p
    q, k = real[0]["layers.0.self_attn.lora.q_proj.lora_A"][1], real[0]["layers.0.self_attn.lora.k_proj.lora_A"][1]
    assert np.array_equal(q, k) and np.abs(q).max() > 0           # (one A shared by q, k, v: copies)
    assert not np.array_equal(real[0]["embed_tokens"][1], real[1]["embed_tokens"][1])      # sharded
    # lm_head (modules_to_save) comes from the adapter directory: the base's plus one, in our layout
    base = transformers.Phi3ForCausalLM.from_pretrained(run["base_model"], dtype=torch.float32).lm_head.weight
    want = (base.detach() + 1.0).T.numpy()                                              # ours: [hidden, vocab]
    axis = next(i for i, n in enumerate(real[0]["lm_head"][1].shape) if n != want.shape[i])   # (FSDP's split)
    assert np.array_equal(np.concatenate([r["lm_head"][1] for r in real], axis=axis), want)
