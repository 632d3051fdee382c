"""The meta kernel of CPU flash attention (functional_pp/_torch/cpu_attention_meta.py): up to
torch 2.11 it declared a float32 ``logsumexp`` for float64 queries, which the kernel computes in
float64, and inductor's compiled backward refused the float32 copy it had planned. With
functional_pp imported, fake tensors and the kernel agree on every supported torch."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import functional_pp  # noqa: F401  (the correction is registered at import)
from functional_pp._torch import cpu_attention_meta

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _dtypes(dtype):
    q = torch.randn(2, 4, 8, 16, dtype=dtype)
    with FakeTensorMode() as mode:
        fake = OP(mode.from_tensor(q), mode.from_tensor(q), mode.from_tensor(q), is_causal=True)
    real = OP(q, q, q, is_causal=True)
    return [(f.dtype, f.stride()) for f in fake], [(r.dtype, r.stride()) for r in real]


def test_fake_attention_has_the_kernels_dtypes():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        fake, real = _dtypes(dtype)
        assert fake == real, (dtype, fake, real)


def test_the_correction_is_registered_exactly_where_the_capability_is_missing():
    matches = cpu_attention_meta.cpu_flash_attention_meta_matches_kernel()
    assert isinstance(matches, bool)
    assert cpu_attention_meta.correct_cpu_flash_attention_meta() is (not matches)
    print(f"torch {torch.__version__}: CPU flash attention meta matches the kernel={matches}")


def test_float64_attention_compiled_by_inductor_equals_eager():
    """The failure itself, small: a float64 causal GQA attention's forward and backward."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).square().sum()

    torch.manual_seed(0)
    args = [torch.randn(2, h, 8, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    eager = torch.autograd.grad(f(*args), args)
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    try:
        got = torch.autograd.grad(compiled(*args), args)
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
