"""Memory of the gated delta rule (ops/linear_attention.py) without timing anything: the bytes its
forward saves for backward, per token and head, stay a few head_dim whatever the chunk (the
intra-chunk scores by halving, ops/decayed_scores.py, recomputed in backward), where the direct
per-channel form (a chunk x chunk x head_dim decay tensor per chunk, benchmarks/linear_attention_memory.py's
``cubic_scores``) grows with chunk x head_dim; and that benchmark's smoke run."""
import sys
from pathlib import Path

import pytest
import torch

from functional_pp.ops.linear_attention import chunked_gated_delta_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import linear_attention_memory as bench  # noqa: E402

S, H, DK = 128, 2, 64


def saved_bytes_per_token_head(x, chunk: int) -> float:
    """Bytes of the distinct storages autograd keeps from the op's forward, per token and head."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_gated_delta_rule(*x, chunk=chunk)
    return sum(storages.values()) / (S * H)


def bound(chunk: int) -> float:
    """At most 24 float32 values of head_dim per token and head (the op's per-position tensors: q,
    k, v, their decayed and solved forms, the chunks' states; the halving keeps only its inputs),
    whatever the chunk; the direct form keeps over chunk x head_dim."""
    return 4 * DK * 24


@pytest.mark.parametrize("chunk", [16, 64])
def test_saved_bytes_per_token_are_linear_in_head_dim_and_the_cubic_form_exceeds_them(chunk):
    x = bench.inputs(1, S, H, DK, per_channel=True)
    new = saved_bytes_per_token_head(x, chunk)
    with bench.scores_form(bench.cubic_scores):
        cubic = saved_bytes_per_token_head(x, chunk)
    assert new <= bound(chunk), f"{new:.0f} bytes per token and head saved, over {bound(chunk):.0f}"
    assert cubic > bound(chunk) and cubic >= 4 * DK * chunk      # (the bound catches a return to it)


def test_benchmark_smoke_measures_both_forms_and_they_agree():
    args = bench.parse_args(["--smoke"])
    rows = bench.run(args)
    kda, gdn, branch = rows
    assert kda["old_peak"] > 4 * kda["new_peak"] and kda["old_saved"] > 3 * kda["new_saved"]
    assert gdn["old_saved"] > 1.3 * gdn["new_saved"]                  # (its scores recomputed in backward too)
    assert branch["new_peak"] < branch["old_peak"] and branch["new_saved"] < branch["old_saved"]  # (own branch)
    assert all(r["max_diff"] < 1e-5 for r in rows)
    assert "| Kimi Delta Attention" in bench.table(rows, args)
