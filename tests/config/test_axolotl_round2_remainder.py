"""Axolotl keys of issue 47's remainder that are bookkeeping: a transformers ``*ForCausalLM``
(or multimodal ``*ForConditionalGeneration``: its text decoder) class as ``model_type`` (the
architecture is base_model's config.json, as in Axolotl, where the class must load that config); ``unfrozen_parameters`` matched as Axolotl's ``LayerNamePattern``
(dots literal, from the start) against the Hugging Face names of the base model's own files
(DBRX's ``transformer.blocks.N``), compared with Axolotl's rule on transformers' parameter names."""
import json
import re

import pytest

from functional_pp.config import ConfigError, TrainConfig

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("cls", ["GPTNeoXForCausalLM", "GemmaForCausalLM", "LlamaForCausalLM",
                                 "Llama4ForConditionalGeneration"])
def test_a_causal_lm_class_as_model_type_is_accepted(cls):
    assert TrainConfig.from_dict({"model_type": cls, "model": {"preset": "tiny"}}).model.preset == "tiny"


@pytest.mark.parametrize("cls", ["BertForMaskedLM", "T5Model", "forcausallm"])
def test_other_model_classes_are_refused(cls):
    with pytest.raises(ConfigError, match=f"model_type: '{cls}' is not supported"):
        TrainConfig.from_dict({"model_type": cls})


def _axolotl_unfrozen(model, patterns):
    """Axolotl's freeze_layers_except: LayerNamePattern (dots literal unless before '+'), re.match."""
    rx = [re.compile(re.sub(r"\.(?!\+)", "\\.", p)) for p in patterns]
    return {n for n, _ in model.named_parameters() if any(r.match(n) for r in rx)}


def test_dbrx_unfrozen_parameters_train_what_axolotl_unfreezes(tmp_path):
    from functional_pp.adapters.lora import unfrozen
    from functional_pp.adapters.peft_fused import model_type_of
    from functional_pp.app.inputs import frozen_and_adapters
    from functional_pp.config import model_config, model_family
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.models.llama_hf import file_name
    conf = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=3, max_seq_len=64, vocab_size=128,
                                   attn_config={"kv_n_heads": 2, "rope_theta": 1e4}, ffn_config={"ffn_hidden_size": 32,
                                                                              "moe_num_experts": 2, "moe_top_k": 1})
    model = transformers.DbrxForCausalLM(conf)
    model.save_pretrained(tmp_path)
    assert model_type_of(str(tmp_path)) == "dbrx"
    patterns = ["transformer.blocks.[0-1].", "lm_head"]
    want = _axolotl_unfrozen(model, patterns)
    cfg = TrainConfig.from_dict({"base_model": str(tmp_path), "unfrozen_parameters": patterns})
    mcfg = model_config(cfg)
    family = model_family(cfg)
    _, decls, mask_fn = frozen_and_adapters(cfg, None, lambda p, b: None, family.param_decls(mcfg))
    trained = {p for p, t in leaves_with_paths(mask_fn(decls)) if t}
    got = {file_name(p, "dbrx")[0] for p in trained}
    assert got == want and any(".blocks.1." in n for n in got) and not any(".blocks.2." in n for n in got)
    # dots are literal: "transformerXblocks" is not "transformer.blocks"
    assert not any(t for _, t in leaves_with_paths(unfrozen(["transformerXblocks"], (), "dbrx")(decls)))


def test_a_row_range_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"unfrozen_parameters: '\^model.embed_tokens.weight\$\[:32000\]': a row range"):
        TrainConfig.from_dict({"model": {"preset": "tiny"}, "unfrozen_parameters": ["^model.embed_tokens.weight$[:32000]"]})


def _run(tmp_path, **keys):
    import yaml

    from functional_pp import cli
    cfg = {"micro_batch_size": 2, "sequence_len": 32, "learning_rate": 3e-3, "lr_scheduler": "constant",
           "max_steps": 5, "model": "tiny", "data": {"max_bytes": 60_000}, "logging_steps": 1,
           "val_set_size": 0.05, "eval_steps": 1, "output_dir": str(tmp_path / "out"),
           **keys}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(path), "--simulate", "2"]) == 0
    evals = {m["step"]: m["eval_loss"] for m in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text()
                                                     .splitlines()) if "eval_loss" in m and m.get("step")}
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out" / "checkpoints").glob("step-*"))
    return evals, saved


@pytest.mark.parametrize("higher", [False, True])
def test_save_strategy_best_saves_at_each_new_best_held_out_loss(tmp_path, higher):
    keys = {"save_strategy": "best", "checkpoint": {"save_final": False, "keep_last": None}}
    if higher:
        keys["greater_is_better"] = True
    evals, saved = _run(tmp_path, **keys)
    want, best = [], None
    for s in sorted(evals):
        if best is None or (evals[s] > best if higher else evals[s] < best):
            best = evals[s]
            want.append(s)
    assert saved == want and len(evals) == 5, (evals, saved)
    assert (len(want) == 1) == higher            # (the loss falls: each step is a new lowest, none a new highest)


def test_save_strategy_best_needs_the_held_out_loss():
    with pytest.raises(ConfigError, match="save_strategy: best saves at the best held-out loss"):
        TrainConfig.from_dict({"model": {"preset": "tiny"}, "save_strategy": "best"})
    with pytest.raises(ConfigError, match="metric_for_best_model: 'accuracy' is not computed here"):
        TrainConfig.from_dict({"model": {"preset": "tiny"}, "save_strategy": "best", "val_set_size": 0.1,
                               "metric_for_best_model": "accuracy"})
