"""The time model: compute from the dry-run's FLOPs, every collective by alpha-beta on the
links it crosses, overlap of weight traffic with compute (docs/planning.md, "Time model").

A cost model is any function ``(LayoutEstimate, Cluster) -> StepTime``; :func:`cost` is the
default one, and :func:`fit_cluster` fits a cluster's constants to measured step times."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from functional_pp.core.mesh import Mesh
from functional_pp.plan.cluster import Cluster
from functional_pp.plan.cluster import cluster as as_cluster
from functional_pp.plan.tracker import DeviceRun, TaggedEvent


@dataclass
class StepTime:
    """Seconds of one step on one device, and how they add up."""
    step_s: float
    compute_s: float
    exposed_comm_s: float       # collectives on the critical path + weight traffic not hidden
    hidden_comm_s: float        # weight traffic hidden under compute
    update_s: float             # optimizer: memory-bound pass over the state
    mfu: float
    by_collective: dict[str, float] = field(default_factory=dict)   # "tp all_gather (intra)" -> seconds
    per_layer: dict[str, float] = field(default_factory=dict)       # one repeated layer: compute, critical, weight
    placement: dict[str, str] = field(default_factory=dict)
    bubble_s: float = 0.0           # a pipeline's idle time (its schedule's timeline)
    p2p_s: float = 0.0              # a pipeline's stage-to-stage transfers (part of exposed_comm_s)
    host_s: float = 0.0             # the host's time launching an eager step's ops (:func:`host_seconds`)

    def row(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "hidden_comm_s": self.hidden_comm_s, "update_s": self.update_s, "mfu": self.mfu,
                "bubble_s": self.bubble_s, "p2p_s": self.p2p_s, "host_s": self.host_s,
                "by_collective": dict(self.by_collective), "per_layer": dict(self.per_layer),
                "placement": dict(self.placement)}


def event_seconds(e: TaggedEvent, mesh: Mesh, cl: Cluster, bytes_sent: int) -> tuple[float, str]:
    """Seconds of collective ``e`` sending ``bytes_sent`` (:func:`sent_bytes`) and its link's name."""
    link = cl.link(mesh, e.axes)
    return cl.collective_seconds(e.kind, bytes_sent, e.group_size, link), link[0]


#: the tensor-parallel mesh axis: its activation collectives are what async TP overlaps
TP = "tp"
_16BIT = ("bfloat16", "float16")


def sent_bytes(e: TaggedEvent, *, float8: bool = False, activation_sums: str | None = None,
               float8_all_gather: bool = False) -> int:
    """Bytes ``e`` sends in the run being costed: as the dry-run recorded them, except
    ``activation_sums="bfloat16"``: activation sums that the step widens to float32 (its
    ``reduce_dtype``; TP/SP reduce-scatters and all-reduces) sent in bf16, as torchtitan does;
    ``float8``: the layers' activation all-gathers in forward and in recomputation (the
    sequence-parallel gathers feeding the linear layers) sent in fp8, as torchtitan's Float8
    tensor parallelism casts before gathering (the backward's gradient gathers stay bf16);
    ``float8_all_gather``: the layers' FSDP gathers of their matrix weights (not the norms' 1-D
    ones; the embedding and the head are outside the layers) in fp8, in forward and backward
    (torchao's ``enable_fsdp_float8_all_gather``: each shard cast before the gather)."""
    n = e.bytes_sent
    if (float8_all_gather and e.kind == "all_gather" and e.weight_traffic and e.layer is not None
            and e.dtype in _16BIT and len(e.shape) >= 2):
        n //= 2
    if (activation_sums == "bfloat16" and e.widened and not e.weight_traffic
            and e.kind in ("all_reduce", "reduce_scatter")):
        n //= 2
    if (float8 and e.kind == "all_gather" and not e.weight_traffic and e.layer is not None and e.dtype in _16BIT
            and (e.phase == "forward" or e.recompute)):
        n //= 2
    return n


