"""Llama 4's image chat data (``processor_type: Llama4Processor``; data/llama4_images.py, data/vision_chat.py):
the tile canvas chosen as transformers' ``Llama4ImageProcessor`` chooses it (its own functions, read from
its source: its module needs torchvision), each image written as ``Llama4Processor`` writes it, the labels
masked as Axolotl's base strategy (``chat_template: llama4``: the pad and ``<|image|>``), and
``functional-pp train`` of a tiny Llama 4 on two simulated devices whose first loss equals transformers'
``Llama4ForConditionalGeneration`` on the loader's first batch."""
import ast
import json
import math
from collections import defaultdict, namedtuple
from functools import lru_cache

import numpy as np
import pytest
import torch
from chat_tokenizer import make_tokenizer, write_llama4_processor_files
from image_chat import (DECODER_LORA, assert_first_loss_equals, cli_first_step, hf_loss, write_image_rows,
                        write_train_yaml)

from functional_pp.config import TrainConfig
from functional_pp.data.chat import template_text
from functional_pp.data.llama4_images import _fitted, best_fit, image_text, resolutions
from functional_pp.data.vision_chat import encode, load_processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TOKENS = ("<|image_start|>", "<|image|>", "<|patch|>", "<|image_end|>", "<|tile_x_separator|>",
          "<|tile_y_separator|>")
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


SIZE = namedtuple("SizeDict", "height width")


def hf_functions():
    """transformers' get_best_fit, find_supported_resolutions and get_max_res_without_distortion,
    executed from the source of models/llama4/image_processing_llama4.py (whose imports need torchvision)."""
    from pathlib import Path
    src = (Path(transformers.__file__).parent / "models/llama4/image_processing_llama4.py").read_text()
    names = {"get_factors", "get_max_res_without_distortion", "find_supported_resolutions", "get_best_fit"}
    tree = ast.parse(src)
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    scope = {"torch": torch, "math": math, "defaultdict": defaultdict, "lru_cache": lru_cache,
             "SizeDict": SIZE}
    exec(compile(tree, "image_processing_llama4", "exec"), scope)
    return scope


def test_canvas_and_resize_equal_transformers():
    f = hf_functions()
    for max_patches, size in ((16, 336), (4, 16), (5, 224)):
        canvases = f["find_supported_resolutions"](max_patches, SIZE(size, size))
        assert resolutions(max_patches, size) == canvases
        for h, w in ((20, 40), (200, 300), (336, 336), (1000, 90), (17, 17), (700, 1400), (5, 3)):
            want = f["get_best_fit"]((h, w), torch.tensor(canvases))
            assert best_fit(h, w, canvases) == tuple(want.tolist()), (h, w)
            top = f["get_best_fit"]((h, w), torch.tensor(canvases), resize_to_max_canvas=True)
            assert best_fit(h, w, canvases, True) == tuple(top.tolist()), (h, w)
            assert _fitted(h, w, tuple(want.tolist())) == f["get_max_res_without_distortion"]((h, w),
                                                                                             tuple(want.tolist()))


