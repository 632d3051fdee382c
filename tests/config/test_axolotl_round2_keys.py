"""Axolotl keys of issue 47 that map onto existing settings: ``eta_min`` (the learning rate the
decay ends at), ``batch_size`` (Axolotl's deprecated per-device total: gradient accumulation),
``adapter:`` written blank next to LoRA keys (full fine-tuning, as Axolotl), ``model_config`` /
``overrides_of_model_config`` (keys of base_model's config.json replaced, as transformers'
setattr on the loaded config), ``min_sample_len`` and ``dataset_exact_deduplication`` for
language-model data (rows left out and counted; the stream equals the one built from the data
without them)."""
import json
from pathlib import Path

import numpy as np
import pytest

from functional_pp.config import ConfigError, DatasetConfig, TrainConfig
from functional_pp.config.models import model_config
from functional_pp.data.formats import ByteTokenizer, build_streams

BASE = {"model": {"preset": "tiny"}, "max_steps": 4, "lr_scheduler": "cosine", "learning_rate": 1e-3}


def test_eta_min_is_the_learning_rate_the_decay_ends_at():
    cfg = TrainConfig.from_dict({**BASE, "eta_min": 7e-5})
    assert cfg.min_lr() == 7e-5 == TrainConfig.from_dict({**BASE, "min_learning_rate": 7e-5}).min_lr()
    with pytest.raises(ConfigError, match="contradicts min_learning_rate"):
        TrainConfig.from_dict({**BASE, "eta_min": 7e-5, "min_learning_rate": 1e-5})