def async_tp_event(e: TaggedEvent) -> bool:
    """A tensor-parallel activation collective that async TP overlaps with its matmul
    (torchtitan's fused all-gather + matmul and matmul + reduce-scatter)."""
    return (not e.weight_traffic and e.axes == (TP,) and e.kind in ("all_gather", "reduce_scatter")
            and e.phase != "update")


#: bytes per element Float8's dynamic tensorwise scaling moves for each matmul operand: its
#: bf16 value read for the absolute maximum and again for the cast, the fp8 copy written
FLOAT8_CAST_BYTES = 2 + 2 + 1


def attention_slowdown(run: DeviceRun, cl: Cluster) -> float:
    """How much slower than ``attention_efficiency`` the run's attention kernels run: each
    call's FLOPs weighted by ``(keys / attention_length) ** attention_length_exponent`` for key
    lengths above ``attention_length`` (1 below it), ``keys`` the call's key length
    (docs/planning.md, "Attention at long sequences")."""
    total = sum(run.attention_by_keys.values())
    if not total or not cl.attention_length_exponent:
        return 1.0
    return sum(f * max(1.0, n / cl.attention_length) ** cl.attention_length_exponent
               for n, f in run.attention_by_keys.items()) / total


#: the data-parallel mesh axes: their gradient all-reduces are what a distributed optimizer splits
DATA_AXES = ("dp_replicate", "dp_shard")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def distributed_optimizer_events(e: TaggedEvent, sent: int, mesh: Mesh, param_dtype: str = "bfloat16") -> list:
    """What a distributed optimizer (Megatron's ``--use-distributed-optimizer``, ZeRO-1) sends
    in place of ``e``, a gradient all-reduce over data-parallel axes (``sent`` its ring bytes),
    as ``(event, bytes)`` pairs: the gradients reduce-scattered over the data-parallel axes in
    their dtype in backward, and the updated shards all-gathered in ``param_dtype`` before the
    next forward (``--overlap-param-gather``: weight traffic of the forward); a gradient
    all-reduced over other axes too (a sequence-parallel norm's over ``tp``) is first summed
    over those once per step after backward, outside the buckets (Megatron's
    ``finalize_model_grads``: on the critical path, with the update). Other events: unchanged."""
    if not (e.weight_traffic and e.kind == "all_reduce" and e.phase == "backward"
            and any(a in DATA_AXES for a in e.axes)):
        return [(e, sent)]
    g = e.group_size
    full = sent * g / (2 * (g - 1)) if g > 1 else 0.0          # the buffer's bytes
    dp_axes = tuple(a for a in e.axes if a in DATA_AXES)
    other = tuple(a for a in e.axes if a not in DATA_AXES)
    dp = math.prod(mesh.shape[a] for a in dp_axes)
    rs = int(full * (dp - 1) / dp)
    ag = rs * _ITEMSIZE[param_dtype] // _ITEMSIZE.get(e.dtype, 4)
    out = [(replace(e, kind="reduce_scatter", axes=dp_axes, group_size=dp), rs),
           (replace(e, kind="all_gather", phase="forward", axes=dp_axes, group_size=dp), ag)]
    if other:
        n = g // dp
        out.append((replace(e, axes=other, group_size=n, weight_traffic=False, phase="update"),
                    int(full * 2 * (n - 1) / n)))
    return out


