"""The oracle: a small transformer (embedding, RMSNorm, causal GQA attention with rotary
embedding, SwiGLU MLP, vocab-parallel loss, two layers) written once, whose loss and every
parameter gradient equal the single-device run under every layout."""
import itertools

import pytest
import torch
from harness import make_batch, parallel, single_device

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama

CFG = llama.Config.tiny()
FULL = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
BATCH = make_batch(CFG, batch=8, seq=16)
REF = single_device(CFG, FULL, BATCH)


def assert_matches_reference(results, ref=REF):
    loss0, grads0 = ref
    for rank, (loss, grads, _) in enumerate(results):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank} loss: {m}")
        for (path, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} grad {path}: {m}")


R = fpp.Rules
LAYOUTS = {
    "dp": (dict(dp_replicate=4), R(batch=("dp_replicate", "dp_shard"))),
    "fsdp": (dict(dp_shard=4), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard")),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), R(batch=("dp_replicate", "dp_shard"), hidden="dp_shard")),
    "tp": (dict(tp=2), llama.default_rules(fsdp=False)),
    "tp_sp": (dict(tp=2), llama.default_rules(fsdp=False, sequence_parallel=True)),
    "cp": (dict(cp=4), R(batch=("dp_replicate", "dp_shard"), seq="cp")),
    "fsdp_tp": (dict(dp_shard=2, tp=2), llama.default_rules()),
    "fsdp_cp": (dict(dp_shard=2, cp=2), llama.default_rules(tp=False)),
    "dp_fsdp_cp_tp": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules()),
    "all_sp": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), llama.default_rules(sequence_parallel=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name):
    mesh_kw, rules = LAYOUTS[name]
    assert_matches_reference(parallel(CFG, FULL, BATCH, fpp.Mesh(**mesh_kw), rules))


def test_cp_allgather_attention_and_keep_gathered_match():
    mesh_kw, rules = LAYOUTS["fsdp_cp"]
    assert_matches_reference(parallel(CFG, FULL, BATCH, fpp.Mesh(**mesh_kw), rules,
                                      options=dict(cp_attention="allgather", keep_gathered=True)))


def test_tied_embeddings_and_noncausal_paths():
    cfg = llama.Config.tiny(tie_embeddings=True)
    full = fpp.init_params(llama.init(cfg, torch.float64), seed=1)
    ref = single_device(cfg, full, BATCH)
    assert_matches_reference(parallel(cfg, full, BATCH, fpp.Mesh(dp_shard=2, tp=2), llama.default_rules()), ref)


