"""Dynamo's settings for a block (functional_pp/_torch/dynamo_settings.py): a patch on one thread
is that thread's from torch 2.13 on and process-wide on torch 2.11, where simulated devices'
overlapping blocks restored a setting while peers still compiled. Both paths run on the torch
installed (the process-wide one forced)."""
import threading

import pytest
import torch._dynamo.config as dcfg

from functional_pp._torch import dynamo_settings


def test_the_capability_is_what_another_thread_sees():
    before = dcfg.trace_autograd_ops
    inside, release, seen = threading.Event(), threading.Event(), []

    def patcher():
        with dcfg.patch(trace_autograd_ops=not before):
            inside.set()
            release.wait(60)

    t = threading.Thread(target=patcher)
    t.start()
    try:
        assert inside.wait(60)
        seen.append(dcfg.trace_autograd_ops)
    finally:
        release.set()
        t.join(60)
    assert (seen[0] == before) is dynamo_settings.dynamo_settings_are_thread_local()
    assert dcfg.trace_autograd_ops == before


@pytest.mark.parametrize("process_wide", [False, True], ids=["native", "process-wide"])
def test_overlapping_blocks_of_two_threads_keep_the_setting_until_the_last_leaves(monkeypatch, process_wide):
    if process_wide:
        monkeypatch.setattr(dynamo_settings, "dynamo_settings_are_thread_local", lambda: False)
    elif not dynamo_settings.dynamo_settings_are_thread_local():
        pytest.skip("this torch's dynamo settings are process-wide (the other case covers it)")
    before = dcfg.force_compile_during_fx_trace
    first_in, first_out, second_done, seen = threading.Event(), threading.Event(), threading.Event(), {}

    def first():
        with dynamo_settings.patch_dynamo(force_compile_during_fx_trace=not before):
            first_in.set()
            second_done.wait(60)
        first_out.set()

    def second():
        assert first_in.wait(60)
        with dynamo_settings.patch_dynamo(force_compile_during_fx_trace=not before):
            second_done.set()
            assert first_out.wait(60)         # the first block has left; this one is still in
            seen["second"] = dcfg.force_compile_during_fx_trace

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen["second"] == (not before)
    assert dcfg.force_compile_during_fx_trace == before
    assert not dynamo_settings._held


@pytest.mark.parametrize("process_wide", [False, True], ids=["native", "process-wide"])
def test_the_cache_limits_are_restored_though_their_names_are_aliases(monkeypatch, process_wide):
    """``compile_cache_limits`` sets ``recompile_limit`` and ``cache_size_limit``, one setting
    under two names on torch 2.11: the block restored the second name to the value the first had
    just been given, and the raised limit outlived it (a later test ran out of accumulated
    recompilations)."""
    from functional_pp._torch import compile_cache_limits
    if process_wide:
        monkeypatch.setattr(dynamo_settings, "dynamo_settings_are_thread_local", lambda: False)
    before = {name: getattr(dcfg, name) for name in ("recompile_limit", "cache_size_limit")
              if hasattr(dcfg, name)}
    with compile_cache_limits(10 * max(before.values()) + 1000):
        assert dcfg.recompile_limit >= 1000
    assert {name: getattr(dcfg, name) for name in before} == before
    assert not dynamo_settings._held