def make(root):
    d = root / "llama4"
    tok = make_tokenizer(d, "<|begin_of_text|>", "<|eot|>", extra=TOKENS)
    write_llama4_processor_files(d, VISION["patch_size"], VISION["image_size"], template_text("llama4"), max_patches=4)
    vocab = tok.tok.get_vocab_size()
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                interleave_moe_layer_step=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    conf = transformers.Llama4Config(text_config=text, vision_config=VISION,
                                     image_token_index=tok.tok.token_to_id("<|patch|>"))
    model = transformers.Llama4ForConditionalGeneration(conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(d)
    return d, tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4_chat")
    data = write_image_rows(root / "data", ((20, 40), (12, 12), (40, 18), (30, 30)), image_first=lambda i: True,
                            without_image=False)
    d, tok = make(root)
    return d, tok, data


def test_rows_are_encoded_as_llama4_processor_and_axolotl_encode_them(files):
    d, tok, data = files
    proc = load_processor(d)
    rec = json.loads(data.read_text().splitlines()[0])
    ids, mask, (pixels, sizes) = encode(proc, rec, data.parent, "row 0")
    # 20 x 40 pixels: a canvas of 1 x 2 tiles of 16 (upscaled no more than to 16 high), and the global tile
    assert tuple(pixels.shape) == (3, 3, 16, 16) and sizes.tolist() == [[16, 16]] * 3
    per_tile = (16 // 4) ** 2 // 4
    split = transformers.models.llama4.processing_llama4.Llama4Processor._prompt_split_image(None, (1, 2), per_tile)
    assert image_text((1, 2), per_tile) == split
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is 0?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "a picture 0"}]}],
        chat_template=proc.chat_template, tokenize=False)
    assert ids == proc.tokenizer(text.replace("<|image|>", split, 1), add_special_tokens=False)["input_ids"]
    patch, image = (proc.tokenizer.convert_tokens_to_ids(t) for t in ("<|patch|>", "<|image|>"))
    assert ids.count(patch) == 3 * per_tile
    # Axolotl's base strategy (chat_template llama4): the pad and the processor's image token (<|image|>) masked
    assert [m for i, m in zip(ids, mask) if i == image] == [0]
    assert all(m == 1 for i, m in zip(ids, mask) if i != image)
    # the pixels: resized (bilinear, antialiased) to 16 x 32, rescaled and normalised in bfloat16, cut in two;
    # the global tile the whole image resized to 16 x 16
    img = torch.from_numpy(np.array(Image.open(data.parent / "img0.png").convert("RGB"))).permute(2, 0, 1)

    def norm(x):
        return ((x.to(torch.bfloat16) * (1 / 255) - 0.5) / 0.5).float()
    fitted = torch.nn.functional.interpolate(img[None], size=(16, 32), mode="bilinear", antialias=True)[0]
    torch.testing.assert_close(pixels[:2], norm(torch.stack([fitted[:, :, :16], fitted[:, :, 16:]])), rtol=0, atol=0)
    whole = torch.nn.functional.interpolate(img[None], size=(16, 16), mode="bilinear", antialias=True)[0]
    torch.testing.assert_close(pixels[2], norm(whole), rtol=0, atol=0)


def train_yaml(tmp_path, d, data, **extra):
    return write_train_yaml(tmp_path, d, data, 96, **{
        "processor_type": "Llama4Processor", "chat_template": "llama4", **DECODER_LORA,
        "lora_target_modules": ["self_attn.q_proj", "vision_adapter.mlp.fc1"], **extra})


def test_cli_first_loss_equals_transformers(files, tmp_path):
    """Two simulated FSDP devices through ``functional-pp train``: the first step's loss (LoRA's B
    starts at zero) equals transformers' on the loader's first global batch, its tiles and all."""
    d, _, data = files
    step = cli_first_step(train_yaml(tmp_path, d, data, dp_shard_size=2))
    assert (step.vision["class_token"], step.vision["image_size"], step.vision["merge"]) == ("trailing", 16, 2)
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pixels = torch.cat([p for p, _ in step.images])
    assert_first_loss_equals(step, hf_loss(model, step.batch, pixel_values=pixels),
                             load_processor(d).tokenizer.convert_tokens_to_ids("<|image|>"))
    with torch.no_grad():
        tiles = model(input_ids=step.batch["tokens"], pixel_values=pixels).logits
        assert (tiles - model(input_ids=step.batch["tokens"]).logits).abs().max() > 0.1     # (the tiles matter)


def test_a_processor_that_disagrees_with_its_model_is_refused(files, tmp_path):
    d, _, data = files
    from functional_pp.app.inputs import image_settings
    other = tmp_path / "other"
    import shutil
    shutil.copytree(d, other)
    write_llama4_processor_files(other, 4, 32, template_text("llama4"))     # (tiles of 32, the model's 16)
    with pytest.raises(ValueError, match="makes tiles of 32 pixels, 4-pixel patches, 16 <|patch|> tokens"):
        image_settings(TrainConfig.from_yaml(train_yaml(tmp_path, other, data)))
    with pytest.raises(Exception, match="processor_type: LlavaProcessor but base_model's processor_config.json "
                                        "names 'Llama4Processor'"):
        TrainConfig.from_yaml(train_yaml(tmp_path, d, data, processor_type="LlavaProcessor")).validate()
