"""Activation offloading (``train_step(activation_offloading=True)``; docs/memory.md): on the CPU
a no-op that says so once; the packer's composition with the FSDP re-gathering hooks
(core/saved_hooks.py) checked on the CPU with a mover that copies (the CUDA mover's streams
need a GPU): the saved activations of every layer go through it, inside the FSDP units too,
and the numbers equal those without offloading, bitwise, on simulated devices and on gloo."""
import warnings

import pytest
import torch
from harness import assert_same_run, launch_steps, make_batch, train_steps

import functional_pp as fpp
from functional_pp.core.saved_hooks import Packed
from functional_pp.models import llama
from functional_pp.step import activation_offload
from functional_pp.step.activation_offload import NotOffloadedWarning

CFG = llama.Config.tiny(layers=2, hidden=32, mlp=64, vocab=64)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)


class _Copied(Packed):
    def __init__(self, t, log):
        self.copy, self.log = t.clone(), log
        log.append("pack")

    def restore(self):
        self.log.append("restore")
        return self.copy.clone()


def test_on_the_cpu_it_is_a_no_op_that_says_so_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = launch_steps(CFG, steps=2)
        offloaded = launch_steps(CFG, steps=2, activation_offloading=True)
    said = [w for w in caught if issubclass(w.category, NotOffloadedWarning)]
    assert len(said) == 1 and "computes on cpu" in str(said[0].message)
    assert_same_run(plain[0], offloaded[0])


def _copying_mover(monkeypatch, log):
    monkeypatch.setattr(activation_offload, "MIN_BYTES", 1)
    monkeypatch.setattr(activation_offload, "mover_for", lambda device: lambda t: _Copied(t, log))


def test_saved_activations_go_through_the_packer_inside_fsdp_units_with_the_same_numbers(monkeypatch):
    log = []
    _copying_mover(monkeypatch, log)
    plain = launch_steps(CFG, mesh=MESH, rules=RULES, steps=2, precision="bf16")
    offloaded = launch_steps(CFG, mesh=MESH, rules=RULES, steps=2, precision="bf16", activation_offloading=True)
    for a, b in zip(plain, offloaded):
        assert_same_run(a, b)
    # every packed tensor restored once; more than the root's few: the layers' too
    assert log.count("pack") == log.count("restore") > 20 * 2 * MESH.size


def test_without_units_hooks_the_packer_sees_no_more(monkeypatch):
    """The units' and re-gathering hooks pass what they do not replace on: switching them off
    (keep_gathered: no re-gather hooks) packs the same tensors, but the gathered weights, which
    the re-gathering replaces by their shards."""
    counts = []
    for keep in (False, True):
        log = []
        _copying_mover(monkeypatch, log)
        launch_steps(CFG, mesh=MESH, rules=RULES, steps=1, activation_offloading=True, keep_gathered=keep)
        counts.append(log.count("pack"))
    assert counts[1] > counts[0] > 0


LOG: list = []


def _offloaded_run():
    """On a gloo rank (forked: it inherits the copying mover): the steps and how many tensors
    the packer took."""
    LOG.clear()
    data = [make_batch(CFG, batch=4, seq=16, seed=i) for i in range(2)]
    return train_steps(CFG, data, MESH, RULES, torch.float32, activation_offloading=True)(), LOG.count("pack")


@pytest.mark.multiprocess
def test_offloaded_activations_on_gloo_processes(monkeypatch):
    _copying_mover(monkeypatch, LOG)
    plain = launch_steps(CFG, mesh=MESH, rules=RULES, steps=2)
    for a, (b, packed) in zip(plain, fpp.launch(_offloaded_run, MESH, processes=True, timeout=300)):
        assert_same_run(a, b)
        assert packed > 20 * 2
