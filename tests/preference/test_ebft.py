"""EBFT's strided mode (docs/preference.md "EBFT"): the hidden states of chosen layers
(``llama.layer_states``, a recording layer wrapper) equal transformers' ``output_hidden_states``
on a tiny Llama."""
from __future__ import annotations

import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")

KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers' tiny Llama, our config, our named parameters) with the same weights."""
    from functional_pp.checkpoint import hf
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    m.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp("ebft-llama")
    m.save_pretrained(d)
    cfg, params = hf.load_hf_llama(d)
    return m, cfg, sharding.named_tree(params, llama.init(cfg))


def test_layer_states_equal_transformers_hidden_states(model):
    m, cfg, params = model
    toks = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = m(input_ids=toks, output_hidden_states=True).hidden_states
        got = llama.layer_states(params, fpp.wrap(toks, "batch seq"), cfg, [3, 0, 1, 2, 4])
    assert len(want) == 5
    for i, g in zip([3, 0, 1, 2, 4], got):
        assert g.dims == ("batch", "seq", "hidden")
        torch.testing.assert_close(g.value(), want[i], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"layers \[5\] are outside 0..4"):
        llama.layer_states(params, fpp.wrap(toks, "batch seq"), cfg, [5])
