"""The held-out loss counts each held-out token once, whatever the batch size (issue 46): the
last batch of an epoch is topped up by wrapping around (``drop_last=False``), and those
repeated windows used to count twice (the same weights and data gave 5.8354 at batch 1 and
5.8284 at 16). Oracle: the mean token loss of every window, each scored alone."""
import functools

import pytest
import torch
from harness import single_device

import functional_pp as fpp
from functional_pp.app.evaluate import evaluate
from functional_pp.data import DataLoader
from functional_pp.models import llama

CFG = llama.Config(vocab=64, hidden=32, layers=1, heads=2, kv_heads=2, mlp=64, max_seq=8, rope_scaling=None)
TOKENS = torch.randint(1, CFG.vocab, (5 * 8 + 1,), generator=torch.Generator().manual_seed(0)).numpy()   # 5 windows


def _loader(batch_size, **kw):
    return DataLoader(TOKENS, global_batch_size=batch_size, seq_len=8, drop_last=False, **kw)


def test_wrapped_rows_train_no_label():
    loader = _loader(3)                           # 5 windows: batch 1 holds windows 3, 4 and 0 again
    last = loader.batch(1, each_window_once=True)["labels"]
    assert (last[2] == -100).all() and (last[:2] != -100).all()
    assert (loader.batch(1)["labels"] != -100).all()          # training batches are unchanged
    second = _loader(3, dp_size=3, dp_rank=2).batch(1, each_window_once=True)["labels"]
    assert (second == -100).all()                 # the device holding the repeated row


@pytest.fixture(scope="module")
def trained():
    """A tiny model's step and state, and the oracle: the mean of its loss on each of the 5
    windows scored alone (each has 8 labels)."""
    step = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(0.1))
    full = fpp.init(llama.init, CFG, torch.float64, seed=0)
    state = step.init(full)
    whole = {p: x.data for p, x in fpp.leaves_with_paths(full)}
    params = fpp.core.tree.map_with_path(lambda p, d: whole[p], llama.init(CFG, torch.float64))
    windows = _loader(5).global_batch(0)
    losses = [single_device(CFG, params, {k: windows[k][w:w + 1] for k in ("tokens", "labels")})[0]
              for w in range(5)]
    return step, state, float(sum(losses) / 5)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 5])
def test_the_held_out_loss_is_the_same_at_any_batch_size(trained, batch_size):
    step, state, oracle = trained
    assert evaluate(step, state, _loader(batch_size)) == pytest.approx(oracle, rel=1e-12)
