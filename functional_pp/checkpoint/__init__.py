"""Sharded, pickle-free checkpoints of train states (params, optimizer state, RNG, loader).

Every device writes one replica of its own shards to ``rank-NNNNN.safetensors``; rank 0 writes
``index.json`` (per tensor: path, dim names, global shape, dtype, which file holds which
slice) and publishes ``step-NNNNNN`` atomically. A device that passes an empty tensor for a non-empty
block does not hold that leaf (a pipeline stage's other layers): the lowest rank holding each
slice writes it, so each stage writes only its own layers, under their logical names. Loading reads only the slices the current
mesh and rules need, so a checkpoint loads on any mesh, or whole on one device::

    ckpt.save_checkpoint(root, step, {"params": params, "opt": opt_state, "rng": rng},
                         {"params": decls, "opt": opt_specs}, rules=rules,
                         metadata={"loader": loader.state_dict()}, config=cfg, keep_last=3)
    r = ckpt.load_checkpoint(root, {"params": decls, "opt": opt_specs}, rules=rules)
    params, opt_state, step = r.tree["params"], r.tree["opt"], r.step
"""
from functional_pp.checkpoint.consolidate import consolidate
from functional_pp.checkpoint.format import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                             CheckpointNotFoundError, UnsafeFormatError)
from functional_pp.checkpoint.load import Restored, load_checkpoint, load_safetensors
from functional_pp.checkpoint.manager import CheckpointManager, rng_state, set_rng_state
from functional_pp.checkpoint.save import save_checkpoint
from functional_pp.checkpoint.specs import PER_RANK, Spec, specs_like, state_specs

__all__ = [
    "save_checkpoint", "load_checkpoint", "load_safetensors", "consolidate", "CheckpointManager",
    "Restored", "Spec", "PER_RANK", "specs_like", "state_specs", "rng_state", "set_rng_state",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointCorruptError",
    "CheckpointMismatchError", "UnsafeFormatError",
]
