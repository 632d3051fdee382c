"""``torch.compiler.is_compiling()`` during a compilation, seen from another thread
(functional_pp/_torch/__init__.py ``compile_flag_is_process_wide``): torch 2.13 on holds it True
for every thread while any thread compiles; torch 2.11 never sets it outside dynamo's trace.
Either way ``is_tracing()`` stays False on the other threads, so simulated devices keep running
their eager code while one of them compiles (docs/torch_versions.md)."""
import threading

import torch

from functional_pp import _torch as torch_private


def test_the_capability_is_what_another_thread_sees_during_a_compilation():
    compiling, release, seen = threading.Event(), threading.Event(), {}

    def backend(gm, example_inputs):           # runs during the compilation, outside the trace
        compiling.set()
        release.wait(60)
        return gm.forward

    def compile_one():
        fn = torch.compile(lambda x: x * 3 + 1, backend=backend, fullgraph=True)
        seen["result"] = fn(torch.ones(2))

    t = threading.Thread(target=compile_one)
    t.start()
    try:
        assert compiling.wait(60)
        seen["flag"] = torch.compiler.is_compiling()
        seen["tracing"] = torch_private.is_tracing()
        seen["eager"] = torch_private.runs_eagerly(torch.ones(1))
    finally:
        release.set()
        t.join(60)
    assert seen["flag"] is torch_private.compile_flag_is_process_wide()
    assert seen["tracing"] is False and seen["eager"] is True
    assert torch.equal(seen["result"], torch.full((2,), 4.0))
    assert not torch.compiler.is_compiling()
