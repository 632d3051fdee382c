"""GRPO's online pieces (functional_pp/preference/rollout.py, grpo_spec.py) composed equal a
hand-composed reference on transformers' tiny Llama: the completions (one left-padded generate
call for prompts of different lengths) equal to each row sampled alone with its row's seed and cut
at the stop token, the reward functions called with TRL's
signature and the dataset's columns, the weighted rewards and group-normalised advantages by
TRL's formula, and the loss and gradients of the rollout's batch equal to TRL's
``_compute_loss`` on transformers' log-probabilities of the same completions (with the KL to a
reference). GDPO's ``normalize_then_sum`` equals TRL's lines; bad reward outputs and ``trl:``
keys that change the math are refused by name."""
from __future__ import annotations

import functools

import pytest
import torch

import functional_pp as fpp

from functional_pp.core.tree import tree_map
from functional_pp.data.prompts import Prompt
from functional_pp.models import llama
from functional_pp.models.sampling import generate
from functional_pp.parallel import sharding
from functional_pp.preference import grpo
from functional_pp.preference.grpo_spec import GRPOSpec, grpo_spec
from functional_pp.preference.rollout import generation_seed, rollout, rollout_batch, rollout_metrics, score

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
from trl_oracle import grpo_loss  # noqa: E402

KW = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
G, MAXC, SEQ = 4, 5, 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers' tiny Llama, our config, our parameters) with the same weights."""
    from functional_pp.checkpoint import hf
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**KW)).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    m.config._attn_implementation = "eager"
    d = tmp_path_factory.mktemp("grpo-rollout-llama")
    m.save_pretrained(d)
    cfg, params = hf.load_hf_llama(d)
    return m, cfg, params


class Tok:
    """Decodes ids as space-separated numbers, the stop token left out (a special token)."""

    def __init__(self, stop: int) -> None:
        self.stop = stop

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == self.stop))


PROMPTS = [Prompt([5, 6, 7], "a", {"target": 9}), Prompt([8, 9], "b", {"target": 11}),
           Prompt([10, 11, 12], "c", {"target": 12})]


def _hits(prompts, completions, completion_ids, target, **kwargs):
    return [ids.count(t) / len(ids) for ids, t in zip(completion_ids, target)]


def _words(prompts, completions, **kwargs):
    return [None if p == "b" else float(len(c.split())) for p, c in zip(prompts, completions)]


def _logps(m, tokens, starts, lengths):
    """Transformers' log-probabilities of each row's completion tokens, ``[N, MAXC]`` and the mask."""
    logp = torch.log_softmax(m(input_ids=tokens).logits.double(), -1)
    out = torch.zeros(len(starts), MAXC, dtype=torch.float64)
    mask = torch.zeros(len(starts), MAXC, dtype=torch.long)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        pos = torch.arange(s - 1, s - 1 + n)
        out[i, :n] = logp[i, pos, tokens[i, pos + 1]]
        mask[i, :n] = 1
    return out, mask


