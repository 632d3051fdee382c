"""Preference training under a pipeline: the DPO / KTO objectives (policy and reference
forwards of one micro-batch: several passes through the stages, docs/pipelines.md "Several
forwards per micro-batch") on a tiny Llama whose layers, and the frozen reference copy's, are
split over ``pp``, against ``train_step`` with the same micro-batches on one device: the loss,
TRL's reported metrics, every gradient (SGD(lr=1)'s update) and AdamW's updated parameters;
GPipe, 1F1B and ZB-H1, pp x DP, pp x FSDP, pp x TP and pp x CP, the reference as LoRA's base (adapters left out), and
one run on real gloo processes."""
import functools

import numpy as np
import pytest
import torch

import functional_pp as fpp
from functional_pp import adapters
from functional_pp.core.tree import tree_map
from functional_pp.models import llama
from functional_pp.parallel.raw_collectives import raw_all_gather
from functional_pp.preference.objective import PreferenceSpec, preference_loss
from functional_pp.step.pipeline import pipeline_step

CFG = llama.Config.tiny(layers=2)
DTYPE = torch.float64
M, B, S = 2, 4, 8                     # micro-batches, pairs per step, tokens per row
FIRST, LAST = llama.pipeline_ends(CFG)
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies", "logps_chosen",
           "logps_rejected")


