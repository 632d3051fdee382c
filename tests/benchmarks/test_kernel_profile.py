"""benchmarks/kernel_profile.py: its grouping lines up the two sides' equivalent work, and its
matmul timer sees the products inductor's wrapper code calls (no compilation here)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_profile as kp  # noqa: E402

from functional_pp.models import llama  # noqa: E402


def test_inductor_kernels_of_both_sides_fall_in_the_same_groups():
    # kernel names as inductor gave them for the small preset (ours: graph 0; plain: graphs 1, 2)
    cases = {
        "graph_0_cpp_fused__foreach_add__foreach_addcmul__foreach_lerp__foreach_sqrt_embedding_dense_backward_24":
            "optimizer",
        "graph_2_cpp_fused__foreach_add__foreach_addcdiv__foreach_sqrt_copy__full_like_0": "optimizer",
        "graph_0_cpp_fused__to_copy_abs_add_arange_exp_gather_logsumexp_masked_fill_mul_sub_sum_12": "loss",
        "graph_1_cpp_fused__log_softmax__log_softmax_backward_data_nll_loss_backward_nll_loss_forward_0": "loss",
        "graph_0_cpp_fused__unsafe_view_mul_silu_silu_backward_view_14": "swiglu",
        "graph_1_cpp_fused__unsafe_view_mul_silu_3": "swiglu",
        "graph_0_cpp_fused__unsafe_view_add_mul_roll_view_3": "rotary",
        "graph_1_cpp_fused__unsafe_view_add_cat_mul_neg_split_transpose_view_1": "rotary",
        "graph_1_cpp_fused_add_div_embedding_dense_backward_expand_mul_pow_sum_view_13": "embedding",
        "graph_0_cpp_fused__unsafe_view_add_div_expand_mean_mul_pow_rsqrt_sum_view_21": "rms_norm",
        "graph_1_cpp_fused_add_div_expand_mul_pow_sum_view_8": "rms_norm",
        "graph_0_cpp_fused_clone_7": "other kernels",
    }
    assert {name: kp.kernel_group(name) for name in cases} == cases


def test_a_product_and_its_transpose_share_a_row_with_their_transposes():
    x, dy = torch.randn(8, 4), torch.randn(8, 6)
    w_in_out, w_out_in = torch.randn(4, 6), torch.randn(6, 4)

    def key(a, b):
        return kp.matmul_key("aten::mm", [list(a.shape), list(b.shape)], [list(a.stride()), list(b.stride())])
    # weight gradients: ours x^T dy ([in, out]), nn.Linear's dy^T x ([out, in]): one problem
    assert key(x.T, dy) == ("K=8 {4, 6}", "4x8@8x6 TN")
    assert key(dy.T, x) == ("K=8 {4, 6}", "6x8@8x4 TN")
    # forward: ours x @ W, nn.Linear's x @ W.T
    assert key(x, w_in_out) == ("K=4 {6, 8}", "8x4@4x6 NN")
    assert key(x, w_out_in.T) == ("K=4 {6, 8}", "8x4@4x6 NT")


def test_the_matmul_timer_times_what_the_wrapper_calls_and_restores_it():
    from torch._inductor.select_algorithm import extern_kernels
    before = extern_kernels.mm

    class Side:                      # calls the product as inductor's generated wrapper does
        name = "functional"

        def step(self, batch):
            a, b = batch
            out = torch.empty(a.shape[0], b.shape[0])
            extern_kernels.mm(a, b.T, out=out)
            return out

    a, b = torch.randn(64, 32), torch.randn(16, 32)
    with kp.MatmulTimer() as timer:
        seconds, faults, system = timer.step(Side(), (a, b))
        seconds, faults, system = timer.step(Side(), (a, b))
    assert extern_kernels.mm is before
    assert list(timer.ms) == [("functional", "K=32 {16, 64}", "64x32@32x16 NT")]
    assert timer.steps["functional"] == 2 and seconds >= 0 and faults >= 0 and system >= 0
    assert torch.allclose(Side().step((a, b)), a @ b.T)


def test_isolated_products_cover_every_linear_in_both_layouts():
    cfg = llama.Config.tiny()
    res = kp.isolated_matmuls(cfg, tokens=16, rounds=2)
    assert set(res) == {"q_proj, o_proj", "k_proj, v_proj", "gate_proj, up_proj", "down_proj", "lm_head"}
    for times in res.values():
        assert set(times) == {(p, side) for p in ("forward", "input grad", "weight grad") for side in ("ours", "plain")}
        assert all(t >= 0 for t in times.values())