# the decoder families as configurations (models/llama.py; docs/models.md): q/k/v biases, an
# output bias, per-head q/k RMSNorm with an explicit head_dim, sliding windows (every layer, or
# alternating with full attention: the window under CP takes the K/V all-gather path), tied
# embeddings, Gemma 2's sandwich (1 + w) norms, scaled embedding, tanh-GELU GLU and soft-caps,
# Gemma 3's rope base of the local layers
FAMILIES = {
    "mistral": llama.Config.tiny(model_type="mistral", sliding_window=5),
    "qwen2": llama.Config.tiny(model_type="qwen2", qkv_bias=True, tie_embeddings=True, sliding_window=4,
                               layer_types=("full_attention", "sliding_attention")),
    "qwen3": llama.Config.tiny(model_type="qwen3", qk_norm=True, head_dim=32, qkv_bias=True, o_bias=True),
    "gemma2": llama.Config.tiny(model_type="gemma2", mlp_act="gelu_tanh", norm_offset=1.0, scale_embeddings=True,
                                sandwich_norms=True, query_pre_attn_scalar=24.0, attn_softcap=2.0, final_softcap=3.0,
                                sliding_window=5, layer_types=("sliding_attention", "full_attention"),
                                tie_embeddings=True),
    "gemma3_text": llama.Config.tiny(model_type="gemma3_text", mlp_act="gelu_tanh", norm_offset=1.0,
                                     scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=16.0,
                                     qk_norm=True, sliding_window=5, local_rope_theta=10.0,
                                     layer_types=("sliding_attention", "full_attention"), tie_embeddings=True),
    # SmolLM3's NoPE layer; Granite's multipliers; OLMo 2's norms after each block only and q/k
    # norms over every head (split over tp: one norm across the shards); Cohere's parallel block,
    # LayerNorm and interleaved rotary; Phi's LayerNorm biases, partial rotary, GELU MLP with
    # biases and LM-head bias; GPT-NeoX's parallel MLP with its own norm
    "smollm3": llama.Config.tiny(model_type="smollm3", nope_layers=(1,), tie_embeddings=True),
    "granite": llama.Config.tiny(model_type="granite", embedding_multiplier=3.0, residual_multiplier=0.5,
                                 query_pre_attn_scalar=64.0, logit_scale=0.25),
    "olmo2": llama.Config.tiny(model_type="olmo2", pre_norms=False, sandwich_norms=True, qk_norm=True,
                               qk_norm_heads=True),
    "cohere": llama.Config.tiny(model_type="cohere", parallel_block=True, norm_kind="layer", rotary_interleaved=True,
                                logit_scale=0.5, tie_embeddings=True),
    "phi": llama.Config.tiny(model_type="phi", parallel_block=True, norm_kind="layer", norm_bias=True, mlp_gated=False,
                             mlp_bias=True, mlp_act="gelu_tanh", lm_head_bias=True, qkv_bias=True, o_bias=True,
                             partial_rotary_factor=0.5),
    "gpt_neox": llama.Config.tiny(model_type="gpt_neox", parallel_block=True, parallel_mlp_norm=True, norm_kind="layer",
                                  norm_bias=True, mlp_gated=False, mlp_bias=True, mlp_act="gelu", qkv_bias=True,
                                  o_bias=True, partial_rotary_factor=0.25, kv_heads=4),
    # GPT-2's learned positions (each device's rows of the table: its positions under CP, load-balanced);
    # GLM-4-0414's sandwich norms with interleaved partial rotary; Nemotron's LayerNorm1P (1 + w, a bias)
    "gpt2": llama.Config.tiny(model_type="gpt2", learned_positions=True, norm_kind="layer", norm_bias=True,
                              mlp_gated=False, mlp_bias=True, mlp_act="gelu_tanh", qkv_bias=True, o_bias=True,
                              kv_heads=4, tie_embeddings=True, max_seq=32),
    "glm4": llama.Config.tiny(model_type="glm4", qkv_bias=True, sandwich_norms=True, rotary_interleaved=True,
                              partial_rotary_factor=0.5),
    "nemotron": llama.Config.tiny(model_type="nemotron", norm_kind="layer", norm_bias=True, norm_offset=1.0,
                                  mlp_gated=False, mlp_act="relu2", partial_rotary_factor=0.5),
}


def _noisy(cfg, seed):              # biases start at zero, norms at one: move them
    full = fpp.init_params(llama.init(cfg, torch.float64), seed=seed)
    g = torch.Generator().manual_seed(seed)
    return tree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype), full)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", ["fsdp_tp", "cp", "all_sp"])
def test_family_layout_matches_single_device(family, name):
    cfg = FAMILIES[family]
    full = _noisy(cfg, 4)
    mesh_kw, rules = LAYOUTS[name]
    assert_matches_reference(parallel(cfg, full, BATCH, fpp.Mesh(**mesh_kw), rules), single_device(cfg, full, BATCH))


def factorizations(n=8):
    sizes = [1, 2, 4, 8]
    for combo in itertools.product(sizes, repeat=4):
        if combo[0] * combo[1] * combo[2] * combo[3] == n:
            yield dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), combo))


ALL_8 = [(f, fsdp) for f in factorizations() for fsdp in (True, False)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_kw,fsdp", ALL_8, ids=[f"{'x'.join(str(v) for v in f.values())}-{'fsdp' if s else 'nofsdp'}"
                                                      for f, s in ALL_8])
