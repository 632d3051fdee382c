"""EBFT's strided mode (docs/preference.md "EBFT"): the hidden states of chosen layers
(``llama.layer_states``, a recording layer wrapper) equal transformers' ``output_hidden_states``
on a tiny Llama; the anchors, block features, whitening, rewards and advantages
(functional_pp/preference/ebft.py) of fixed samples equal the paper's formulas re-derived here
from transformers' hidden states (the whitening through an eigendecomposition of the samples'
Gram matrix, the rewards and advantages sample by sample); the rollout samples each block from the
document before its anchor (transformers' greedy continuation at a temperature near 0), its
bounded sampling calls drawing what one call does; the loss
and gradients of the batch equal their re-derivation on transformers, and FSDP x TP with
accumulation and two gloo processes equal one device."""
from __future__ import annotations

import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.core.tree import leaves_with_paths, tree_map
from functional_pp.preference import ebft
from functional_pp.data.ebft_documents import Document
from functional_pp.preference.ebft_rollout import ebft_batch, ebft_metrics, score_samples
from functional_pp.preference.ebft_spec import EBFTSpec, ebft_spec
from functional_pp.preference.weighted_logps import weighted_logps_objective

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
    return m, cfg, sharding.named_tree(params, llama.init(cfg)), params


def test_layer_states_equal_transformers_hidden_states(model):
    m, cfg, params, _ = model
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


# a document of S tokens, blocks of GEN tokens every STRIDE from CTX, N samples per block
S, CTX, STRIDE, GEN, N = 20, 4, 4, 4, 3
FRACTIONS = (0.25, 0.5, 0.75)


def test_strided_anchors():
    assert ebft.strided_anchors(S, stride=STRIDE, context_length=CTX, generate_max_len=GEN) == [4, 8, 12, 16]
    assert ebft.strided_anchors(S, stride=3, context_length=5, generate_max_len=4) == [5, 8, 11, 14]
    # with a prompt: from max(prompt + min_completion_prefix, context_length)
    assert ebft.strided_anchors(S, stride=4, context_length=4, generate_max_len=4, prompt_length=6,
                                min_completion_prefix=2) == [8, 12, 16]
    assert ebft.strided_anchors(S, stride=4, context_length=12, generate_max_len=4, prompt_length=2) == [12, 16]
    assert ebft.strided_anchors(7, stride=4, context_length=4, generate_max_len=4) == []
    with pytest.raises(ValueError, match="ebft.stride must be >= 1"):
        ebft.strided_anchors(S, stride=0, context_length=4, generate_max_len=4)
    assert ebft.feature_layer_indices(FRACTIONS, 4) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"ebft.feature_layers must be fractions"):
        ebft.feature_layer_indices([0.5, 1.5], 4)


def _hf_block_feature(m, toks, start, layers, method):
    """The paper's feature of tokens ``start .. start + GEN - 1`` of ``toks``, from transformers."""
    with torch.no_grad():
        hs = m(input_ids=toks[None], output_hidden_states=True).hidden_states
    per_token = torch.cat([torch.nn.functional.normalize(hs[i][0, start:start + GEN].double(), dim=-1)
                           for i in layers], -1)
    return per_token[-1] if method == "last_token" else per_token.mean(0)


def _whitening(phi, tol=1e-5):
    """The pseudo-inverse square root of the samples' Gram matrix ``phi^T phi`` (eigenvalues
    ``s^2``), the directions of singular values below ``tol * max s`` dropped."""
    lam, u = torch.linalg.eigh(phi.T @ phi)
    s = lam.clamp(min=0).sqrt()
    keep = s > tol * s.max()
    return (u[:, keep] / s[keep]) @ u[:, keep].T


def _expected(feats, refs, whitening, estimator, align=1.0, div=1.0):
    """Rewards and advantages of one block, sample by sample."""
    if whitening:
        w = _whitening(feats)
        feats, refs = feats @ w, refs @ w
    n = len(feats)
    r = []
    for j in range(n):
        cos = feats[j] @ refs / (feats[j].norm() * refs.norm())
        others = sum(feats[j] @ feats[k] for k in range(n) if k != j) if n > 1 else torch.tensor(0.0)
        r.append(align * 2 * cos - div * 2 * others / max(n - 1, 1))
    r = torch.stack(r)
    if n == 1 or estimator == "reinforce":
        return r, r
    if estimator == "rloo":
        return r, torch.stack([r[j] - (r.sum() - r[j]) / (n - 1) for j in range(n)])
    mean = r.mean()
    std = ((r - mean) ** 2).sum().div(n - 1).sqrt()
    return r, (r - mean) / (std + 1e-8)


