"""The masked-diffusion objective (Axolotl's ``DiffusionPlugin``, models/diffusion_lm.py).
Oracles: transformers' ``LlamaForCausalLM`` run bidirectionally (a block-diagonal 4D attention
mask built by hand) on the same masked inputs, with Axolotl's trainer's formula (the logits
shifted onto the inputs, cross-entropy over the masked answer tokens divided by p, each row over
its answer tokens, the mean over rows), in fp64: loss and gradients; one device for the layouts
and for real gloo processes."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from harness import assert_processes_equal_one_device, parallel

import functional_pp as fpp
from functional_pp.checkpoint import hf
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.models.diffusion_lm import DiffusionSpec, diffusion_loss
from functional_pp.parallel import sharding
from functional_pp.ops.keep_mask import uniform

transformers = pytest.importorskip("transformers")

BOS, EOS, MASK, SEED = 1, 2, 63, 5
SPEC = DiffusionSpec(mask_token_id=MASK, eps=1e-3, importance_weighting=True)
CFG = llama.Config(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, max_seq=32)
LENGTHS = [[5, 7], [12], [4, 4, 4]]          # each row's documents (packed rows of 12 tokens)


def _rows(S: int = 12) -> dict:
    """Axolotl's inputs of packed SFT rows: ``ids``; ``answer`` (its labels != -100: the second half of
    each document, EOS included, after BOS and a prompt); ``segments`` (document ids); and ours:
    ``tokens`` = ids, ``labels`` = the next token where it is an answer token, else -100, the last
    label a token past the row (never trained here)."""
    g = torch.Generator().manual_seed(3)
    ids, answer, segments = [], [], []
    for lengths in LENGTHS:
        row, ans, seg = [], [], []
        for d, n in enumerate(lengths):
            doc = [BOS, *torch.randint(3, MASK, (n - 2,), generator=g).tolist(), EOS]
            row += doc
            ans += [False] * (n - n // 2) + [True] * (n // 2)
            seg += [d] * n
        ids.append(row), answer.append(ans), segments.append(seg)
    ids, answer, segments = torch.tensor(ids), torch.tensor(answer), torch.tensor(segments)
    nxt = torch.randint(3, MASK, (len(LENGTHS), 1), generator=g)
    labels = torch.where(answer, ids, -100)[:, 1:]
    return {"ids": ids, "answer": answer, "segments": segments,
            "batch": {"tokens": ids, "labels": torch.cat([labels, nxt], 1), "segments": segments}}


def _hf_dir(tmp_path):
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-5,
                                    max_position_embeddings=32, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(conf)
    with torch.no_grad():
        for n, w in model.named_parameters():
            w.copy_(1 + 0.1 * torch.randn_like(w) if "norm" in n else 0.2 * torch.randn_like(w))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _ours(cfg, spec=SPEC, special=(BOS, EOS)):
    forward = functools.partial(llama.forward, cfg=dataclasses.replace(cfg, causal=False))
    return lambda named, b, _cfg: diffusion_loss(named, b, forward=forward, spec=spec, special_ids=special, seed=SEED)


def _axolotl_loss(model, rows: dict, spec: DiffusionSpec, forward: int = 0) -> torch.Tensor:
    """Axolotl's ``DiffusionTrainer._forward_process`` and ``_compute_diffusion_loss`` (SFT: labels
    given) with its two torch.rand draws replaced by ours (the hash of seed, forward, row, position)."""
    ids, answer, seg = rows["ids"], rows["answer"], rows["segments"]
    B, S = ids.shape
    site = lambda s: torch.tensor(s)                                            # noqa: E731
    t = uniform(SEED, [torch.tensor(forward), site(0), torch.arange(B)])
    p_mask = ((1 - spec.eps) * t + spec.eps)[:, None].repeat(1, S)
    attention_mask = seg + 1                                                    # packed: segment ids, 1-based
    p_mask = p_mask * attention_mask.bool().float()
    special = (ids == BOS) | (ids == EOS)
    rand = uniform(SEED, [torch.tensor(forward), site(1), torch.arange(B)[:, None], torch.arange(S)[None, :]])
    masked = (rand < p_mask) & ~special & attention_mask.bool() & answer
    noisy = torch.where(masked, torch.full_like(ids, spec.mask_token_id), ids)
    m_i, m_j = attention_mask.unsqueeze(2), attention_mask.unsqueeze(1)
    bidirectional = ((m_i == m_j) & (m_i > 0)).unsqueeze(1)
    logits = model(input_ids=noisy, attention_mask=bidirectional).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    b, s = torch.where(masked)
    token_loss = torch.nn.functional.cross_entropy(logits[b, s], ids[b, s], reduction="none")
    weighted = token_loss / p_mask[b, s] if spec.importance_weighting else token_loss
    lengths = answer.sum(1).to(logits.dtype)
    per_row = torch.stack([weighted[b == i].sum() / lengths[i].clamp(min=1.0) for i in range(B)])
    assert masked.any() and masked.sum() < answer.sum()
    _axolotl_loss.metrics = {"diffusion_masked_tokens": masked.sum().item(), "diffusion_mask_ratio":
                             masked.float().mean().item(), "diffusion_ce_loss": token_loss.mean().item()}
    return per_row.mean()


@pytest.mark.parametrize("weighting", [True, False])
def test_loss_and_gradients_equal_axolotls_formula_on_transformers(tmp_path, weighting):
    d = _hf_dir(tmp_path)
    # (sdpa, as Axolotl's config: transformers' eager attention adds a boolean 4D mask to the scores)
    model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="sdpa")
    cfg, params = hf.load_hf_llama(d, dtype=torch.float64)
    spec = dataclasses.replace(SPEC, importance_weighting=weighting)
    rows = _rows()
    want = _axolotl_loss(model, rows, spec)
    want.backward()
    found = {}

    def collected(named, b, c):
        from functional_pp.core import step_values
        with step_values.collecting() as values:
            out = _ours(cfg, spec)(named, b, c)
        found.update({k: v.item() for k, (v, _) in values.items()})
        return out
    loss, grads, _ = parallel(cfg, params, rows["batch"], fpp.Mesh(), fpp.Rules(), loss_fn=collected)[0]
    assert found.keys() == _axolotl_loss.metrics.keys()       # Axolotl's metrics of the masking
    for k, v in _axolotl_loss.metrics.items():
        assert abs(found[k] - v) <= 1e-7 * abs(v), (k, found[k], v)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)    # (transformers' rotary tables: fp32)
    ours = dict(tree.leaves_with_paths(grads))
    files = dict(hf._file_tensors(llama.init(cfg), cfg))
    for name, w in model.named_parameters():
        (path, kind, _), = files[name]
        torch.testing.assert_close(kind.to_hf(ours[path]), w.grad, rtol=1e-5, atol=1e-6 * w.grad.abs().max().item(),
                                   msg=lambda s: f"{name}: {s}")
    # the attention is bidirectional and the masks matter: causal attention or another seed differ
    causal = lambda named, b, _c: diffusion_loss(                                                # noqa: E731
        named, b, forward=functools.partial(llama.forward, cfg=cfg), spec=spec, special_ids=(BOS, EOS), seed=SEED)
    assert abs(parallel(cfg, params, rows["batch"], fpp.Mesh(), fpp.Rules(), loss_fn=causal)[0][0] - loss) > 1e-4
    other = lambda named, b, _c: diffusion_loss(                                                  # noqa: E731
        named, b, forward=functools.partial(llama.forward, cfg=dataclasses.replace(cfg, causal=False)), spec=spec,
        special_ids=(BOS, EOS), seed=SEED + 1)
    assert abs(parallel(cfg, params, rows["batch"], fpp.Mesh(), fpp.Rules(), loss_fn=other)[0][0] - loss) > 1e-4


LAYOUTS = {
    "dp_fsdp": (fpp.Mesh(dp_replicate=1, dp_shard=2), llama.default_rules(tp=False)),
    "fsdp_tp_sp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True)),
    "cp": (fpp.Mesh(cp=2), llama.default_rules(tp=False)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_device(layout):
    mesh, rules = LAYOUTS[layout]
    params = fpp.init_params(llama.init(CFG, torch.float64), seed=0)
    batch = _rows()["batch"]
    batch = {k: torch.cat([v, v.flip(0)[:1]]) for k, v in batch.items()}       # 4 rows (2 per data-parallel device)
    loss0, grads0, _ = parallel(CFG, params, batch, fpp.Mesh(), fpp.Rules(), loss_fn=_ours(CFG))[0]
    for rank, (loss, grads, _) in enumerate(parallel(CFG, params, batch, mesh, rules, loss_fn=_ours(CFG))):
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for (p, g), (_, g0) in zip(tree.leaves_with_paths(grads), tree.leaves_with_paths(grads0)):
            torch.testing.assert_close(g, g0, rtol=1e-9, atol=1e-12, msg=lambda m: f"rank {rank} {p}: {m}")


def test_real_processes_equal_one_device():
    """Two AdamW steps on four gloo processes (FSDP x TP) equal one device's, diffusion objective."""
    forward = functools.partial(llama.forward, cfg=dataclasses.replace(CFG, causal=False))
    objective = functools.partial(diffusion_loss, forward=forward, spec=SPEC, special_ids=(BOS, EOS), seed=SEED)
    assert_processes_equal_one_device(CFG, wrap_loss=lambda _loss: objective)


