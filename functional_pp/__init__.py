"""functional_pp: functional training on PyTorch with layouts derived from named axes.

The top level is the vocabulary of a training script: meshes and rules, launching, named
arrays and parameters, manual collectives and ``shard_map``, the training step. Everything
else lives in a submodule: the named ops in :mod:`functional_pp.ops`, the optimizers in
:mod:`functional_pp.optim`, models in :mod:`functional_pp.models`, checkpoints, data, the
planner, the config and the command line in their folders (docs/architecture.md)."""
from functional_pp import ops, optim
from functional_pp.core.comm import CommReport, comm_report
from functional_pp.core.layout import P, Rules, balanced, inherit
from functional_pp.core.mesh import Mesh
from functional_pp.core.policy import Policy
from functional_pp.core.runtime import current_mesh, current_rank, device_coords
from functional_pp.core.tree import Param, count_params, leaves_with_paths, map_with_path, param
from functional_pp.devices.launch import DeviceError, launch
from functional_pp.devices.mesh_view import per_device
from functional_pp.ops.layer import layer, remat
from functional_pp.parallel.collectives import (all_gather, all_to_all, axis_index, axis_size, pmax, pmean, pmin,
                                                ppermute, psum, psum_scatter, pvary)
from functional_pp.parallel.grads import gather_tree, value_and_grad
from functional_pp.parallel.init import init, init_params
from functional_pp.parallel.named import Named, configure, tied, wrap
from functional_pp.parallel.reshard import named
from functional_pp.parallel.shard_map import shard_map, use_rules
from functional_pp.step.pipeline import pipeline_step
from functional_pp.step.train import TrainStep, train_step
from functional_pp.version import __version__

__all__ = [
    # meshes, rules and devices
    "Mesh", "Rules", "P", "balanced", "inherit", "launch", "per_device", "DeviceError",
    "current_mesh", "current_rank", "device_coords",
    # parameters and named arrays
    "param", "Param", "init", "init_params", "count_params", "map_with_path", "leaves_with_paths",
    "Named", "named", "tied", "wrap",
    # the execution policy
    "Policy", "configure",
    # manual mode: collectives with JAX's names, shard_map
    "psum", "pmean", "pmax", "pmin", "pvary", "all_gather", "psum_scatter", "ppermute", "all_to_all",
    "axis_index", "axis_size", "shard_map", "use_rules",
    # the step
    "layer", "remat", "value_and_grad", "gather_tree", "train_step", "TrainStep",
    "pipeline_step",
    "comm_report", "CommReport",
    # submodules
    "ops", "optim",
]
