"""LLaVA-1.5 (CLIP's vision tower, LLaVA's projector, the text decoder; models/clip.py) equals
transformers' ``LlavaForConditionalGeneration`` on a tiny random checkpoint: logits, fp64 loss and
every gradient, with ``vision_feature_select_strategy`` default (class token dropped) and full;
FSDP, TP and CP on two simulated devices equal one device (DP x FSDP on gloo processes:
tests/models/test_pixtral.py's launch); export loads in transformers."""
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from vision_harness import (assert_logits_equal_hf, assert_loss_and_grads_equal_hf,
                            assert_rows_layout_equals_one_device, config_of, renaming, saved_config, sized_case)

from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.data.images import image_batch
from functional_pp.models import pixtral_hf

transformers = pytest.importorskip("transformers")

IMAGE = 400
TEXT = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=512)
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16, hidden_act="quick_gelu")
COUNTS = [2, 1, 0, 1]                  # images per row (8 x 8 pixels: 4 patches, +1 with the class token)
STARTS = {0: [1, 9], 1: [4], 3: [10]}  # where each row's images' tokens start


def case(strategy):
    """Rows with 4 (default: the class token dropped) or 5 (full) image tokens per image."""
    per = 4 if strategy == "default" else 5
    return sized_case("LlavaForConditionalGeneration", IMAGE, [[(8, 8)] * n for n in COUNTS], 8,
                      {b: [(s, s + per) for s in ss] for b, ss in STARTS.items()}, seq=18, image_sizes=False,
                      patch=4, merge=1, class_token="dropped" if strategy == "default" else "kept", image_size=8)


DEFAULT = case("default")


def save(d, strategy, layer=-2):
    torch.manual_seed(0)
    conf = transformers.LlavaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE,
                                    vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                                    initializer_range=0.2)
    model = transformers.LlavaForConditionalGeneration(conf).eval()
    with torch.no_grad():                       # the norms, biases and embeddings off their initial values
        for n, p in model.named_parameters():
            if p.ndim == 1 or "embedding" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model, saved_config(model, d)