@pytest.mark.parametrize("kw, message", [
    (dict(min_mask_ratio=0.8, max_mask_ratio=0.2),
     r"diffusion.min_mask_ratio \(0.8\) must be <= max_mask_ratio \(0.2\)"),
    (dict(eps=1.5), r"diffusion.eps must be a number in \[0.0, 1.0\], got 1.5"),
    (dict(noise_schedule="sqrt"), r"diffusion.noise_schedule 'sqrt' is not one of linear, cosine"),
    (dict(mask_token_id=-1), r"diffusion.mask_token_id must be a token id"),
    (dict(generation_interval=0), r"diffusion.generation_interval must be an integer >= 1, got 0"),
])
def test_bad_settings_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        DiffusionSpec(**kw)


def test_mask_token_outside_the_vocabulary_refused():
    with pytest.raises(ValueError, match=r"diffusion.mask_token_id 64 is outside the model's vocabulary of 64 tokens"):
        DiffusionSpec(mask_token_id=64).check_vocab(64)
    with pytest.raises(ValueError, match=r"diffusion.mask_token_id is not set"):
        DiffusionSpec().check_vocab(64)
    DiffusionSpec(mask_token_id=63).check_vocab(64)


def test_bidirectional_attention_refused_with_recurrent_or_local_layers():
    with pytest.raises(ValueError, match=r"bidirectional attention \(causal=False, the diffusion objective\) is not "
                                         r"supported with sliding-window or chunked attention \(layers \[0, 1\]\)"):
        dataclasses.replace(CFG, sliding_window=4, causal=False)