def test_batch_size_is_micro_batch_size_times_accumulation():
    cfg = TrainConfig.from_dict({**BASE, "batch_size": 8, "micro_batch_size": 2})
    assert cfg.gradient_accumulation_steps == 4
    assert TrainConfig.from_dict({**BASE, "batch_size": 3}).gradient_accumulation_steps == 3
    with pytest.raises(ConfigError, match=r"batch_size=8 contradicts micro_batch_size=2 x gradient_accumulation"):
        TrainConfig.from_dict({**BASE, "batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match=r"batch_size=5 must be a whole multiple of micro_batch_size=2"):
        TrainConfig.from_dict({**BASE, "batch_size": 5, "micro_batch_size": 2})


def test_blank_adapter_is_full_fine_tuning_and_its_lora_keys_are_noted():
    cfg = TrainConfig.from_dict({**BASE, "adapter": None, "lora_r": 64, "lora_alpha": 16,
                                 "lora_target_modules": ["q_proj"]})
    assert cfg.adapter is None and cfg.lora_r == TrainConfig.from_dict(BASE).lora_r
    assert any("adapter is blank" in n and "lora_r" in n for n in cfg.notes)
    with pytest.raises(ConfigError, match="lora_r is set but adapter is not"):
        TrainConfig.from_dict({**BASE, "lora_r": 64})          # no adapter key at all: still refused


def _tiny_mixtral(tmp_path: Path) -> Path:
    import transformers
    d = tmp_path / "mixtral"
    conf = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, router_aux_loss_coef=0.02,
                                      output_router_logits=False)
    d.mkdir()
    (d / "config.json").write_text(conf.to_json_string())
    return d


def test_model_config_overrides_keys_of_the_base_models_config(tmp_path):
    from functional_pp.models.llama_hf import config_from_hf_dict
    d = _tiny_mixtral(tmp_path)
    plain = model_config(TrainConfig.from_dict({"base_model": str(d), "max_steps": 1}))
    over = model_config(TrainConfig.from_dict({"base_model": str(d), "max_steps": 1,
                                               "model_config": {"output_router_logits": True}}))
    edited = {**json.loads((d / "config.json").read_text()), "output_router_logits": True}
    assert plain.router_aux_loss_coef == 0.0            # transformers adds the loss only with router logits
    assert over == config_from_hf_dict(edited) and over.router_aux_loss_coef == 0.02
    with pytest.raises(ConfigError, match="without base_model give them in the model section"):
        model_config(TrainConfig.from_dict({**BASE, "model_config": {"output_router_logits": True}}))


ROWS = [{"text": "a fairly long first document"}, {"text": "hi"}, {"text": "a fairly long first document"},
        {"text": "another document of some length"}, {"text": "ok"}, {"text": "another document of some length"}]


def _streams(tmp_path: Path, rows: list[dict], name: str, **kw):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_streams([DatasetConfig(path=str(tmp_path / name), type="completion")], ByteTokenizer(),
                         seq_len=64, **kw)[0]


@pytest.mark.parametrize("packing", [True, False])
def test_short_and_repeated_rows_are_left_out_and_counted(tmp_path, packing):
    train = _streams(tmp_path, ROWS, "all.jsonl", min_sample_len=5, deduplicate=True, sample_packing=packing)
    kept = [ROWS[0], ROWS[3]]                     # "hi" / "ok" (3 tokens with EOS) are short; two repeat
    oracle = _streams(tmp_path, kept, "kept.jsonl", sample_packing=packing)
    assert np.array_equal(train.tokens, oracle.tokens) and train.documents == oracle.documents == 2
    st = train.stats[0]
    assert (st.rows, st.short, st.duplicates) == (2, 2, 2)
    assert "2 rows shorter than min_sample_len left out" in st.line()
    assert "2 rows equal to an earlier one left out (dataset_exact_deduplication)" in st.line()
    assert len(_streams(tmp_path, ROWS, "all.jsonl", sample_packing=packing).stats[0].line()) > 0
    assert _streams(tmp_path, ROWS, "all.jsonl", sample_packing=packing).stats[0].rows == 6   # off: all kept


def test_every_row_left_out_is_refused_naming_why(tmp_path):
    with pytest.raises(ValueError, match=r"every row was left out \(6 shorter than min_sample_len=100"):
        _streams(tmp_path, ROWS, "all.jsonl", min_sample_len=100)


def test_the_keys_are_accepted_for_language_model_data(tmp_path):
    cfg = TrainConfig.from_dict({**BASE, "min_sample_len": 2, "dataset_exact_deduplication": True})
    assert (cfg.min_sample_len, cfg.dataset_exact_deduplication) == (2, True)


def test_old_and_reporting_keys_map_or_are_noted():
    """max_packed_sequence_len (Axolotl's old name of the packed length) is sequence_len with
    packing, refused beside another sequence_len or sample_packing: false; eval_table_size,
    hf_use_auth_token and lora_fan_in_fan_out change nothing here and are noted as unused."""
    cfg = TrainConfig.from_dict({**BASE, "max_packed_sequence_len": 128})
    assert cfg.sequence_len == 128 and cfg.sample_packing
    with pytest.raises(ConfigError, match="max_packed_sequence_len: 128 contradicts sequence_len: 64"):
        TrainConfig.from_dict({**BASE, "max_packed_sequence_len": 128, "sequence_len": 64})
    with pytest.raises(ConfigError, match="max_packed_sequence_len packs .* sample_packing is false"):
        TrainConfig.from_dict({**BASE, "max_packed_sequence_len": 128, "sample_packing": False})
    noted = TrainConfig.from_dict({**BASE, "eval_table_size": 2, "eval_max_new_tokens": 64, "hf_use_auth_token": True,
                                   "adapter": "lora", "lora_target_linear": True, "lora_fan_in_fan_out": True})
    text = " ".join(noted.notes)
    for key in ("eval_table_size", "eval_max_new_tokens", "hf_use_auth_token", "lora_fan_in_fan_out"):
        assert key in text, key


def test_peft_turns_fan_in_fan_out_off_for_linear_weights():
    """The claim behind noting lora_fan_in_fan_out: peft's LoRA on torch.nn.Linear weights (every
    family here) runs with fan_in_fan_out false whatever the config says, and gives the same
    output as without it."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch
    conf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)
    outs = []
    for fan in (True, False):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(conf).eval()
        lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], fan_in_fan_out=fan,
                             init_lora_weights=False)
        with pytest.warns(UserWarning, match="fan_in_fan_out") if fan else _nothing():
            pm = peft.get_peft_model(model, lc)
        layer = pm.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.fan_in_fan_out is False
        with torch.no_grad():
            outs.append(pm(input_ids=torch.arange(8)[None]).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _nothing():
    import contextlib
    return contextlib.nullcontext()
