"""Axolotl's adapter keys (docs/adapters.md): ``adapter: lora`` and the ``lora_*`` /
``peft_use_*`` keys map onto ``adapters.LoraConfig``; ``unfrozen_parameters`` picks the
trained parameters by our path or Hugging Face name; bad QLoRA settings, LoRA keys without an
adapter and an adapter directory without its base model are refused by name."""
import functools

import pytest
import yaml

from functional_pp import adapters
from functional_pp.app.inputs import frozen_and_adapters
from functional_pp.config import ConfigError, TrainConfig
from functional_pp.core.tree import leaves_with_paths
from functional_pp.models import llama

CFG = llama.Config.tiny()


def test_lora_keys_map_onto_the_lora_config():
    cfg = TrainConfig.from_dict({"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                 "lora_target_modules": ["q_proj", "v_proj"], "peft_use_rslora": True,
                                 "lora_modules_to_save": ["lm_head"], "lora_mlp_kernel": True})
    lc = cfg.lora_config()
    assert (lc.r, lc.alpha, lc.dropout, lc.target_modules, lc.modules_to_save, lc.rslora) == (
        16, 32, 0.05, ("q_proj", "v_proj"), ("lm_head",), True)
    assert lc.scale == 8.0
    regex = TrainConfig.from_dict({"adapter": "lora", "lora_target_modules": r".*\.(q|v)_proj"}).lora_config()
    assert regex.target_modules == r".*\.(q|v)_proj"
    assert TrainConfig.from_dict({"adapter": "lora", "lora_target_linear": True}).lora_config().target_linear
    assert TrainConfig.from_dict({}).lora_config() is None
    assert TrainConfig.from_dict({"adapter": "lora", "lora_target_linear": True, "peft_use_dora": True}).lora_config().dora
    loss, decls, mask = frozen_and_adapters(cfg, lc, functools.partial(llama.loss, cfg=CFG), llama.init(CFG))
    trained = [p for p, t in leaves_with_paths(mask(decls)) if t]
    assert trained == sorted(trained, key=[p for p, _ in leaves_with_paths(decls)].index)
    assert set(trained) == {"lm_head"} | {f"layers.{i}.self_attn.lora.{w}.{m}" for i in range(CFG.layers)
                                          for w in ("q_proj", "v_proj") for m in ("lora_A", "lora_B")}


def test_unfrozen_parameters_without_an_adapter():
    cfg = TrainConfig.from_dict({"unfrozen_parameters": [r"^lm_head\.weight$", r"model\.layers\.1\.mlp\..*"]})
    loss, decls, mask = frozen_and_adapters(cfg, None, functools.partial(llama.loss, cfg=CFG), llama.init(CFG))
    assert [p for p, t in leaves_with_paths(mask(decls)) if t] == [
        "layers.1.mlp.down_proj", "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj", "lm_head"]
    none = TrainConfig.from_dict({"unfrozen_parameters": ["^nothing"]})
    with pytest.raises(ConfigError, match="match no parameter"):
        frozen_and_adapters(none, None, llama.loss, llama.init(CFG))


