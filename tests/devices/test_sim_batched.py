"""Batched simulation (launch(simulate="batched"), docs/simulation.md): every device in one run,
each op batched over a device dimension. Oracles: the threaded simulation (bitwise: the same
ops on the same blocks, sums in the same order) and the single-device run."""
import pytest
import torch
from harness import assert_same_run, make_batch, train_steps

import functional_pp as fpp
from functional_pp.devices.device_stack import DevicesDisagree
from functional_pp.models import llama
from functional_pp.parallel import collectives

CFG = llama.Config.tiny()
DATA = [make_batch(CFG, batch=8, seq=16, seed=s) for s in range(2)]
SP = llama.default_rules(sequence_parallel=True)


def test_training_steps_match_threaded_bitwise_and_collectives_agree():
    """HSDP-free 8 devices (FSDP x CP ring x TP+SP): losses, parameters after two AdamW steps and
    the collectives of a step are those of the threaded simulation, on every device."""
    mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
    threaded = fpp.launch(train_steps(CFG, DATA, mesh, SP), mesh)
    batched = fpp.launch(train_steps(CFG, DATA, mesh, SP), mesh, simulate="batched")
    assert len(batched) == mesh.size
    for a, b in zip(threaded, batched):
        assert_same_run(a, b)
        assert [(e.kind, e.axes, e.shape, e.backward) for e in a[2]] == \
            [(e.kind, e.axes, e.shape, e.backward) for e in b[2]]


def test_sixteen_devices_match_one_device():
    """The benchmark's layout (HSDP x CP ring x TP+SP, 16 devices) batched against one device."""
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    one = fpp.launch(train_steps(CFG, DATA, fpp.Mesh(), SP), fpp.Mesh())[0]
    for rank, run in enumerate(fpp.launch(train_steps(CFG, DATA, mesh, SP), mesh, simulate="batched")):
        assert_same_run(one, run, rtol=1e-9, atol=1e-12)


def _collectives():
    """Every collective with its gradient, on per-device inputs (device r's own values)."""
    x = fpp.per_device(lambda: torch.randn(4, 6, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(fpp.current_rank())))
    x.requires_grad_()
    w = torch.arange(24, dtype=torch.float64).reshape(4, 6) / 10
    outs = {
        "psum": fpp.psum(x, ("dp_shard", "tp")),
        "pmax": fpp.pmax(x, "cp"),
        "all_gather": fpp.all_gather(x, "tp", axis=1, tiled=True),
        "all_gather_stacked": fpp.all_gather(x, ("cp", "tp"), axis=0),
        "psum_scatter": fpp.psum_scatter(x, ("dp_shard", "cp"), scatter_dimension=0, tiled=True),
        "all_to_all": fpp.all_to_all(x, "tp", split_axis=1, concat_axis=0, tiled=True),
        "ppermute": fpp.ppermute(x, "cp", [(0, 1)]),
        "split_invariant": collectives.split_invariant(fpp.psum(x, "tp"), "tp", 1),
        "pvary": fpp.pvary(x.sum(), "dp_shard") * x,
        "slice_varying": collectives.slice_varying(x, "cp", 0),
        "offset": x * fpp.axis_index(("dp_shard", "tp")),
    }
    loss = sum((o * w[: o.shape[0], : o.shape[1]].sum()).sum() * (i + 1) for i, o in enumerate(outs.values()))
    loss.backward()
    return {k: v.detach() for k, v in outs.items()}, x.grad


def test_collectives_and_their_transposes_match_threaded():
    mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
    threaded = fpp.launch(_collectives, mesh)
    batched = fpp.launch(_collectives, mesh, simulate="batched")
    for rank, ((outs_t, grad_t), (outs_b, grad_b)) in enumerate(zip(threaded, batched)):
        for name in outs_t:
            assert torch.equal(outs_t[name], outs_b[name]), f"{name} on device {rank}"
        assert torch.equal(grad_t, grad_b), f"gradient on device {rank}"


