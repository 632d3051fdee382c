"""Axolotl's cosine variants (issue 47): ``cosine_constant_lr_ratio`` (the cosine reaches
``cosine_min_lr_ratio x lr`` at that fraction of the run and holds it) and
``lr_quadratic_warmup`` (warmup ``(step / warmup) ** 2``, then cosine to 0). The references are
Axolotl's scheduler lambdas (``axolotl/utils/schedulers.py``) written out here from their
definitions, in plain Python; the config builds them for the optimizer (an SGD step's size is
the schedule's value) and refuses the combinations Axolotl would ignore."""
from __future__ import annotations

import math

import pytest
import torch

from functional_pp import optim
from functional_pp.app.optimizer import optimizer_from_config
from functional_pp.config import ConfigError, TrainConfig


def _axolotl_decay_constant(step, *, warmup, total, constant_ratio, min_ratio):
    """get_cosine_schedule_with_warmup_decay_constant's lambda (num_cycles 0.5), times 1."""
    if step < warmup:
        return step / max(1, warmup)
    n_constant = int(total * constant_ratio)
    step = min(step, n_constant)
    progress = (step - warmup) / max(1, n_constant - warmup)
    return max(0, (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))) + min_ratio


def _axolotl_quadratic(step, *, warmup, total):
    """get_cosine_schedule_with_quadratic_warmup's lambda (num_cycles 0.5)."""
    if step < warmup:
        return (step / max(1, warmup)) ** 2
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


@pytest.mark.parametrize("warmup,total,constant_ratio,min_ratio", [(3, 20, 0.6, 0.1), (0, 10, 0.5, 0.25),
                                                                    (2, 9, 1.0, 0.5), (4, 10, 0.3, 0.2)])
def test_cosine_constant_equals_axolotl(warmup, total, constant_ratio, min_ratio):
    peak = 2e-3
    sched = optim.make_schedule(peak, "cosine", warmup, total, min_ratio * peak, constant_ratio=constant_ratio)
    for step in range(total + 3):
        want = peak * _axolotl_decay_constant(step, warmup=warmup, total=total, constant_ratio=constant_ratio,
                                              min_ratio=min_ratio)
        assert float(sched(step)) == pytest.approx(want, rel=1e-6, abs=peak * 1e-6), step   # (float32)
    assert float(sched(total + 5)) == pytest.approx(min_ratio * peak, rel=1e-6)       # held at the minimum


@pytest.mark.parametrize("warmup,total", [(4, 12), (0, 5), (1, 3)])
def test_quadratic_warmup_equals_axolotl(warmup, total):
    peak = 1e-3
    sched = optim.make_schedule(peak, "cosine", warmup, total, quadratic_warmup=True)
    for step in range(total + 1):       # (Axolotl's cosine would rise again past the last step)
        assert float(sched(step)) == pytest.approx(peak * _axolotl_quadratic(step, warmup=warmup, total=total),
                                                   rel=1e-6, abs=peak * 1e-6), step
    if warmup > 1:
        assert float(sched(1)) == pytest.approx(peak / warmup ** 2)     # not linear


def test_config_builds_them_for_the_optimizer():
    base = {"learning_rate": 0.1, "optimizer": "sgd", "max_steps": 10, "warmup_steps": 2, "lr_scheduler": "cosine",
            "max_grad_norm": None, "weight_decay": 0.0}
    constant = TrainConfig.from_dict({**base, "cosine_min_lr_ratio": 0.2, "cosine_constant_lr_ratio": 0.5})
    quadratic = TrainConfig.from_dict({**base, "lr_quadratic_warmup": True})
    for cfg, ref in ((constant, lambda s: _axolotl_decay_constant(s, warmup=2, total=10, constant_ratio=0.5,
                                                                  min_ratio=0.2)),
                     (quadratic, lambda s: _axolotl_quadratic(s, warmup=2, total=10))):
        opt, schedule = optimizer_from_config(cfg)
        params = {"w": torch.zeros(1, dtype=torch.float64)}
        state = opt.init(params)
        for step in range(10):          # an SGD step of gradient 1 moves the weight by the learning rate
            before = params["w"].clone()
            updates, state = opt.update({"w": torch.ones(1, dtype=torch.float64)}, state, params)
            params = optim.apply_updates(params, updates)
            assert float(before - params["w"]) == pytest.approx(0.1 * ref(step), rel=1e-6, abs=1e-7), step
            assert float(schedule(step)) == pytest.approx(0.1 * ref(step), rel=1e-6, abs=1e-7)
    # Axolotl: a constant ratio of 0 is no constant phase (the corpus's QAT configs write it)
    zero = TrainConfig.from_dict({**base, "cosine_min_lr_ratio": 1.0, "cosine_constant_lr_ratio": 0})
    assert float(optimizer_from_config(zero)[1](5)) == pytest.approx(0.1)


@pytest.mark.parametrize("d, message", [
    ({"lr_quadratic_warmup": True, "lr_scheduler": "linear"}, "lr_quadratic_warmup shapes the cosine"),
    ({"lr_quadratic_warmup": True, "cosine_min_lr_ratio": 0.1}, "lr_quadratic_warmup decays the cosine to 0"),
    ({"cosine_constant_lr_ratio": 0.5}, "cosine_constant_lr_ratio holds .* cosine_min_lr_ratio"),
    ({"cosine_constant_lr_ratio": 0.5, "cosine_min_lr_ratio": 0.1, "lr_scheduler": "constant"},
     "set lr_scheduler: cosine"),
    ({"cosine_constant_lr_ratio": 1.5, "cosine_min_lr_ratio": 0.1}, r"cosine_constant_lr_ratio must be in \[0, 1\]"),
    ({"cosine_constant_lr_ratio": 0.5, "cosine_min_lr_ratio": 0.1, "lr_quadratic_warmup": True}, "choose one"),
])
def test_what_axolotl_would_ignore_is_refused_by_name(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"max_steps": 10, **d})
