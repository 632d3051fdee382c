"""Sampling from the model's pure function with a key / value cache (functional_pp/models/sampling.py,
kv_cache.py): greedy tokens equal transformers' ``generate`` on the same tiny Llama; a FSDP x TP
layout (vocabulary split) draws the same tokens as one device; the temperature / top-k / top-p
filters equal transformers' logits warpers; rows stop at EOS and are padded; prompts of different
lengths in one left-padded batch equal transformers' left-padded ``generate`` and each prompt
generated alone (one device and FSDP x TP), their logits each row's alone, sampled with a seed per
row each row's tokens alone (ALiBi, sinks, soft-caps, latent attention, experts with a capacity per
sequence), whatever the padding holds; ``cache_bytes`` is what a cache holds on each device;
bad arguments are refused."""
from __future__ import annotations

import functools

import pytest
import torch

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core.runtime import current_context
from functional_pp.models import llama
from functional_pp.models.sampling import filtered_logits, generate, left_padded
from functional_pp.parallel import sharding

transformers = pytest.importorskip("transformers")
KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers' tiny Llama, our config, our parameters) with the same weights."""
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float().eval()
    with torch.no_grad():             # weights large enough that attention is far from uniform
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("gen-llama")
    m.save_pretrained(d)
    cfg, params = hf.load_hf_llama(d)
    return m, cfg, params


def _ours(cfg, params, prompts, **kw):
    p = sharding.named_tree(params, llama.init(cfg, torch.float32))
    return generate(functools.partial(llama.forward, cfg=cfg), p, prompts, **kw)