def test_axis_index_is_per_device_and_results_come_back_in_rank_order():
    mesh = fpp.Mesh(cp=2, tp=3)
    got = fpp.launch(lambda: fpp.axis_index("tp") * 10 + fpp.axis_index("cp"), mesh, simulate="batched")
    assert [int(v) for v in got] == [r % 3 * 10 + r // 3 for r in range(6)]


def test_host_read_of_a_value_devices_agree_on_works():
    mesh = fpp.Mesh(dp_shard=4)

    def fn():
        x = fpp.per_device(lambda: torch.tensor(float(fpp.current_rank())))
        total = fpp.psum(x, "dp_shard")
        return total.item(), bool(total > 5), total.tolist()
    assert fpp.launch(fn, mesh, simulate="batched") == [(6.0, True, 6.0)] * 4


@pytest.mark.parametrize("read", ["item", "bool", "tolist"])
def test_host_read_of_a_value_devices_disagree_on_is_refused(read):
    def fn():
        x = fpp.per_device(lambda: torch.tensor(float(fpp.current_rank())))
        return {"item": x.item, "bool": lambda: bool(x > 0), "tolist": x.tolist}[read]()
    with pytest.raises(DevicesDisagree, match=r"differs between devices \(devices \[1\]"):
        fpp.launch(fn, fpp.Mesh(tp=2), simulate="batched")


def test_asking_for_one_integer_rank_is_refused():
    with pytest.raises(RuntimeError, match="running device's rank as one integer"):
        fpp.launch(lambda: fpp.device_coords(), fpp.Mesh(tp=2), simulate="batched")


def test_random_ops_are_refused():
    def fn():
        x = fpp.per_device(lambda: torch.ones(8))
        return torch.nn.functional.dropout(x, 0.5)
    with pytest.raises(RuntimeError, match="draws random numbers"):
        fpp.launch(fn, fpp.Mesh(tp=2), simulate="batched")


def test_per_device_refuses_collectives_and_unequal_plain_values():
    with pytest.raises(RuntimeError, match=r"per_device: the function called a collective \(all_reduce\)"):
        fpp.launch(lambda: fpp.per_device(lambda: fpp.psum(torch.ones(()), "tp")), fpp.Mesh(tp=2),
                   simulate="batched")
    with pytest.raises(ValueError, match="different values"):
        fpp.launch(lambda: fpp.per_device(lambda: fpp.current_rank()), fpp.Mesh(tp=2), simulate="batched")


def test_unknown_simulate_value_is_refused():
    with pytest.raises(ValueError, match="simulate must be True .* or 'batched'"):
        fpp.launch(lambda: None, fpp.Mesh(tp=2), simulate="fast")


def test_compiled_step_is_refused():
    mesh = fpp.Mesh(tp=2)
    with pytest.raises(ValueError, match="cannot run in a batched simulation"):
        fpp.launch(train_steps(CFG, DATA[:1], mesh, SP, compile="aot_eager"), mesh, simulate="batched")


def test_fused_in_place_adamw_matches_threaded_bitwise():
    """donate_state: AdamW's fused in-place kernel on the stacked blocks, its step counter (an
    ordinary tensor) advanced once with the value every device agrees on."""
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    threaded = fpp.launch(train_steps(CFG, DATA, mesh, SP, donate_state=True), mesh)
    batched = fpp.launch(train_steps(CFG, DATA, mesh, SP, donate_state=True), mesh, simulate="batched")
    for a, b in zip(threaded, batched):
        assert_same_run(a, b)


def test_torch_equal_answers_per_device():
    def fn():
        x = fpp.per_device(lambda: torch.full((3,), float(fpp.current_rank())))
        y = fpp.per_device(lambda: torch.full((3,), float(fpp.current_rank())))
        same = torch.equal(x, y)                     # True on every device
        with pytest.raises(DevicesDisagree, match="torch.equal answers"):
            torch.equal(x, torch.zeros(3))           # True on device 0 only
        return same
    assert fpp.launch(fn, fpp.Mesh(tp=2), simulate="batched") == [True, True]
