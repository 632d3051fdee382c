"""Watch one device run a training step: live memory by category, its peak, the tensors
autograd saves, FLOPs of the matrix products and the collectives, each tagged with the op,
the phase (forward, backward, update) and the model layer (docs/planning.md, "Memory").

Works on meta tensors (the dry-run) and on real ones (the measurement it is checked
against): a storage counts from the op that creates it until it is freed."""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import torch

from functional_pp._torch import EagerDispatchMode, in_backward
from functional_pp._torch.meta_cache import call_meta
from functional_pp.compile.selective import MATMULS, SAVED_OPS, keeps_matmul
from functional_pp.core.comm import CommReport
from functional_pp.core.observers import on_checkpointed, on_saved_for_backward, on_serial_work, on_uneven_work
from functional_pp.core.runtime import per_thread
from functional_pp.plan import fsdp2
from functional_pp.plan.allocator import COMPUTE, CachingAllocator
from functional_pp.plan.partition import Value, partition_saved, recomputable

CATEGORIES = ("weights", "optimizer state", "weights in flight", "activations", "logits",
              "logits grad", "forward temporaries", "gradients and backward temporaries",
              "update temporaries")

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default: "mm", _aten.bmm.default: "bmm", _aten.addmm.default: "addmm",
            _aten.baddbmm.default: "baddbmm",
            # (the chunked LM head's products into its buffers: ops/xent/chunks.py)
            _aten.mm.out: "mm", _aten.addmm_.default: "addmm"}
_TWO_OPERANDS = {_aten.mm.default, _aten.bmm.default, _aten.mm.out}     # (the others: bias / accumulator first)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_LOGITS_GRAD = {_aten._log_softmax_backward_data.default, _aten.nll_loss_backward.default,
                _aten.nll_loss2d_backward.default}
_NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias",
               "lift_fresh", "_local_scalar_dense"}


def launches_kernel(func, name: str) -> bool:
    """Whether an ATen op runs a kernel (one launch on a GPU): not a view, an allocation, a
    detach or a host read. The host dispatches each such op of an eager step
    (``Cluster.launch_seconds``, docs/planning.md "Time model")."""
    return not getattr(func, "is_view", False) and name.split(".")[0] not in _NO_TRAFFIC


_LAUNCHES: dict = {}     # op -> launches_kernel(op): asked once per op, not once per call
_VIEWS: dict = {}        # op -> whether it is a view (its result shares an input's storage)
_storage_of = torch.Tensor.untyped_storage

_FLASH = {_aten._scaled_dot_product_flash_attention_for_cpu.default: 1.0,
          _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 2.5}


@dataclass
class _Alloc:
    nbytes: int
    category: str
    op: str
    layer: int | None
    phase: str
    param_derived: bool
    recomputed: bool = False     # created by backward's recomputation of a checkpointed region
    widened: bool = False        # a 16-bit tensor cast up to float32 (mixed precision's wide sums)
    key: int = 0                 # its storage's key in MemoryTracker._live
    kept_for: int | None = None  # kept by that compiled layer (not saved in eager) until its backward
    discounted: bool = False     # saved in eager, recomputed by a compiled layer (held in the compiled curve: no)


@dataclass
class SavedTensor:
    """A tensor autograd keeps for backward."""
    op: str
    layer: int | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    category: str


@dataclass
class TaggedEvent:
    """A collective with where it was issued."""
    kind: str
    axes: tuple[str, ...]
    group_size: int
    bytes_sent: int
    shape: tuple[int, ...]
    dtype: str
    phase: str
    layer: int | None
    op: str
    weight_traffic: bool      # gathers weights or reduces weight gradients: may overlap compute
    recompute: bool = False   # issued by backward's recomputation of a checkpointed region (remat)
    widened: bool = False     # sums 16-bit values cast up to float32 (the step's reduce_dtype)


