"""relayout changes layouts only (functional_pp/parallel/reshard.py); the FSDP bookkeeping of a gathered
parameter or activation (its shard kept for a re-gather in backward, no memo of an untied
gathered weight) is the ops' relayout (functional_pp/parallel/fsdp/regather.py), docs/layouts.md."""
import torch

import functional_pp as fpp
from functional_pp.parallel.fsdp import regather
from functional_pp.parallel import reshard
from functional_pp.parallel.named import Named

MESH = fpp.Mesh(dp_shard=2)
WHOLE = ((), ())


def _param(tied=False):
    block = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    return Named(block, ("hidden", "out"), (("dp_shard",), ()), is_param=True, tied=tied)


def test_layout_only_relayout_keeps_no_shard_and_the_ops_relayout_does():
    def fn():
        w = _param()
        plain = reshard.relayout(w, WHOLE)
        ops = regather.relayout(w, WHOLE)
        shard, axes, dim, order = ops.gathered_from
        return (plain.gathered_from, plain.is_param, plain.split, ops.split, shard is w.data, axes, dim, order,
                torch.equal(plain.data, ops.data))
    for plain_origin, is_param, plain_split, ops_split, same_shard, axes, dim, order, equal in fpp.launch(fn, MESH):
        assert plain_origin is None and is_param
        assert plain_split == ops_split == WHOLE
        assert same_shard and axes == ("dp_shard",) and dim == 0 and order == 1
        assert equal


def test_a_gathered_weight_is_kept_only_for_a_tied_parameter():
    def fn():
        w, t = _param(), _param(tied=True)
        return (regather.relayout(w, WHOLE) is regather.relayout(w, WHOLE),
                regather.relayout(t, WHOLE) is regather.relayout(t, WHOLE),
                reshard.relayout(w, WHOLE) is reshard.relayout(w, WHOLE))
    for untied, tied, plain in fpp.launch(fn, MESH):
        assert (untied, tied, plain) == (False, True, False)


def test_an_activation_keeps_its_shard_only_with_regather_activations():
    def fn():
        x = Named(torch.randn(2, 4, requires_grad=True) * 1.0, ("hidden", "out"), (("dp_shard",), ()))
        before = regather.relayout(x, WHOLE).gathered_from
        with fpp.configure(regather_activations=True):
            y = Named(x.data * 1.0, x.dims, x.split)
            after = regather.relayout(y, WHOLE).gathered_from
        return before, after is not None and after[0] is y.data
    for before, after in fpp.launch(fn, MESH):
        assert before is None and after


def test_a_parameter_sliced_as_well_as_gathered_keeps_no_shard():
    def fn():
        w = _param()
        out = regather.relayout(w, ((), ("dp_shard",)))     # gather hidden, slice out
        return out.gathered_from, out.split
    for origin, split in fpp.launch(fn, MESH):
        assert origin is None and split == ((), ("dp_shard",))
