"""GRPO's formulas (functional_pp/preference/grpo.py) equal TRL 1.16's ``GRPOTrainer``: the clipped
policy loss with the KL term, for each loss type and importance-sampling level, its gradient
and the KL TRL logs (TRL's own ``_compute_loss`` on the same per-token log-probabilities and
advantages); the group-normalised advantages equal TRL's formula (with its ``nanstd``)."""
from __future__ import annotations

import pytest
import torch

from functional_pp.preference import grpo

trl = pytest.importorskip("trl")
from trl_oracle import grpo_loss  # noqa: E402

N, T = 6, 7


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)       # ratios on both sides of the clip
    ref = logps + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = torch.ones(N, T, dtype=torch.long)
    for i in range(N):
        mask[i, int(torch.randint(2, T + 1, (), generator=g)):] = 0
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, adv


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
@pytest.mark.parametrize("beta,level,delta,eps_high", [(0.0, "token", None, None), (0.04, "token", 1.5, 0.28),
                                                       (0.04, "sequence", None, None)])
def test_grpo_loss_equals_trl(loss_type, beta, level, delta, eps_high):
    logps, old, ref, mask, adv = _inputs(len(loss_type) + int(100 * beta) + len(level))
    mine_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    kw = dict(beta=beta, epsilon=0.2, epsilon_high=eps_high, delta=delta, importance_sampling_level=level)
    want, metrics = grpo_loss(trl_in, mask, adv, old_logps=old, ref_logps=ref if beta else None, loss_type=loss_type,
                              max_completion_length=T, **kw)
    want.backward()
    token_losses, kl = grpo.grpo_token_losses(mine_in, adv, mask, old_logps=old, ref_logps=ref if beta else None, **kw)
    got = grpo.grpo_loss(token_losses, mask, loss_type, max_completion_length=T)
    got.backward()
    assert abs(float(want)) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mine_in.grad, trl_in.grad, rtol=1e-12, atol=1e-14)
    if beta:
        m = mask.double()
        assert float((kl * m).sum() / m.sum()) == pytest.approx(metrics["kl"], rel=1e-12)


def test_on_policy_loss_is_minus_the_mean_advantage_and_its_gradient_the_policy_gradient():
    """With the policy's own log-probabilities as the old ones (one update per batch), every
    ratio is 1: the loss is -A per token, its gradient -A / tokens (grpo)."""
    logps, _, _, mask, adv = _inputs(5)
    x = logps.clone().requires_grad_()
    loss = grpo.grpo_loss(grpo.grpo_token_losses(x, adv, mask)[0], mask, "grpo")
    loss.backward()
    torch.testing.assert_close(loss, -adv.mean())
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / mask.sum(-1, keepdim=True) / N)


@pytest.mark.parametrize("scale", grpo.SCALE_REWARDS)
def test_group_advantages_equal_trls_formula(scale):
    from trl.trainer.utils import nanstd
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    rewards[4] = float("nan")                                     # unscorable: out of the mean, advantage 0
    got = grpo.group_advantages(rewards, 4, scale)
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)        # TRL's lines, its nanstd
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4) if scale == "group" else nanstd(rewards).expand(12)
    want = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(got, torch.nan_to_num(want, nan=0.0))
    assert got[4] == 0 and abs(float(got[:4].sum())) < 1e-9 and abs(float(got[5:8].sum())) < 1e-9
    with pytest.raises(ValueError, match="12 rewards do not split into groups of num_generations=5"):
        grpo.group_advantages(rewards, 5)


KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
P, C = 4, 6                                   # prompt and completion lengths (completions padded)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """(transformers' tiny Llama with TRL's fused head, our config, our parameters), same weights."""
    transformers = pytest.importorskip("transformers")
    from functional_pp.checkpoint import hf
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    m.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp("grpo-llama")
    m.save_pretrained(d)
    trl.trainer.utils.add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    cfg, params = hf.load_hf_llama(d)
    return m, cfg, params


