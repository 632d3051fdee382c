"""Under ``kernel="auto"`` a fused kernel that fails falls back to the next one for that call
only: no process-wide switch remembers it (docs/policy.md)."""
import pytest
import torch

from functional_pp.ops import attention_kernels as ak


def test_a_failing_kernel_falls_back_per_call(monkeypatch):
    real = ak.select_attention_kernel
    monkeypatch.setattr(ak, "select_attention_kernel",
                        lambda q, k, v, skip=(): "cuda_flash" if "cuda_flash" not in skip else real(q, k, v, skip))
    tried = []

    def fused(name):
        tried.append(name)
        if name == "cuda_flash":
            raise RuntimeError("no kernel image is available")
        return ("fused", name)
    q = k = v = torch.zeros(1, 2, 4, 8)
    for _ in range(2):
        with pytest.warns(UserWarning, match="cuda_flash failed .* for this call"):
            assert ak._run_with_fallback("auto", q, k, v, fused, lambda: ("math",)) == ("fused", "cpu_flash")
    assert tried == ["cuda_flash", "cpu_flash"] * 2       # the second call tries it again


def test_select_passes_over_skipped_kernels():
    q = k = v = torch.zeros(1, 2, 4, 8)
    assert ak.select_attention_kernel(q, k, v) == "cpu_flash"
    assert ak.select_attention_kernel(q, k, v, skip={"cpu_flash"}) == "math"
