"""``lora_target_linear`` (peft's ``all-linear``) adapts the linear projections of the recurrent token
mixers, never their convolution taps, ``A_log``, ``D``, ``dt_bias`` or norms (declared
``meta={"linear": False}``: peft adapts ``nn.Linear`` only, these are ``nn.Conv1d`` weights and
``nn.Parameter``s); Jamba's all-linear LoRA equals peft's (tests/models/test_jamba.py)."""
import pytest

from functional_pp import adapters
from functional_pp.adapters import lora
from functional_pp.models import kimi_delta, llama

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, mlp=96, vocab=256)
CASES = {
    "mamba2": (dict(layer_blocks=("mamba2", "attention"), mamba_heads=8, mamba_head_dim=8, mamba_groups=2,
                    ssm_state=8), "mamba", {"z_proj", "x_proj", "b_proj", "c_proj", "dt_proj", "out_proj"}),
    "mamba1": (dict(layer_blocks=("mamba1+mlp", "attention+mlp"), mamba1_inner=64, mamba1_dt_rank=4, ssm_state=8),
               "mamba1", {"in_proj", "x_proj", "dt_proj", "out_proj"}),
    "gated_deltanet": (dict(layer_types=("linear_attention", "full_attention"), linear_heads=4, linear_kv_heads=2,
                            linear_head_dim=16, linear_v_head_dim=16), "linear_attn",
                       {f"in_proj_{x}" for x in "qkvzba"} | {"out_proj"}),
    "short_conv": (dict(layer_types=("conv", "full_attention")), "conv", {"in_proj", "out_proj"}),
    "kimi_delta": (dict(layer_types=(kimi_delta.KIND, "full_attention"), linear_heads=4, linear_head_dim=16),
                   "kda", {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj",
                                   "g_b_proj", "o_proj"})}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_target_linear_adapts_the_mixers_projections_only(kind):
    fields, key, want = CASES[kind]
    decls = llama.init(llama.Config(**SMALL, **fields))
    found = lora.targets(decls, adapters.LoraConfig(target_linear=True))
    mixer = {p.rsplit(".", 1)[-1] for p in found if p.startswith(f"layers.0.{key}.")}
    assert mixer == want
    others = set(decls["layers"][0][key]) - want
    assert others
    for name in sorted(others):                  # (named as a target: refused, it is not a linear weight)
        decl = decls["layers"][0][key][name]
        if len(decl.dims) >= 2 and not name.endswith("bias"):
            with pytest.raises(ValueError, match="is not a linear weight"):
                lora.targets(decls, adapters.LoraConfig(target_modules=(f"{key}.{name}",)))