@pytest.mark.parametrize("method,whitening,estimator", [("last_token", True, "rloo"),
                                                        ("mean_pooling", False, "group_norm"),
                                                        ("last_token", False, "reinforce")])
def test_rewards_and_advantages_equal_the_formulas_on_transformers_features(model, method, whitening, estimator):
    m, cfg, params, _ = model
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(0, 64, (S,), generator=g)
    anchors = ebft.strided_anchors(S, stride=STRIDE, context_length=CTX, generate_max_len=GEN)
    samples = torch.randint(0, 64, (len(anchors), N, GEN), generator=g)
    layers = ebft.feature_layer_indices(FRACTIONS, cfg.layers)
    # ours: every block's samples as rows doc[:a] + sample (padded), and the document itself
    rows = torch.zeros(len(anchors) * N + 1, S, dtype=torch.long)
    for b, a in enumerate(anchors):
        for j in range(N):
            rows[b * N + j, :a + GEN] = torch.cat([doc[:a], samples[b, j]])
    rows[-1] = doc
    with torch.no_grad():
        states = [h.value() for h in llama.layer_states(params, fpp.wrap(rows, "batch seq"), cfg, layers)]
    starts = torch.tensor(anchors).repeat_interleave(N)
    phi = ebft.row_block_features([h[:-1] for h in states], starts, GEN, method).view(len(anchors), N, -1)
    ref = ebft.row_block_features([h[-1:].expand(len(anchors), -1, -1) for h in states], torch.tensor(anchors), GEN,
                                  method)
    rewards, _, _ = ebft.block_rewards(phi, ref, use_whitening=whitening)
    advantages = ebft.block_advantages(rewards, estimator)
    for b, a in enumerate(anchors):
        feats = torch.stack([_hf_block_feature(m, torch.cat([doc[:a], samples[b, j]]), a, layers, method)
                             for j in range(N)])
        refs = _hf_block_feature(m, doc, a, layers, method)
        torch.testing.assert_close(phi[b].double(), feats, rtol=0, atol=1e-5)
        want_r, want_a = _expected(feats, refs, whitening, estimator)
        torch.testing.assert_close(rewards[b].double(), want_r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(advantages[b].double(), want_a, rtol=1e-4, atol=1e-4)


def test_one_sample_has_no_diversity_and_its_reward_is_its_advantage():
    g = torch.Generator().manual_seed(0)
    phi, ref = torch.randn(2, 1, 6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g,
                                                                                 dtype=torch.float64)
    rewards, alignment, diversity = ebft.block_rewards(phi, ref, alignment_coef=0.5, diversity_coef=3.0)
    assert torch.equal(diversity, torch.zeros(2, 1))
    cos = (phi[:, 0] * ref).sum(-1) / (phi[:, 0].norm(dim=-1) * ref.norm(dim=-1))
    torch.testing.assert_close(rewards[:, 0], 0.5 * 2 * cos)
    for estimator in ebft.ADVANTAGE_ESTIMATORS:
        torch.testing.assert_close(ebft.block_advantages(rewards, estimator), rewards)


def test_bad_settings_are_refused_by_name():
    x = torch.zeros(2, 3, 4, 8)
    with pytest.raises(ValueError, match="ebft.embed_method 'concat' is not one of last_token, mean_pooling"):
        ebft.block_features([x], "concat")
    with pytest.raises(ValueError, match="ebft.advantage_estimator 'ppo' is not one of rloo"):
        ebft.block_advantages(torch.zeros(2, 3), "ppo")
    with pytest.raises(ValueError, match=r"reference's features \(2, 5\) do not match"):
        ebft.block_rewards(torch.zeros(2, 3, 4), torch.zeros(2, 5))


SPEC = EBFTSpec(stride=STRIDE, context_length=CTX, generate_max_len=GEN, n_samples_per_prompt=N,
                feature_layers=FRACTIONS, use_whitening=True, rl_coef=1.5, ce_coef=0.5, min_completion_prefix=2)
PAD = 0


def _documents():
    """A raw-text document (every token trained by the cross-entropy, its padding too) and a
    prompt + completion (labels on the completion only; anchors from the prompt + 2)."""
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(1, 64, (S,), generator=g).tolist()
    structured = torch.randint(1, 64, (16,), generator=g).tolist() + [PAD] * (S - 16)
    labels = [-100] * 6 + structured[6:16] + [-100] * (S - 16)
    return [Document(tuple(raw), tuple(raw)), Document(tuple(structured), tuple(labels), prompt_length=6)]


def _samples(docs):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (len(ebft.strided_anchors(S, stride=STRIDE, context_length=CTX, generate_max_len=GEN,
                                                            prompt_length=d.prompt_length, min_completion_prefix=2)),
                                   N, GEN), generator=g) for d in docs]


