"""The step's op policy is explicit: ``train_step(..., keep_gathered=, cp_attention=,
regather_activations=, remat=)`` decides what the ops communicate, overriding the ambient
``functional_pp.configure`` default, and leaves the results equal (docs/policy.md)."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny()
LOSS = functools.partial(llama.loss, cfg=CFG)
MESH = fpp.Mesh(dp_shard=2, cp=2)
RULES = llama.default_rules()
BATCH = make_batch(CFG, batch=4, seq=16, seed=1)


def one_step(ambient=None, **policy):
    """Loss, reduced-gradient norm and the communication of one step on every device."""
    step = fpp.train_step(LOSS, fpp.optim.sgd(0.1), mesh=MESH, rules=RULES, **policy)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=MESH, rules=RULES, seed=0))
        with fpp.use_rules(RULES):
            local = {k: v.data for k, v in local_batch(BATCH, MESH, RULES).items()}
        with fpp.configure(**(ambient or {})), fpp.comm_report() as rep:
            _, m = step(state, local)
        return m["loss"], m["grad_norm"], rep
    return fpp.launch(device, MESH)[0]


@pytest.fixture(scope="module")
def default():
    return one_step()


def _same_numbers(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-9) and a[1] == pytest.approx(b[1], rel=1e-9)


def test_keep_gathered_removes_the_backward_regather(default):
    kept = one_step(keep_gathered=True)
    _same_numbers(kept, default)
    regather = default[2].bytes("all_gather", backward=True)
    assert regather > 0, "FSDP re-gathers weights in backward by default"
    assert kept[2].bytes("all_gather", backward=True) < regather


def test_cp_attention_decides_how_kv_travel(default):
    ring = default[2]
    gathered = one_step(cp_attention="allgather")
    _same_numbers(gathered, default)
    assert ring.count("permute", axes="cp") > 0
    assert gathered[2].count("permute", axes="cp") == 0


def test_explicit_argument_overrides_the_ambient_default(default):
    explicit = one_step(ambient={"cp_attention": "allgather"}, cp_attention="ring")
    assert explicit[2].as_dict() == default[2].as_dict()
    ambient = one_step(ambient={"cp_attention": "allgather"})            # None: the ambient value
    assert ambient[2].count("permute", axes="cp") == 0


def test_a_policy_value_is_checked_when_the_step_is_built():
    with pytest.raises(ValueError, match=r"cp_attention 'ringg': choose 'ring' or 'allgather'"):
        fpp.train_step(LOSS, fpp.optim.sgd(0.1), mesh=MESH, rules=RULES, cp_attention="ringg")


def test_a_step_refuses_a_second_different_parameter_tree():
    mesh = fpp.Mesh(dp_shard=2)
    rules = fpp.Rules(batch="dp_shard", vocab="dp_shard")
    step = fpp.train_step(LOSS, fpp.optim.sgd(0.1), mesh=mesh, rules=rules)

    def device():
        step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=0))
        step.init(fpp.init(llama.init, CFG, mesh=mesh, rules=rules, seed=1))     # same tree: fine
        with pytest.raises(ValueError, match="initialised with other parameters"):
            step.init(fpp.init(llama.init, llama.Config.tiny(layers=3), mesh=mesh, rules=rules, seed=0))
        return True
    assert all(fpp.launch(device, mesh))


def test_ops_outside_a_mesh_refuse_rules_that_split():
    x = torch.ones(4, 3)
    with fpp.use_rules(fpp.Rules(batch="dp_shard")):
        with pytest.raises(RuntimeError, match=r"split dimension 'batch' over mesh axes \('dp_shard',\), but no "
                                               r"mesh is running: call the op inside functional_pp.launch"):
            fpp.named(x, "batch hidden")
    with fpp.use_rules(fpp.Rules()):                  # rules that split nothing: one device
        assert fpp.named(x, "batch hidden").data.shape == (4, 3)
    from functional_pp.ops import sum as nsum
    assert nsum(fpp.named(x, "batch hidden")).data.item() == 12      # no rules at all