def run_components(run: DeviceRun, mesh: Mesh, cl: Cluster, layer: int | None = "all", *,
                   compiled: bool = False, selective_ac: str | None = None, float8: bool = False,
                   activation_sums: str | None = None, distributed_optimizer: bool = False,
                   fused_recompute: bool = False, float8_all_gather: bool = False) -> dict[str, float]:
    """Additive seconds of one run (so they extrapolate over layers): compute per phase
    (matrix products, attention, the other kernels' memory traffic) and communication per
    phase, split into critical-path and weight traffic, per collective. Work the devices of a mesh axis
    take turns at (a chain of blocks along a sequence split over cp, ``DeviceRun.serial_flops``) counts
    once per device: this device waits while the others do theirs. ``float8``: the
    layers' linear matmuls at the FP8 rate plus their operands' casts (torchtitan's Float8
    with dynamic tensorwise scaling; attention and the head stay bf16) and their activation
    all-gathers in fp8; ``activation_sums``, ``float8_all_gather``: see :func:`sent_bytes`; ``distributed_optimizer``:
    the data-parallel gradient all-reduces as :func:`distributed_optimizer_events`;
    ``fused_recompute``: what checkpointed regions recompute besides matmuls and attention moves
    no memory of its own (fused into the backward kernels that read it, as XLA does). ``async
    {phase}``: the part of the critical path async TP can overlap (:func:`async_tp_event`)."""
    if activation_sums not in (None, "float32", "bfloat16"):
        raise ValueError(f"cost: activation_sums={activation_sums!r}; use None or 'float32' (as the step sends them) "
                         f"or 'bfloat16' (torchtitan's TP/SP sums)")
    mm_rate = cl.peak_flops * cl.compute_efficiency
    attn_rate = cl.peak_flops * cl.attention_efficiency / attention_slowdown(run, cl)
    byte_rate = cl.memory_bandwidth * cl.memory_efficiency / (cl.compiled_traffic if compiled else 1.0)
    if float8 and not cl.peak_fp8_flops:
        raise ValueError(f"cost(float8=True): cluster {cl.name!r} has no FP8 matmuls (peak_fp8_flops is None); "
                         f"use a cluster with FP8 (h100x8, h200x8, l40sx4) or Cluster(..., peak_fp8_flops=...)")
    fp8_rate = cl.peak_fp8_flops * cl.float8_efficiency if float8 else mm_rate
    out: dict[str, float] = {}

    def add(k, v):
        out[k] = out.get(k, 0.0) + v

    def fp8_part(linear: float) -> float:      # seconds saved by running ``linear`` FLOPs in fp8
        return linear / mm_rate - linear / fp8_rate if float8 else 0.0
    if layer == "all":
        for phase, f in run.flops.items():
            attn = run.attention_flops.get(phase, 0.0)
            cast = FLOAT8_CAST_BYTES * run.linear_operands.get(phase, 0.0) if float8 else 0.0
            fused = run.recompute_traffic if fused_recompute and phase == "backward" else 0.0
            add(f"compute {phase}", (f - attn) / mm_rate + attn / attn_rate - fp8_part(run.linear_flops.get(phase, 0.0))
                + (run.traffic.get(phase, 0.0) - fused + cast) / byte_rate
                + run.serial_flops.get(phase, 0.0) / mm_rate + run.serial_traffic.get(phase, 0.0) / byte_rate)
        if selective_ac == "op":     # torchtitan's: recompute every second matmul and the unsaved kernels
            add("compute backward", run.every_other_mm_forward / (fp8_rate if float8 else mm_rate)
                + run.layer_forward_traffic / byte_rate)
        elif selective_ac is not None:
            raise ValueError(f"cost: selective_ac={selective_ac!r}; use 'op' (torchtitan's op-level policy) or "
                             f"None (for full recomputation estimate with remat=True)")
        add("model flops", run.flops.get("forward", 0.0) - run.attention_flops.get("forward", 0.0)
            + run.dense_attention_forward)
    else:
        attn = run.attention_by_layer.get(layer, 0.0)
        serial = run.serial_by_layer.get(layer, (0.0, 0.0))
        add("compute", (run.flops_by_layer.get(layer, 0.0) - attn) / mm_rate + attn / attn_rate
            - fp8_part(run.linear_by_layer.get(layer, 0.0)) + run.traffic_by_layer.get(layer, 0.0) / byte_rate
            + serial[0] / mm_rate + serial[1] / byte_rate)
    grouped: set = set()
    parts = []
    for e in run.events:
        sent = sent_bytes(e, float8=float8, activation_sums=activation_sums, float8_all_gather=float8_all_gather)
        parts += distributed_optimizer_events(e, sent, mesh) if distributed_optimizer else [(e, sent)]
    for e, sent in parts:
        if layer != "all" and (e.layer != layer or e.phase == "update"):
            continue
        s, where = event_seconds(e, mesh, cl, sent)
        if e.weight_traffic and e.layer is not None:     # the step's FSDP units: one flat collective per layer
            key = (e.kind, e.axes, e.phase, e.layer)
            if key in grouped:
                s -= cl.collective_parts(e.kind, sent, e.group_size, cl.link(mesh, e.axes))[0]
            grouped.add(key)
        kind = "weight" if e.weight_traffic else "critical"
        add(f"{kind} {e.phase}" if layer == "all" else kind, s)
        if e.weight_traffic and where == "inter" and layer == "all":
            add(f"weight inter {e.phase}", s)
        if e.weight_traffic and e.kind == "all_gather" and layer == "all":
            add(f"gather {e.phase}", s)
        if layer == "all" and async_tp_event(e):
            add(f"async {e.phase}", s)
        label = f"{'+'.join(e.axes)} {e.kind} ({where})"
        add(label, s)
        if layer == "all" and e.phase == "update":         # once per step, also in a pipeline
            add(f"update: {label}", s)
        elif e.weight_traffic and layer == "all":          # a pipeline may issue these once per step
            add(f"{'gathered ' + e.phase if e.kind == 'all_gather' else 'weight'}: {label}", s)
    return out


