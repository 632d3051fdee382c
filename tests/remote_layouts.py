"""Tiny checkpoints in the layouts of remote-code models (``trust_remote_code``), written from a
transformers model of the same math, independently of the package's name tables: the oracle of
tests/models/test_remote_code.py and the stand-ins of tests/axolotl_corpus.py.

- Qwen (v1) from a ``Qwen2ForCausalLM`` (modeling_qwen.py's names: ``transformer.h.{i}.attn.c_attn``
  = q, k, v stacked along the rows, ``mlp.w1`` = up, ``mlp.w2`` = gate, ``mlp.c_proj`` = down).
- MiMo from a ``Qwen2ForCausalLM``: its tensors as they are, plus ``model.mtp_layers.{j}`` (random,
  modeling_mimo.py's ``MiMoMTPLayers``: never called by the forward).
- Replit's MPT from an ``MptForCausalLM`` (``ln_1`` / ``ln_2``, ``mlp.mlp_up`` / ``mlp.mlp_down``, ``ln_f``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN_AUTO_MAP = {"AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"}
MIMO_AUTO_MAP = {"AutoConfig": "configuration_mimo.MiMoConfig", "AutoModel": "modeling_mimo.MiMoModel",
                 "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}


def _save(sd: dict, conf: dict, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    return d


def qwen_v1_from_qwen2(model, d: Path, seq_length: int | None = None) -> Path:
    """``model`` (a ``Qwen2ForCausalLM``, one k/v head per head, untied) as Qwen-7B's files in ``d``."""
    c = model.config
    assert c.num_key_value_heads == c.num_attention_heads and not c.tie_word_embeddings
    sd, out = dict(model.state_dict()), {}
    out["transformer.wte.weight"] = sd["model.embed_tokens.weight"]
    out["transformer.ln_f.weight"] = sd["model.norm.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        a, h = f"model.layers.{i}.", f"transformer.h.{i}."
        for t in ("weight", "bias"):
            out[h + f"attn.c_attn.{t}"] = torch.cat([sd[a + f"self_attn.{x}_proj.{t}"] for x in "qkv"])
        out[h + "attn.c_proj.weight"] = sd[a + "self_attn.o_proj.weight"]
        out[h + "ln_1.weight"] = sd[a + "input_layernorm.weight"]
        out[h + "ln_2.weight"] = sd[a + "post_attention_layernorm.weight"]
        out[h + "mlp.w1.weight"] = sd[a + "mlp.up_proj.weight"]          # (a1 = w1(x), times silu(w2(x)))
        out[h + "mlp.w2.weight"] = sd[a + "mlp.gate_proj.weight"]
        out[h + "mlp.c_proj.weight"] = sd[a + "mlp.down_proj.weight"]
    seq = seq_length or c.max_position_embeddings
    conf = dict(architectures=["QWenLMHeadModel"], auto_map=QWEN_AUTO_MAP, model_type="qwen",
                vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads, kv_channels=c.hidden_size // c.num_attention_heads,
                intermediate_size=2 * c.intermediate_size, layer_norm_epsilon=c.rms_norm_eps,
                rotary_emb_base=c.rope_parameters["rope_theta"], rotary_pct=1.0, seq_length=seq,
                max_position_embeddings=4 * seq, use_dynamic_ntk=True, use_logn_attn=True, no_bias=True,
                scale_attn_weights=True, emb_dropout_prob=0.0, attn_dropout_prob=0.0, initializer_range=0.02,
                tie_word_embeddings=False, use_flash_attn="auto", bf16=False, fp16=False, fp32=False,
                tokenizer_class="QWenTokenizer", torch_dtype="float32")
    return _save(out, conf, d)


def mimo_from_qwen2(model, d: Path, mtp_layers: int = 1, seed: int = 0) -> Path:
    """``model`` (a ``Qwen2ForCausalLM``) as MiMo-7B's files in ``d``: its tensors, and ``mtp_layers``
    multi-token-prediction layers of random weights under ``model.mtp_layers.{j}``."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    sd = dict(model.state_dict())
    H, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,), "token_layernorm.weight": (H,),
              "hidden_layernorm.weight": (H,), "final_layernorm.weight": (H,), "input_proj.weight": (H, 2 * H),
              "self_attn.q_proj.weight": (H, H), "self_attn.q_proj.bias": (H,), "self_attn.k_proj.weight": (kv, H),
              "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (H, H), "mlp.gate_proj.weight": (c.intermediate_size, H),
              "mlp.up_proj.weight": (c.intermediate_size, H), "mlp.down_proj.weight": (H, c.intermediate_size)}
    for j in range(mtp_layers):
        for name, shape in shapes.items():
            # (in a dtype of their own: an export copies them with their bits and dtype)
            sd[f"model.mtp_layers.{j}.{name}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    conf = {k: v for k, v in json.loads(c.to_json_string()).items() if not re.match(r"^(transformers_version)$", k)}
    conf.update(architectures=["MiMoForCausalLM"], auto_map=MIMO_AUTO_MAP, model_type="mimo",
                num_nextn_predict_layers=mtp_layers)
    return _save(sd, conf, d)


REPLIT_AUTO_MAP = {"AutoConfig": "configuration_mpt.MPTConfig", "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"}
#: transformers' MptForCausalLM names -> replit-code-v1-3b's (its original Hub files, as ggml's Replit example
#: reads them)
_REPLIT_NAMES = ((r"\.norm_1\.", ".ln_1."), (r"\.norm_2\.", ".ln_2."), (r"\.ffn\.up_proj\.", ".mlp.mlp_up."),
                 (r"\.ffn\.down_proj\.", ".mlp.mlp_down."), (r"^transformer\.norm_f\.", "transformer.ln_f."))


def replit_from_mpt(model, d: Path) -> Path:
    """``model`` (transformers' ``MptForCausalLM``) as replit-code-v1-3b's files in ``d``: Replit's
    module names, the head tied (not stored), ``config.json`` the remote ``MPTForCausalLM``'s."""
    out = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        for pattern, repl in _REPLIT_NAMES:
            k = re.sub(pattern, repl, k)
        out[k] = v
    conf = {k: v for k, v in json.loads(model.config.to_json_string()).items() if k != "transformers_version"}
    conf.update(architectures=["MPTForCausalLM"], auto_map=REPLIT_AUTO_MAP, model_type="mpt",
                norm_type="low_precision_layernorm")
    return _save(out, conf, d)