@dataclass
class DeviceRun:
    """What one device did in one step (exact for the model it ran)."""
    baseline: dict[str, int]
    peak_bytes: int = 0
    peak_reserved: int = 0       # the caching allocator's reserved bytes at their peak (plan/allocator.py)
    reserved_by_stream: dict = field(default_factory=dict)   # stream -> bytes its pools reserved (at the end)
    # fsdp2_streams: (layer, fp32 bytes) of each weight gradient's reduce-scatter output, in order: FSDP2's
    # sharded gradients, held on its reduce-scatter stream until the next step (plan/fsdp2.py held_gradients)
    gradient_shards: list = field(default_factory=list)
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""
    flops: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0, "update": 0.0})
    flops_by_layer: dict = field(default_factory=dict)
    attention_flops: dict = field(default_factory=dict)      # phase -> the part of ``flops`` in attention kernels
    dense_attention_forward: float = 0.0    # forward attention FLOPs counting causal as full (torchtitan's MFU)
    traffic: dict = field(default_factory=dict)              # phase -> bytes read + written by the other ops
    attention_by_layer: dict = field(default_factory=dict)   # layer -> attention FLOPs (forward and backward)
    attention_by_keys: dict = field(default_factory=dict)    # key length of a call -> its attention FLOPs
    traffic_by_layer: dict = field(default_factory=dict)     # layer -> traffic (forward and backward)
    every_other_mm_forward: float = 0.0     # FLOPs of each layer's 2nd, 4th, ... forward matmul
    layer_forward_traffic: float = 0.0      # forward traffic inside the layers
    recompute_traffic: float = 0.0          # backward traffic of what checkpointed regions recompute
    linear_flops: dict = field(default_factory=dict)         # phase -> matmul FLOPs inside the layers (Float8's)
    linear_operands: dict = field(default_factory=dict)      # phase -> elements those matmuls read (cast to fp8)
    linear_by_layer: dict = field(default_factory=dict)      # layer -> matmul FLOPs (forward and backward)
    launches: dict = field(default_factory=dict)             # phase -> ops that run a kernel (:func:`launches_kernel`)
    saved: list[SavedTensor] = field(default_factory=list)
    events: list[TaggedEvent] = field(default_factory=list)
    timeline: list[tuple[int, str, str, int | None, int]] = field(default_factory=list)
    # per memory lever (offload_params, activation_offloading): the device's and the host's peaks
    # with what the lever keeps on the host counted there (:meth:`MemoryTracker.split`)
    offload_peaks: dict = field(default_factory=dict)
    uneven: dict[str, dict] = field(default_factory=dict)    # what -> busiest coordinates (observers.uneven_work)
    # the other devices' turns of serial work (observers.serial_work: a chain of blocks under cp), which this
    # device waits for: (devices - 1) x its own FLOPs and traffic there, per phase and per layer
    serial_flops: dict = field(default_factory=dict)
    serial_traffic: dict = field(default_factory=dict)
    serial_by_layer: dict = field(default_factory=dict)       # layer -> (FLOPs, traffic) waited for
    # with compiled layers (MemoryTracker(compiled=True); plan/partition.py): the peak when each layer's
    # forward saves what AOTAutograd's partitioner keeps, its split, the saved bytes that changes (compiled
    # minus eager, every micro-step), and each layer's compiled saved bytes (its inputs counted, parameters not)
    compiled_peak_bytes: int = 0
    compiled_breakdown: dict = field(default_factory=dict)
    compiled_saved_delta: int = 0
    compiled_layer_saved: dict = field(default_factory=dict)
    needed_positions: dict = field(default_factory=dict)     # layer -> positions of the values backward read

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward, parameters and their copies excluded."""
        return sum(s.nbytes for s in self.saved if s.category in ("activations", "logits"))


_active = per_thread("plan.tracker")
#: the (offload_params, activation_offloading) settings whose peaks a run records
OFFLOAD_LEVERS = ((True, False), (False, True), (True, True))


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an ATen op's arguments or results (tuples, lists, dicts of them), in
    order: what torch's pytree flattening gives here, without its per-leaf type checks."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list = []
    if isinstance(value, dict):
        _collect(value.values(), found)
    elif isinstance(value, (tuple, list)):
        _collect(value, found)
    return found


def _collect(items, found: list) -> None:
    for v in items:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            if v and not isinstance(v[0], (int, float)):      # (a shape or a scalar list: no tensors)
                _collect(v, found)
        elif isinstance(v, dict):
            _collect(v.values(), found)


@on_saved_for_backward
def count_saved(t: torch.Tensor) -> None:
    """Report a tensor saved for backward by a pack hook that replaces ours (inner
    ``saved_tensors_hooks`` win: FSDP re-gathering announces it, :mod:`functional_pp.core.observers`)."""
    tracker = getattr(_active, "tracker", None)
    if tracker is not None:
        tracker.pack(t)


@on_checkpointed
def note_region(region: object, recompute: bool, entering: bool) -> None:
    """A checkpointed region runs: in forward remember its layer; recomputed in backward, run it
    as that layer and tag what it does as recomputation."""
    tracker = getattr(_active, "tracker", None)
    if tracker is not None:
        tracker.region(region, recompute, entering)


@on_serial_work
def note_serial(devices: int) -> None:
    """Serial work enters (its devices) or leaves (1): the tracker counts the other devices' turns."""
    tracker = getattr(_active, "tracker", None)
    if tracker is not None:
        tracker.serial = devices


@on_uneven_work
def note_uneven(what: str, busiest) -> None:
    """Record that an op's work depends on the device (the representative is not typical)."""
    tracker = getattr(_active, "tracker", None)
    if tracker is not None:
        tracker.run.uneven[what] = dict(busiest)


