"""The execution policy in one object (functional_pp/core/policy.py, docs/policy.md): a frozen
``Policy`` whose ambient fields left None inherit (``over``), the thread-local ambient policy
(``current_policy`` / ``use_policy`` / ``fpp.configure``), and a training step's ``policy``
taking effect over the ambient one."""
import functools
import threading

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.core.policy import AMBIENT, FIELDS, RESOLVED, STEP_ONLY, Policy
from functional_pp.core.runtime import current_policy, use_policy
from functional_pp.models import llama


def test_over_fills_only_the_fields_left_none():
    base = Policy(remat=True, keep_gathered=True, cp_attention="allgather", regather_activations=True,
                  reduce_dtype=torch.float32, check_rep=True)
    mine = Policy(keep_gathered=False, bucket_mb=None)
    got = mine.over(base)
    assert got.keep_gathered is False                            # set here: kept (False is not None)
    assert (got.remat, got.cp_attention, got.regather_activations, got.reduce_dtype) == (
        True, "allgather", True, torch.float32)                   # None here: base's
    assert got.bucket_mb is None and got.fsdp_units is True      # step fields: never inherited
    assert Policy().over(RESOLVED) == RESOLVED.replace()         # everything inherited
    full = base.replace(remat=False, reduce_dtype=torch.float16)
    assert full.over(RESOLVED) is full                           # nothing to inherit: the same object
    assert RESOLVED.over(base).reduce_dtype == torch.float32     # (None there too: "no dtype" inherits)


def test_replace_changes_fields_and_refuses_unknown_keys():
    p = Policy(remat=True)
    q = p.replace(bucket_mb=0, cp_attention="ring")
    assert (q.remat, q.bucket_mb, q.cp_attention) == (True, 0, "ring") and p.bucket_mb == 25.0
    with pytest.raises(TypeError, match=r"unknown policy setting 'keep_gatherd'; the settings are remat, "
                                        r"keep_gathered, .*fsdp_prefetch"):
        p.replace(keep_gatherd=True)
    with pytest.raises(TypeError, match="unknown policy setting 'remmat'"):
        Policy.of(remmat=True)
    with pytest.raises(ValueError, match="cp_attention 'ringg'"):
        p.replace(cp_attention="ringg")
    with pytest.raises(ValueError, match="bucket_mb must be a size in megabytes"):
        Policy(bucket_mb=-1)
    with pytest.raises(Exception):                               # frozen
        p.remat = False
    assert set(AMBIENT) | set(STEP_ONLY) == set(FIELDS)


def test_configure_takes_ambient_settings_only():
    with pytest.raises(TypeError, match=r"'bucket_mb' is a setting of a training step only.*train_step"):
        fpp.configure(bucket_mb=None)
    with pytest.raises(TypeError, match=r"configure: unknown policy setting 'keep'; the settings are remat, "
                                        r"keep_gathered, cp_attention, regather_activations, reduce_dtype, check_rep$"):
        fpp.configure(keep=True)


def test_use_policy_nests_and_restores():
    assert current_policy() is RESOLVED
    with fpp.configure(keep_gathered=True) as outer:
        assert current_policy() is outer and outer.keep_gathered and outer.cp_attention == "ring"
        with use_policy(Policy(cp_attention="allgather")) as inner:
            assert current_policy() is inner
            assert (inner.keep_gathered, inner.cp_attention) == (True, "allgather")    # outer's inherited
            with fpp.configure(keep_gathered=False):
                assert not current_policy().keep_gathered and current_policy().cp_attention == "allgather"
            assert current_policy() is inner
        assert current_policy() is outer
    assert current_policy() is RESOLVED
    with pytest.raises(TypeError, match="needs a functional_pp.Policy"):
        use_policy({"remat": True})


def test_the_ambient_policy_is_per_thread():
    inside, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with fpp.configure(remat=True):
            inside.set()
            release.wait(10)
            seen["other"] = current_policy().remat
        seen["after"] = current_policy()

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    seen["main"] = current_policy().remat            # the other thread's block is not this one's
    with fpp.configure(cp_attention="allgather"):
        release.set()
        t.join(10)
        assert current_policy().cp_attention == "allgather"
    assert seen == {"other": True, "main": False, "after": RESOLVED}


# --------------------------------------------------------------- a step's policy takes effect
CFG = llama.Config.tiny(layers=2)
MESH = fpp.Mesh(dp_shard=2)
RULES = llama.default_rules(tp=False)
BATCH = make_batch(CFG, batch=2, seq=8, seed=1)


