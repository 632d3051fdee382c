"""Hugging Face Llama import/export: logits equal transformers' on one device and sharded,
exports load with ``from_pretrained``, Meta rotary permutation, clear errors."""
import json

import pytest
import torch
from harness import our_logits, tokens
from safetensors import safe_open
from safetensors.torch import save_file

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp import ops
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.core.layout import block_slices
from functional_pp.models import llama
from functional_pp.ops.rotary import Llama3Scaling, inverse_frequencies
from functional_pp.parallel import sharding
from functional_pp.parallel.named import settle

transformers = pytest.importorskip("transformers")

MESH = fpp.Mesh(dp_shard=2, tp=2)
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=128)
LLAMA3 = dict(BASE, tie_word_embeddings=True,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
VARIANTS = {"plain": BASE, "llama3_tied": LLAMA3}


def hf_model(kw, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float().eval()
    with torch.no_grad():                # O(1) logits and non-trivial norms
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per variant: (model, single-file dir, sharded dir)."""
    out = {}
    for name, kw in VARIANTS.items():
        model = hf_model(kw)
        one = tmp_path_factory.mktemp(f"{name}-one")
        many = tmp_path_factory.mktemp(f"{name}-many")
        model.save_pretrained(one, safe_serialization=True)
        model.save_pretrained(many, safe_serialization=True, max_shard_size="100KB")
        out[name] = (model, one, many)
    return out


def test_config_from_hf_and_back():
    cfg = hf.config_from_hf(transformers.LlamaConfig(**LLAMA3).to_dict())
    assert cfg == llama.Config(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128,
                               rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
                               max_seq=128, rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 32))
    legacy = dict(LLAMA3, model_type="llama")        # transformers 4.x keys
    assert hf.config_from_hf(legacy) == cfg
    back = transformers.LlamaConfig(**hf.config_to_hf(cfg))
    assert hf.config_from_hf(back.to_dict()) == cfg
    assert hf.config_from_hf(transformers.LlamaConfig(**BASE).to_dict()).rope_scaling is None
    with pytest.raises(ck.CheckpointMismatchError, match="rope type 'dynamic'"):
        hf.config_from_hf(dict(BASE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_table_names_round_trip():
    for p, _ in tree.leaves_with_paths(llama.init(llama.Config.tiny())):
        assert hf.our_path(hf.hf_name(p)) == p
    assert hf.hf_name("layers.1.self_attn.o_proj") == "model.layers.1.self_attn.o_proj.weight"
    assert hf.our_path("model.rotary_emb.inv_freq") is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_logits_equal_hf(saved, variant):
    model, one, many = saved[variant]
    cfg, params = hf.load_hf_llama(one)
    assert ("lm_head" in params) == (not cfg.tie_embeddings)
    toks = tokens()
    want = hf_logits(model, toks)
    got = our_logits(params, cfg, toks)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the sharded safetensors set (with an index) reads the same tensors
    assert (many / "model.safetensors.index.json").is_file()
    _, params2 = hf.load_hf_llama(many)
    for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(params2)):
        assert torch.equal(a, b), p


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers(tmp_path, variant):
    cfg = hf.config_from_hf(VARIANTS[variant])
    decls = llama.init(cfg)
    params = tree.tree_map(lambda t: t * 5, fpp.init_params(decls, seed=7))   # std 0.1
    params = tree.map_with_path(lambda p, t: t / 5 + 0.1 * torch.randn_like(t)
                                if "norm" in p else t, params)
    toks = tokens()
    ours = our_logits(params, cfg, toks)
    for sub, shard in (("one", None), ("many", "60KB")):
        out = hf.save_hf_llama(params, cfg, tmp_path / sub, max_shard_size=shard)
        assert (out / "model.safetensors.index.json").is_file() == (shard is not None)
        model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                              attn_implementation="eager")
        torch.testing.assert_close(hf_logits(model, toks), ours, atol=1e-5, rtol=1e-5)
        cfg2, back = hf.load_hf_llama(out)
        assert cfg2 == cfg
        for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(back)):
            assert torch.equal(a, b), p


class _Spy:
    """A safetensors slice handle that records how many elements each read returns."""

    def __init__(self, sl, log):
        self.sl, self.log = sl, log

    def __getitem__(self, idx):
        t = self.sl[idx]
        self.log.append(t.numel())
        return t


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_import_and_forward(saved, variant, monkeypatch):
    model, one, many = saved[variant]
    cfg, full = hf.load_hf_llama(one)
    reads = []
    real = hf._HFReader.slice
    monkeypatch.setattr(hf._HFReader, "slice", lambda self, name: _Spy(real(self, name), reads))
    decls = llama.init(cfg)
    rules = llama.default_rules()
    toks = tokens()
    want = hf_logits(model, toks)

    def device():
        with fpp.use_rules(rules):
            _, local = hf.load_hf_llama(many)
            rank = fpp.current_rank()
            expect = sharding.shard(full, decls, MESH, rules, rank)
            for (p, a), (_, b) in zip(tree.leaves_with_paths(local), tree.leaves_with_paths(expect)):
                assert a.shape == b.shape and torch.equal(a, b), (rank, p)
            sharded = any(a.numel() < b.numel() for (_, a), (_, b)
                          in zip(tree.leaves_with_paths(local), tree.leaves_with_paths(full)))
            with torch.no_grad():
                logits = settle(llama.forward(sharding.named_tree(local, decls),
                                              fpp.named(toks, "batch seq"), cfg))
            region = block_slices(tuple(want.shape), logits.split, MESH, rank)
            torch.testing.assert_close(logits.data, want[region], atol=1e-5, rtol=1e-5)
            return sharded, tuple(logits.data.shape), sum(t.numel() for _, t in
                                                          tree.leaves_with_paths(local))
    results = fpp.launch(device, MESH)
    # the devices read exactly their own shards from the files, nothing more
    assert sum(reads) == sum(n for *_, n in results) < 4 * tree.count_params(full)
    assert all(s for s, *_ in results)
    assert results[0][1] == (2, 12, 128)       # batch over dp_shard, vocab over tp


def test_export_from_sharded_checkpoint(tmp_path):
    cfg = hf.config_from_hf(LLAMA3)
    decls = llama.init(cfg)
    rules = llama.default_rules()

    def device():
        with fpp.use_rules(rules):
            local = fpp.init_params(decls, seed=3, mesh=MESH, rules=rules)
            ck.save_checkpoint(tmp_path / "ckpt", 5, {"params": local}, {"params": decls},
                               rules=rules, config=cfg.to_dict())
    fpp.launch(device, MESH)
    out = hf.export_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=50_000)
    assert not list(out.glob(".consolidate-*"))
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == 20   # tied: no lm_head
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                          attn_implementation="eager")
    toks = tokens()
    ours = our_logits(fpp.init_params(decls, seed=3), cfg, toks)   # init is mesh-independent
    torch.testing.assert_close(hf_logits(model, toks), ours, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- rotary
def meta_rotary(x, theta, scaling):
    """Meta's reference: complex rotation of interleaved pairs (2i, 2i+1); x [B, S, N, D]."""
    S, D = x.shape[1], x.shape[-1]
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inverse_frequencies(D, theta, scaling)[None]
    freqs = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).float()


def hf_permute(w, n_heads):
    """HF convert_llama_weights_to_hf.permute for a Meta [N*D, H] weight."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


@pytest.mark.parametrize("scaling", [None, Llama3Scaling(8.0, 1.0, 4.0, 32)])
def test_meta_interleaved_equals_rotate_half_with_permuted_weights(scaling):
    H, N, D, S = 32, 4, 16, 10
    x = torch.randn(2, S, H)
    wq_meta, wk_meta = torch.randn(H, N, D), torch.randn(H, N, D)   # ours layout, Meta order
    theta = 10000.0

    def ours(w):
        q = torch.einsum("bsh,hnd->bsnd", x, w)
        return ops.rotary(fpp.wrap(q, "batch seq heads head_dim"), ops.positions("seq", S),
                          theta=theta, scaling=scaling, head_dim="head_dim").value()

    def meta(w):
        return meta_rotary(torch.einsum("bsh,hnd->bsnd", x, w), theta, scaling)

    wq, wk = hf.permute_for_rotate_half(wq_meta), hf.permute_for_rotate_half(wk_meta)
    q_meta, k_meta, q, k = meta(wq_meta), meta(wk_meta), ours(wq), ours(wk)
    torch.testing.assert_close(q, hf.permute_for_rotate_half(q_meta), atol=1e-5, rtol=1e-5)
    scores_meta = torch.einsum("bsnd,btnd->bnst", q_meta, k_meta)
    torch.testing.assert_close(torch.einsum("bsnd,btnd->bnst", q, k), scores_meta,
                               atol=1e-4, rtol=1e-5)
    # without the permutation the two conventions disagree
    bad = torch.einsum("bsnd,btnd->bnst", ours(wq_meta), ours(wk_meta))
    assert not torch.allclose(bad, scores_meta, atol=1e-2)
    # inverse, and the flattened Meta [N*D, H] form equals HF's conversion permute
    assert torch.equal(hf.unpermute_from_rotate_half(wq), wq_meta)
    flat = wq_meta.reshape(H, N * D).T
    assert torch.equal(hf.permute_for_rotate_half(flat, dim=0, head_dim=D), hf_permute(flat, N))
    assert torch.equal(hf.unpermute_from_rotate_half(hf_permute(flat, N), dim=0, head_dim=D), flat)


# ----------------------------------------------------------------------------- errors
def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    for where in (tmp_path, tmp_path / "pytorch_model.bin"):
        with pytest.raises(ck.UnsafeFormatError, match=r"(?s)pickle.*safetensors"):
            hf.load_hf_params(where, hf.config_from_hf(BASE))
    with pytest.raises(ck.UnsafeFormatError, match="save_pretrained"):
        hf.load_hf_llama(tmp_path)


def test_missing_tensor_and_shape_mismatch_are_named(saved, tmp_path):
    _, one, _ = saved["plain"]
    with safe_open(str(one / "model.safetensors"), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    gone = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((one / "config.json").read_text())
    with pytest.raises(ck.CheckpointMismatchError, match=f"missing tensors.*{gone}"):
        hf.load_hf_llama(tmp_path)
    cfg = json.loads((one / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=96)))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"model\.layers\.0\.mlp\.gate_proj\.weight: shape mismatch: file "
                             r"\(128, 64\), expected \(96, 64\)"):
        hf.load_hf_llama(tmp_path)
    # an unmapped tensor (a bias) is refused unless strict=False
    save_file(dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ck.CheckpointMismatchError, match=r"unexpected.*q_proj\.bias"):
        hf.load_hf_llama(tmp_path)
    hf.load_hf_llama(tmp_path, strict=False)


def test_every_row_of_the_name_table_has_its_own_paths():
    """The decoder's name table is one list for every family and vision tower: a tree path (or HF name)
    in two rows would read one tower's tensors under another's names (the first row wins)."""
    from collections import Counter

    from functional_pp.models.llama_hf import LLAMA_TABLE
    for column in (0, 1):
        twice = [k for k, n in Counter(row[column] for row in LLAMA_TABLE).items() if n > 1]
        assert not twice, f"in more than one row of LLAMA_TABLE: {twice}"