def _layer_states(params, cfg, layers, rows):
    """``llama.layer_states`` of block-parallel rows (their tokens and layout)."""
    named = {k: fpp.wrap(v, "batch seq") for k, v in rows.items()}
    return [h.value() for h in llama.layer_states(params, named.pop("tokens"), cfg, layers, **named)]


def _policy(cfg):
    return lambda p, t, **layout: llama.forward(p, t, cfg, **layout)


def _our_batch(cfg, params, row_multiple=4):
    docs = _documents()
    layers = ebft.feature_layer_indices(SPEC.feature_layers, cfg.layers)

    def feature_states(rows):
        return _layer_states(params, cfg, layers, rows)
    r = score_samples(docs, _samples(docs), SPEC, feature_states, pad_id=PAD)
    return r, ebft_batch(r, SPEC, PAD, row_multiple=row_multiple)


def _hf_loss(m, docs, samples):
    """The strided EBFT loss re-derived on transformers: per document, the mean over its sampled
    tokens of -A log p (each token's log-probability at the position that sampled it) times
    rl_coef, plus ce_coef times the cross-entropy of its labelled tokens; the documents' mean."""
    layers = ebft.feature_layer_indices(FRACTIONS, KW["num_hidden_layers"])
    total = 0
    for doc, s in zip(docs, samples):
        toks = torch.tensor(doc.tokens)
        anchors = ebft.strided_anchors(S, stride=STRIDE, context_length=CTX, generate_max_len=GEN,
                                       prompt_length=doc.prompt_length, min_completion_prefix=2)
        rl = 0
        for b, a in enumerate(anchors):
            rows = torch.stack([torch.cat([toks[:a], s[b, j]]) for j in range(N)])
            out = m(input_ids=rows, output_hidden_states=True)
            feats = torch.cat([torch.nn.functional.normalize(out.hidden_states[i][:, a + GEN - 1].double(), dim=-1)
                               for i in layers], -1)
            _, adv = _expected(feats.detach(), _hf_block_feature(m, toks, a, layers, "last_token"), True, "rloo")
            logp = torch.log_softmax(out.logits.double(), -1)
            for j in range(N):
                rl = rl - adv[j] * sum(logp[j, a - 1 + k, s[b, j, k]] for k in range(GEN))
        logp = torch.log_softmax(m(input_ids=toks[None]).logits[0].double(), -1)
        targets = [(t, lab) for t, lab in enumerate(doc.labels) if t > 0 and lab != -100]
        ce = -sum(logp[t - 1, lab] for t, lab in targets) / len(targets)
        total = total + SPEC.rl_coef * rl / (len(anchors) * N * GEN) + SPEC.ce_coef * ce
    return total / len(docs)


