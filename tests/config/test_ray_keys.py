"""Axolotl's Ray launch keys (``use_ray``, ``ray_num_workers``, ``resources_per_worker``; issue 47):
accepted as a launcher choice (the processes come from torchrun / --simulate), with a start-up
note; the world size must agree with ``ray_num_workers``; what would change the run is refused."""
import pytest

from functional_pp.config import ConfigError, TrainConfig


def test_use_ray_is_a_launcher_choice_checked_against_the_world_size():
    cfg = TrainConfig.from_dict({"use_ray": True, "ray_num_workers": 4, "resources_per_worker": {"GPU": 1}})
    assert any(n.startswith("use_ray (ray_num_workers: 4): the processes come from torchrun") for n in cfg.notes)
    cfg.validate(4)
    assert dict(cfg.mesh(4).shape)["dp_shard"] == 4         # no sizes: the 4 devices data parallel, as Axolotl
    with pytest.raises(ConfigError, match=r"ray_num_workers: 4 but --simulate gives 2 devices"):
        TrainConfig.from_dict({"use_ray": True, "ray_num_workers": 4}).validate(2, launcher="--simulate")


def test_ray_workers_must_agree_with_the_mesh_sizes():
    cfg = TrainConfig.from_dict({"use_ray": True, "ray_num_workers": 4, "dp_shard_size": 2, "tp_size": 2})
    cfg.validate(None)
    cfg.validate(4)
    with pytest.raises(ConfigError, match=r"ray_num_workers: 8 but the mesh's sizes need 4 devices"):
        TrainConfig.from_dict({"use_ray": True, "ray_num_workers": 8, "dp_shard_size": 2,
                               "tp_size": 2}).validate(None)


@pytest.mark.parametrize("raw, message", [
    ({"use_ray": True, "resources_per_worker": {"GPU": 2}}, r"resources_per_worker.GPU: 2: each process drives one"),
    ({"use_ray": True, "ray_num_workers": 0}, r"ray_num_workers must be a whole number >= 1"),
    ({"ray_num_workers": 4}, r"ray_num_workers without use_ray: true has no effect"),
    ({"use_ray": True, "ray_cluster_address": "x"}, r"'ray_cluster_address' is not supported: this Ray option"),
])
def test_what_ray_would_change_is_refused_by_name(raw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(raw)