def test_greedy_tokens_equal_transformers_generate(model):
    m, cfg, params = model
    prompts = torch.randint(1, KW["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(1))
    want = m.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    got = _ours(cfg, params, prompts, max_new_tokens=12)
    assert got.shape == (3, 18)
    assert torch.equal(got, want)
    assert len(set(got[:, 6:].flatten().tolist())) > 3               # not one token repeated


def _device_tokens(cfg, params, prompts):
    rules = llama.default_rules()
    with fpp.use_rules(rules):
        decls = llama.init(cfg, torch.float32)
        local = sharding.named_tree(sharding.shard(params, decls, current_context().mesh, rules,
                                                   fpp.current_rank()), decls)
        return generate(functools.partial(llama.forward, cfg=cfg), local, prompts, max_new_tokens=8,
                        temperature=0.8, top_k=20, seed=3), \
            generate(functools.partial(llama.forward, cfg=cfg), local, prompts, max_new_tokens=8)


def test_fsdp_tp_layout_draws_the_tokens_of_one_device(model):
    _, cfg, params = model
    prompts = torch.randint(1, KW["vocab_size"], (4, 5), generator=torch.Generator().manual_seed(2))
    sampled = _ours(cfg, params, prompts, max_new_tokens=8, temperature=0.8, top_k=20, seed=3)
    greedy = _ours(cfg, params, prompts, max_new_tokens=8)
    assert not torch.equal(sampled, greedy)
    for s, g in fpp.launch(functools.partial(_device_tokens, cfg, params, prompts), fpp.Mesh(dp_shard=2, tp=2)):
        assert torch.equal(s, sampled) and torch.equal(g, greedy)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation import logits_process as lp
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=g) * 3
    want = logits.clone()
    for warper in ([lp.TemperatureLogitsWarper(temperature)] + ([lp.TopKLogitsWarper(top_k)] if top_k else [])
                   + ([lp.TopPLogitsWarper(top_p)] if top_p < 1 else [])):
        want = warper(None, want)
    got = filtered_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_rows_stop_at_eos_and_are_padded(model):
    _, cfg, params = model
    prompts = torch.randint(1, KW["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(5))
    free = _ours(cfg, params, prompts, max_new_tokens=6)
    eos = int(free[0, 6])                       # row 0's third new token
    row1 = free[1, 4:].tolist()
    out = _ours(cfg, params, prompts, max_new_tokens=6, eos_id=eos, pad_id=0)
    assert out[0, 4:7].tolist() == free[0, 4:7].tolist() and (out[0, 7:] == 0).all()
    stop = row1.index(eos) + 1 if eos in row1 else len(row1)
    assert out[1, 4:4 + stop].tolist() == row1[:stop]
    only = _ours(cfg, params, prompts[:1], max_new_tokens=6, eos_id=eos)
    assert only.shape == (1, 7) and int(only[0, -1]) == eos          # all rows done: no more steps


def test_bad_arguments_are_refused(model):
    _, cfg, params = model
    with pytest.raises(ValueError, match=r"prompts must be \[batch, length\] token ids"):
        _ours(cfg, params, torch.zeros(3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        _ours(cfg, params, torch.ones(1, 2, dtype=torch.long), max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        filtered_logits(torch.zeros(1, 4), top_p=0.0)


RAGGED = [[5, 9, 17, 3, 40, 22, 8], [11, 2], [30, 31, 7, 12], [44]]


def test_ragged_batch_equals_transformers_left_padded_and_each_prompt_alone(model):
    m, cfg, params = model
    tokens, mask = left_padded(RAGGED, pad_id=0)
    assert mask.tolist()[1] == [0, 0, 0, 0, 0, 1, 1]
    want = m.generate(tokens, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, want)
    for i, p in enumerate(RAGGED):
        alone = _ours(cfg, params, torch.tensor([p]), max_new_tokens=10)
        assert got[i, 7:].tolist() == alone[0, len(p):].tolist(), i
    unmasked = _ours(cfg, params, tokens, max_new_tokens=10)        # the padding seen: other tokens
    assert not torch.equal(unmasked[:, 7:], got[:, 7:])


SEEDS = [101, 102, 103, 104]


def _device_ragged(cfg, params, tokens, mask):
    rules = llama.default_rules()
    with fpp.use_rules(rules):
        decls = llama.init(cfg, torch.float32)
        local = sharding.named_tree(sharding.shard(params, decls, current_context().mesh, rules,
                                                   fpp.current_rank()), decls)
        forward = functools.partial(llama.forward, cfg=cfg)
        return (generate(forward, local, tokens, attention_mask=mask, max_new_tokens=6),
                generate(forward, local, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=2),
                generate(forward, local, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=SEEDS))


def test_ragged_batch_under_fsdp_tp_equals_one_device(model):
    _, cfg, params = model
    tokens, mask = left_padded(RAGGED, pad_id=0)
    greedy = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6)
    sampled = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=2)
    per_row = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=SEEDS)
    for g, s, r in fpp.launch(functools.partial(_device_ragged, cfg, params, tokens, mask),
                              fpp.Mesh(dp_shard=2, tp=2)):
        assert torch.equal(g, greedy) and torch.equal(s, sampled) and torch.equal(r, per_row)


def test_a_seed_per_row_draws_each_rows_tokens_alone(model):
    """A ragged left-padded batch with a seed per row gives each row the tokens it draws alone
    (unpadded, its seed), in any order of the rows; one int seed is one stream for the batch."""
    _, cfg, params = model
    tokens, mask = left_padded(RAGGED, pad_id=0)
    kw = dict(max_new_tokens=10, temperature=1.0)
    got = _ours(cfg, params, tokens, attention_mask=mask, seed=SEEDS, **kw)[:, 7:]
    for i, p in enumerate(RAGGED):
        alone = _ours(cfg, params, torch.tensor([p]), seed=[SEEDS[i]], **kw)
        assert got[i].tolist() == alone[0, len(p):].tolist(), i
    order = [2, 0, 3, 1]
    shuffled, shuffled_mask = left_padded([RAGGED[i] for i in order], pad_id=0)
    again = _ours(cfg, params, shuffled, attention_mask=shuffled_mask, seed=[SEEDS[i] for i in order], **kw)
    assert torch.equal(again[:, shuffled.size(1):], got[order])
    twice = _ours(cfg, params, torch.tensor([RAGGED[0]] * 2), seed=SEEDS[:2], **kw)
    assert not torch.equal(twice[0], twice[1])                            # each seed its own draws
    assert not torch.equal(_ours(cfg, params, tokens, attention_mask=mask, seed=SEEDS[0], **kw)[:, 7:], got)
    with pytest.raises(ValueError, match=r"one seed per row \(4 rows\), got 3 seeds"):
        _ours(cfg, params, tokens, attention_mask=mask, seed=SEEDS[:3], **kw)


FAMILIES = {"alibi": dict(alibi_max=8.0), "sinks_softcap": dict(attn_sinks=True, attn_softcap=20.0, final_softcap=30.0),
            "latent": dict(kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                           head_dim=16),
            "moe": dict(experts=4, experts_top_k=2, moe_mlp=32),
            "moe_capacity": dict(experts=4, experts_top_k=2, moe_mlp=32, capacity_factor=1.0)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_padded_rows_draw_their_tokens_alone(family):
    """ALiBi (its bias from key positions), attention sinks and soft-caps, latent attention,
    experts dropless and with a capacity per sequence (a row's padding takes no slot, its
    capacity is its own tokens'): a ragged left-padded batch's tokens, greedy and with a seed per
    row, are each row's alone."""
    from functional_pp.core.tree import tree_map
    cfg = llama.Config(**{**dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64), **FAMILIES[family]})
    with torch.no_grad():        # weights large enough that the tokens depend on what is attended
        params = tree_map(lambda x: x if x.dims == ("hidden",) else x * 8, fpp.init(llama.init, cfg, seed=0))
    forward = functools.partial(llama.forward, cfg=cfg)
    tokens, mask = left_padded(RAGGED, pad_id=0)
    for kw in (dict(), dict(temperature=1.0, seed=SEEDS)):
        got = generate(forward, params, tokens, attention_mask=mask, max_new_tokens=8, **kw)[:, 7:]
        for i, p in enumerate(RAGGED):
            own = {**kw, "seed": SEEDS[i]} if kw else kw
            alone = generate(forward, params, torch.tensor([p]), max_new_tokens=8, **own)[0, len(p):]
            assert got[i].tolist() == alone.tolist(), (family, kw, i)


def _device_capacity_experts(cfg, whole, tokens, mask):
    rules = llama.default_rules()
    with fpp.use_rules(rules):
        decls = llama.init(cfg, torch.float32)
        local = sharding.named_tree(sharding.shard(whole, decls, current_context().mesh, rules, fpp.current_rank()),
                                    decls)
        return generate(functools.partial(llama.forward, cfg=cfg), local, tokens, attention_mask=mask,
                        max_new_tokens=6, temperature=1.0, seed=SEEDS)


def test_capacity_experts_padding_under_fsdp_tp_equals_one_device():
    """The rows' padding, split over dp_shard with the rows, still takes no expert slot."""
    from functional_pp.core.tree import tree_map
    cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, **FAMILIES["moe_capacity"])
    with torch.no_grad():
        params = tree_map(lambda x: x if x.dims == ("hidden",) else x * 8, fpp.init(llama.init, cfg, seed=0))
    tokens, mask = left_padded(RAGGED, pad_id=0)
    want = generate(functools.partial(llama.forward, cfg=cfg), params, tokens, attention_mask=mask, max_new_tokens=6,
                    temperature=1.0, seed=SEEDS)
    whole = tree_map(lambda x: x.value(), params)
    for got in fpp.launch(functools.partial(_device_capacity_experts, cfg, whole, tokens, mask),
                          fpp.Mesh(dp_shard=2, tp=2)):
        assert torch.equal(got, want)


def _cached_logits(cfg, params, tokens, mask, fed):
    """The last position's logits of the prompt's forward and of one cached step feeding ``fed``."""
    from functional_pp.models.kv_cache import KVCache, caching
    from functional_pp.models.sampling import last_logits
    from functional_pp.parallel.reshard import named
    p = sharding.named_tree(params, llama.init(cfg, torch.float32))
    pads = (mask == 0).sum(1)
    cache = KVCache(named(pads, "batch") if bool(pads.any()) else None)
    with torch.no_grad(), caching(cache):
        first = last_logits(llama.forward(p, named(tokens, "batch seq"), cfg))
        second = last_logits(llama.forward(p, named(fed[:, None], "batch seq"), cfg))
    return first, second


def test_padded_rows_logits_equal_each_row_alone(model):
    """The prompt's and a cached step's logits of each left-padded row are its own unpadded
    row's within fp32 round-off."""
    _, cfg, params = model
    tokens, mask = left_padded(RAGGED, pad_id=0)
    fed = torch.tensor([3, 9, 27, 50])
    first, second = _cached_logits(cfg, params, tokens, mask, fed)
    for i, p in enumerate(RAGGED):
        row = torch.tensor([p])
        own_first, own_second = _cached_logits(cfg, params, row, torch.ones_like(row), fed[i:i + 1])
        torch.testing.assert_close(first[i], own_first[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second[i], own_second[0], rtol=1e-5, atol=1e-5)
    assert first.std(0).mean() > 0.1                                      # the rows' logits differ


def test_the_padding_is_never_attended(model):
    """Another pad id, or random tokens on the padding, leave every row's tokens as they were
    (greedy and sampled with a seed per row)."""
    _, cfg, params = model
    tokens, mask = left_padded(RAGGED, pad_id=0)
    noise = torch.randint(1, KW["vocab_size"], tokens.shape, generator=torch.Generator().manual_seed(5))
    others = [left_padded(RAGGED, pad_id=KW["vocab_size"] - 1)[0], torch.where(mask.bool(), tokens, noise)]
    assert not torch.equal(others[1], tokens)
    for kw in (dict(), dict(temperature=1.0, top_p=0.9, seed=SEEDS)):
        want = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=8, **kw)[:, 7:]
        for other in others:
            got = _ours(cfg, params, other, attention_mask=mask, max_new_tokens=8, **kw)[:, 7:]
            assert torch.equal(got, want), kw


def test_bad_attention_masks_are_refused(model):
    _, cfg, params = model
    tokens = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rows \[1\] are not left-padded"):
        _ours(cfg, params, tokens, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"must have the prompts' shape \(2, 3\)"):
        _ours(cfg, params, tokens, attention_mask=torch.ones(2, 4), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token each"):
        left_padded([[1, 2], []])


def test_ragged_batch_counts_learned_positions_from_each_rows_first_token(tmp_path):
    """GPT-2's learned positions (rotary is relative: only absolute positions show the count)."""
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0)).eval()
    with torch.no_grad():                         # position rows far apart: a wrong count changes the tokens
        for name, p in m.named_parameters():
            if "ln" not in name:
                p.copy_((1.0 if "wpe" in name else 0.3) * torch.randn_like(p))
    m.save_pretrained(tmp_path)
    cfg, params = hf.load_hf_llama(tmp_path)
    tokens, mask = left_padded(RAGGED)
    want = m.generate(tokens, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, want)
    for i, p in enumerate(RAGGED):
        assert got[i, 7:].tolist() == _ours(cfg, params, torch.tensor([p]), max_new_tokens=8)[0, len(p):].tolist()


def _cache_after(cfg, params, prompts, new, rules=None):
    """The bytes a cache holds on this device after the prompts' forward and ``new`` more tokens."""
    from functional_pp.models.kv_cache import KVCache, caching
    from functional_pp.parallel.reshard import named
    decls = llama.init(cfg, torch.float32)
    ctx = current_context(required=False)
    with fpp.use_rules(rules or fpp.Rules()), torch.no_grad():
        local = params if ctx is None else sharding.shard(params, decls, ctx.mesh, rules, fpp.current_rank())
        p = sharding.named_tree(local, decls)
        cache = KVCache()
        with caching(cache):
            llama.forward(p, named(prompts, "batch seq"), cfg)
            for _ in range(new):
                llama.forward(p, named(prompts[:, :1], "batch seq"), cfg)
        return cache.nbytes()


@pytest.mark.parametrize("family", ["llama", "latent"])
def test_cache_bytes_are_what_the_cache_holds_on_each_device(model, family):
    from functional_pp.models.kv_cache import cache_bytes
    _, cfg, params = model
    if family == "latent":                       # DeepSeek's latent attention: other widths
        cfg = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=4, mlp=64, max_seq=64, kv_lora_rank=8,
                           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
        params = fpp.init(llama.init, cfg, seed=0)
    prompts = torch.randint(1, 64, (4, 5), generator=torch.Generator().manual_seed(6))
    one = _cache_after(cfg, _whole(params), prompts, 3)
    assert one == cache_bytes(cfg, 4, 8) > 0
    rules = llama.default_rules()
    got = fpp.launch(functools.partial(_cache_after, cfg, _whole(params), prompts, 3, rules), fpp.Mesh(dp_shard=2, tp=2))
    assert set(got) == {cache_bytes(cfg, 4, 8, batch_split=2, kv_heads_split=2)} == {one // 4}


def _whole(params):
    """Plain tensors of a parameter tree (named arrays unwrapped)."""
    from functional_pp.core.tree import tree_map
    return tree_map(lambda x: getattr(x, "data", x), params)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers' tiny Mistral with a 3-token sliding window, our config, our parameters)."""
    torch.manual_seed(0)
    m = transformers.MistralForCausalLM(transformers.MistralConfig(**KW, sliding_window=3)).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("gen-mistral")
    m.save_pretrained(d)
    cfg, params = hf.load_hf_llama(d)
    assert cfg.window(0) == 3
    return m, cfg, params


def test_sliding_window_equals_transformers_sliding_cache(mistral):
    """A new token sees the cached keys of its window only (transformers' sliding-window cache):
    unpadded and left-padded, one device and FSDP x TP."""
    import dataclasses
    m, cfg, params = mistral
    prompts = torch.randint(1, KW["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    want = m.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert torch.equal(_ours(cfg, params, prompts, max_new_tokens=10), want)
    whole = _ours(dataclasses.replace(cfg, sliding_window=None), params, prompts, max_new_tokens=10)
    assert not torch.equal(whole, want)                        # the window changes the tokens
    tokens, mask = left_padded(RAGGED, pad_id=0)
    want = m.generate(tokens, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(got, want)
    sampled = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=2)
    per_row = _ours(cfg, params, tokens, attention_mask=mask, max_new_tokens=6, temperature=0.9, seed=SEEDS)
    for i, p in enumerate(RAGGED):                             # each row's window counted from its own tokens
        alone = _ours(cfg, params, torch.tensor([p]), max_new_tokens=6, temperature=0.9, seed=SEEDS[i])
        assert per_row[i, 7:].tolist() == alone[0, len(p):].tolist(), i
    for g, s, r in fpp.launch(functools.partial(_device_ragged, cfg, params, tokens, mask),
                              fpp.Mesh(dp_shard=2, tp=2)):
        assert torch.equal(g, got) and torch.equal(s, sampled) and torch.equal(r, per_row)
