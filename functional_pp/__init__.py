"""functional_pp: functional training on PyTorch with layouts derived from named axes."""
from . import optim
from .collectives import (all_gather, all_to_all, axis_index, axis_size, pmax, pmean, ppermute,
                          psum, psum_scatter, pvary, split_invariant)
from .comm import CommReport, comm_report
from .init import init, init_params
from .launch import DeviceError, launch
from .backends.batched_run import per_device
from .layout import P, Rules, balanced, inherit
from .mesh import Mesh
from .runtime import current_mesh, current_rank, device_coords
from .shard_map import shard_map, use_rules
from .named import Named, configure, tied, wrap
from .reshard import named
from .ops import (attention, concat, cross_entropy, cumsum, dropout, einsum, embed, gelu, layer_norm,
                  logsumexp, merge_dims, positions, rearrange, rename, rms_norm, rotary, silu, slice_dim,
                  softmax, split_dim, take, tanh, unbind, where)
from .grads import gather_tree, value_and_grad
from .remat import layer, remat
from .train import TrainStep, train_step
from .tree import Param, count_params, leaves_with_paths, map_with_path, param
from . import sharding, tree

# moved to functional_pp.sharding; the old names keep working (docs/architecture.md)
tree.shard, tree.gather, tree.named_tree = sharding.shard, sharding.gather, sharding.named_tree

from .version import __version__
from . import moved_modules

moved_modules.install(__name__)   # old paths of the application modules (docs/architecture.md)

__all__ = [
    "Mesh", "Rules", "P", "balanced", "inherit", "launch", "per_device", "DeviceError", "current_mesh", "current_rank", "device_coords",
    "psum", "pmean", "pmax", "pvary", "all_gather", "psum_scatter", "ppermute", "all_to_all",
    "axis_index", "axis_size", "split_invariant", "shard_map", "use_rules", "comm_report",
    "CommReport", "param", "Param", "init", "init_params", "count_params", "map_with_path",
    "leaves_with_paths", "Named", "named", "tied", "wrap", "configure", "einsum", "silu", "rms_norm",
    "layer_norm", "attention", "rotary", "positions", "embed", "cross_entropy", "rename", "split_dim",
    "merge_dims", "rearrange", "logsumexp", "softmax", "gelu", "tanh", "where", "dropout", "concat",
    "cumsum", "slice_dim", "take", "unbind", "optim", "train_step", "TrainStep", "remat",
    "gather_tree", "value_and_grad", "layer",
]