def test_the_loss_and_gradients_equal_the_re_derivation_on_transformers(model):
    m, cfg, named, full = model
    r, batch = _our_batch(cfg, named)
    assert [len(a) for a in r.anchors] == [4, 3] and batch["tokens"].shape[0] % 4 == 0
    decls = llama.init(cfg)
    local = tree_map(lambda x: x.clone().requires_grad_(), full)
    objective = weighted_logps_objective(_policy(cfg))
    loss = objective(sharding.named_tree(local, decls), {k: fpp.wrap(v, "batch seq") for k, v in batch.items()})
    loss = loss.value()
    loss.backward()
    m.zero_grad()
    want = _hf_loss(m, r.documents, r.samples)
    want.backward()
    assert abs(float(want)) > 1e-3
    assert float(loss) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    torch.testing.assert_close(local["lm_head"].grad, m.lm_head.weight.grad.T, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(local["layers"][0]["mlp"]["down_proj"].grad,
                               m.model.layers[0].mlp.down_proj.weight.grad.T, rtol=1e-3, atol=1e-6)
    metrics = ebft_metrics(r)
    assert metrics["ebft_blocks"] == 7.0
    assert metrics["ebft_mean_reward"] == pytest.approx(float(torch.cat([x.reshape(-1) for x in r.rewards]).mean()))


def _step(cfg, full, batch, mesh, rules, accum=1, processes=False, query_chunk=None):
    """One SGD step (lr 1) of the EBFT objective from ``full`` on ``mesh``: the loss and the
    gradients (the update), float64; ``query_chunk``: the attention's blocks of queries
    (ops/query_chunks.py) in the launched processes."""
    decls = llama.init(cfg, torch.float64)
    full = tree_map(lambda x: x.double(), full)
    objective = weighted_logps_objective(_policy(cfg))
    step = fpp.train_step(objective, fpp.optim.sgd(1.0), mesh=mesh, rules=rules, grad_accum=accum,
                          batch_dims={k: "batch seq" for k in batch})

    def run():
        from harness import local_batch

        from functional_pp.ops import query_chunks
        if query_chunk:
            query_chunks.QUERY_CHUNK = query_chunk
        with fpp.use_rules(rules):
            state = step.init(sharding.named_tree(sharding.shard(full, decls, mesh, rules, fpp.current_rank()), decls))
            local = {k: v.data for k, v in local_batch(batch, mesh, rules).items()}
        state, metrics = step(state, local)
        with fpp.use_rules(rules):
            new = fpp.gather_tree(state["params"], decls, rules)
        return float(metrics["loss"]), tree_map(lambda x: getattr(x, "data", x).detach().clone(), new)
    out = fpp.launch(run, mesh, processes=processes, timeout=600)
    return [(loss, tree_map(lambda w, n: w - n, full, new)) for loss, new in out]


def _assert_same(got, want):
    for loss, grads in got:
        assert loss == pytest.approx(want[0], rel=1e-10)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want[1])):
            torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-12, msg=lambda msg: f"{p}: {msg}")


@pytest.fixture(scope="module")
def one_device(model):
    _, cfg, named, full = model
    _, batch = _our_batch(cfg, named)
    return cfg, full, batch, _step(cfg, full, batch, fpp.Mesh(), fpp.Rules())[0]


def test_fsdp_x_tp_with_accumulation_equals_one_device(one_device):
    cfg, full, batch, want = one_device
    _assert_same(_step(cfg, full, batch, fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(), accum=2), want)


def test_context_parallel_block_parallel_rows_equal_one_device(one_device):
    """The rows split over cp (balanced): the shared context seen by row index, positions as given."""
    cfg, full, batch, want = one_device
    assert batch["tokens"].shape[1] % 4 == 0 and int(batch["prefix"].max()) > 0
    _assert_same(_step(cfg, full, batch, fpp.Mesh(dp_shard=2, cp=2), llama.default_rules(tp=False)), want)


@pytest.mark.multiprocess
def test_a_step_on_two_gloo_processes_equals_one_device(one_device):
    cfg, full, batch, want = one_device
    _assert_same(_step(cfg, full, batch, fpp.Mesh(dp_shard=2), llama.default_rules(), processes=True), want)


@pytest.mark.multiprocess
def test_blocks_of_queries_on_two_gloo_cp_processes_equal_one_device(one_device):
    """The rows split over cp 2 on two gloo processes, the attention by blocks of 5 queries
    (each recomputed in backward) against the gathered keys: the one-device step."""
    cfg, full, batch, want = one_device
    _assert_same(_step(cfg, full, batch, fpp.Mesh(cp=2), llama.default_rules(tp=False), processes=True,
                       query_chunk=5), want)


def test_the_ebft_section_is_read_and_the_structured_mode_refused():
    spec = ebft_spec({"mode": "strided", "stride": 4, "feature_layers": [0.5], "ce_coef": 0.03,
                      "adaptive_max_tokens": True})
    assert spec.stride == 4 and spec.feature_layers == (0.5,) and spec.ce_coef == 0.03
    with pytest.raises(ValueError, match="ebft.mode 'structured' is not built: only the strided mode"):
        ebft_spec({"stride": 4})
    with pytest.raises(ValueError, match="ebft: unknown key.s. strid "):
        ebft_spec({"mode": "strided", "strid": 4})
    with pytest.raises(ValueError, match="ebft.embed_method 'concat' is not built for the strided mode"):
        ebft_spec({"mode": "strided", "embed_method": "concat"})


