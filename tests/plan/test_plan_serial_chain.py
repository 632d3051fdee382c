"""The time model of a recurrence under context parallelism (docs/planning.md, "Recurrences under cp"):
the chain's blocks run device after device (ops/sequence_chain.py), so a device waits while the others
run theirs: the dry-run counts the other devices' turns (``DeviceRun.serial_flops`` / ``serial_traffic``)
and ``plan.cost`` adds them to the compute, with the state's sends on the critical path. A layer that is
only a recurrence is then no faster under cp 2 than on one device, and the search, which includes cp for
such models, does not choose cp for a hybrid whose recurrent layers it would serialise."""
import functools

import functional_pp as fpp
from functional_pp import plan
from functional_pp.models import llama
from functional_pp.ops.linear_attention import gated_delta_rule

S = 4096
BATCH = {"tokens": ((2, S), "batch seq"), "labels": ((2, S), "batch seq")}
#: the device's work alone (the host's launches, ``launch_seconds``, would bound these tiny steps: each cp
#: device's host launches only its own blocks of the chain)
DEVICE = plan.cluster("h100x8").with_(launch_seconds=0.0)


def recurrence_decls():
    return {"q": fpp.param((2, S, 2, 16), "batch seq kvh hd"), "k": fpp.param((2, S, 2, 16), "batch seq kvh hd"),
            "v": fpp.param((2, S, 2, 16), "batch seq heads vd"), "g": fpp.param((2, S, 2), "batch seq heads"),
            "beta": fpp.param((2, S, 2), "batch seq heads")}


@fpp.layer
def recurrence(p):
    return gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], batch="batch", seq="seq", heads="heads",
                            kv_heads="kvh", head_dim="hd", v_head_dim="vd")


def recurrence_loss(p, batch):
    o = recurrence(p)
    return fpp.ops.mean(o * o, ("batch", "seq", "heads", "vd"))


def test_a_recurrence_is_not_faster_under_cp():
    """One gated delta rule over 2 x 4096 tokens: the device's predicted work on cp 2 is not less than on
    one device (0.230 ms against 0.189 ms on h100x8; without the other device's turn 0.143 ms),
    and the waited work is the other device's blocks: as much as this device's own."""
    one = plan.estimate(recurrence_loss, recurrence_decls(), fpp.Mesh(), fpp.Rules(), BATCH)
    cp = plan.estimate(recurrence_loss, recurrence_decls(), fpp.Mesh(cp=2), fpp.Rules(seq=fpp.balanced("cp")), BATCH)
    assert not one.runs[-1].serial_flops
    run = cp.runs[-1]
    for phase in ("forward", "backward"):
        assert 0 < run.serial_flops[phase] <= run.flops[phase]
    assert sum(run.serial_flops.values()) + sum(run.flops.values()) >= sum(one.runs[-1].flops.values())
    t_one, t_cp = plan.cost(one, DEVICE).step_s, plan.cost(cp, DEVICE).step_s
    assert t_cp >= t_one, (t_cp, t_one)
    assert any(e.kind == "permute" for e in run.events)          # (the state's sends, on the critical path)


def test_the_search_includes_cp_for_a_hybrid_and_does_not_choose_it():
    """A Qwen3.5 hybrid (a Gated DeltaNet layer, a full-attention layer), 2 devices: the cp 2 layout is
    estimated, predicted slower than data parallelism on the device's work, and not chosen."""
    cfg = llama.Config(model_type="qwen3_5_text", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       mlp=128, rope_theta=10000.0, rope_scaling=None, q_gate=True, qk_norm=True, norm_offset=1.0,
                       partial_rotary_factor=0.25, linear_heads=4, linear_kv_heads=2, linear_head_dim=16,
                       linear_v_head_dim=16, layer_types=("linear_attention", "full_attention"))
    space = plan.Space(fsdp=(("dp_shard", "cp"),), sequence_parallel=(False,), regather_activations=(False,),
                       cp_attention=("ring",), remat=(False,), keep_gathered=(False,), precision="fp32",
                       max_axis={"tp": 1, "dp_replicate": 1})
    ranking = plan.search(functools.partial(llama.loss, cfg=cfg), llama.init(cfg), 2, BATCH, space=space,
                          cluster=DEVICE)
    by_cp = {e.mesh.shape["cp"]: e for e in ranking}
    assert set(by_cp) == {1, 2}, [e.mesh for e in ranking]
    assert by_cp[2].runs[-1].serial_flops                          # (its recurrent layer ran as a chain)
    assert ranking[0].mesh.shape["cp"] == 1
    assert by_cp[2].time.step_s > by_cp[1].time.step_s