@pytest.mark.parametrize("d, message", [
    ({"load_in_4bit": True}, "load_in_4bit: a quantized base is frozen, so it trains only under an adapter"),
    ({"adapter": "qlora", "lora_target_linear": True, "load_in_8bit": True}, "adapter: qlora quantizes the base to 4 bit"),
    ({"adapter": "qlora", "lora_target_linear": True, "bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}},
     "bnb_4bit_quant_type: 'fp4' is not supported"),
    ({"adapter": "qlora", "lora_target_linear": True, "bnb_config_kwargs": {"llm_int8_threshold": 6.0}},
     "bnb_config_kwargs.llm_int8_threshold is not supported"),
    ({"lora_r": 16}, "lora_r is set but adapter is not: add adapter: lora"),
    ({"adapter": "lora"}, "adapter: lora names no weights to adapt; set lora_target_modules"),
    ({"adapter": "lora", "lora_target_linear": True, "lora_model_dir": "x"}, "lora_model_dir needs base_model"),
    ({"adapter": "lora", "lora_target_linear": True, "lora_dropout": 1.5}, "lora_dropout\\) must be in"),
    ({"adapter": "lora", "lora_target_linear": True, "lora_alpha": 0}, "alpha \\(lora_alpha\\) must be a finite number "
                                                                      "other than 0, got 0.0: .* learn nothing"),
    ({"unfrozen_parameters": ["("]}, "unfrozen_parameters: '\\(' is not a regex"),
    ({"adapter": "lora", "lora_target_linear": True, "peft": {"loftq": True}}, "peft: loftq is not supported: peft's own options here are loftq_config"),
])
def test_bad_adapter_settings_are_refused_by_name(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(d)


@pytest.mark.parametrize("d, key, typo", [
    ({"lora_target_linear": True, "lora_modules_to_save": ["lm_head", "embed_tokns"]}, "modules_to_save", "embed_tokns"),
    ({"lora_target_modules": ["q_proj", "v_prj"]}, "target_modules", "v_prj"),
])
def test_a_misspelt_module_name_is_refused_not_left_frozen(d, key, typo):
    """One misspelt module name beside correct ones used to train nothing under it, silently
    (issue 46): refused naming the key, the name and the model's module names."""
    cfg = TrainConfig.from_dict({"adapter": "lora", **d})
    with pytest.raises(ConfigError, match=f"{key} .*{typo}.* match no parameter .*'embed_tokens'"):
        frozen_and_adapters(cfg, cfg.lora_config(), functools.partial(llama.loss, cfg=CFG), llama.init(CFG))


@pytest.mark.parametrize("adapter", [{}, {"adapter": "lora", "lora_target_linear": True}])
def test_an_unfrozen_pattern_that_matches_nothing_is_named(adapter):
    """A regex of unfrozen_parameters that matches nothing is warned about by name (Axolotl's
    examples carry patterns for another layout of the model); none matching is refused when they
    are all that would train (no adapter), warned about beside an adapter."""
    cfg = TrainConfig.from_dict({**adapter, "unfrozen_parameters": [r"^lm_head\.weight$", "^nothing"]})
    with pytest.warns(UserWarning, match=r"unfrozen_parameters \['\^nothing'\] match no parameter .*'model\.embed"):
        _, decls, mask = frozen_and_adapters(cfg, cfg.lora_config(), llama.loss, llama.init(CFG))
    assert "lm_head" in [p for p, t in leaves_with_paths(mask(decls)) if t]
    none = TrainConfig.from_dict({**adapter, "unfrozen_parameters": ["^nothing", "^nor_this"]})
    if adapter:
        with pytest.warns(UserWarning, match=r"\['\^nothing', '\^nor_this'\] match no parameter"):
            _, decls, mask = frozen_and_adapters(none, none.lora_config(), llama.loss, llama.init(CFG))
        assert all(".lora." in "." + p for p, t in leaves_with_paths(mask(decls)) if t)
    else:
        with pytest.raises(ConfigError, match=r"\['\^nothing', '\^nor_this'\] match no parameter"):
            frozen_and_adapters(none, none.lora_config(), llama.loss, llama.init(CFG))


def test_another_architectures_linear_names_are_warned_about_and_the_others_adapted():
    """peft adapts the target names a model has (Axolotl's GLM-4.7-Flash example targets q_proj,
    k_proj, v_proj beside o_proj on latent attention, which has none of the three): such names of
    another architecture's linear weights are warned about by name when another target matches;
    a misspelling, or only absent names, stays refused."""
    cfg = TrainConfig.from_dict({"adapter": "lora", "lora_target_modules": ["o_proj", "q_a_proj", "kv_b_proj"]})
    with pytest.warns(UserWarning, match=r"\['q_a_proj', 'kv_b_proj'\] name linear weights this model does not"):
        _, decls, mask = frozen_and_adapters(cfg, cfg.lora_config(), llama.loss, llama.init(CFG))
    assert {p.split(".lora.")[1].split(".")[0] for p, t in leaves_with_paths(mask(decls)) if t} == {"o_proj"}
    for names in (["q_a_proj"], ["o_proj", "q_a_proj", "o_prj"]):
        only = TrainConfig.from_dict({"adapter": "lora", "lora_target_modules": names})
        with pytest.raises(ConfigError, match="match no parameter"):
            frozen_and_adapters(only, only.lora_config(), llama.loss, llama.init(CFG))


@pytest.mark.parametrize("lora", [{"lora_r": 8}, {"lora_alpha": 16, "lora_dropout": 0.0},
                                  {"lora_target_modules": ["q_proj", "v_proj"]}, {"lora_target_linear": True}])
def test_lora_keys_at_their_defaults_without_adapter_are_refused_on_the_command_line(tmp_path, capsys, lora):
    """``lora_r: 8`` (the default rank) without ``adapter:`` used to train the whole model, the
    LoRA keys ignored: a key written in the config counts even at its default value. A saved
    config (``adapter: null`` beside every LoRA key) and ``false`` / blank values still load."""
    from functional_pp import cli
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "max_steps": 1, **lora}))
    for command in ("validate", "train"):
        assert cli.main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{', '.join(lora)} {'is' if len(lora) == 1 else 'are'} set but adapter is not: add adapter: lora" in err
        assert "or remove the LoRA keys for full fine-tuning" in err
    full = TrainConfig.from_dict({"model": {"preset": "tiny"}})
    assert full.lora_config() is None and TrainConfig.from_dict(full.to_dict()).lora_config() is None
    TrainConfig.from_dict({"lora_target_linear": False, "lora_model_dir": None, "lora_r": None})
    assert TrainConfig.from_dict({"adapter": "lora", **lora, "lora_target_linear": True}).lora_config().r == 8