def test_the_rollout_samples_each_block_from_the_document_before_its_anchor(model):
    """At a temperature near 0 every sample is transformers' greedy continuation of ``doc[:a]``."""
    import dataclasses

    from functional_pp.preference.ebft_rollout import ebft_rollout
    m, cfg, params, _ = model
    spec = dataclasses.replace(SPEC, temperature=1e-6, n_samples_per_prompt=2)
    docs = _documents()
    layers = ebft.feature_layer_indices(spec.feature_layers, cfg.layers)

    def feature_states(rows):
        return _layer_states(params, cfg, layers, rows)
    with torch.no_grad():
        r = ebft_rollout(lambda p, t: llama.forward(p, t, cfg), params, docs, spec, feature_states, pad_id=PAD,
                         key=3, step=1)
    assert [tuple(s.shape) for s in r.samples] == [(4, 2, GEN), (3, 2, GEN)]
    for doc, anchors, samples in zip(docs, r.anchors, r.samples):
        for b, a in enumerate(anchors):
            want = m.generate(torch.tensor([doc.tokens[:a]]), max_new_tokens=GEN, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)[0, a:]
            for j in range(2):
                assert samples[b, j].tolist() == want.tolist(), (a, j)


def test_the_rollouts_bounded_calls_sample_what_one_call_does(model, monkeypatch):
    """Sampled (temperature 1): the rollout's calls (several, each at most the last anchor's
    cache) give every block the samples of all the step's rows in one left-padded call."""
    import dataclasses

    from functional_pp.preference import rollout
    from functional_pp.preference.ebft_rollout import ebft_rollout
    _, cfg, params, _ = model
    spec = dataclasses.replace(SPEC, temperature=1.0, n_samples_per_prompt=2)
    docs = _documents()
    layers = ebft.feature_layer_indices(spec.feature_layers, cfg.layers)
    calls = []

    def counted(*args, **kw):
        calls.append(args[2].shape)
        return generate(*args, **kw)
    generate = rollout.generate
    monkeypatch.setattr(rollout, "generate", counted)
    with torch.no_grad():
        r = ebft_rollout(lambda p, t: llama.forward(p, t, cfg), params, docs, spec,
                         lambda rows: _layer_states(params, cfg, layers, rows), pad_id=PAD, key=3, step=1)
        prompts = [list(d.tokens[:a]) for d, anchors in zip(docs, r.anchors) for a in anchors]
        bounded = len(calls)
        assert 1 < bounded < len(prompts)
        assert all(b * (t + GEN) <= 2 * 2 * (max(map(len, prompts)) + GEN) for b, t in calls)
        one, _ = rollout.sample_completions(lambda p, t: llama.forward(p, t, cfg), params, prompts, num_generations=2,
                                            max_completion_length=GEN, stop_ids=[], pad_id=PAD, temperature=1.0,
                                            key=3, step=1)
    assert len(calls) == bounded + 1 and calls[-1][0] == len(prompts) * 2     # (the one call: every row)
    assert torch.cat(r.samples).reshape(-1, GEN).tolist() == one
    assert len({tuple(x) for x in one}) > len(one) // 2                      # sampled, not one token repeated


def test_models_the_block_parallel_rows_cannot_take_are_named(model):
    """``llama.prefix_refusal`` (checked before any work) and the forward's own refusal."""
    _, cfg, params, _ = model
    base = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64)
    assert llama.prefix_refusal(llama.Config(**base)) is None
    why = llama.prefix_refusal(llama.Config(**base, alibi_max=8.0, learned_positions=True, max_seq=32))
    assert "alibi_max=8.0 (ALiBi)" in why and "learned_positions=True (learned absolute positions)" in why
    assert "layers [0, 1] have sliding-window attention" in llama.prefix_refusal(llama.Config(**base, sliding_window=4))
    toks = fpp.wrap(torch.zeros(1, 4, dtype=torch.long), "batch seq")
    with pytest.raises(ValueError, match="prefix .each query's shared context. needs segments"):
        llama.forward(params, toks, cfg, prefix=fpp.wrap(torch.zeros(1, 4, dtype=torch.long), "batch seq"))