def test_every_factorization_of_8_devices(mesh_kw, fsdp):
    rules = llama.default_rules(fsdp=fsdp)
    if mesh_kw["tp"] > 2:     # tiny has kv_heads=2: use the 8-head variant
        assert_matches_reference(parallel(CFG4, FULL4, BATCH, fpp.Mesh(**mesh_kw), rules), REF4)
    else:
        assert_matches_reference(parallel(CFG, FULL, BATCH, fpp.Mesh(**mesh_kw), rules))


CFG4 = llama.Config.tiny(heads=8, kv_heads=8)  # splits over tp up to 8
FULL4 = fpp.init_params(llama.init(CFG4, torch.float64), seed=2)
REF4 = single_device(CFG4, FULL4, BATCH)


def test_tp4_with_four_kv_heads():
    assert_matches_reference(parallel(CFG4, FULL4, BATCH, fpp.Mesh(dp_shard=2, tp=4), llama.default_rules()), REF4)


# ------------------------------------------------------------------------- bad input
def _run(mesh_kw, rules, cfg=CFG, batch=BATCH):
    full = fpp.init_params(llama.init(cfg, torch.float64), seed=0)
    return parallel(cfg, full, batch, fpp.Mesh(**mesh_kw), rules)


def test_heads_not_divisible_by_tp():
    with pytest.raises(fpp.DeviceError, match=r"layers\.0\.self_attn\.k_proj: dim 'kv_heads' has size 2.*tp"):
        _run(dict(tp=4), llama.default_rules(fsdp=False))
    cfg = llama.Config.tiny(heads=6, kv_heads=6, hidden=48)
    with pytest.raises(fpp.DeviceError, match=r"_proj: dim '(kv_)?heads' has size 6, which is not divisible.*tp=4"):
        _run(dict(tp=4), llama.default_rules(fsdp=False), cfg=cfg)


def test_sequence_not_divisible_by_2cp():
    batch = make_batch(CFG, batch=2, seq=12)
    with pytest.raises(fpp.DeviceError, match=r"'seq' of size 12 is load-balanced over 'cp'.*divisible by 8"):
        _run(dict(cp=4), R(seq=fpp.balanced("cp")), batch=batch)   # the batch layout refuses it

    def attend():                                       # and so does the attention op itself
        with fpp.use_rules(R(seq=fpp.balanced("cp"))):
            q = fpp.wrap(torch.ones(1, 3, 2, 4), "batch seq heads head_dim")
            k = fpp.wrap(torch.ones(1, 3, 2, 4), "batch seq kv_heads head_dim")
            return fpp.ops.attention(q, k, k, causal=True, batch="batch", seq="seq", heads="heads", kv_heads="kv_heads", head_dim="head_dim")
    with pytest.raises(fpp.DeviceError, match=r"sequence length \(12\) divisible by 2 x cp = 8"):
        fpp.launch(attend, fpp.Mesh(cp=4))


def test_two_dims_wanting_one_mesh_axis_in_explicit_spec():
    with pytest.raises(fpp.DeviceError, match="dimensions 0 and 1 both want mesh axis 'tp'|'dim 0' and 'dim 1' both want"):
        fpp.launch(lambda: fpp.shard_map(lambda x: x, fpp.P("tp", "tp"), fpp.P())(torch.ones(4, 4)), fpp.Mesh(tp=2))


def test_unknown_logical_name_in_pattern():
    x = fpp.named(torch.ones(2, 3), "batch hidden")
    w = fpp.named(torch.ones(3, 4), "hidden mlp")
    with pytest.raises(ValueError, match=r"operand 1 has dimensions \('hidden', 'mlp'\) but the pattern names \('hidden', 'mpl'\)"):
        fpp.ops.einsum("batch hidden, hidden mpl -> batch mpl", x, w)
    with pytest.raises(ValueError, match="output dimension 'vocab' appears in no operand"):
        fpp.ops.einsum("batch hidden, hidden mlp -> batch vocab", x, w)
    with pytest.raises(ValueError, match="dimension 'hidden' has size 3 in one operand and 5"):
        fpp.ops.einsum("batch hidden, hidden mlp -> batch mlp", x, fpp.named(torch.ones(5, 4), "hidden mlp"))