def _rollouts(seed: int):
    """Prompts of P tokens, completions of 1..C tokens (padded, masked) and their advantages;
    our rows: prompt + completion, labels the completion's tokens at the positions before them."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, KW["vocab_size"], (N, P), generator=g)
    completion = torch.randint(1, KW["vocab_size"], (N, C), generator=g)
    mask = torch.ones(N, C, dtype=torch.long)
    for i in range(N):
        mask[i, int(torch.randint(1, C + 1, (), generator=g)):] = 0
    completion = completion * mask
    rewards = torch.randn(N, generator=g, dtype=torch.float64)
    adv = grpo.group_advantages(rewards, 3)
    tokens = torch.cat([prompt, completion], 1)
    labels = torch.full_like(tokens, -100)
    labels[:, P - 1:P + C - 1] = completion.masked_fill(mask == 0, -100)
    batch = {"tokens": tokens, "labels": labels, "advantages": adv[:, None].expand(N, P + C).contiguous()}
    return batch, tokens, mask, adv


def _trl_completion_logps(model, tokens, mask, entropy=False):
    labels = torch.full_like(tokens, -100)
    labels[:, P:] = tokens[:, P:].masked_fill(mask == 0, -100)
    out = model(input_ids=tokens, labels=labels, fused_lm_head=True)
    return (out.log_probs[:, P - 1:], out.entropy[:, P - 1:].detach()) if entropy else out.log_probs[:, P - 1:]


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_grpo_objective_equals_trl_on_transformers_llama(llama_pair, loss_type):
    """On-policy (old log-probs the policy's own) with the KL to a reference (the policy's
    weights moved), TRL's loss and gradients on the same completions and advantages."""
    import functools

    from harness import single_device

    from functional_pp.core.tree import tree_map
    from functional_pp.models import llama
    from functional_pp.parallel import sharding
    m, cfg, params = llama_pair
    batch, tokens, mask, adv = _rollouts(7)
    ref_params = tree_map(lambda x: (x * 1.05).double(), params)
    with torch.no_grad():
        saved = {n: p.clone() for n, p in m.named_parameters()}
        for _, p in m.named_parameters():
            p.mul_(1.05)
        ref_logps = _trl_completion_logps(m, tokens, mask)
        for n, p in m.named_parameters():
            p.copy_(saved[n])
    m.zero_grad()
    logps, entropies = _trl_completion_logps(m, tokens, mask, entropy=True)
    want, metrics = grpo_loss(logps, mask, adv.float(), ref_logps=ref_logps, beta=0.05, loss_type=loss_type,
                              max_completion_length=C, entropies=entropies)
    want.backward()
    forward = functools.partial(llama.forward, cfg=cfg)
    found = {}

    def loss_fn(p, b, _cfg):
        from functional_pp.core import step_values
        ref = sharding.named_tree(ref_params, llama.init(cfg, torch.float64))
        with step_values.collecting() as values:
            out = grpo.grpo_objective(forward, loss_type=loss_type, beta=0.05, max_completion_length=C,
                                      reference=lambda _p, t: forward(ref, t))(p, b)
        found.update({k: float(v) for k, (v, _) in values.items()})
        return out
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), params), batch, loss_fn=loss_fn)
    assert abs(float(want)) > 1e-4
    assert metrics["entropy"] > 1 and found["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    torch.testing.assert_close(loss.float(), want.detach(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(grads["lm_head"].float(), m.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][0]["mlp"]["down_proj"].float(),
                               m.model.layers[0].mlp.down_proj.weight.grad.T, rtol=1e-4, atol=1e-6)