class MemoryTracker(EagerDispatchMode):
    """Counts storages created while active (see module docstring). ``baseline``: bytes alive
    before (weights, optimizer state); ``param_storages``: storages of the parameters, whose
    casts, views and gathers are "weights in flight". ``baseline_sizes``: the bytes of each
    tensor held before the step, allocated first in the caching allocator's model (without
    them the baseline counts as reserved exactly). ``compiled``: also follow the step as if each
    layer were compiled (``torch.compile``, AOTAutograd's partitioner choosing what its forward
    saves: plan/partition.py), into ``compiled_peak_bytes`` and the ``compiled_*`` fields.
    ``fsdp2_streams``: replay the weight collectives' buffers as FSDP2 allocates them, on its
    all-gather and reduce-scatter streams (plan/fsdp2.py); ``expandable_segments``:
    the allocator's setting of that name (plan/allocator.py). ``needed`` (compiled selective
    layers: what backward reads of each, by position) with ``selective``, the policy's name
    (compile/selective.py): the results it keeps, the rest recomputed. ``float8``: the layers'
    matmuls are torchao's Float8 linear layers', their operands' fp8 copies counted
    (:meth:`_float8_casts`); ``float8_all_gather``: the layers' matrix weights gathered in fp8,
    1 byte per element. ``offload``: also record the device's and the host's peaks with each
    offload lever pulled (``DeviceRun.offload_peaks``)."""

    def __init__(self, baseline: dict[str, int], param_tensors, report: CommReport | None = None,
                 timeline: bool = True, baseline_sizes=None, compiled: bool = False, needed=None,
                 fsdp2_streams: bool = False, expandable_segments: bool = False, selective: str = "selective",
                 float8: bool = False, float8_all_gather: bool = False, offload: bool = True,
                 fsdp2_held: tuple | None = None):
        super().__init__()
        # fsdp2_streams: (root bytes, last layer, its bytes) FSDP2 holds gathered (plan/fsdp2.py held_unsharded)
        self._fsdp2_held = fsdp2_held if fsdp2_streams else None
        self._fsdp2_live: dict = {}          # "root" / "last" -> the key of its held buffer
        self._fsdp2_done: set = set()        # those resharded (backward done with them)
        self._offload_levers = OFFLOAD_LEVERS if offload else ()   # whose peaks the run records
        self.float8, self.float8_all_gather = float8, float8_all_gather     # Float8 linear layers' buffers
        self._seq_cast = 0
        self._float8_kept: dict = {}         # (layer, weight shape) -> eager fp8 weight copies saved for backward
        self._checkpointed_forward = 0       # checkpointed regions open in forward
        self.selective = selective           # the selective policy of the layers when ``needed`` is given
        self._open_matmuls = 0               # matrix products in the open layer's forward so far
        self.fsdp2_streams = fsdp2_streams
        self.compiled = compiled
        self._needed = needed                # selective layers: layer -> positions read in backward without
        self._seen_sigs: dict = {}           # checkpointing (DeviceRun.needed_positions of such a run)
        self._open: int | None = None        # the layer whose forward ops are being recorded (compiled)
        self._values: dict = {}              # its values (plan/partition.py Value), by id of their _Alloc
        self._held: dict = {}                # id -> _Alloc of those values (kept: ids stay unique)
        self._pending: dict = {}             # layer -> (discounted allocs, surcharge bytes) until its backward
        self._adjust = 0                     # compiled curve minus eager curve now
        self._freed_kept: dict = {}          # layer -> bytes it keeps that eager freed
        self.run = DeviceRun(dict(baseline))
        self.allocator = CachingAllocator(expandable_segments)
        self._noted_reserved = -1
        self._reserved_base = 0 if baseline_sizes is not None else sum(baseline.values())
        for i, n in enumerate(baseline_sizes or ()):
            self.allocator.malloc(("baseline", i), n)
        self.run.peak_reserved = self._reserved_base + self.allocator.peak_reserved
        self._totals = {c: 0 for c in CATEGORIES}
        self._totals.update(baseline)
        self._current = sum(baseline.values())
        self.run.peak_bytes = self.run.compiled_peak_bytes = self._current
        self.run.peak_breakdown = dict(self._totals)
        self.run.compiled_breakdown = dict(self._totals)
        self._live: dict[int, _Alloc] = {}
        self._watch: dict[int, weakref.ref] = {}     # key -> a reference to its storage that frees it when it dies
        self._param_ids = {id(t.untyped_storage()) for t in param_tensors}
        self._weight_shapes: set = {tuple(t.shape) for t in param_tensors}
        self._report = report
        self._n_events = 0
        self._collective: str | None = None  # a weight collective whose output is the next new storage
        self._gathers: list = []             # fsdp2_streams: ((layer, phase, recomputing), bytes) of each gather
        self._seq = 0
        self._keep_timeline = timeline
        self.layer: int | None = None
        self.phase = "forward"
        self._seen_backward = False
        self._mm_in_layer: dict = {}
        self._region_layer: dict = {}      # checkpointed region -> the layer it ran in forward
        self._outer_regions: list = []
        self.recomputing = False
        self._activations_by_layer: dict = {}
        self.serial = 1         # devices taking turns at the work running now (observers.serial_work)

    def __enter__(self):
        self._outer = getattr(_active, "tracker", None)
        _active.tracker = self
        return super().__enter__()

    def __exit__(self, *exc):
        if self._gathers:                    # (FSDP2's all-gather stream: a pool of its own, replayed apart)
            fsdp2.replay(self.allocator, self._gathers)
            self._note_reserved()
        self.close_layer()
        _active.tracker = self._outer
        return super().__exit__(*exc)

    def region(self, region: object, recompute: bool, entering: bool) -> None:
        """A checkpointed region enters or leaves (:func:`functional_pp.core.observers.checkpointed`):
        its recomputation counts for the layer it ran in forward (the dry-run extrapolates
        per layer), and its collectives are tagged ``recompute``."""
        if not recompute:
            self._checkpointed_forward += 1 if entering else -1
            if entering:
                self._region_layer[region] = self.layer
            return
        if entering:
            self._outer_regions.append((self.layer, self.recomputing))
            self.layer, self.recomputing = self._region_layer.get(region, self.layer), True
        else:
            self.layer, self.recomputing = self._outer_regions.pop()

    # -------------------------------------------------------------- autograd hooks
    def pack(self, t: torch.Tensor):
        alloc = self._live.get(id(t.untyped_storage()))
        if self.compiled:
            self._follow_compiled()
            if self._open is not None:
                self._value(t, alloc).needed = True
        if alloc is not None and alloc.phase == "forward" and not getattr(alloc, "_saved", False):
            alloc._saved = True
            if alloc.category == "forward temporaries":
                self._move(alloc, "activations")
            self.run.saved.append(SavedTensor(alloc.op, alloc.layer, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                              alloc.nbytes, alloc.category))
        return t

    @staticmethod
    def unpack(t):
        return t

    def _move(self, alloc: _Alloc, category: str) -> None:
        self._totals[alloc.category] -= alloc.nbytes
        self._count_activation(alloc, -1)
        alloc.category = category
        self._totals[category] += alloc.nbytes
        self._count_activation(alloc, 1)

    def _count_activation(self, alloc: _Alloc, sign: int) -> None:
        """Keep the saved activations per layer (what activation offloading leaves on the
        device: the layer computing, :meth:`split`)."""
        if alloc.category == "activations":
            self._activations_by_layer[alloc.layer] = self._activations_by_layer.get(alloc.layer, 0) + sign * alloc.nbytes

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            return False if args[0].dtype == torch.bool else 0     # meta has no values: checks pass
        backward = in_backward()
        if backward:
            self.phase, self._seen_backward = "backward", True
        elif self._seen_backward and self.phase == "backward":
            self.phase = "update"
        if self._fsdp2_live and (self.phase == "update" or (backward and self.layer is not None
                                                            and self.layer < self._fsdp2_held[1])):
            self._fsdp2_release()
        inputs = _tensors((args, kwargs))
        in_allocs = [self._live.get(id(a.untyped_storage())) for a in inputs]
        if backward and not self.recomputing:     # recomputation keeps its region's layer
            layers = [a.layer for a in in_allocs
                      if a is not None and (a.phase == "forward" or a.recomputed) and a.layer is not None]
            if layers:
                self.layer = max(layers)
        if self.compiled:
            self._follow_compiled()
        if self._float8_kept and not self.recomputing and self.phase == "update":
            self._release_float8(None)
        elif self._float8_kept and not self.recomputing and self.phase == "backward" and self.layer is not None:
            self._release_float8(self.layer)
        view = _VIEWS.get(func)
        if view is None:
            view = _VIEWS[func] = bool(getattr(func, "is_view", False))
        casts: list = []
        if view and not self.compiled and not self._keep_timeline and (
                self._report is None or len(self._report.events) == self._n_events):
            out = func(*args, **kwargs)     # a view of tracked storage: no kernel, bytes, FLOPs or event
            if all(id(s) in self._live or id(s) in self._param_ids for s in map(_storage_of, _tensors(out))):
                self._seq += 1
                return out
        else:
            casts = self._float8_casts(func, args)   # (Float8's operand copies, live during the product)
            out = call_meta(func, args, kwargs)     # (meta: memoised; real tensors: the kernel)
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        launch = _LAUNCHES.get(func)
        if launch is None:
            launch = _LAUNCHES[func] = launches_kernel(func, name)
        if launch:
            self.run.launches[self.phase] = self.run.launches.get(self.phase, 0) + 1
        if not self._count_flops(func, args, out):
            self._count_traffic(func, name, inputs, out)
        derived = self.phase != "update" and bool(inputs) and all(
            id(a.untyped_storage()) in self._param_ids or (al is not None and al.param_derived)
            for a, al in zip(inputs, in_allocs))
        if self._report is not None and len(self._report.events) > self._n_events:
            self._tag_events(name, derived, inputs, any(a is not None and a.widened for a in in_allocs))
        for t in _tensors(out):
            self._allocate(t, name, derived, func, inputs)
        for key in casts:
            self._free(key)
        if self._open is not None:
            self._record(func, inputs, in_allocs, out)
        if func is _aten._log_softmax.default:           # the loss's input and its log-softmax
            self.mark_logits(args[0])
            self.mark_logits(out)
        if self._keep_timeline:
            self.run.timeline.append((self._seq, name, self.phase, self.layer, self._current))
        self._seq += 1
        return out

    def _tag_events(self, op: str, derived: bool, inputs, widened: bool = False) -> None:
        for e in self._report.events[self._n_events:]:
            # forward and its recomputation: a collective on parameters; backward: on their gradients
            weight = derived if self.phase == "forward" or self.recomputing else e.shape in self._weight_shapes
            if self.phase == "update":
                weight = False     # gradient-norm and token-count sums: scalars
            self.run.events.append(TaggedEvent(e.kind, e.axes, e.group_size, e.bytes_sent, e.shape, e.dtype,
                                               self.phase, self.layer, op, weight, self.recomputing, widened))
            if weight and self.fsdp2_streams and e.kind in ("all_gather", "reduce_scatter"):
                self._collective = e.kind
        self._n_events = len(self._report.events)

    def _allocate(self, t: torch.Tensor, op: str, derived: bool, func, inputs=()) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live or key in self._param_ids:
            return
        nbytes = storage.nbytes()
        kind, self._collective = self._collective, None        # (the collective's output is its first)
        if derived and self.float8_all_gather and self.layer is not None and t.dim() == 2 and t.is_floating_point():
            nbytes = t.numel()               # a layer's matrix weight gathered in fp8 (float8_all_gather)
        if kind == "all_gather":             # (stands for FSDP2's copy-out, on the compute stream)
            self._gathers.append(((self.layer, self.phase, self.recomputing), nbytes))
        elif kind == "reduce_scatter":       # FSDP2 reduces in fp32 (torchtitan's reduce_dtype)
            self.run.gradient_shards.append((self.layer, 4 * t.numel()))
        if self._fsdp2_held is not None and derived:
            nbytes = self._fsdp2_unsharded(kind, nbytes, inputs, t)
        if derived:
            category = "weights in flight"
            self._weight_shapes.add(tuple(t.shape))
        elif func in _LOGITS_GRAD:
            category = "logits grad"
        elif self.phase == "forward":
            category = "forward temporaries"
        elif self.phase == "backward":
            category = "gradients and backward temporaries"
        else:
            category = "update temporaries"
        widened = (func is _aten._to_copy.default and t.dtype == torch.float32 and len(inputs) == 1
                   and inputs[0].dtype in (torch.bfloat16, torch.float16))
        alloc = _Alloc(nbytes, category, op, self.layer, self.phase, derived, self.recomputing, widened, key)
        self._add(alloc, fsdp2.REDUCE_SCATTER_STREAM if kind == "reduce_scatter" else COMPUTE)
        self._watch[key] = weakref.ref(storage, functools.partial(self._dead, key))

    def _add(self, alloc: _Alloc, stream=COMPUTE) -> None:
        """Count a new allocation (a storage, or a buffer the program's kernels would make that
        the dry-run's ops do not: Float8's casts) and update the peaks."""
        key, nbytes, category = alloc.key, alloc.nbytes, alloc.category
        self._live[key] = alloc
        self.allocator.malloc(key, nbytes, stream)
        self._note_reserved()
        self._totals[category] += nbytes
        self._current += nbytes
        self._count_activation(alloc, 1)
        for levers in self._offload_levers:
            device, host = self.split(*levers)
            was = self.run.offload_peaks.get(levers, (0, 0))
            self.run.offload_peaks[levers] = (max(was[0], device), max(was[1], host))
        self._compiled_peak()
        if self._current > self.run.peak_bytes:
            self.run.peak_bytes = self._current
            self.run.peak_breakdown = {c: v for c, v in self._totals.items() if v}
            self.run.peak_at = f"{self.phase} {alloc.op}" + (f" (layer {self.layer})" if self.layer is not None else "")

    # -------------------------------------------------------------- FSDP2's unsharded parameters
    def _fsdp2_unsharded(self, kind, nbytes: int, inputs, t) -> int:
        """The bytes a weight's gather or cast counts as FSDP2 holds them (``fsdp2_held``):
        the root unit is gathered whole at the first gather outside the layers and held to the
        end of backward, the last layer from its forward gather to the end of its backward
        (docs/planning.md, "Reserved memory"): the dry-run's own gathers of them count nothing
        meanwhile (the held buffer stands for them). The step's 16-bit copy of a parameter's
        shard counts nothing: FSDP2 casts the shard inside the all-gather's copy-in and frees it."""
        root, last, last_bytes = self._fsdp2_held
        if kind != "all_gather":
            shard = any(id(a.untyped_storage()) in self._param_ids and a.numel() == t.numel() for a in inputs)
            return 0 if shard and self.layer is None and self.phase == "forward" else nbytes
        which = "root" if self.layer is None else "last" if self.layer == last else None
        if which is None:
            return nbytes
        if which not in self._fsdp2_live:
            if self.phase != "forward" or self.recomputing or which in self._fsdp2_done:
                return nbytes
            key = ("fsdp2 unsharded", which)
            self._add(_Alloc(root if which == "root" else last_bytes, "weights in flight", f"fsdp2 {which} unit",
                             self.layer, self.phase, True, False, False, key))
            self._fsdp2_live[which] = key
        return 0

    def _fsdp2_release(self) -> None:
        """Reshard what FSDP2 held: the last layer once backward has left it, the root at the update."""
        for which in [w for w in self._fsdp2_live if w == "last" or self.phase == "update"]:
            self._free(self._fsdp2_live.pop(which))
            self._fsdp2_done.add(which)

    # -------------------------------------------------------------- Float8
    def _float8_casts(self, func, args) -> list:
        """The fp8 copies of a layer matmul's operands that torchao's Float8 linear layers make
        (dynamic tensorwise scaling; docs/planning.md, "Float8's memory"), allocated before the
        product: each operand's, but a weight gathered in fp8 read by a forward product (its
        transpose is already the column-major operand ``_scaled_mm`` takes). Compiled layers
        fuse each cast into one kernel (1 byte per element); eager runs torchao's
        ``tensor.to(float32) * scale``, its clamp and the cast (fp32 temporaries of 8 bytes per
        element, freed after it), and the weight gradient's product copies both fp8 operands
        transposed (``preprocess_addmm``: 1 byte more each). Returns the keys to free after the
        product.

        Eager, a weight's fp8 copy is made outside torchao's autograd function, which saves it for
        backward: a forward product's (outside a checkpointed region, whose forward saves nothing)
        or a recomputed one's is kept, as an activation, until the layer's backward product that
        reads that weight. Compiled, the partitioner recomputes it from the weight (free to save)."""
        if not (self.float8 and func in _MATMULS and self.layer is not None and self.phase != "update"):
            return []
        operands = (args[0], args[1]) if func in _TWO_OPERANDS else (args[1], args[2])
        forward = self.phase == "forward" or self.recomputing
        keys = []
        allocs = [self._live.get(id(t.untyped_storage())) for t in operands]
        weights = [id(t.untyped_storage()) in self._param_ids or (al is not None and al.param_derived)
                   for t, al in zip(operands, allocs)]
        for t, al, weight in zip(operands, allocs, weights):
            gathered = weight and al is not None and self.float8_all_gather and t.dim() == 2
            if (gathered and forward) or t.dtype in _FP8:
                continue
            n = t.numel()
            # backward reads a weight's fp8 copy (kept, gathered or, compiled, recast): a transposed copy only
            cast = self.compiled or (weight and not forward)
            temps = [] if cast else [self._cast_buffer(4 * n, "float8 scale (fp32)"),
                                     self._cast_buffer(4 * n, "float8 clamp (fp32)")]
            held = (self.layer, tuple(sorted(t.shape)))           # (the weight or its transpose)
            if weight and not self.compiled and forward and (self.recomputing or not self._checkpointed_forward):
                self._float8_kept.setdefault(held, []).append(self._cast_buffer(n, "float8 weight", "activations"))
            else:
                keys.append(self._cast_buffer(n, "float8 cast"))
                if weight and not forward and self._float8_kept.get(held):
                    keys.append(self._float8_kept[held].pop())          # its backward has read it
            for k in temps:
                self._free(k)
            if not self.compiled and not forward and not any(weights):
                keys.append(self._cast_buffer(n, "float8 transposed copy"))   # the weight gradient's operands
        return keys

    def _release_float8(self, layer: int | None) -> None:
        """Free the kept fp8 weight copies of the layers after ``layer`` (all: None): backward has
        left them (a weight no backward product read, its input not needing a gradient)."""
        for held in [h for h in self._float8_kept if layer is None or h[0] > layer]:
            for key in self._float8_kept.pop(held):
                self._free(key)

    def _cast_buffer(self, nbytes: int, op: str, category: str | None = None):
        self._seq_cast += 1
        key = ("float8", self._seq_cast)
        category = category or ("forward temporaries" if self.phase == "forward"
                                else "gradients and backward temporaries")
        self._add(_Alloc(nbytes, category, op, self.layer, self.phase, False, self.recomputing, False, key))
        return key

    def _note_reserved(self) -> None:
        if self.allocator.reserved == self._noted_reserved:      # (no segment reserved since)
            return
        self._noted_reserved = self.allocator.reserved
        self.run.peak_reserved = max(self.run.peak_reserved, self._reserved_base + self.allocator.peak_reserved)
        self.run.reserved_by_stream = dict(self.allocator.reserved_by_stream)

    def split(self, params: bool, activations: bool) -> tuple[int, int]:
        """The live bytes now as (device, host) with ``params`` offloaded (weights and optimizer
        state on the host, the update and, once it starts, the gradients too) and/or
        ``activations`` (tensors saved for backward on the host, but those of the layer
        computing; docs/memory.md)."""
        t = self._totals
        host = 0
        if params:
            host += t["weights"] + t["optimizer state"] + t["update temporaries"]
            if self.phase == "update":
                host += t["gradients and backward temporaries"]
        if activations:      # but the layer computing: its saved tensors are made or brought back now
            host += t["activations"] - self._activations_by_layer.get(self.layer, 0)
        return self._current - host, host

    def mark_logits(self, t: torch.Tensor) -> None:
        """Report ``t``'s storage as logits (the loss's input)."""
        alloc = self._live.get(id(t.untyped_storage()))
        if alloc is not None and alloc.category in ("forward temporaries", "activations"):
            self._move(alloc, "logits")

    def _dead(self, key: int, _ref) -> None:
        self._watch.pop(key, None)
        self._free(key)

    def _free(self, key: int) -> None:
        alloc = self._live.pop(key, None)
        if alloc is not None:
            if alloc.discounted:
                alloc.discounted, self._adjust = False, self._adjust + alloc.nbytes
            if alloc.kept_for is not None:       # eager frees what the compiled layer keeps until its backward
                self._adjust += alloc.nbytes
                self._freed_kept[alloc.kept_for] = self._freed_kept.get(alloc.kept_for, 0) + alloc.nbytes
            self.allocator.free(key)
            self._count_activation(alloc, -1)
            self._totals[alloc.category] -= alloc.nbytes
            self._current -= alloc.nbytes

    # -------------------------------------------------------------- compiled layers
    def _follow_compiled(self) -> None:
        """Before an op: open or close the layer whose forward is recorded; at a layer's first
        backward op its recomputed values are back (the compiled backward remakes them)."""
        forward = self.phase == "forward" and not self.recomputing
        if self._open is not None and (not forward or self.layer != self._open):
            self.close_layer()
        if forward and self.layer is not None and self._open is None:
            self._open, self._values, self._held = self.layer, {}, {}
            self._seen_sigs, self._open_matmuls = {}, 0
        if self.phase == "backward" and self.layer in self._pending:
            allocs, surcharge = self._pending.pop(self.layer)
            for alloc in allocs:
                if alloc.discounted:
                    alloc.discounted, self._adjust = False, self._adjust + alloc.nbytes
                alloc.kept_for = None
            self._adjust -= surcharge + self._freed_kept.pop(self.layer, 0)
            self._compiled_peak()

    def _value(self, t: torch.Tensor, alloc: _Alloc | None) -> Value:
        """The recorded value of ``t`` in the open layer: made there, or one of its inputs."""
        key = id(alloc) if alloc is not None else ("outside", id(t.untyped_storage()))
        v = self._values.get(key)
        if v is None:
            free = id(t.untyped_storage()) in self._param_ids or (alloc is not None and alloc.param_derived)
            v = self._values[key] = Value(t.untyped_storage().nbytes(), primal=True, free=free,
                                          position=self._position("input", t))
            if alloc is not None:
                self._held[key] = alloc
        return v

    def _position(self, op: str, t: torch.Tensor) -> tuple:
        """A value's name in its layer, the same with and without checkpointing: its op, shape and
        dtype and how many such values came before it (other ops in between do not shift it)."""
        sig = (op, tuple(t.shape), t.dtype)
        n = self._seen_sigs[sig] = self._seen_sigs.get(sig, -1) + 1
        return (*sig, n)

    def begin_forward(self) -> None:
        """A forward pass of the loss begins (each micro-step's): no layer yet, and each layer's
        matmuls counted afresh, as torchtitan's op policy counts them per run of a block."""
        self.phase, self.layer = "forward", None
        self._mm_in_layer = {}
        self._release_float8(None)

    def _policy_keeps(self, func) -> bool:
        """Whether the selective policy keeps the result of this call of ``func`` in the open
        layer's forward (the same count as the policy's, compile/selective.py)."""
        if func in MATMULS:
            self._open_matmuls += 1
            return keeps_matmul(self.selective, self._open_matmuls)
        return func in SAVED_OPS

    def _record(self, func, inputs, in_allocs, out) -> None:
        """One forward op of the open layer: its new outputs become values read from its inputs."""
        fusible = recomputable(func)
        read = []
        for a, al in zip(inputs, in_allocs):
            v = self._value(a, al)
            read.append(id(al) if al is not None else ("outside", id(a.untyped_storage())))
            if not fusible:
                v.read_by_unfusible = True
        in_bytes = sum(a.untyped_storage().nbytes() for a in inputs)
        forced = self._needed is not None and not self._policy_keeps(func)     # (asked once per call)
        for t in _tensors(out):
            alloc = self._live.get(id(t.untyped_storage()))
            if alloc is None or id(alloc) in self._values:       # a view or an in-place result: the same value
                continue
            self._values[id(alloc)] = Value(alloc.nbytes, fusible, tuple(read), free=alloc.param_derived,
                                            input_bytes=in_bytes, forced=forced,
                                            position=self._position(func.__name__, t))
            self._held[id(alloc)] = alloc
            for k in read:
                self._values[k].users.append(id(alloc))

    def close_layer(self) -> None:
        """The open layer's forward is done: keep what the partitioner saves; the values eager saved
        and it recomputes leave the compiled curve until the layer's backward begins."""
        layer, values, held = self._open, self._values, self._held
        self._open, self._values, self._held = None, {}, {}
        if layer is None or not values:
            return
        self.run.needed_positions[layer] = {v.position for v in values.values() if v.needed}
        saved = {k for k, v in values.items() if v.needed}      # what this (eager) run keeps
        if self._needed is not None:         # a selective layer: backward reads what it reads without checkpointing
            learnt = self._needed.get(layer, set())
            for v in values.values():
                v.needed = v.position in learnt
        kept = partition_saved(values)
        self.run.compiled_layer_saved[layer] = sum(values[k].nbytes for k in kept if not values[k].free)
        allocs, surcharge = [], 0
        for k, v in values.items():
            if v.free or (k in saved) == (k in kept):
                continue
            alloc = held.get(k)
            if k in saved:                   # saved in eager, recomputed when compiled
                if alloc is not None and not alloc.discounted and self._live.get(alloc.key) is alloc:
                    alloc.discounted = True
                    allocs.append(alloc)
                    self._adjust -= alloc.nbytes
                    self.run.compiled_saved_delta -= alloc.nbytes
            else:                            # kept when compiled, not saved in eager: counted once eager frees it
                self.run.compiled_saved_delta += v.nbytes
                if alloc is not None and self._live.get(alloc.key) is alloc:
                    alloc.kept_for = layer
                    allocs.append(alloc)
                else:
                    surcharge += v.nbytes
        self._adjust += surcharge
        was = self._pending.get(layer, ([], 0))
        self._pending[layer] = (was[0] + allocs, was[1] + surcharge)

    def _compiled_peak(self) -> None:
        now = self._current + self._adjust
        if self.compiled and now > self.run.compiled_peak_bytes:
            self.run.compiled_peak_bytes = now
            split = dict(self._totals)
            split["activations"] = split.get("activations", 0) + self._adjust
            self.run.compiled_breakdown = {c: v for c, v in split.items() if v}

    # -------------------------------------------------------------- flops
    def _count_flops(self, func, args, out) -> bool:
        """Count a matrix product's or attention kernel's FLOPs; False for any other op."""
        flops = 0.0
        if func in _MATMULS:
            a, b = (args[0], args[1]) if func in _TWO_OPERANDS else (args[1], args[2])
            flops = 2.0 * math.prod(a.shape) * b.shape[-1]
            if self.layer is not None and self.phase != "update":      # a layer's linear projections
                r = self.run
                r.linear_flops[self.phase] = r.linear_flops.get(self.phase, 0.0) + flops
                r.linear_operands[self.phase] = r.linear_operands.get(self.phase, 0.0) + a.numel() + b.numel()
                r.linear_by_layer[self.layer] = r.linear_by_layer.get(self.layer, 0.0) + flops
            if self.phase == "forward" and self.layer is not None:
                n = self._mm_in_layer[self.layer] = self._mm_in_layer.get(self.layer, 0) + 1
                if n % 2 == 0:          # torchtitan's op-level selective AC recomputes these
                    self.run.every_other_mm_forward += flops
        elif func in _FLASH:
            q, k = args[1], args[2]
            if func is _aten._scaled_dot_product_flash_attention_for_cpu.default:
                q, k = args[0], args[1]
            causal = _flash_causal(func, args)
            b, h, sq, d = q.shape
            dense = 4.0 * b * h * sq * k.shape[2] * d * _FLASH[func]
            flops = dense * (0.5 if causal else 1.0)
            self.run.attention_flops[self.phase] = self.run.attention_flops.get(self.phase, 0.0) + flops
            self.run.attention_by_layer[self.layer] = self.run.attention_by_layer.get(self.layer, 0.0) + flops
            keys = self.run.attention_by_keys
            keys[k.shape[2]] = keys.get(k.shape[2], 0.0) + flops
            if self.phase == "forward":
                self.run.dense_attention_forward += dense
        else:
            return False
        self.run.flops[self.phase] = self.run.flops.get(self.phase, 0.0) + flops
        key = self.layer if self.phase != "update" else None
        self.run.flops_by_layer[key] = self.run.flops_by_layer.get(key, 0.0) + flops
        self._waited(flops, 0.0)
        return True

    def _waited(self, flops: float, traffic: float) -> None:
        """Inside serial work, the other devices' turns at the like: ``serial - 1`` times this op's."""
        if self.serial > 1 and self.phase != "update":
            n, r = self.serial - 1, self.run
            r.serial_flops[self.phase] = r.serial_flops.get(self.phase, 0.0) + n * flops
            r.serial_traffic[self.phase] = r.serial_traffic.get(self.phase, 0.0) + n * traffic
            f, t = r.serial_by_layer.get(self.layer, (0.0, 0.0))
            r.serial_by_layer[self.layer] = (f + n * flops, t + n * traffic)

    def _count_traffic(self, func, name: str, inputs, out) -> None:
        """Bytes an unfused kernel moves: its tensor inputs read, its new outputs written
        (views and allocations move nothing; an in-place op reads and writes its input). The optimizer's are costed from the state."""
        if self.phase == "update" or not _LAUNCHES[func]:      # (views and allocations move nothing)
            return
        outs = _tensors(out)
        moved = sum(t.numel() * t.element_size() for t in list(inputs) + outs)
        self.run.traffic[self.phase] = self.run.traffic.get(self.phase, 0.0) + moved
        self.run.traffic_by_layer[self.layer] = self.run.traffic_by_layer.get(self.layer, 0.0) + moved
        if self.phase == "forward" and self.layer is not None:
            self.run.layer_forward_traffic += moved
        if self.recomputing:
            self.run.recompute_traffic += moved
        self._waited(0.0, moved)


def _flash_causal(func, args) -> bool:
    if func is _aten._scaled_dot_product_flash_attention_for_cpu.default:
        return bool(args[4]) if len(args) > 4 else False
    return bool(args[7]) if len(args) > 7 else False
