"""The pipeline keys: pp_size (alias pipeline_parallel_size) puts the outermost pp axis on the
mesh and the layers on it; pp_schedule and pp_virtual_stages are checked before any work, with
errors naming the key and the fix (the train command's pipeline runs: tests/app/test_train_pipeline.py)."""
import pytest

from functional_pp.config import ConfigError, TrainConfig

TINY = {"model": {"preset": "tiny", "layers": 4}, "max_steps": 1}


def test_pp_size_is_the_outermost_axis_and_splits_the_layers():
    cfg = TrainConfig.from_dict({**TINY, "pipeline_parallel_size": 2, "dp_shard_size": 2,
                                 "gradient_accumulation_steps": 4})
    assert cfg.pp_size == 2
    cfg.validate(4)
    mesh = cfg.mesh(4)
    assert mesh.axis_names[0] == "pp" and mesh.shape["pp"] == 2 and mesh.size == 4
    assert cfg.build_rules(mesh)["layers"] == ("pp",)
    assert TrainConfig.from_dict({**TINY, "pp_size": 2, "dp_shard_size": -1,
                                  "gradient_accumulation_steps": 2}).mesh(8).shape["dp_shard"] == 4
    assert "pp" not in TrainConfig.from_dict(TINY).mesh(1).shape          # pp_size 1: no axis


@pytest.mark.parametrize("keys,msg", [
    ({"pp_size": 2, "pp_schedule": "1F1B"}, "unknown schedule '1F1B'.*Did you mean '1f1b'"),
    ({"pp_size": 0}, "pp_size must be an integer >= 1"),
    ({"pp_size": 2, "pp_fsdp_gather": "never"}, "pp_fsdp_gather 'never': choose one of step, micro"),
    ({"pp_size": 2, "pp_virtual_stages": 2}, "virtual stages 2 need pp_schedule 'interleaved_1f1b'")])
def test_bad_values_are_refused_while_parsing(keys, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig.from_dict({**TINY, **keys})


def test_checks_with_the_model_and_the_world():
    cfg = TrainConfig.from_dict({**TINY, "pp_size": 4, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2,
                                 "gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match="4 layers do not split into 4 stages x 2 virtual stages"):
        cfg.validate(4)
    cfg = TrainConfig.from_dict({**TINY, "pp_size": 4, "gradient_accumulation_steps": 2})
    with pytest.warns(UserWarning, match="gradient_accumulation_steps 2 < pp_size 4"):
        cfg.validate(4)
