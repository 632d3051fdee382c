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


@pytest.fixture(scope="module")
def frozen_run(files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frozen_run")
    return tmp, train(tmp, files, "frozen", freeze_mm_modules=True)


def test_vision_frozen_bitwise_and_the_decoder_equals_a_decoder_only_run(files, frozen_run, tmp_path):
    read = base(tmp_path, files)
    frozen = params(frozen_run[1])
    vision = [p for p in frozen if p.startswith(TOWERS)]
    assert len(vision) > 5 and len(vision) < len(frozen)
    for p in vision:
        assert torch.equal(frozen[p], read[p]), p
    assert all(not torch.equal(frozen[p], read[p]) for p in frozen if p not in vision and p.endswith("q_proj"))
    index = json.loads(next((frozen_run[1] / "checkpoints").glob("step-*/index.json")).read_text())
    moments = [p for p in index["tensors"] if p.startswith("opt.")]
    assert any("q_proj" in p for p in moments)                             # (AdamW's moments of the decoder)
    assert not [p for p in moments if any("." + t in p for t in TOWERS)]   # none of the vision parts
    decoder = "(?!vision_tower|multi_modal_projector).+"                 # (every path but the towers')
    decoder_only = params(train(tmp_path, files, "decoder", unfrozen_parameters=[decoder]))
    assert decoder_only.keys() == frozen.keys()
    for p in frozen:
        assert torch.equal(decoder_only[p], frozen[p]), p
    trained = params(train(tmp_path, files, "all"))
    assert any(not torch.equal(trained[p], read[p]) for p in vision)      # (unfrozen, the tower moves)


def test_one_sgd_step_equals_transformers_with_the_vision_parts_not_requiring_grad(files, tmp_path):
    """One SGD step on the loader's first global batch, pixels and all: every parameter equals
    transformers' ``Mistral3ForConditionalGeneration`` after the same step with ``requires_grad``
    off on ``vision_tower`` and ``multi_modal_projector`` (read back through our import)."""
    from functional_pp.app.inputs import image_settings, load_tokenizer
    from functional_pp.checkpoint import hf
    from functional_pp.config import TrainConfig, model_config
    from functional_pp.data import DataLoader
    from functional_pp.data.formats import build_streams
    lr = 0.05
    sets = dict(freeze_mm_modules=True, optimizer="sgd", learning_rate=lr, max_steps=1, save_steps=1,
                max_grad_norm=None, lr_scheduler="constant")
    ours = params(train(tmp_path, files, "sgd", **sets))
    cfg = TrainConfig.from_yaml(config(tmp_path, files, "sgd", **sets))
    stream, _ = build_streams(cfg.datasets, load_tokenizer(cfg), seq_len=40, sample_packing=False,
                              vision=image_settings(cfg))
    loader = DataLoader(stream, global_batch_size=4, seq_len=40, seed=cfg.seed)
    batch = loader.global_batch(0)
    have = [stream.images.rows[r] for r in (loader.window_starts(0) // 40).tolist() if stream.images.rows[r]]
    H, W = max(p.shape[-2] for p, _ in have), max(p.shape[-1] for p, _ in have)
    pixels = torch.cat([torch.nn.functional.pad(p, (0, W - p.shape[-1], 0, H - p.shape[-2])) for p, _ in have])
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
    logits = model(input_ids=batch["tokens"], pixel_values=pixels, image_sizes=torch.cat([s for _, s in have])).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p -= lr * p.grad
    model.save_pretrained(tmp_path / "hf_step")
    want = dict(leaves_with_paths(hf.load_hf_params(tmp_path / "hf_step", model_config(cfg))))
    read = base(tmp_path, files)
    assert want.keys() == ours.keys()
    for p in ours:
        torch.testing.assert_close(ours[p], want[p], rtol=1e-5, atol=1e-6, msg=lambda m: f"{p}: {m}")
        assert p.startswith(TOWERS) or not torch.equal(ours[p], read[p]), p         # (the decoder moved)


@pytest.mark.multiprocess
def test_two_gloo_processes_under_torchrun_equal_the_simulated_run(files, frozen_run):
    """``torchrun --nproc_per_node 2`` (FSDP over 2 gloo processes): the same checkpoint as the
    simulated run's, the vision weights bit for bit as read."""
    tmp, sim = frozen_run
    out = tmp / "torchrun"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "functional_pp", "train", str(tmp / "frozen.yaml"), "--output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    real, want, read = params(out), params(sim), base(tmp, files)
    assert real.keys() == want.keys()
    for p in real:
        torch.testing.assert_close(real[p], want[p], rtol=1e-6, atol=1e-7, msg=lambda m: f"{p}: {m}")
        if p.startswith(TOWERS):
            assert torch.equal(real[p], read[p]), p


def test_under_lora_the_towers_are_frozen_already(files, tmp_path):
    """``adapter: lora``: the base weights of the towers are frozen already; freeze_mm_modules
    freezes besides the adapters that target names inside the tower (``q_proj`` matches the vision
    attention's too, as in peft), and leaves LoRA's mask as it is everywhere else."""
    from functional_pp.app.inputs import frozen_and_adapters
    from functional_pp.config import TrainConfig, model_config, model_family
    lora = dict(adapter="lora", lora_r=2, lora_alpha=4, lora_target_modules=["q_proj", "v_proj"])
    masks = []
    for extra in ({}, {"freeze_mm_modules": True}):
        cfg = TrainConfig.from_yaml(config(tmp_path, files, "lora", **lora, **extra))
        decls = model_family(cfg).param_decls(model_config(cfg))
        _, decls, trainable = frozen_and_adapters(cfg, cfg.lora_config(), None, decls)
        masks.append(dict(leaves_with_paths(trainable(decls))))
    tower_adapters = [p for p in masks[1] if p.startswith(TOWERS) and ".lora." in f".{p}."]
    assert tower_adapters and all(masks[0][p] for p in tower_adapters)     # (q_proj / v_proj inside the tower too)
    assert not any(t for p, t in masks[1].items() if p.startswith(TOWERS))
    assert {p: t for p, t in masks[0].items() if p not in tower_adapters} == {
        p: t for p, t in masks[1].items() if p not in tower_adapters}       # (the rest: LoRA's own mask)
    assert any(t for p, t in masks[1].items() if ".lora." in f".{p}.")
