"""The mixture-of-experts training keys: ``router_z_loss_coef`` and ``capacity_factor`` reach
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


@pytest.mark.parametrize("keys,msg", [
    ({"model": {"preset": "tiny"}, "capacity_factor": 1.0}, r"capacity_factor: the model has no mixture of experts"),
    ({"capacity_factor": -1.0}, r"capacity_factor must be a positive number"),
])
def test_bad_values_are_refused(keys, msg):
    with pytest.raises(ConfigError, match=msg):
        model_config(TrainConfig.from_dict({**MOE, **keys}))
