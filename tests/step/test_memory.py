"""FSDP memory: between forward and backward no device keeps a gathered (full) weight alive
unless asked to (keep_gathered=True)."""
import gc

import pytest
import torch
from harness import local_batch, make_batch

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.parallel.fsdp.units import fsdp_units

CFG = llama.Config.tiny()


def _storage(t):
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:          # fake tensors left by compiled graphs have no storage
        return None


def _tracked(obj, shapes) -> bool:
    """A live tensor of one of these shapes with a grad_fn. gc also walks objects earlier tests
    left half torn down (an undefined tensor inside a compiled graph's cache raises on any
    attribute): those are not weights of this step."""
    if not isinstance(obj, torch.Tensor):
        return False
    try:
        return obj.grad_fn is not None and tuple(obj.shape) in shapes
    except RuntimeError:
        return False


def full_weights_alive_after_forward(keep_gathered, units=False):
    mesh = fpp.Mesh(dp_shard=2)
    rules = fpp.Rules(batch="dp_shard", hidden="dp_shard")
    decls = llama.init(CFG)
    full = fpp.init_params(decls, seed=0)
    batch = make_batch(CFG, batch=4, seq=16)
    barrier = __import__("threading").Barrier(mesh.size)

    def fn():
        with fpp.use_rules(rules), fpp.configure(keep_gathered=keep_gathered), fsdp_units(units):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  sharding.shard(full, decls, mesh, rules, fpp.current_rank()))
            shapes = {(CFG.hidden, CFG.mlp), (CFG.mlp, CFG.hidden), (CFG.hidden, CFG.heads, CFG.dim_head)}

            def count():              # gathered weights carry a grad_fn; views share their storage
                gc.collect()
                return {_storage(o) for o in gc.get_objects() if _tracked(o, shapes)} - {None}
            barrier.wait()
            before = count()           # tensors left over by earlier tests (e.g. compiled graphs)
            barrier.wait()
            loss = llama.loss(sharding.named_tree(local, decls), local_batch(batch, mesh, rules), CFG).value()
            barrier.wait()
            alive = len(count() - before)    # new storages only: earlier tests' tensors may go meanwhile
            barrier.wait()
            loss.backward()
        return alive
    return fpp.launch(fn, mesh)[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")   # gc walks a deprecated torch.distributed alias
def test_fsdp_keeps_no_gathered_weight_between_forward_and_backward():
    assert full_weights_alive_after_forward(keep_gathered=False) == 0
    # the same check sees them when they are kept: 2 devices x layers x (q, gate, up, down)
    assert full_weights_alive_after_forward(keep_gathered=True) == 2 * CFG.layers * 4


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp_units_keep_no_gathered_weight_between_forward_and_backward():
    """Layers gathered as one unit (functional_pp/parallel/fsdp/units.py) are re-gathered too."""
    assert full_weights_alive_after_forward(keep_gathered=False, units=True) == 0
    assert full_weights_alive_after_forward(keep_gathered=True, units=True) == 2 * CFG.layers * 4