def _pairs(step: int) -> dict:
    """Chosen / rejected rows, labels only on a completion of varying length (-100 elsewhere)."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for side in ("chosen", "rejected"):
        toks = torch.randint(0, CFG.vocab, (B, S), generator=g)
        labels = torch.full((B, S), -100)
        for i in range(B):
            start = int(torch.randint(1, 4, (), generator=g))
            labels[i, start:] = toks[i, start:]
        out[f"{side}_tokens"], out[f"{side}_labels"] = toks, labels
    return out


def _kto(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    toks = torch.randint(0, CFG.vocab, (B, S), generator=g)
    labels = torch.where(torch.arange(S) >= 2, toks, -100)
    desirable = torch.tensor([1, 0, 1, 1]).unsqueeze(1).expand(B, S).contiguous()
    return {"tokens": toks, "labels": labels, "desirable": desirable, "kl_tokens": toks.roll(1, 0),
            "kl_labels": labels.roll(1, 0)}


def _full(method="dpo"):
    """(loss, declarations, trainable mask, pipeline paths): the policy and a frozen reference copy."""
    forward = functools.partial(llama.forward, cfg=CFG)
    decls = {**llama.init(CFG, DTYPE), "reference": llama.init(CFG, DTYPE)}

    def policy(params, tokens):
        return forward({k: v for k, v in params.items() if k != "reference"}, tokens)

    def reference(params, tokens):
        return forward(params["reference"], tokens)

    def trainable(params):
        return {k: tree_map(lambda _: k != "reference", v) for k, v in params.items()}
    ends = dict(layers=("layers", "reference.layers"), first_stage=FIRST + tuple(f"reference.{n}" for n in FIRST),
                last_stage=LAST + tuple(f"reference.{n}" for n in LAST))
    return preference_loss(PreferenceSpec(method, beta=0.1), policy, reference), decls, trainable, ends


LC = adapters.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _lora():
    """(loss, declarations, trainable mask, pipeline paths): the reference is the base without adapters."""
    forward = functools.partial(llama.forward, cfg=CFG)
    base = llama.init(CFG, DTYPE)
    decls = adapters.init(base, LC)

    def policy(params, tokens):
        return forward(adapters.apply(params, LC), tokens)

    def reference(params, tokens):
        return forward(adapters.split(params)[0], tokens)
    return (preference_loss(PreferenceSpec("dpo", beta=0.1), policy, reference), decls, adapters.trainable(LC),
            dict(first_stage=FIRST, last_stage=LAST))


def _run(objective, mesh, rules, data, opt="adamw", processes=False, **pp):
    """Per device: per step the loss and metrics, and the held parameters (gathered) after the steps."""
    loss, decls, trainable, paths = objective
    optimizer = fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=0.5) if opt == "adamw" else fpp.optim.sgd(1.0)
    if pp:
        step = pipeline_step(loss, optimizer, mesh=mesh, rules=rules, grad_accum=M, trainable=trainable,
                             batch_dims={k: "batch seq" for k in data[0]}, **paths, **pp)
    else:
        step = fpp.train_step(loss, optimizer, mesh=mesh, rules=rules, grad_accum=M, trainable=trainable,
                              batch_dims={k: "batch seq" for k in data[0]})

    def device():
        state = step.init(fpp.init(lambda: decls, mesh=mesh, rules=rules, seed=0))
        seen = []
        for b in data:
            with fpp.use_rules(rules):
                local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
            state, m = step(state, local)
            seen.append({k: float(v) for k, v in m.items() if k == "loss" or k in METRICS or k == "kl"})
        out = {}
        for path, x in fpp.leaves_with_paths(state["params"]):
            if x.numel():       # (frozen ones too: they stay as they were)
                for dim, axes in enumerate(rules.resolve(_decl(decls, path).dims, x.shape, mesh, name=path)):
                    x = raw_all_gather(x, axes, dim) if axes else x
                out[path] = x.numpy().copy()
        return seen, out
    kw = {"processes": True, "timeout": 300} if processes else {}
    return fpp.launch(device, mesh, **kw)


def _decl(decls, path):
    return dict(fpp.leaves_with_paths(decls))[path]


def _assert_equal(one, results, rtol=1e-10, atol=1e-12):
    (ref_metrics, ref_params), = one
    seen = set()
    for metrics, params in results:
        assert [m.keys() for m in metrics] == [m.keys() for m in ref_metrics]
        for got, want in zip(metrics, ref_metrics):
            for k in want:          # (the reported metrics are float32, as TRL logs them)
                tol = dict(rtol=rtol, atol=atol) if k == "loss" else dict(rtol=1e-6, atol=1e-7)
                np.testing.assert_allclose(got[k], want[k], err_msg=k, **tol)
        for path, x in params.items():
            np.testing.assert_allclose(x, ref_params[path], rtol=rtol, atol=atol, err_msg=path)
            seen.add(path)
    assert seen == ref_params.keys()              # every parameter held by some stage


@pytest.fixture(scope="module")
def dpo():
    objective, data = _full(), [_pairs(0), _pairs(1)]
    return objective, data, {opt: _run(objective, fpp.Mesh(), fpp.Rules(), data, opt) for opt in ("adamw", "sgd")}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dpo_pp2_equals_one_device(dpo, schedule):
    objective, data, one = dpo
    assert set(one["adamw"][0][0][0]) == {"loss", *METRICS}
    for opt in ("adamw", "sgd"):           # SGD(lr=1): the update is the gradient
        _assert_equal(one[opt], _run(objective, fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, opt,
                                     schedule=schedule))


@pytest.mark.parametrize("what,mesh,rules,schedule", [
    ("dp", fpp.Mesh(pp=2, dp_shard=2), fpp.Rules(batch="dp_shard", layers="pp"), "1f1b"),
    ("fsdp", fpp.Mesh(pp=2, dp_shard=2), fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp"), "1f1b"),
    ("tp", fpp.Mesh(pp=2, tp=2), fpp.Rules(layers="pp", heads="tp", mlp="tp", vocab="tp"), "zb_h1"),
    ("cp", fpp.Mesh(pp=2, cp=2), fpp.Rules(seq=fpp.balanced("cp"), res_seq=fpp.inherit("seq"), layers="pp"),
     "gpipe")])
def test_dpo_pp_composes(dpo, what, mesh, rules, schedule):
    objective, data, one = dpo
    tol = dict(rtol=1e-8, atol=1e-10) if what == "cp" else {}     # (CP's ring: another order of sums)
    _assert_equal(one["adamw"], _run(objective, mesh, rules, data, schedule=schedule), **tol)


def test_kto_and_lora_dpo_pp2_equal_one_device():
    """KTO's four forwards (two without gradient, its KL estimate) and LoRA's reference (the
    same layers with the adapters left out) through the stages."""
    data = [_kto(0), _kto(1)]
    kto = _full("kto")
    _assert_equal(_run(kto, fpp.Mesh(), fpp.Rules(), data, "sgd"),
                  _run(kto, fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, "sgd", schedule="1f1b"))
    lora, data = _lora(), [_pairs(0), _pairs(1)]
    one = _run(lora, fpp.Mesh(), fpp.Rules(), data, "sgd")
    _assert_equal(one, _run(lora, fpp.Mesh(pp=2), fpp.Rules(layers="pp"), data, "sgd", schedule="gpipe"))


@pytest.mark.multiprocess
def test_dpo_pp_fsdp_on_gloo_processes_equals_one_device(dpo):
    objective, data, one = dpo
    _assert_equal(one["adamw"], _run(objective, fpp.Mesh(pp=2, dp_shard=2),
                                     fpp.Rules(batch="dp_shard", hidden="dp_shard", layers="pp"), data,
                                     processes=True, schedule="1f1b"))


def test_a_loss_calling_the_layers_a_partial_number_of_times_is_refused():
    """A loss whose layer calls are not whole forwards of the model is refused by name."""
    def loss(params, batch):
        x = llama.forward(params, batch["tokens"], CFG)
        llama.layer(params["layers"][0], ops_embed(params, batch["tokens"]), None, CFG)
        return x.map(lambda t: t.sum())

    def ops_embed(params, tokens):
        return fpp.ops.embed(params["embed_tokens"], tokens)
    step = pipeline_step(loss, fpp.optim.sgd(1.0), mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"), grad_accum=2)

    def device():
        state = step.init(fpp.init(llama.init, CFG, DTYPE, mesh=step.mesh, rules=step.rules, seed=0))
        step(state, {"tokens": torch.zeros(2, S, dtype=torch.long), "labels": torch.zeros(2, S, dtype=torch.long)})
    with pytest.raises(Exception, match="called 3 layers, not a multiple of the 2"):
        fpp.launch(device, step.mesh)