def hidable(cl: Cluster, weight: float, inter: float) -> float:
    """Seconds of ``weight`` traffic (``inter`` of them across nodes) that can hide under compute:
    ``overlap`` of the traffic inside nodes, ``inter_overlap`` of the traffic across nodes
    (``overlap`` when not set)."""
    across = cl.overlap if cl.inter_overlap is None else cl.inter_overlap
    return cl.overlap * (weight - inter) + across * inter


def cost(est, cl: "Cluster | str", *, compiled: bool = False, selective_ac: str | None = None,
         float8: bool = False, activation_sums: str | None = None, async_tp: bool = False,
         tp_comm_overlap: bool = False, distributed_optimizer: bool = False,
         fused_recompute: bool = False, float8_all_gather: bool = False) -> "StepTime":
    """Step time, MFU and breakdown of ``est`` (a LayoutEstimate) on cluster ``cl``:
    compute = matmul FLOPs / (peak x compute efficiency) + attention FLOPs / (peak x
    attention efficiency) + the other kernels' bytes / (memory bandwidth x memory
    efficiency), those bytes scaled by ``compiled_traffic`` when ``compiled``;
    ``selective_ac="op"`` adds torchtitan's op-level recomputation to a dry-run without remat
    (an estimate with ``remat=True`` or ``"selective"`` counts its own recomputation in
    backward); ``float8`` runs the
    layers' linear matmuls at ``peak_fp8_flops x float8_efficiency`` and adds their
    operands' casts to the memory traffic (attention and the head stay bf16) and sends the
    layers' activation all-gathers in fp8; ``float8_all_gather`` (with ``float8``) also the
    layers' FSDP weight all-gathers (torchao's Float8 FSDP all-gather); ``activation_sums="bfloat16"`` sends the TP/SP
    activation sums in bf16 rather than the step's float32 (torchtitan's);
    ``async_tp`` hides a fraction ``async_tp_overlap`` of the tensor-parallel activation
    all-gathers and reduce-scatters under the compute of their phase (torchtitan's async TP);
    ``tp_comm_overlap`` (Megatron's ``--tp-comm-overlap``: Transformer Engine splits each of
    them into ``tp`` chunks and pipelines the chunks' transfers under the chunked matmul) hides
    all but one chunk of each, (tp - 1) / tp of them, within their phase's compute;
    ``distributed_optimizer`` (Megatron's, ZeRO-1) reduce-scatters the data-parallel gradients
    in backward, all-gathers the updated parameters in the compute dtype before the next
    forward (weight traffic of the forward) and updates each rank's shard of the state
    (:func:`distributed_optimizer_events`); ``fused_recompute`` charges no memory traffic for
    what checkpointed regions recompute besides matmuls and attention (XLA fuses it into the
    backward kernels that read it; MaxText's remat policies).
    A fraction ``overlap``
    of the weight traffic (FSDP gathers, gradient reductions) hides under the compute of its
    phase, the rest and the other collectives (TP/SP/CP activations, loss sums) add to it;
    the update is a memory-bound pass over the state. A pipeline (``est.pipeline``) repeats
    one micro-batch's time over its micro-batches, adds the stage-to-stage transfers on the
    link ``pp`` crosses, and stretches the whole by its timeline's makespan over one device's
    work (the bubble). An eager step takes at least the host's time launching its ops
    (:func:`host_seconds`). MFU is torchtitan's: 6 x parameters
    (embedding excluded) + 12 x layers x heads x head_dim x seq per token (causal attention
    counted as full), over step time x peak."""
    cl = as_cluster(cl)
    if float8_all_gather and not float8:
        raise ValueError("cost: float8_all_gather=True sends the Float8 linear layers' weights in fp8; it needs "
                         "float8=True")
    if selective_ac is not None and est.settings.get("remat"):
        raise ValueError(f"cost: selective_ac={selective_ac!r} models recomputation on a dry-run without it, but "
                         f"this estimate ran remat={est.settings['remat']!r}, whose recomputation its backward "
                         f"already counts; drop selective_ac")
    comps = [run_components(r, est.mesh, cl, compiled=compiled, selective_ac=selective_ac, float8=float8,
                            activation_sums=activation_sums, distributed_optimizer=distributed_optimizer,
                            fused_recompute=fused_recompute, float8_all_gather=float8_all_gather)
             for r in est.runs]
    keys = set().union(*comps)
    total = {k: est.extrapolate_values([c.get(k, 0.0) for c in comps]) for k in keys}
    compute = sum(v for k, v in total.items() if k.startswith("compute "))
    if async_tp and tp_comm_overlap:
        raise ValueError("cost: async_tp (torchtitan's) and tp_comm_overlap (Megatron's) are two ways of overlapping "
                         "the same tensor-parallel collectives; pass one")
    tp_size = est.mesh.shape.get(TP, 1)
    fraction = (cl.async_tp_overlap if async_tp else (tp_size - 1) / tp_size if tp_comm_overlap else 0.0)
    exposed = hidden = tp_hidden = 0.0
    for phase in ("forward", "backward"):
        w = total.get(f"weight {phase}", 0.0)
        c = total.get(f"compute {phase}", 0.0)
        hide = min(hidable(cl, w, total.get(f"weight inter {phase}", 0.0)), c)
        # async TP: a fraction of the TP activation collectives runs under the matmuls they feed
        tp = min(fraction * total.get(f"async {phase}", 0.0), c - hide)
        exposed += total.get(f"critical {phase}", 0.0) - tp + w - hide
        hidden += hide + tp
        tp_hidden += tp
    once = total.get("critical update", 0.0) + total.get("weight update", 0.0)
    by_coll = {k: v for k, v in total.items() if "(" in k and ": " not in k}
    model_flops = total.get("model flops", 0.0)
    bubble = p2p = 0.0
    pipe = est.pipeline
    if pipe is not None:        # the runs are one micro-batch of one stage: the schedule repeats them
        m = pipe.micro
        link = cl.link(est.mesh, ("pp",))
        p2p = pipe.sends * cl.collective_seconds("permute", pipe.boundary_bytes, 2, link)
        if pipe.fsdp_gather == "step":      # weight traffic once per step (gathered in the master dtype, no re-gather)
            scale = pipe.gather_scale
            weight = (scale * total.get("gather forward", 0.0) + total.get("weight forward", 0.0)
                      - total.get("gather forward", 0.0) + total.get("weight backward", 0.0)
                      - total.get("gather backward", 0.0))
            inter = sum(total.get(f"weight inter {ph}", 0.0) for ph in ("forward", "backward"))
            hide = min(hidable(cl, weight, inter), m * compute)
            # the TP overlap's budget is the micro-batch's compute left once the step's weight
            # traffic, spread over the m micro-batches, has hidden under it (not the per-micro-batch
            # charge of that traffic, which the loop above assumed)
            tp_hidden = min(fraction * sum(total.get(f"async {ph}", 0.0) for ph in ("forward", "backward")),
                            compute - hide / m)
            critical = sum(total.get(f"critical {ph}", 0.0) for ph in ("forward", "backward")) - tp_hidden
            once_w, hidden = weight - hide, hide / m + tp_hidden
            exposed = critical + once_w / m
        busy = m * (compute + exposed) + p2p
        bubble = busy * (pipe.slots_per_busy - 1.0)
        compute, exposed, hidden, model_flops = m * compute, m * exposed + p2p, m * hidden, m * model_flops
        by_coll = {k: m * v - (m - 1) * total.get(f"update: {k}", 0.0) for k, v in by_coll.items()}
        if pipe.fsdp_gather == "step":      # once per step: gathers in the master dtype, none in backward
            for k in by_coll:
                w = (total.get(f"weight: {k}", 0.0), total.get(f"gathered forward: {k}", 0.0),
                     total.get(f"gathered backward: {k}", 0.0))
                by_coll[k] -= m * sum(w) - w[0] - pipe.gather_scale * w[1]
        by_coll[f"pp permute ({link[0]})"] = p2p
    exposed += once
    update = 3 * est.state_bytes / cl.memory_bandwidth        # read state and gradients, write state
    if distributed_optimizer:       # each rank updates its shard: split over the axes its gradients were all-reduced on
        reduced = {a for r in est.runs for e in r.events for a in e.axes
                   if a in DATA_AXES and len(distributed_optimizer_events(e, 0, est.mesh)) > 1}
        update /= math.prod(est.mesh.shape[a] for a in reduced)
    offloaded, update = host_copies(est, cl, update)
    if offloaded:
        exposed += offloaded
        by_coll["host copies (offload)"] = offloaded
    host = host_seconds(est, cl, compiled, pipe.micro if pipe is not None else 1)
    step = max(compute + exposed + bubble + update, host)
    mfu = 3 * model_flops / (step * cl.peak_flops) if step > 0 else 0.0
    per_layer = {}
    if est.layers > 1:
        last = est.runs[-1]
        layer = max((e for e in last.flops_by_layer if e is not None), default=None)
        if layer is not None:
            per_layer = run_components(last, est.mesh, cl, layer, compiled=compiled, float8=float8,
                                       activation_sums=activation_sums, distributed_optimizer=distributed_optimizer,
                                       float8_all_gather=float8_all_gather)
    return StepTime(step, compute, exposed, hidden, update, mfu, by_coll, per_layer, cl.placement(est.mesh), bubble,
                    p2p, host)