def test_grpo_objective_fsdp_tp_equals_one_device(llama_pair):
    import functools

    from harness import parallel, single_device

    import functional_pp as fpp
    from functional_pp.core.tree import leaves_with_paths, tree_map
    from functional_pp.models import llama
    _, cfg, params = llama_pair
    batch, *_ = _rollouts(8)
    full = tree_map(lambda x: x.double(), params)
    from functional_pp.core import step_values
    objective = grpo.grpo_objective(functools.partial(llama.forward, cfg=cfg), loss_type="dapo")
    entropy = []               # (each device's: the entropy over the vocabulary split over tp)

    def loss_fn(p, b, _c):
        with step_values.collecting() as values:
            out = objective(p, b)
        entropy.append(float(values["entropy"][0]))
        return out
    want, want_grads = single_device(cfg, full, batch, loss_fn=loss_fn)
    for loss, grads, _ in parallel(cfg, full, batch, fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(),
                                   loss_fn=loss_fn):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for (p, g), (_, w) in zip(leaves_with_paths(grads), leaves_with_paths(want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda msg: f"{p}: {msg}")
    assert len(entropy) == 5 and entropy[0] > 1
    assert all(e == pytest.approx(entropy[0], rel=1e-12) for e in entropy)


M, ACCUM, PROCS = 2, 2, 2                     # TRL's per_device_train_batch_size, accumulation, processes
NB = M * ACCUM * PROCS


def _step_batch(seed: int):
    """A step's NB completions of different lengths (a Rollout as sampling makes it), the
    sampling policy's per-token log-probabilities away from the policy's, and the same in
    TRL's form (completions padded to C)."""
    from functional_pp.preference.rollout import Rollout, rollout_batch
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, KW["vocab_size"], (NB, P), generator=g)
    lengths = [1, 6, 2, 2, 6, 5, 3, 1]              # micro-batches of 7, 4, 11 and 4 tokens
    completions = [torch.randint(1, KW["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    adv = grpo.group_advantages(torch.randn(NB, generator=g, dtype=torch.float64), 4).float()
    r = Rollout([p.tolist() for p in prompt], completions, [False] * NB, torch.zeros(NB, 1), torch.zeros(NB), adv,
                torch.zeros(NB, dtype=torch.bool), ["r"])
    batch = rollout_batch(r, P + C, 0, chunk_rows=M)
    mask = torch.tensor([[1] * n + [0] * (C - n) for n in lengths])
    tokens = batch["tokens"]
    old_noise = 0.3 * torch.randn(NB, C, generator=g, dtype=torch.float64)
    return batch, tokens, mask, adv, old_noise


def _trl_step_grads(m, tokens, mask, adv, old_noise, loss_type, level):
    """TRL's step: each process's rows split into ACCUM micro-batches of M, each micro-batch's
    ``_compute_loss`` (normalised for the accumulation and the processes as TRL does) summed,
    the processes' gradients averaged (DDP); the loss as TRL reports it, and the gradients."""
    m.zero_grad()
    with torch.no_grad():
        old = _trl_completion_logps(m, tokens, mask).double() + old_noise
    total, num_items = 0.0, mask.sum()
    for p in range(PROCS):
        for s in range(ACCUM):
            rows = slice((p * ACCUM + s) * M, (p * ACCUM + s + 1) * M)
            logps = _trl_completion_logps(m, tokens[rows], mask[rows])
            loss, _ = grpo_loss(logps, mask[rows], adv[rows], old_logps=old[rows].float(), loss_type=loss_type,
                                max_completion_length=C, importance_sampling_level=level, accumulation=ACCUM,
                                processes=PROCS, num_items=num_items)
            (loss / PROCS).backward()                       # DDP: the processes' mean
            total += float(loss.detach()) / PROCS
    return total, old


def _our_step(cfg, params, batch, loss_type, level, processes=False):
    """Our step from ``params`` on dp=2 with 2 micro-batches per device: the loss and the
    gradients (SGD with lr 1: the update is the gradient)."""
    import functools

    import functional_pp as fpp
    from functional_pp.core.tree import tree_map
    from functional_pp.models import llama
    from functional_pp.parallel import sharding
    mesh, rules = fpp.Mesh(dp=PROCS), llama.default_rules()
    decls = llama.init(cfg, torch.float64)
    full = tree_map(lambda x: x.double(), params)
    objective = grpo.grpo_objective(functools.partial(llama.forward, cfg=cfg), loss_type=loss_type,
                                    max_completion_length=C, importance_sampling_level=level)
    step = fpp.train_step(objective, fpp.optim.sgd(1.0), mesh=mesh, rules=rules, grad_accum=ACCUM,
                          batch_dims={k: "batch seq" for k in batch})

    def run():
        from harness import local_batch
        with fpp.use_rules(rules):
            state = step.init(sharding.named_tree(sharding.shard(full, decls, mesh, rules, fpp.current_rank()), decls))
            local = {k: v.data for k, v in local_batch(batch, mesh, rules).items()}
        state, metrics = step(state, local)
        with fpp.use_rules(rules):
            new = fpp.gather_tree(state["params"], decls, rules)
        return float(metrics["loss"]), tree_map(lambda x: getattr(x, "data", x).detach().clone(), new)
    loss, new = fpp.launch(run, mesh, processes=processes, timeout=600)[0]
    return loss, tree_map(lambda w, n: w - n, full, new)


def _compare(m, cfg, params, loss_type, level, processes=False):
    batch, tokens, mask, adv, old_noise = _step_batch(11)
    want, old = _trl_step_grads(m, tokens, mask, adv, old_noise, loss_type, level)
    batch["old_logps"] = torch.zeros(NB, P + C, dtype=torch.float32)
    batch["old_logps"][:, P - 1:P - 1 + C] = old.float()
    loss, grads = _our_step(cfg, params, batch, loss_type, level, processes)
    assert abs(want) > 1e-4
    assert loss == pytest.approx(want, rel=2e-5, abs=2e-6)
    torch.testing.assert_close(grads["lm_head"].float(), m.lm_head.weight.grad.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["layers"][0]["mlp"]["down_proj"].float(),
                               m.model.layers[0].mlp.down_proj.weight.grad.T, rtol=1e-4, atol=1e-6)
    return batch


@pytest.mark.parametrize("level", grpo.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_an_accumulated_data_parallel_step_equals_trls(llama_pair, loss_type, level):
    """2 processes x 2 micro-batches of 2 completions of different lengths, old log-probs away
    from the policy's (the clip acts): the loss and gradients equal TRL's step, each
    micro-batch's ``_compute_loss`` with TRL's normalisers (``bnpo``: each micro-batch over its
    own tokens), for token- and sequence-level (GSPO) ratios."""
    m, cfg, params = llama_pair
    _compare(m, cfg, params, loss_type, level)


def test_bnpo_normalises_each_micro_batch_by_its_own_tokens():
    """TRL's bnpo is the mean of the micro-batches' token means, not the step's token mean."""
    g = torch.Generator().manual_seed(2)
    losses = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    got = grpo.grpo_loss(losses, mask, "bnpo", chunk_rows=2)
    a, b = (losses * mask)[:2].sum() / 6, (losses * mask)[2:].sum() / 5
    torch.testing.assert_close(got, (a + b) / 2)
    assert not torch.isclose(got, grpo.grpo_loss(losses, mask, "bnpo"))
    with pytest.raises(ValueError, match="4 rows do not split into micro-batches of 3"):
        grpo.grpo_loss(losses, mask, "bnpo", chunk_rows=3)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("loss_type,level", [("bnpo", "sequence"), ("grpo", "token")])
def test_an_accumulated_step_on_two_gloo_processes_equals_trls(llama_pair, loss_type, level):
    m, cfg, params = llama_pair
    _compare(m, cfg, params, loss_type, level, processes=True)


@pytest.mark.parametrize("level", grpo.IMPORTANCE_SAMPLING_LEVELS)
def test_logged_kl_and_clip_ratios_equal_trls(llama_pair, level):
    """``kl`` and TRL's ``clip_ratio/low_mean``, ``high_mean``, ``region_mean``, ``low_min`` and
    ``high_max`` of a batch with ratios on both sides of the clip (per token, or per sequence)."""
    import functools

    from functional_pp.core import step_values
    from functional_pp.core.tree import tree_map
    from functional_pp.models import llama
    from functional_pp.parallel import sharding
    m, cfg, params = llama_pair
    batch, tokens, mask, adv, old_noise = _step_batch(5)
    with torch.no_grad():
        logps = _trl_completion_logps(m, tokens, mask).double()
        old, ref = logps + old_noise, logps + 0.2 * old_noise.flip(0)
    _, want = grpo_loss(logps, mask, adv.double(), old_logps=old, ref_logps=ref, beta=0.1, epsilon_high=0.28,
                        importance_sampling_level=level, max_completion_length=C)
    for k, x in (("old_logps", old), ("ref", ref)):
        batch[k] = torch.zeros(NB, P + C, dtype=torch.float64)
        batch[k][:, P - 1:P - 1 + C] = x
    ref_col = batch.pop("ref")
    forward = functools.partial(llama.forward, cfg=cfg)
    objective = grpo.grpo_objective(forward, beta=0.1, epsilon_high=0.28, importance_sampling_level=level,
                                    reference=lambda _p, t: ref_logits)
    named = sharding.named_tree(tree_map(lambda x: x.double(), params), llama.init(cfg, torch.float64))
    b = {k: fpp_wrap(v) for k, v in batch.items()}
    # the reference's logits: the labels' log-probabilities are ref (a one-hot-like table)
    ref_logits = _logits_with_label_logps(b["labels"], ref_col, KW["vocab_size"])
    with step_values.collecting() as found:
        objective(named, b)
    got = {k: float(v) for k, (v, _) in found.items()}
    assert want["clip_ratio/region_mean"] > 0.05 and want["kl"] > 0
    for name in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max"):
        # (TRL's from transformers' fp32 log-probabilities, ours fp64: the KL to ~1e-5)
        assert got[name.replace("/", "_")] == pytest.approx(want[name], rel=1e-4, abs=1e-9), name


def fpp_wrap(x):
    import functional_pp as fpp
    return fpp.wrap(x, "batch seq")


def _logits_with_label_logps(labels, logps, vocab: int):
    """Named logits ``[batch, seq, vocab]`` whose log-softmax at each label is ``logps``: the
    label's logit ``logp - log(1 - exp(logp)) + log(vocab - 1)`` over zeros elsewhere."""
    import math

    import functional_pp as fpp
    lab = labels.value().clamp(min=0)
    lp = logps.clamp(max=-1e-6)
    logit = lp - torch.log1p(-torch.exp(lp)) + math.log(vocab - 1)
    out = torch.zeros(*lab.shape, vocab, dtype=torch.float64).scatter(-1, lab[..., None], logit[..., None])
    return fpp.wrap(out, "batch seq vocab")