@pytest.mark.parametrize("weighting", ["rows", "labels"])
def test_accumulated_micro_batches_weigh_equally_by_rows(weighting):
    """Two micro-batches of different answer counts: the step's loss is the mean of their row means
    (``micro_weighting="rows"``, what a ``diffusion:`` run uses), not their label-weighted mean."""
    from functional_pp.models import dropout_seeds
    batch = _rows()["batch"]
    batch = {k: torch.cat([v[:1], v]) for k, v in batch.items()}          # rows 0, 0 | rows 1, 2
    forward = functools.partial(llama.forward, cfg=dataclasses.replace(CFG, causal=False))
    objective = functools.partial(diffusion_loss, forward=forward, spec=SPEC, special_ids=(BOS, EOS), seed=SEED)
    step = fpp.train_step(objective, fpp.optim.adamw(1e-3), mesh=fpp.Mesh(), rules=fpp.Rules(), grad_accum=2,
                          micro_weighting=weighting, batch_dims={"tokens": "batch seq", "labels": "batch seq",
                                                                 "segments": "batch seq"})

    def run():
        params = named = fpp.init(llama.init, CFG, torch.float64, seed=0)
        dropout_seeds.begin_step(0)
        halves = [objective(named, {k: fpp.wrap(v[i:i + 2], "batch seq") for k, v in batch.items()}).value()
                  for i in (0, 2)]
        dropout_seeds.begin_step(0)
        _, m = step(step.init(params), batch)
        return float(m["loss"]), [float(h) for h in halves]
    loss, (a, b) = fpp.launch(run, fpp.Mesh())[0]
    counts = [int((batch["labels"][i:i + 2] != -100).sum()) for i in (0, 2)]     # (what "labels" counts)
    assert counts[0] != counts[1]
    want = (a + b) / 2 if weighting == "rows" else (counts[0] * a + counts[1] * b) / sum(counts)
    assert abs(loss - want) < 1e-10 * abs(want)
    assert abs((a + b) / 2 - (counts[0] * a + counts[1] * b) / sum(counts)) > 1e-4       # (the weightings differ)


def test_latent_attention_bidirectional_equals_transformers(tmp_path):
    """DeepSeek-V3's latent attention takes the same option: logits equal transformers' with the
    block-diagonal 4D mask (sdpa)."""
    torch.manual_seed(0)
    conf = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        rms_norm_eps=1e-5, max_position_embeddings=32, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    model = transformers.DeepseekV3ForCausalLM(conf)
    with torch.no_grad():
        for n, w in model.named_parameters():
            w.copy_(1 + 0.1 * torch.randn_like(w) if "norm" in n else 0.2 * torch.randn_like(w))
    model.save_pretrained(tmp_path, safe_serialization=True)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                                                attn_implementation="sdpa",
                                                                experts_implementation="eager").eval()
    cfg, params = hf.load_hf_llama(tmp_path, dtype=torch.float64)
    rows = _rows()
    seg = rows["segments"] + 1
    with torch.no_grad():
        want = model(input_ids=rows["ids"], attention_mask=(seg[:, :, None] == seg[:, None, :]).unsqueeze(1)).logits
        named = sharding.named_tree(params, llama.init(cfg, torch.float64))
        got = llama.forward(named, fpp.wrap(rows["ids"], "batch seq"), dataclasses.replace(cfg, causal=False),
                            segments=fpp.wrap(rows["segments"], "batch seq")).value()
        causal = llama.forward(named, fpp.wrap(rows["ids"], "batch seq"), cfg,
                               segments=fpp.wrap(rows["segments"], "batch seq")).value()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (causal - want).abs().max() > 1e-2