def host_seconds(est, cl: Cluster, compiled: bool = False, micro_batches: int = 1) -> float:
    """The host's seconds launching ``est``'s eager step: every op that runs a kernel
    (``DeviceRun.launches``) at ``cl.launch_seconds`` each, ``micro_batches`` times for a pipeline's
    runs (one micro-batch of a stage). The device runs them from its queue while the host launches
    the next, so the step takes the larger of the two (``cost``). A compiled step (few, fused
    launches, which the dry-run of eager ops does not count) is not charged: 0."""
    if compiled or not cl.launch_seconds:
        return 0.0
    return micro_batches * est.extrapolate(lambda r: sum(r.launches.values())) * cl.launch_seconds


def host_copies(est, cl: Cluster, update: float) -> tuple[float, float]:
    """(seconds of host copies on the critical path, the update's seconds) of ``est``'s
    offload levers (docs/memory.md): ``offload_params`` copies the fp32 shards to the device and
    the gradients back (in the compute precision) each step, and updates on the host;
    ``activation_offloading`` copies the saved activations out in forward on a side stream
    (hidden) and back in backward when needed (not prefetched: on the critical path)."""
    seconds = 0.0
    if est.settings.get("offload_params"):
        grad_bytes = est.param_bytes * (1 if est.settings.get("precision", "fp32") == "fp32" else 0.5)
        seconds += (est.param_bytes + grad_bytes) / cl.host_bandwidth
        update = 3 * est.state_bytes / cl.host_memory_bandwidth
    if est.settings.get("activation_offloading"):
        seconds += est.activation_bytes / cl.host_bandwidth
    return seconds, update