def backward_gather_bytes(ambient=None, **step_kw):
    """Bytes all-gathered in backward by one FSDP step (device 0), under ``configure(**ambient)``."""
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1), mesh=MESH, rules=RULES,
                          **step_kw)

    def device():
        state = step.init(fpp.init(llama.init, CFG, mesh=MESH, rules=RULES, seed=0))
        with fpp.use_rules(RULES):
            local = {k: v.data for k, v in local_batch(BATCH, MESH, RULES).items()}
        with fpp.configure(**(ambient or {})), fpp.comm_report() as rep:
            step(state, local)
        return rep.bytes("all_gather", backward=True)
    return fpp.launch(device, MESH)[0]


def test_a_step_policy_takes_effect_and_inherits_the_ambient_fields_it_leaves_none():
    regathered = backward_gather_bytes()
    assert regathered > 0, "FSDP re-gathers the layers' weights in backward by default"
    assert backward_gather_bytes(policy=Policy(keep_gathered=True)) == 0
    assert backward_gather_bytes(keep_gathered=True) == 0                         # the keyword builds it
    assert backward_gather_bytes(ambient={"keep_gathered": True}) == 0            # None: inherited
    assert backward_gather_bytes(ambient={"keep_gathered": True}, keep_gathered=False) == regathered
    assert backward_gather_bytes(policy=Policy(fsdp_units=False), keep_gathered=False) > 0


def test_a_step_resolves_its_policy_over_the_ambient_one():
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1), precision="bf16",
                          policy=Policy(cp_attention="allgather"), bucket_mb=0)
    assert step.policy == Policy(cp_attention="allgather", bucket_mb=0)
    with fpp.configure(remat=True, keep_gathered=True, cp_attention="ring"):
        got = step.resolved_policy()
    assert (got.remat, got.keep_gathered, got.cp_attention, got.reduce_dtype) == (
        True, True, "allgather", torch.float32)          # (remat left None by policy=: inherited)
    assert fpp.train_step(step.loss_fn, step.optimizer).resolved_policy().remat is False   # the default
    with pytest.raises(TypeError, match="needs a functional_pp.Policy"):
        fpp.train_step(step.loss_fn, step.optimizer, policy={"remat": True})


def test_a_training_config_gives_its_step_policy():
    from functional_pp.config.train_config import TrainConfig
    cfg = TrainConfig.from_dict({"gradient_checkpointing": True, "fsdp_config": {"reshard_after_forward": False}})
    assert cfg.policy() == Policy(remat=True, keep_gathered=True)
    assert TrainConfig.from_dict({}).policy() == Policy(remat=False, keep_gathered=False)


def test_use_policy_resolves_the_same_two_policies_once():
    """``use_policy`` puts a policy over the ambient one as ``Policy.over`` does, and gives the
    same object again for the same two policy objects (a step enters its policy, and its FSDP
    root's, over the same ambient one every step: docs/eager_overhead.md); another ambient policy
    resolves anew."""
    step_policy = Policy(remat=True)
    with use_policy(step_policy) as first:
        pass
    with use_policy(step_policy) as again:
        pass
    assert again is first and first == step_policy.over(RESOLVED)
    with fpp.configure(remat=False, keep_gathered=True):
        with use_policy(Policy(cp_attention="allgather")) as inner:
            assert inner.keep_gathered is True and inner.remat is False and inner.cp_attention == "allgather"
            assert current_policy() is inner
    with use_policy(Policy(cp_attention="allgather")) as outside:
        assert outside.keep_gathered is False


def test_a_repeated_step_resolves_no_policy(monkeypatch):
    """A step's policies (its own, the FSDP root's keep_gathered) are put over the ambient one
    without a ``Policy.over`` (a ``dataclasses.replace``) after the first step."""
    cfg = llama.Config(vocab=64, hidden=16, layers=2, heads=2, kv_heads=1, mlp=32, max_seq=16,
                       tie_embeddings=False, rope_scaling=None)
    step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-2))
    state = step.init(fpp.init(llama.init, cfg, seed=0))
    batch = make_batch(cfg, 2, 8, seed=1)
    state, _ = step(state, batch)
    calls = []
    original = Policy.over
    monkeypatch.setattr(Policy, "over", lambda self, base: calls.append(self) or original(self, base))
    state, _ = step(state, batch)
    assert calls == []
