"""functional_pp: functional training on PyTorch with layouts derived from named axes."""
from functional_pp import optim
from functional_pp.parallel.collectives import (all_gather, all_to_all, axis_index, axis_size, pmax, pmean, pmin, ppermute,
                          psum, psum_scatter, pvary, split_invariant)
from functional_pp.core.comm import CommReport, comm_report
from functional_pp.parallel.init import init, init_params
from functional_pp.devices.launch import DeviceError, launch
from functional_pp.devices.batched_run import per_device
from functional_pp.core.layout import P, Rules, balanced, inherit
from functional_pp.core.mesh import Mesh
from functional_pp.core.runtime import current_mesh, current_rank, device_coords
from functional_pp.parallel.shard_map import shard_map, use_rules
from functional_pp.parallel.named import Named, configure, tied, wrap
from functional_pp.parallel.reshard import named
from functional_pp.ops import (attention, concat, cross_entropy, cumsum, dropout, einsum, embed, gelu, layer_norm,
                  logsumexp, merge_dims, positions, rearrange, rename, rms_norm, rotary, silu, slice_dim,
                  softmax, split_dim, take, tanh, unbind, where)
from functional_pp.parallel.grads import gather_tree, value_and_grad
from functional_pp.ops.layer import layer, remat
from functional_pp.step.train import TrainStep, train_step
from functional_pp.core.tree import Param, count_params, leaves_with_paths, map_with_path, param
from functional_pp.parallel import sharding
from functional_pp.core import tree

from functional_pp.version import __version__

__all__ = [
    "Mesh", "Rules", "P", "balanced", "inherit", "launch", "per_device", "DeviceError", "current_mesh", "current_rank", "device_coords",
    "psum", "pmean", "pmax", "pmin", "pvary", "all_gather", "psum_scatter", "ppermute", "all_to_all",
    "axis_index", "axis_size", "split_invariant", "shard_map", "use_rules", "comm_report",
    "CommReport", "param", "Param", "init", "init_params", "count_params", "map_with_path",
    "leaves_with_paths", "Named", "named", "tied", "wrap", "configure", "einsum", "silu", "rms_norm",
    "layer_norm", "attention", "rotary", "positions", "embed", "cross_entropy", "rename", "split_dim",
    "merge_dims", "rearrange", "logsumexp", "softmax", "gelu", "tanh", "where", "dropout", "concat",
    "cumsum", "slice_dim", "take", "unbind", "optim", "train_step", "TrainStep", "remat",
    "gather_tree", "value_and_grad", "layer",
]
