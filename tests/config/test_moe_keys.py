"""The mixture-of-experts training keys: ``router_z_loss_coef``, ``capacity_factor`` and
``expert_parallel_token_capacity`` (the model's ``token_capacity``) reach
the model's config (from a preset or a Hugging Face directory alike), and a dense model or a
bad value is refused by name before any work."""
import pytest

from functional_pp.config import ConfigError, TrainConfig
from functional_pp.config.models import model_config

MOE = {"model": {"preset": "tiny", "experts": 4, "moe_mlp": 32}, "max_steps": 1}


def test_the_keys_reach_the_model():
    model = model_config(TrainConfig.from_dict({**MOE, "router_z_loss_coef": 0.001, "capacity_factor": 1.25}))
    assert (model.router_z_loss_coef, model.capacity_factor) == (0.001, 1.25)
    model = model_config(TrainConfig.from_dict(MOE))
    assert (model.router_z_loss_coef, model.capacity_factor) == (0.0, None)        # dropless, no z-loss
    assert model.token_capacity is None
    assert model_config(TrainConfig.from_dict({**MOE, "expert_parallel_token_capacity": 64})).token_capacity == 64


@pytest.mark.parametrize("keys,msg", [
    ({"model": {"preset": "tiny"}, "capacity_factor": 1.0}, r"capacity_factor: the model has no mixture of experts"),
    ({"capacity_factor": -1.0}, r"capacity_factor must be a positive number"),
    ({"expert_parallel_token_capacity": 0}, r"token_capacity must be a positive int .* got token_capacity=0"),
    ({"expert_parallel_token_capacity": 8, "capacity_factor": 1.0}, r"token_capacity must be .* dropless routing"),
])
def test_bad_values_are_refused(keys, msg):
    with pytest.raises(ConfigError, match=msg):
        model_config(TrainConfig.from_dict({**MOE, **keys}))


def test_token_capacity_reaches_every_moe_layer():
    """The model's ``token_capacity`` is each MoE layer's cap: a small one changes the loss and
    counts drops; one above any expert's load is the dropless model."""
    import torch
    from harness import make_batch

    import functional_pp as fpp
    from functional_pp.models import llama, moe
    from functional_pp.parallel import sharding
    cfg = llama.Config.tiny(experts=4, moe_mlp=32)
    decls = llama.init(cfg, torch.float64)
    from functional_pp.core import tree
    params = sharding.named_tree(tree.tree_map(lambda x: x.data, fpp.init(lambda: decls, seed=0)), decls)
    batch = {k: fpp.wrap(v, "batch seq") for k, v in make_batch(cfg, batch=2, seq=8, seed=1).items()}

    def run(cap):
        c = llama.Config(**{**vars(cfg), "token_capacity": cap})
        with moe.collect() as stats:
            loss = llama.loss(params, batch, c).value()
        return loss, sum(s.dropped.value().item() for s in stats)
    plain, none = run(None)
    capped, dropped = run(2)
    assert none == 0 and dropped > 0 and abs(capped - plain) > 1e-8
    assert run(64) == (plain, 0)
