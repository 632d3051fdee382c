"""A compiled function called on one thread while another thread's compilation FX-traces
(functional_pp/_torch/__init__.py ``compiled_calls_ignore_fx_tracing``,
``compile_despite_peers_fx_tracing``): AOT autograd's trace sets ``torch.fx``'s process-wide
tracing flag, and torch 2.11's torch.compile then refuses the call on every other thread
("Detected that you are using FX to symbolically trace a dynamo-optimized function"): the
race between simulated devices where one compiles and the others call a compiled layer or
step. Inside ``compile_despite_peers_fx_tracing()`` the call runs compiled on any torch."""
import contextlib
import threading

import torch
from torch.fx._symbolic_trace import Tracer

from functional_pp import _torch as torch_private


def _call_while_a_peer_fx_traces(settings):
    """Call an already compiled function on this thread while another thread's compilation
    is inside an FX trace; returns how many times the compiled code ran, or the error."""
    ran = []

    def counting(gm, example_inputs):
        def run(*args):
            ran.append(1)
            return gm.forward(*args)
        return run

    fn = torch.compile(lambda x: x * 2, backend=counting, fullgraph=True)
    fn(torch.ones(2))                           # compiled now: the call below hits the cache
    tracing, release = threading.Event(), threading.Event()

    def peer_backend(gm, example_inputs):       # what AOT autograd does: an FX trace, held open
        def body(x):
            tracing.set()
            release.wait(60)
            return x
        Tracer().trace(body)
        return gm.forward

    peer = threading.Thread(target=lambda: torch.compile(lambda x: x + 1, backend=peer_backend,
                                                         fullgraph=True)(torch.ones(3)))
    peer.start()
    try:
        assert tracing.wait(60)
        with settings():
            try:
                out = fn(torch.ones(2))
            except RuntimeError as e:
                return e
    finally:
        release.set()
        peer.join(60)
    assert torch.equal(out, torch.full((2,), 2.0))
    return len(ran) - 1


def test_the_capability_is_what_a_call_during_a_peers_fx_trace_does():
    result = _call_while_a_peer_fx_traces(contextlib.nullcontext)
    if torch_private.compiled_calls_ignore_fx_tracing():
        assert result == 1
    else:
        assert isinstance(result, RuntimeError) and "symbolically trace" in str(result), result


def test_device_threads_run_compiled_code_while_a_peer_fx_traces():
    assert _call_while_a_peer_fx_traces(torch_private.compile_despite_peers_fx_tracing) == 1


def test_simulated_devices_enter_it():
    """launch's device threads run inside compile_despite_peers_fx_tracing (a thread-local
    dynamo setting where the capability is missing)."""
    import torch._dynamo.config as dcfg

    import functional_pp as fpp
    seen = fpp.launch(lambda: dcfg.force_compile_during_fx_trace, fpp.Mesh(dp=2))
    assert seen == [not torch_private.compiled_calls_ignore_fx_tracing()] * 2
    assert dcfg.force_compile_during_fx_trace is False        # the host's setting untouched
