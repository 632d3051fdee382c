"""The text decoders of multimodal checkpoints (``Gemma3ForConditionalGeneration``,
``Mistral3ForConditionalGeneration``): ``base_model`` of one loads its ``text_config``'s family
(``gemma3_text``, ``mistral``, Ministral 3's ``ministral3``) from the files' ``language_model.``
tensors, the vision tower and projector left aside (``Config.text_of``); logits of text-only input
equal transformers' whole model's, and export writes the text decoder as its family's class with
the same logits (Mistral Small 4: its ``mistral4`` text decoder). A text family the decoder does not
build (DeepSeek-V4's ``deepseek_v4``) is refused by name."""
import json

import pytest
import torch
from harness import our_logits, tokens

from functional_pp import checkpoint as ck
from functional_pp.checkpoint import hf

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=None, eos_token_id=None, max_position_embeddings=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=16)


def _gemma3():
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=dict(TEXT, sliding_window=4, pad_token_id=0), vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=300, boi_token_index=301, eoi_token_index=302))         # (past the vocabulary)


def _mistral3():
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", pad_token_id=None, sliding_window=None),
        vision_config=dict(VISION, model_type="pixtral", head_dim=16), image_token_index=300))


def _ministral3():          # (Ministral 3: queries scaled past 4 positions, as the published files past 16384)
    rope = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=4, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3)
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=dict(TEXT, model_type="ministral3", pad_token_id=None, rope_parameters=rope),
        vision_config=dict(VISION, model_type="pixtral", head_dim=16), image_token_index=300))


def _mistral4():            # (Mistral Small 4: latent attention, queries scaled past 4 positions, experts)
    rope = dict(rope_type="yarn", rope_theta=1000.0, factor=2.0, original_max_position_embeddings=4, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3)
    text = dict({k: v for k, v in TEXT.items() if k != "head_dim"}, model_type="mistral4", num_key_value_heads=4, pad_token_id=None, rope_parameters=rope,
                moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16)
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=dict(VISION, model_type="pixtral", head_dim=16), image_token_index=300))


@pytest.mark.parametrize("build, family, text_class", [(_gemma3, "gemma3_text", "Gemma3ForCausalLM"),
                                                       (_mistral3, "mistral", "MistralForCausalLM"),
                                                       (_ministral3, "ministral3", "Ministral3ForCausalLM"),
                                                       (_mistral4, "mistral4", "Mistral4ForCausalLM")])
def test_text_decoder_loads_and_exports(build, family, text_class, tmp_path):
    torch.manual_seed(0)
    model = build().float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mm")
    cfg, params = hf.load_hf_llama(tmp_path / "mm")
    wrapper = json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"]
    assert (cfg.model_type, cfg.text_of) == (family, wrapper)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.1
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=1e-5, rtol=1e-5)
    out = hf.save_hf_llama(params, cfg, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["architectures"] == [text_class]
    back = getattr(transformers, text_class).from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert type(back).__name__ == text_class
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, want, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_text_family():
    with pytest.raises(ck.CheckpointMismatchError, match=r"mistral3's text decoder: model_type 'deepseek_v4' is not "
                                                         r"supported \(DeepSeek-V4"):
        hf.config_from_hf({"model_type": "mistral3", "text_config": dict(TEXT, model_type="deepseek_v4")})
    with pytest.raises(ck.CheckpointMismatchError, match=r"HF mistral3 config: text_config=None is not supported: "
                                                         r"config.json has no text_config.*give config.json's "
                                                         r"text_config as published, with its model_type"):
        hf.config_from_hf({"model_type": "mistral3", **TEXT})
    with pytest.raises(ck.CheckpointMismatchError, match=r"config.json has a text_config without model_type"):
        hf.config_from_hf({"model_type": "mistral3", "text_config": dict(TEXT)})
