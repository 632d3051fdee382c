"""``freeze_mm_modules: true`` (Axolotl's: the vision encoder and projector frozen) in a full
fine-tune of a tiny Mistral 3 through ``functional-pp train``: the vision weights come out bit for bit
as read, no optimizer state is kept for them, the decoder equals a run that trains only the decoder
(``unfrozen_parameters``) and transformers' SGD step with ``requires_grad`` off on the vision parts;
two gloo processes under torchrun equal the simulated run (app/inputs.py ``frozen_and_adapters``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from chat_tokenizer import make_pixtral_processor

from functional_pp import checkpoint as ck
from functional_pp import cli
from functional_pp.core.tree import leaves_with_paths

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=272, bos_token_id=256, eos_token_id=257)
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=32, patch_size=4)
IMG = 260
TOWERS = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_freeze")
    d = root / "model"
    torch.manual_seed(0)
    conf = transformers.Mistral3Config(text_config=TEXT, vision_config=VISION, image_token_index=IMG,
                                       spatial_merge_size=2, initializer_range=0.2)
    transformers.Mistral3ForConditionalGeneration(conf).save_pretrained(d)
    make_pixtral_processor(d)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        h, w = int(rng.integers(8, 24)), int(rng.integers(8, 24))
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(root / f"img{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}?"}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"picture {i}"}]}],
                     "images": [f"img{i}.png"]})
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d, root / "train.jsonl"


def config(tmp_path, files, name, **extra):
    d, data = files
    cfg = {"base_model": str(d), "processor_type": "AutoProcessor", "sample_packing": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "micro_batch_size": 2, "sequence_len": 40,
           "learning_rate": 1e-2, "max_steps": 2, "warmup_steps": 0, "save_steps": 2, "dp_shard_size": 2,
           "logging": {"log_every": 1, "plot": False}, **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(tmp_path, files, name, **extra):
    out = tmp_path / name
    assert cli.main(["train", str(config(tmp_path, files, name, **extra)), "--simulate", "2",
                     "--output", str(out)]) == 0
    return out


def params(out):
    tree = ck.load_checkpoint(out / "checkpoints", keys=["params"]).tree["params"]
    return {p: x.clone() for p, x in leaves_with_paths(tree)}


def base(tmp_path, files):
    """base_model's weights as read (fp32), by our paths."""
    from functional_pp.checkpoint import hf
    from functional_pp.config import TrainConfig, model_config
    cfg = TrainConfig.from_yaml(config(tmp_path, files, "base"))
    return dict(leaves_with_paths(hf.load_hf_params(files[0], model_config(cfg))))


def test_vision_frozen_bitwise_and_the_decoder_equals_a_decoder_only_run(files, tmp_path):
    read = base(tmp_path, files)
    frozen = params(train(tmp_path, files, "frozen", freeze_mm_modules=True))
    vision = [p for p in frozen if p.startswith(TOWERS)]
    assert len(vision) > 5 and len(vision) < len(frozen)
    for p in vision:
        assert torch.equal(frozen[p], read[p]), p
    assert all(not torch.equal(frozen[p], read[p]) for p in frozen if p not in vision and p.endswith("q_proj"))
    index = json.loads(next((tmp_path / "frozen" / "checkpoints").glob("step-*/index.json")).read_text())
    moments = [p for p in index["tensors"] if p.startswith("opt.")]
    assert any("q_proj" in p for p in moments)                             # (AdamW's moments of the decoder)
    assert not [p for p in moments if any("." + t in p for t in TOWERS)]   # none of the vision parts
    decoder_only = params(train(tmp_path, files, "decoder", unfrozen_parameters=["(?!vision_tower|multi_modal_projector).+"]))
    assert decoder_only.keys() == frozen.keys()
    for p in frozen:
        assert torch.equal(decoder_only[p], frozen[p]), p
    trained = params(train(tmp_path, files, "all"))
    assert any(not torch.equal(trained[p], read[p]) for p in vision)      # (unfrozen, the tower moves)
