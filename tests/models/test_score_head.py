"""The score head (models/score_head.py) against transformers' *ForSequenceClassification and
*ForTokenClassification: imported scores, export that transformers loads to the same scores, and a
causal LM's files read under a fresh head."""
import json

import pytest
import torch
import transformers

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.models import llama, score_head
from functional_pp.core import tree
from functional_pp.data.reward_data import last_token_mask
from functional_pp.parallel import sharding

_SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0)


def _tokens():
    toks = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(3))
    toks[0, 7:] = 0                      # right padding
    toks[1, 9:] = 0
    return toks


def _ours(params, cfg, toks):
    named = sharding.named_tree(params, llama.init(cfg))
    with torch.no_grad():
        if cfg.score_head == "sequence":
            last = fpp.wrap(torch.from_numpy(last_token_mask(toks.numpy(), cfg.pad_token_id)), "batch seq")
            return score_head.sequence_scores(named, fpp.wrap(toks, "batch seq"), last, cfg).value()
        return score_head.token_scores(named, fpp.wrap(toks, "batch seq"), cfg).value()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    torch.manual_seed(0)
    seq = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**_SIZES, num_labels=1,
                                                                               tie_word_embeddings=True)).eval()
    tok = transformers.Qwen3ForTokenClassification(transformers.Qwen3Config(**_SIZES, head_dim=16, num_labels=2,
                                                                            classifier_dropout=0.0)).eval()
    causal = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_SIZES)).eval()
    for name, m in (("seq", seq), ("tok", tok), ("causal", causal)):
        m.save_pretrained(root / name)
    return root, seq, tok


@pytest.mark.parametrize("name", ["seq", "tok"])
def test_import_scores_and_export_round_trip(models, name, tmp_path):
    root, seq, tok = models
    model = seq if name == "seq" else tok
    cfg, params = hf.load_hf_llama(root / name)
    assert cfg.score_head == ("sequence" if name == "seq" else "token")
    assert "lm_head" not in params and params["score"].shape == (32, cfg.num_labels)
    assert cfg.score_bias == (name == "tok")
    toks = _tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    got = _ours(params, cfg, toks)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the last non-pad token, not the last position, is read
    if name == "seq":
        last_pos = fpp.wrap(torch.from_numpy(last_token_mask(toks.numpy(), None)), "batch seq")
        named = sharding.named_tree(params, llama.init(cfg))
        with torch.no_grad():
            other = score_head.sequence_scores(named, fpp.wrap(toks, "batch seq"), last_pos, cfg).value()
        assert not torch.allclose(other[0], want[0], atol=1e-4)
    moved = dict(tree.leaves_with_paths(params))
    params = tree.tree_map(lambda t: t + 0.01 * torch.randn_like(t), params)
    out = hf.save_hf_llama(params, cfg, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    cls = ("Qwen2ForSequenceClassification" if name == "seq" else "Qwen3ForTokenClassification")
    assert written["architectures"] == [cls] and written["num_labels"] == cfg.num_labels
    auto = (transformers.AutoModelForSequenceClassification if name == "seq"
            else transformers.AutoModelForTokenClassification)
    back = auto.from_pretrained(out).eval()
    assert type(back).__name__ == cls
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, _ours(params, cfg, toks), atol=1e-5, rtol=1e-5)
    cfg2, again = hf.load_hf_llama(out)
    assert cfg2 == cfg and moved.keys() == dict(tree.leaves_with_paths(again)).keys()


def test_causal_files_under_a_fresh_head(models):
    """A causal LM's files read as a reward model (Axolotl's AutoModelForSequenceClassification of a
    causal checkpoint): the body is the file's, the LM head is left unread, ``score`` initialised."""
    import dataclasses
    root, _, _ = models
    cfg = dataclasses.replace(hf.config_from_hf(root / "causal"), score_head="sequence", num_labels=1,
                              pad_token_id=0)
    with pytest.raises(hf.CheckpointMismatchError, match="score.weight"):
        hf.load_hf_params(root / "causal", cfg)
    params = hf.load_hf_params(root / "causal", cfg, fresh=("score",), seed=0)
    causal = transformers.Qwen2ForCausalLM.from_pretrained(root / "causal")
    torch.testing.assert_close(params["embed_tokens"], causal.model.embed_tokens.weight.detach())
    assert params["score"].std() > 0.005 and "lm_head" not in params
    again = hf.load_hf_params(root / "causal", cfg, fresh=("score",), seed=0)
    assert torch.equal(again["score"], params["score"])


def test_no_head_is_refused():
    cfg = llama.Config.tiny()
    with pytest.raises(ValueError, match="no score head"):
        score_head.token_scores({}, fpp.wrap(torch.zeros(1, 2, dtype=torch.long), "batch seq"), cfg)
    with pytest.raises(ValueError, match="score_head"):
        llama.Config.tiny(score_head="pooled")
