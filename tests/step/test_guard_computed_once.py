"""The donated compiled step's write guard (docs/optim.md "Bound before the update") is computed
once into a buffer that every leaf's update loop reads (``ops.realize.computed_once``;
docs/compile.md "The write guard computed once"): inlined, inductor recomputed it inside each vectorised loop,
per vector of elements (the loss's and the gradient norm's finiteness and the bound's
double-precision sqrt/division), from loads the C++ compiler cannot hoist past the stores."""
import functools
import re

import torch
from harness import make_batch
from torch._inductor.utils import run_and_get_code

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.ops.realize import computed_once

CFG = llama.Config(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, mlp=32, max_seq=16,
                   tie_embeddings=False, rope_scaling=None)


def test_eager_computed_once_is_the_tensor_itself():
    x = torch.tensor(True)
    assert computed_once(x) is x


def _vector_loops_with_selects(code: str) -> list[str]:
    """Bodies of the vectorised loops that select between new and old values on a scalar
    condition (a mask broadcast from one bool): the donated update's writes."""
    bodies = re.split(r"for\(int64_t x0=", code)[1:]
    return [b.split("for(int64_t", 1)[0] for b in bodies
            if re.match(r"[^;]*;[^;]*;\s*x0\+=static_cast<int64_t>\((8|16)L\)", b)
            and "VecMask<float,1>::from(" in b and "blendv" in b]


def test_the_update_loops_read_the_write_guard_from_a_buffer_and_the_step_is_unchanged():
    batch = make_batch(CFG, batch=2, seq=8, seed=0)
    losses = {}
    for compile_ in (False, True):
        step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), compile=compile_,
                              donate_state=True)
        state = step.init(fpp.init(llama.init, CFG, seed=0))
        state, m1 = step(state, batch)
        if compile_:
            (state, m2), codes = run_and_get_code(step, state, batch)
            torch._dynamo.reset()
        else:
            state, m2 = step(state, batch)
        losses[compile_] = (m1["loss"], m2["loss"], m2["skipped"])
    assert losses[True][2] == 0 and abs(losses[True][1] - losses[False][1]) < 1e-5 * abs(losses[False][1])
    loops = [b for code in codes for b in _vector_loops_with_selects(code)]
    assert loops, "no vectorised update loop found in the compiled step's code"
    for body in loops:
        # the select's mask is one scalar loaded from a buffer, not computed in the loop
        (mask,) = set(re.findall(r"VecMask<float,1>::from\((tmp\d+)\)", body))
        assert re.search(rf"auto {mask} = \w+\[static_cast<int64_t>\(0L\)\];", body), body[:3000]
        assert "convert<double>" not in body and "std::isfinite" not in body and "std::abs(" not in body
