"""A training step's settings and the static description of its parameters: what
:func:`~functional_pp.step.train.train_step` checks when it builds a step, before any device
work (the parts built from them: step/train.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from functional_pp import optim
from functional_pp._torch import is_tracing
from functional_pp.compile.layer_compile import split_mode
from functional_pp.core.layout import Layout, Rules
from functional_pp.core.mesh import Mesh
from functional_pp.core.policy import FIELDS as POLICY_FIELDS
from functional_pp.core.policy import Policy
from functional_pp.core.tree import tree_flatten, tree_leaves, tree_unflatten
from functional_pp.parallel.named import Named

__all__ = ["StepSettings", "ParamSpec", "trainable_flags", "step_options", "PER_WEIGHT", "STEP_POLICY",
           "DEFAULT_BATCH_DIMS", "PRECISIONS", "METRICS_MODES"]

# the step without gradient buckets and FSDP units: one collective per weight, layer by layer
# (the planner's dry runs count collectives per layer; docs/communication.md)
PER_WEIGHT = {"bucket_mb": None, "fsdp_units": False, "fsdp_keep_root": False}
# a step's policy unless told otherwise: it does not recompute (remat=False, whatever the ambient
# value); the other ambient fields inherit functional_pp.configure (docs/policy.md)
STEP_POLICY = Policy(remat=False)
DEFAULT_BATCH_DIMS = {"tokens": "batch seq", "labels": "batch seq", "positions": "seq"}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
METRICS_MODES = ("per_step", "deferred")


@dataclass
class ParamSpec:
    """Static description of the parameter tree: dim names and layout of every leaf."""
    paths: list[str]
    dims: list[tuple[str, ...]]
    layouts: list[Layout]
    treespec: Any
    trainable: tuple[bool, ...] | None = None    # per leaf: trained (None: every leaf)
    _axes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def frozen(self) -> bool:
        """Whether some leaf is frozen (no gradient, no optimizer state, no gradient collective)."""
        return self.trainable is not None and not all(self.trainable)

    def trainable_tree(self, tree: Any) -> Any:
        """``tree`` (laid out like the parameters) with its frozen leaves left out (``None``, an
        empty subtree): what the optimizer sees; the tree itself when every leaf trains."""
        if not self.frozen:
            return tree
        leaves, spec = tree_flatten(tree)
        return tree_unflatten(spec, [x if t else None for x, t in zip(leaves, self.trainable)])

    def merged(self, leaves: list, treespec: Any, trained: Any) -> Any:
        """The full parameter tree (``treespec``, from this step's flatten) from all its old
        ``leaves`` and the new ``trained`` subtree."""
        if not self.frozen:
            return trained
        new = iter(tree_leaves(trained))
        return tree_unflatten(treespec, [next(new) if t else x for x, t in zip(leaves, self.trainable)])

    def named_types(self, mesh, shapes: tuple) -> list[tuple]:
        """Per leaf of local shape ``shapes[i]``: dims, split, vary, partial and global sizes of
        its named value (the fields :class:`Named` derives), once per mesh and shapes (eager)."""
        key = ("types", mesh, shapes)
        cached = self._axes.get(key)
        if cached is None:
            cached = []
            for shape, dims, layout in zip(shapes, self.dims, self.layouts):
                x = Named(torch.empty(shape, device="meta"), dims, layout)
                cached.append((x.dims, x.split, x.vary, x.partial, x._sizes))
            self._axes[key] = cached
        return cached

    def axis_groups(self, mesh) -> list[tuple[tuple[str, ...], list[int]]]:
        """The trainable leaves' indices (counted among the trainable leaves) grouped by the mesh
        axes (in mesh order) that split them (groups in order of their first leaf): what one
        reduction per group completes; derived once per mesh."""
        key = ("groups", mesh)
        cached = None if is_tracing() else self._axes.get(key)
        if cached is None:
            groups: dict[tuple[str, ...], list[int]] = {}
            layouts = [la for i, la in enumerate(self.layouts) if self.trainable is None or self.trainable[i]]
            for i, layout in enumerate(layouts):
                axes = tuple(a for a in mesh.axis_names if any(a in s for s in layout))
                groups.setdefault(axes, []).append(i)
            cached = list(groups.items())
            if not is_tracing():
                self._axes[key] = cached
        return cached


#: how a step's accumulated micro-batches weigh (StepSettings.micro_weighting)
MICRO_WEIGHTINGS = ("labels", "rows")
#: what a step's ``tokens`` metric (tokens/s, MFU) counts (StepSettings.throughput_tokens)
THROUGHPUT_TOKENS = ("labels", "rows")


@dataclass
class StepSettings:
    """A training step's settings, checked when it is built: the loss and optimizer, numerics
    (``precision``, ``grad_accum``, ``on_nonfinite``), compilation, the metrics mode, offloading
    and its execution ``policy`` (a :class:`~functional_pp.core.policy.Policy`: remat,
    keep_gathered, cp_attention, regather_activations, gradient buckets, FSDP units;
    docs/policy.md). :class:`~functional_pp.step.train.TrainStep` is these settings and the
    parts built from them."""

    loss_fn: Callable[[Any, dict], Named]
    optimizer: optim.GradientTransformation
    mesh: Mesh | None = None
    rules: Rules = field(default_factory=Rules)
    compile: bool | str = False           # False, True (inductor), a backend name ("aot_eager"), or
    #                                       "per_layer[:backend]": compile each @fpp.layer once
    grad_accum: int = 1
    precision: str = "fp32"               # fp32 | bf16 | fp16 (compute dtype; master weights fp32)
    policy: Policy = STEP_POLICY          # how the ops and collectives execute (docs/policy.md); its
    #                                       fields left None take the ambient functional_pp.configure values
    on_nonfinite: str = "skip"            # skip | raise
    max_consecutive_skips: int | None = 10  # stop after this many skipped steps in a row (None: never)
    lr_schedule: Callable | None = None   # reported in the metrics
    batch_dims: dict = field(default_factory=lambda: dict(DEFAULT_BATCH_DIMS))
    micro_weighting: str = "labels"       # how accumulated micro-batches weigh: labels (by their non-ignored
    #                                       labels: one large batch of a mean over tokens) | rows (equally: one
    #                                       large batch of a mean over rows, the diffusion objective's)
    throughput_tokens: str = "labels"     # what the ``tokens`` metric (tokens/s, MFU) counts: labels (the
    #                                       non-ignored labels: the trained tokens) | rows (every position of
    #                                       the batch's rows, as computed: EBFT's block-parallel rows)
    flops_per_token: float | None = None
    peak_flops_per_device: float | None = None
    donate_state: bool = False            # the caller gives up the state passed in: compiled steps
    #                                       write the new state into it (the old state may be overwritten;
    #                                       docs/memory.md "Donated state")
    trainable: Any = None                 # which parameters train: a tree of bools like the parameters,
    #                                       a callable(params) returning one (optim.mask_by_path), or
    #                                       None (all); frozen ones get no gradient, optimizer state or
    #                                       gradient collective (docs/adapters.md "Frozen parameters")
    metrics: str = "per_step"             # per_step: each call reads its metrics (one transfer) | deferred:
    #                                       none does; StepMetrics read at step.read() or first use
    #                                       (docs/eager_overhead.md "Host synchronisation")
    offload_params: bool = False          # master shards, gradients and optimizer state on the host between
    #                                       steps, the update there (FSDP2's CPUOffloadPolicy; step/offload.py)
    activation_offloading: bool = False   # saved activations to pinned host memory in forward, back in
    #                                       backward (CUDA; step/activation_offload.py)

    def __post_init__(self):
        self.check_settings()

    def check_settings(self) -> None:
        """Refuse a bad setting by name (the value and the choices)."""
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {sorted(PRECISIONS)}")
        if self.on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite {self.on_nonfinite!r}: choose 'skip' or 'raise'")
        if self.metrics not in METRICS_MODES:
            raise ValueError(f"metrics {self.metrics!r}: choose 'per_step' (read after every step) or 'deferred' "
                             f"(read at step.read() or when a value is used)")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"TrainStep(policy=...) needs a functional_pp.Policy, got {type(self.policy).__name__}")
        if self.micro_weighting not in MICRO_WEIGHTINGS:
            raise ValueError(f"micro_weighting {self.micro_weighting!r}: choose one of {', '.join(MICRO_WEIGHTINGS)}")
        if self.throughput_tokens not in THROUGHPUT_TOKENS:
            raise ValueError(f"throughput_tokens {self.throughput_tokens!r}: choose one of "
                             f"{', '.join(THROUGHPUT_TOKENS)}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        for lever in ("offload_params", "activation_offloading"):
            if getattr(self, lever) and split_mode(self.compile)[0]:
                raise ValueError(f"train_step({lever}=True, compile={self.compile!r}): a compiled step cannot "
                                 f"offload yet; use compile=False or compile='per_layer' (each layer compiled, "
                                 f"the step eager; docs/memory.md)")
        if self.max_consecutive_skips is not None and (
                isinstance(self.max_consecutive_skips, bool) or not isinstance(self.max_consecutive_skips, int)
                or self.max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be an integer >= 1 (or None: never stop), got "
                             f"{self.max_consecutive_skips!r}")


def trainable_flags(trainable: Any, params: Any, leaves: list[Named]) -> tuple[bool, ...] | None:
    """Per parameter leaf whether it trains (``TrainStep.trainable`` resolved against the named
    ``params``: a tree of bools or a callable returning one); None where all do. A
    non-floating leaf never trains."""
    if trainable is None:
        return None
    flags = tuple(tree_leaves(optim.resolve_mask(trainable, params)))
    flags = tuple(f and x.data.is_floating_point() for f, x in zip(flags, leaves))
    if not any(flags):
        raise ValueError("train_step(trainable=...): no parameter is trainable; mark at least one leaf True "
                         "(or pass trainable=None to train them all)")
    return flags


def step_options(options: dict, where: str = "train_step") -> dict:
    """A step builder's keyword ``options`` with the policy settings among them (``remat=``,
    ``keep_gathered=``, ``bucket_mb=``, ...: the fields of :class:`Policy`) gathered into one
    ``policy`` (on top of ``policy=`` if given, else of the step's default)."""
    settings = {k: options.pop(k) for k in list(options) if k in POLICY_FIELDS}
    base = options.pop("policy", STEP_POLICY)
    if not isinstance(base, Policy):
        raise TypeError(f"{where}(policy=...) needs a functional_pp.Policy, got {type(base).__name__}")
    return {**options, "policy": base.replace(**settings) if settings else base}