FITTED = ("compute_efficiency", "intra_bandwidth", "inter_bandwidth")


def fit_cluster(base: "Cluster | str", samples: list[tuple], fit: tuple[str, ...] = FITTED,
                rounds: int = 12) -> Cluster:
    """Fit ``base``'s numbers named in ``fit`` (any of Cluster's: ``compute_efficiency``,
    ``attention_efficiency``, ``memory_efficiency``, ``compiled_traffic``, ``overlap``,
    ``intra_bandwidth``, ``inter_bandwidth``, ``inter_overlap`` (from ``overlap`` when unset),
    ...) to measured step times. ``samples`` are
    ``(estimate, measured_seconds)`` or ``(estimate, measured_seconds, cost_options)`` with
    :func:`cost`'s keywords (``compiled``, ``selective_ac``, ``float8``, ``activation_sums``,
    ``async_tp``). Minimises the squared log ratio of :func:`cost`'s step time to the measured
    one, one number at a time (golden section in
    log space, ``rounds`` sweeps); fractions stay at most 1, and a number that no sample
    depends on keeps its value."""
    cl = as_cluster(base)
    samples = [(s[0], s[1], dict(s[2]) if len(s) > 2 else {}) for s in samples]
    if "inter_overlap" in fit and cl.inter_overlap is None:     # unset: starts from overlap
        cl = cl.with_(inter_overlap=cl.overlap)
    unknown = [k for k in fit if not isinstance(getattr(cl, k, None), (int, float))]
    if unknown:
        raise ValueError(f"fit_cluster: {unknown} are not numbers of a Cluster; fit some of "
                         f"{[k for k, v in vars(cl).items() if isinstance(v, float)]}")
    capped = {"compute_efficiency", "attention_efficiency", "memory_efficiency", "compiled_traffic", "overlap",
              "inter_overlap",
              "float8_efficiency", "async_tp_overlap"}

    def loss(c: Cluster) -> float:
        return sum(math.log(cost(e, c, **o).step_s / t) ** 2 for e, t, o in samples)
    for _ in range(rounds):
        for k in fit:
            v0 = getattr(cl, k)
            hi_cap = math.log(1.0) if k in capped else math.log(v0) + 3
            lo, hi = math.log(v0) - 3, min(math.log(v0) + 3, hi_cap)
            f = lambda x: loss(cl.with_(**{k: math.exp(x)}))   # noqa: E731
            a, b = lo, hi
            g = (math.sqrt(5) - 1) / 2
            x1, x2 = b - g * (b - a), a + g * (b - a)
            f1, f2 = f(x1), f(x2)
            for _ in range(40):
                if f1 < f2:
                    b, x2, f2 = x2, x1, f1
                    x1 = b - g * (b - a)
                    f1 = f(x1)
                else:
                    a, x1, f1 = x1, x2, f2
                    x2 = a + g * (b - a)
                    f2 = f(x2)
            best = (a + b) / 2
            if f(best) < loss(cl):
                cl = cl.with_(**{k: math.exp(best)})
    return cl.with_(name=f"{as_cluster(base).name} (fitted)")