@pytest.fixture(scope="module")
def saved_default(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    model, cfg = save(d, "default")
    return model, d, cfg


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_loss_logits_and_every_gradient_equal_transformers(tmp_path, strategy):
    model, cfg = save(tmp_path, strategy)
    assert (cfg.vision.tower, cfg.vision.feature_layer, cfg.vision.select_strategy) == ("clip", -2, strategy)
    rows = case(strategy)
    # fp64 (atol: transformers' float32 rotary tables)
    assert_logits_equal_hf(rows, rows.hf_model(tmp_path), tmp_path, cfg, atol=1e-5, dtype=torch.float64)
    module = renaming(("language_model.model.", "model.language_model."),
                      ("vision_tower.vision_model.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector."),
                      ("language_model.lm_head.", "lm_head."))
    names = assert_loss_and_grads_equal_hf(rows, tmp_path, cfg, seed=0, rtol=1e-5, scale=1e-6, module=module)
    # (the unused last layer and post_layernorm: not held, and no gradient in transformers)
    assert len(names) == len(list(model.named_parameters())) - 16 - 2
    assert sum(name.startswith("vision_tower.") for name in names) == 5 + 2 * 16    # embeddings, pre_layrnorm,
    # two layers


@pytest.mark.parametrize("layout", ["fsdp", "tp", "cp"])
def test_fsdp_tp_and_cp_equal_one_device(saved_default, layout):
    assert_rows_layout_equals_one_device(DEFAULT, saved_default[1], saved_default[2], layout, seq=17)


def test_export_loads_in_transformers_with_our_logits(saved_default, tmp_path):
    _, d, cfg = saved_default
    params = hf.load_hf_params(d, cfg)
    g = torch.Generator().manual_seed(5)
    moved = tree.tree_map(lambda t: t + 0.01 * torch.randn(t.shape, generator=g), params)
    copied = []
    out = hf.save_hf_llama(moved, cfg, tmp_path / "hf", base_model=d, copied=copied)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlavaForConditionalGeneration"]
    assert raw["vision_config"]["model_type"] == "clip_vision_model"
    assert config_of(raw) == cfg
    loaded, info = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info     # (nothing newly initialised)
    assert sorted(copied) == sorted(f"vision_tower.vision_model.{n}" for n in (
        *(f"encoder.layers.2.{m}.{w}" for m in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2",
                                                *(f"self_attn.{x}_proj" for x in ("q", "k", "v", "out")))
          for w in ("weight", "bias")), "post_layernorm.weight", "post_layernorm.bias"))
    with safe_open(str(d / "model.safetensors"), framework="pt") as b, \
            safe_open(str(out / "model.safetensors"), framework="pt") as e:
        exported = set(e.keys())
        for name in b.keys():                  # every tensor of the checkpoint (transformers 5 saves vision_tower.X)
            ours = name if name in exported else name.replace("vision_tower.", "vision_tower.vision_model.", 1)
            assert ours in exported, name
            if ours in copied:                 # the layers not held: bit for bit
                assert torch.equal(e.get_tensor(ours), b.get_tensor(name)), name
    text_only = dataclasses.replace(cfg, vision=None)
    none = []
    hf.save_hf_llama(hf.load_hf_params(d, text_only), text_only, tmp_path / "text", base_model=d, copied=none)
    assert none == []                          # (another class: nothing of the towers copied)
    loaded.eval()
    ids, pixels = DEFAULT.rows()
    with torch.no_grad():
        want = loaded(**DEFAULT.hf_inputs(ids, pixels)).logits
    torch.testing.assert_close(DEFAULT.logits(moved, cfg, ids, pixels), want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_by_name():
    ids, pixels = DEFAULT.rows()
    with pytest.raises(ValueError, match=r"row 0 holds 8 image tokens \(id 400\) but its 2 images make 10"):
        case("full").entries(ids, pixels)
    with pytest.raises(ValueError, match=r"an image of 8 x 4 pixels; a CLIP tower takes 8 x 8"):
        image_batch(ids[:1], [torch.zeros(1, 3, 8, 8)], [torch.tensor([[8, 4]])], patch=4, merge=1,
                    image_token_id=IMAGE, class_token="dropped", image_size=8)
    with pytest.raises(ValueError, match=r"vision_feature_layer=\[-2, -1\] is not supported"):
        pixtral_hf.vision_from_hf({"model_type": "llava", "vision_feature_layer": [-2, -1],
                                   "vision_config": {"model_type": "clip_vision_model"}})
    with pytest.raises(ValueError, match="vision_config.hidden_act='relu' is not supported"):
        pixtral_hf.vision_from_hf({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model",
                                                                            "hidden_act": "relu"}})


def test_cli_export_of_a_full_fine_tune_copies_the_unheld_layers_and_names_them(tmp_path, capsys):
    """Axolotl's LLaVA-1.5 example as a full fine-tune (one step through ``functional-pp train``), then
    ``functional-pp export``: the summary names the tower's layer after ``vision_feature_layer`` and
    ``post_layernorm`` as copied from base_model unchanged, and transformers loads the export whole."""
    import yaml
    from axolotl_corpus import classify

    from functional_pp import cli
    (tmp_path / "models").mkdir()
    verdict, path, _ = classify("llava/lora-7b.yaml", tmp_path, tmp_path / "models")
    assert verdict == "accepted"
    conf = {k: v for k, v in yaml.safe_load(path.read_text()).items() if not k.startswith(("lora_", "adapter"))}
    conf.update(max_steps=1, val_set_size=0, micro_batch_size=1, gradient_accumulation_steps=1)
    path.write_text(yaml.safe_dump(conf))
    assert cli.main(["train", str(path), "--simulate", "1", "--output", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert "tensors of base_model it does not hold copied unchanged" in said, said
    assert ("18 tensors of base_model it does not hold copied unchanged: vision_tower.vision_model.encoder.layers.1 "
            "(16), vision_tower.vision_model.post_layernorm (2)") in said, said
    _, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
