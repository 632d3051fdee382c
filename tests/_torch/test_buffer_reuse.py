"""In-place buffer reuse past a donated update's ordering-only dependencies (docs/compile.md
"Buffer reuse past the update"): a compiled step with donated state writes the logits'
gradient into the logits' buffer, as plain torch's backward does."""
import re
import types

import pytest
import torch

import functional_pp as fpp
from functional_pp import ops
from functional_pp._torch import buffer_reuse

V, H, B, S = 256, 24, 2, 8


def _user(is_weak, *deps):
    return types.SimpleNamespace(is_weak=is_weak, node=types.SimpleNamespace(
        read_writes=types.SimpleNamespace(reads=list(deps))))


def test_only_a_fake_weak_dependency_is_ordering_only():
    from torch._inductor.dependencies import MemoryDep, StarDep, WeakDep
    fake = WeakDep("buf1", mutating_buf="buf9", is_fake=True)
    alias = WeakDep("buf1", mutating_buf="buf9", is_fake=False)     # the mutated buffer is a view of it
    other = WeakDep("buf2", mutating_buf="buf9", is_fake=True)
    assert buffer_reuse.ordering_only(_user(True, fake, other), "buf1")
    assert not buffer_reuse.ordering_only(_user(True, alias), "buf1")
    assert not buffer_reuse.ordering_only(_user(True, other), "buf1")          # no dependency on buf1
    assert not buffer_reuse.ordering_only(_user(False, fake), "buf1")         # a real user
    assert not buffer_reuse.ordering_only(_user(True, fake, StarDep("buf1")), "buf1")
    index = torch.fx.experimental.symbolic_shapes.sympy.Symbol("c0")
    assert not buffer_reuse.ordering_only(_user(False, MemoryDep("buf1", index, (index,), (4,))), "buf1")


def test_the_decision_sees_the_buffer_without_its_ordering_only_users_and_the_lists_come_back():
    """The wrapped decision runs with ordering-only users hidden inside the context, with every
    user outside it, and the scheduler's lists are restored either way."""
    from torch._inductor.dependencies import WeakDep
    seen = []
    reader = _user(False)
    write = _user(True, WeakDep("buf1", mutating_buf="buf9", is_fake=True))
    buf = types.SimpleNamespace(users=[reader, write])
    node = types.SimpleNamespace(
        read_writes=types.SimpleNamespace(reads=[types.SimpleNamespace(name="buf1")]),
        scheduler=types.SimpleNamespace(name_to_donated_buffer={}, name_to_buf={"buf1": buf}))
    decide = buffer_reuse._decide_inplace_update(lambda self: seen.append(list(buf.users)))
    decide(node)
    with buffer_reuse.reuse_past_ordering_deps() as active:
        assert active
        decide(node)
    decide(node)
    assert seen == [[reader, write], [reader], [reader, write]]
    assert buf.users == [reader, write]


def _init():
    g = torch.Generator().manual_seed(0)
    return {"embed": fpp.Named(torch.randn(V, H, generator=g) * 0.1, ("vocab", "hidden")),
            "head": fpp.Named(torch.randn(H, V, generator=g) * 0.1, ("hidden", "vocab"))}


def _loss(p, batch):
    x = ops.embed(p["embed"], batch["tokens"])
    return ops.cross_entropy(ops.einsum("batch seq hidden, hidden vocab -> batch seq vocab", x, p["head"]),
                             batch["labels"])


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, ::3] = -100
    return {"tokens": ids[:, :-1].contiguous(), "labels": labels}


def _logits_sized_buffers(code: str) -> int:
    """How many buffers of the logits' size (tokens x vocab floats) the compiled step allocates."""
    sizes = re.findall(r"empty_strided_cpu\(\(([0-9, ]+)\)", code)
    numel = [eval("*".join(s.split(",")).strip(" *") or "1") for s in sizes]
    return sum(n == B * S * V for n in numel)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_donated_inductor_step_writes_the_logits_gradient_into_the_logits():
    """One logits-sized buffer in the compiled step (the matmul's output, overwritten with the
    gradient; two without the reuse), and the same losses and parameters as the eager step."""
    from torch._inductor.utils import run_and_get_code
    batch = _batch()
    opt = fpp.optim.sgd(0.5, momentum=0.9)
    compiled = fpp.train_step(_loss, opt, compile=True, donate_state=True)
    eager = fpp.train_step(_loss, opt, donate_state=True)
    cs, es = compiled.init(_init()), eager.init(_init())
    (cs, cm), codes = run_and_get_code(compiled, cs, batch)
    step_code = [c for c in codes if "log_softmax" in c or "logsumexp" in c]
    assert len(step_code) == 1, [c[:200] for c in codes]
    assert _logits_sized_buffers(step_code[0]) == 1, "the logits' gradient got a buffer of its own"
    es, em = eager(es, batch)
    for _ in range(2):
        cs, cm = compiled(cs, batch)
        es, em = eager(es, batch)
        assert cm["loss"] == pytest.approx(em["loss"], rel=1e-5)
    for k in ("embed", "head"):
        torch.testing.assert_close(cs["params"][k].data, es["params"][k].data, rtol=1e-5, atol=1e-6)
