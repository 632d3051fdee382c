"""The compiled decode step (``generate(compile=...)``, functional_pp/models/sampling.py over the
static cache of functional_pp/models/kv_cache.py): its tokens equal the eager path's (greedy and
sampled, a ragged left-padded batch and an unpadded one) on one device, on simulated FSDP x TP
devices and on real gloo processes; one graph serves every new token (dynamo's graph count does
not grow with the tokens, nor on a second call of the same shapes); the static cache holds
``cache_bytes`` of prompt + new tokens."""
from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

import functional_pp as fpp
from functional_pp.core.runtime import current_context
from functional_pp.models import llama
from functional_pp.models.kv_cache import KVCache, cache_bytes, caching
from functional_pp.models.sampling import generate, left_padded
from functional_pp.parallel import sharding
from functional_pp.parallel.reshard import named

CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=64)
RAGGED = [[5, 17, 3, 40, 22, 9, 11], [31, 7], [60, 2, 44, 1], [8, 30, 12, 50, 21]]
BACKEND = "aot_eager"          # dynamo's trace and AOT graph (inductor's code generation is slow on CPU)
LAYOUT_BACKEND = "eager"       # dynamo's trace alone: a graph per device to trace under a layout


@pytest.fixture(scope="module")
def params():
    p = fpp.init(llama.init, CFG, seed=0)
    with torch.no_grad():               # weights large enough that attention is far from uniform
        return {k: v for k, v in _scaled(p).items()}


def _scaled(tree):
    from functional_pp.core.tree import tree_map
    return tree_map(lambda x: x.replace(data=x.data * 3) if x.data.dim() > 1 else x, tree)


def _both(params, tokens, mask, compile, n=10):
    forward = functools.partial(llama.forward, cfg=CFG)
    return (generate(forward, params, tokens, attention_mask=mask, max_new_tokens=n, compile=compile),
            generate(forward, params, tokens, attention_mask=mask, max_new_tokens=n, temperature=0.9, top_k=20,
                     seed=4, compile=compile))


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_tokens_equal_eager_and_one_graph_serves_every_token(params):
    tokens, mask = left_padded(RAGGED)
    eager = _both(params, tokens, mask, False)
    before = _graphs()
    compiled = _both(params, tokens, mask, BACKEND)
    assert _graphs() - before == 1                        # 2 calls x 10 tokens: one graph
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    assert not torch.equal(*eager) and len(set(eager[0][:, 7:].flatten().tolist())) > 3
    plain = torch.tensor([[5, 17, 3, 40], [31, 7, 60, 2]])
    want = generate(functools.partial(llama.forward, cfg=CFG), params, plain, max_new_tokens=6)
    assert torch.equal(generate(functools.partial(llama.forward, cfg=CFG), params, plain, max_new_tokens=6,
                                compile=BACKEND), want)
    assert _graphs() - before == 2                        # another batch shape: one more graph


def test_compiled_sliding_window_equals_eager():
    """A sliding window (Mistral's, 3 tokens) masks the static cache's positions before it."""
    import dataclasses
    cfg = dataclasses.replace(CFG, sliding_window=3)
    params = _scaled(fpp.init(llama.init, cfg, seed=1))
    tokens, mask = left_padded(RAGGED)
    forward = functools.partial(llama.forward, cfg=cfg)
    eager = generate(forward, params, tokens, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(generate(forward, params, tokens, attention_mask=mask, max_new_tokens=8, compile=BACKEND), eager)
    assert not torch.equal(eager, generate(functools.partial(llama.forward, cfg=CFG), params, tokens,
                                           attention_mask=mask, max_new_tokens=8))


def test_compiled_learned_positions_reach_the_table_end_as_eager(tmp_path):
    """GPT-2's learned positions: prompt + new tokens one past the table (the last token drawn,
    never fed) generate compiled as eagerly."""
    transformers = pytest.importorskip("transformers")
    from functional_pp.checkpoint import hf
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                         n_positions=12, attn_pdrop=0.0, resid_pdrop=0.0,
                                                         embd_pdrop=0.0)).save_pretrained(tmp_path)
    cfg, params = hf.load_hf_llama(tmp_path)
    p = sharding.named_tree(params, llama.init(cfg, torch.float32))
    forward, prompts = functools.partial(llama.forward, cfg=cfg), torch.tensor([[5, 17, 3, 40], [31, 7, 60, 2]])
    eager = generate(forward, p, prompts, max_new_tokens=9)
    assert torch.equal(generate(forward, p, prompts, max_new_tokens=9, compile=BACKEND), eager)


def test_static_cache_holds_cache_bytes_of_prompt_and_new_tokens(params):
    tokens, mask = left_padded(RAGGED)
    cache = KVCache(named(torch.tensor([0, 5, 3, 2]), "batch"), capacity=7 + 4)
    with torch.no_grad(), caching(cache):
        llama.forward(params, named(tokens, "batch seq"), CFG)
    assert cache.nbytes() == cache_bytes(CFG, 4, 11) > 0
    with pytest.raises(ValueError, match="exceed the static cache's capacity 5"):
        with torch.no_grad(), caching(KVCache(capacity=5)):
            llama.forward(params, named(tokens, "batch seq"), CFG)


def _device_tokens(params, tokens, mask, compile):
    rules = llama.default_rules()
    with fpp.use_rules(rules):
        decls = llama.init(CFG, torch.float32)
        whole = {k: v for k, v in params.items()}
        local = sharding.named_tree(sharding.shard(_plain(whole), decls, current_context().mesh, rules,
                                                   fpp.current_rank()), decls)
        return _both(local, tokens, mask, compile, n=6)


def _plain(tree):
    from functional_pp.core.tree import tree_map
    return tree_map(lambda x: getattr(x, "data", x), tree)


@pytest.mark.parametrize("processes", [False, True], ids=["simulated", "gloo"])
def test_fsdp_tp_compiled_tokens_equal_one_devices_eager(params, processes):
    """A graph per device at most (the vocabulary-parallel embedding reads the device's index),
    not per token: 4 devices x 2 calls x 6 tokens."""
    tokens, mask = left_padded(RAGGED)
    eager = _both(params, tokens, mask, False, n=6)
    before = _graphs()
    got = fpp.launch(functools.partial(_device_tokens, params, tokens, mask, LAYOUT_BACKEND),
                     fpp.Mesh(dp_shard=2, tp=2), processes=processes)
    assert len(got) == 4
    if not processes:
        assert 1 <= _graphs() - before <= 4
    for device in got:
        for e, c in zip(eager, device):
            assert torch.equal(e, c)
