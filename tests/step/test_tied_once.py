"""A tied Llama (``tie_embeddings``, Llama-3.2-1B's head) under FSDP gathers its 128k x h table
once per step, declared ``fpp.tied`` or not: one all-gather in forward, one reduce-scatter in
backward (docs/layouts.md, "Tied parameters"); the losses are one device's."""
import functools

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.models import llama

CFG = llama.Config.tiny(tie_embeddings=True)
MESH, RULES = fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)
TABLE = CFG.vocab * CFG.hidden * 8          # bytes of the float64 table


def _run(mesh, rules, steps=3):
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-3), mesh=mesh, rules=rules)

    def device():
        state = step.init(fpp.init(llama.init, CFG, torch.float64, mesh=mesh, rules=rules, seed=0))
        out = []
        for i in range(steps):
            with fpp.use_rules(rules):
                local = {k: v.data for k, v in local_batch(make_batch(CFG, 4, 8, i), mesh, rules).items()}
            with fpp.comm_report() as rep:
                state, m = step(state, local)
            # the table's collectives: (n-1)/n of its bytes each
            table = [(e.kind, e.backward) for e in rep.events if e.bytes_sent == TABLE // 2 and e.kind in
                     ("all_gather", "reduce_scatter")]
            out.append((m["loss"], table))
        return out
    return fpp.launch(device, mesh)[0]


@pytest.mark.parametrize("declared", [True, False])
def test_a_tied_llama_gathers_its_table_once_per_step(declared, monkeypatch):
    if not declared:      # the table used at both sites as a plain parameter
        monkeypatch.setattr(llama, "tied", lambda x: x)
    steps = _run(MESH, RULES)
    one = _run(fpp.Mesh(), fpp.Rules())
    first = 1 if declared else 2            # undeclared: learned in the first forward
    assert sorted(steps[0][1]) == sorted([("all_gather", False)] * first + [("reduce_scatter", True)] * first)
    for loss_, table in steps[1:]:
        assert sorted(table) == [("all_gather", False), ("reduce_scatter", True)]
    for (loss_, _), (ref, _) in zip(steps, one):
        assert loss_ == pytest.approx(ref, rel=1e-12)