def test_rollout_and_loss_equal_a_hand_composed_reference(model):
    from harness import single_device
    m, cfg, params = model
    forward = functools.partial(llama.forward, cfg=cfg)
    named = sharding.named_tree(params, llama.init(cfg, torch.float32))
    first = forward(named, fpp.wrap(torch.tensor([[5, 6, 7]]), "batch seq")).value()[0, -1]
    stop = int(torch.topk(first, 3).indices[2])              # a likely token: some rows stop, some are cut
    spec = GRPOSpec(reward_funcs=("hits", "words"), reward_weights=(1.0, 0.25), num_generations=G,
                    max_completion_length=MAXC, temperature=1.3, top_k=12, beta=0.05)
    r = rollout(forward, named, PROMPTS, spec, Tok(stop), [("hits", _hits), ("words", _words)], stop_ids=[stop],
                pad_id=0, key=7, step=2)

    # by hand: each row sampled alone (its prompt unpadded, its own seed), cut after its first stop token
    want: list = []
    for i in range(3 * G):
        ids = torch.tensor([PROMPTS[i // G].ids])
        t = generate(forward, named, ids, max_new_tokens=MAXC, eos_id=stop, pad_id=0, temperature=1.3, top_k=12,
                     seed=generation_seed(7, 2, i))[0, ids.size(1):].tolist()
        want.append(t[:t.index(stop) + 1] if stop in t else t)
    assert r.completion_ids == want
    assert r.truncated == [stop not in c for c in want]
    assert 0 < sum(r.truncated) < 3 * G                       # both kinds of completion occur

    hits = torch.tensor([c.count(PROMPTS[i // G].columns["target"]) / len(c) for i, c in enumerate(want)])
    words = torch.tensor([float("nan") if i // G == 1 else float(len([t for t in c if t != stop]))
                          for i, c in enumerate(want)])
    torch.testing.assert_close(r.rewards_per_func, torch.stack([hits, words], 1), equal_nan=True)
    rewards = hits + 0.25 * torch.nan_to_num(words)
    groups = rewards.view(3, G)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(r.rewards, rewards)
    torch.testing.assert_close(r.advantages, adv)
    metrics = rollout_metrics(r)
    assert metrics["reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert metrics["rewards_words_mean"] == pytest.approx(float(words[~words.isnan()].mean()), rel=1e-6)
    assert metrics["completions_max_length"] == max(len(c) for c in want)
    assert metrics["completions_clipped_ratio"] == pytest.approx(sum(r.truncated) / (3 * G))

    batch = rollout_batch(r, SEQ, pad_id=0)
    starts = [len(PROMPTS[i // G].ids) for i in range(3 * G)]
    lengths = [len(c) for c in want]
    for i, (s, c) in enumerate(zip(starts, want)):               # labels: each completion token, one before it
        assert batch["tokens"][i, s:s + len(c)].tolist() == c
        assert batch["labels"][i, s - 1:s - 1 + len(c)].tolist() == c and (batch["labels"][i] != -100).sum() == len(c)
    ref_params = tree_map(lambda x: x.double() * 1.05, params)
    m.double()
    with torch.no_grad():
        saved = {n: p.clone() for n, p in m.named_parameters()}
        for _, p in m.named_parameters():
            p.mul_(1.05)
        ref_logps, _ = _logps(m, batch["tokens"], starts, lengths)
        for n, p in m.named_parameters():
            p.copy_(saved[n])
    m.zero_grad()
    logps, mask = _logps(m, batch["tokens"], starts, lengths)
    want_loss, logged = grpo_loss(logps, mask, r.advantages.double(), ref_logps=ref_logps, beta=0.05)
    want_loss.backward()

    def loss_fn(p, b, _cfg):
        ref = sharding.named_tree(ref_params, llama.init(cfg, torch.float64))
        return grpo.grpo_objective(forward, beta=0.05, reference=lambda _p, t: forward(ref, t))(p, b)
    loss, grads = single_device(cfg, tree_map(lambda x: x.double(), params), batch, loss_fn=loss_fn)
    m.float()          # (transformers computes the rotary angles in fp32 even in a float64 model: ~1e-7)
    assert abs(float(want_loss)) > 1e-4
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grads["lm_head"], m.lm_head.weight.grad.T.double(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grads["layers"][1]["mlp"]["down_proj"], m.model.layers[1].mlp.down_proj.weight.grad.T
                               .double(), rtol=1e-5, atol=1e-8)


def test_mask_truncated_completions_trains_only_the_stopped_ones(model):
    _, cfg, params = model
    forward = functools.partial(llama.forward, cfg=cfg)
    named = sharding.named_tree(params, llama.init(cfg, torch.float32))
    spec = GRPOSpec(reward_funcs=("hits",), num_generations=G, max_completion_length=3, temperature=1.0)
    r = rollout(forward, named, PROMPTS[:1], spec, Tok(-1), [("hits", _hits)], stop_ids=[], pad_id=0, key=1,
                step=0)
    assert all(r.truncated) and all(len(c) == 3 for c in r.completion_ids)
    assert (rollout_batch(r, SEQ, 0, mask_truncated=True)["labels"] == -100).all()
    assert (rollout_batch(r, SEQ, 0)["labels"] != -100).sum() == 3 * G


def test_gdpo_normalize_then_sum_equals_trls_lines():
    from trl.trainer.utils import nanstd
    g = torch.Generator().manual_seed(4)
    per_func = torch.randn(8, 2, generator=g)
    per_func[3, 1] = float("nan")
    w = torch.tensor([1.0, 2.0])
    rewards, adv, zero = grpo.combine_rewards(per_func, w, 4, "group", "normalize_then_sum")
    grouped = per_func.view(-1, 4, 2)                              # TRL 1.16's lines, its nanstd
    reward_k = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True))
                / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)).view(-1, 2)
    summed = (reward_k * w).nansum(dim=1)
    want = (summed - torch.nanmean(summed)) / (nanstd(summed).expand_as(summed) + 1e-4)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(rewards, (per_func * w).nansum(dim=1))
    _, adv_sum, _ = grpo.combine_rewards(per_func, w, 4, "group", "sum_then_normalize")
    torch.testing.assert_close(adv_sum, grpo.group_advantages((per_func * w).nansum(dim=1), 4))


def test_bad_reward_outputs_are_refused_naming_the_function():
    with pytest.raises(ValueError, match="reward function short returned 1 rewards for 2 completions"):
        score([("short", lambda prompts, completions, **k: [1.0])], ["p", "p"], ["a", "b"], [[1], [2]], {})
    with pytest.raises(ValueError, match="reward function text returned 'yes' for completion 1: not a number"):
        score([("text", lambda prompts, completions, **k: [1.0, "yes"])], ["p", "p"], ["a", "b"], [[1], [2]], {})
    with pytest.raises(RuntimeError, match=r"reward function strict raised TypeError: .*answer.* \(it is called as "
                                           r"f\(prompts=..., completions=..., completion_ids=..., target=...\)\)"):
        score([("strict", lambda prompts, completions, answer, **k: [])], ["p"], ["a"], [[1]], {"target": [1]})


def test_trl_keys_that_change_the_math_are_refused_and_engine_keys_accepted():
    base = {"reward_funcs": ["m.f"]}
    spec = grpo_spec("grpo", {**base, "use_vllm": True, "vllm_server_host": "h", "scale_rewards": True,
                              "num_iterations": 1}, {"host": "0.0.0.0"})
    assert spec.scale_rewards == "group" and spec.engine_keys == ("use_vllm", "vllm_server_host", "vllm.host")
    assert (spec.num_generations, spec.max_completion_length, spec.loss_type, spec.beta) == (8, 512, "dapo", 0.0)
    assert grpo_spec("gdpo", base).multi_objective_aggregation == "normalize_then_sum"
    assert grpo_spec("grpo", {**base, "importance_sampling_level": "sequence"}).importance_sampling_level == "sequence"
    for extra, why in [({"sync_ref_model": True}, "trl.sync_ref_model mixes the reference toward the policy, but "
                                                  "trl.beta is 0"),
                       ({"num_iterations": 0}, "trl.num_iterations must be >= 1"),
                       ({"steps_per_generation": 2}, "trl.steps_per_generation: generation batches larger"),
                       ({"importance_sampling_level": "tokens"}, "trl.importance_sampling_level 'tokens' is not one"),
                       ({"bogus": 1}, "trl.bogus is not a GRPO key read here"),
                       ({"num_generations": 1}, "num_generations must be >= 2"),
                       ({"reward_weights": [1, 2]}, "one weight per reward function \\(1\\)"),
                       ({"loss_type": "luspo"}, "trl.loss_type 'luspo' is not built")]:
        with pytest.raises(ValueError, match=why):
            grpo_spec("grpo", {**base, **extra})
    with pytest.raises(ValueError, match="trl.reward_funcs must list the reward functions"):
        grpo_spec("grpo", {})


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_an_accumulated_step_of_a_rollout_equals_one_batch(model, loss_type):
    """Completions of different lengths in 2 micro-batches: the step (which weighs a micro-batch
    by its share of the tokens) gives each loss type's one-batch loss and gradient norm."""
    _, cfg, params = model
    forward = functools.partial(llama.forward, cfg=cfg)
    named = sharding.named_tree(params, llama.init(cfg, torch.float32))
    spec = GRPOSpec(reward_funcs=("hits",), num_generations=G, max_completion_length=MAXC, temperature=1.3, top_k=12)
    first = forward(named, fpp.wrap(torch.tensor([[5, 6, 7]]), "batch seq")).value()[0, -1]
    stop = int(torch.topk(first, 3).indices[2])
    r = rollout(forward, named, PROMPTS, spec, Tok(stop), [("hits", _hits)], stop_ids=[stop], pad_id=0, key=3,
                step=0)
    lengths = sorted({len(c) for c in r.completion_ids})
    assert len(lengths) > 1, lengths
    batch = rollout_batch(r, SEQ, 0)
    objective = grpo.grpo_objective(forward, loss_type=loss_type, max_completion_length=MAXC)
    dims = {k: "batch seq" for k in batch}
    out = []
    for accum in (1, 2):
        step = fpp.train_step(objective, fpp.optim.sgd(0.0), mesh=fpp.Mesh(), rules=fpp.Rules(), grad_accum=accum,
                              batch_dims=dims)

        def device():
            state = step.init(fpp.init(llama.init, cfg, torch.float64, seed=0))
            return step(state, dict(batch))[1]
        m = fpp.launch(device, fpp.Mesh())[0]
        out.append((float(m["loss"]), float(m["grad_norm"])))
    (loss1, norm1), (loss2, norm2) = out
    assert norm1 > 1e-6
    assert loss2 == pytest.approx(loss1, rel=1e-9, abs=1e-12) and norm2 == pytest.approx(norm1, rel=1e-9)
