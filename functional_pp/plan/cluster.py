"""What the devices are and how they are wired: a :class:`Cluster`, presets for common GPU
nodes, and the placement of a mesh's axes on nodes (docs/planning.md, "Time model")."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from functional_pp.core.mesh import Mesh

#: ring steps of a collective over g devices (latency terms)
STEPS = {"all_reduce": lambda g: 2 * (g - 1), "all_gather": lambda g: g - 1, "reduce_scatter": lambda g: g - 1,
         "all_to_all": lambda g: g - 1, "permute": lambda g: 1}


#: measured on this project's CPU machine by benchmarks/host_dispatch.py (2026-12-07, torch 2.13, one
#: thread, load average about 7 on 2 cores): the host's CPU seconds per launched op of the eager
#: functional step (bf16, AdamW, donated state) with Llama-3.2-1B's structure and tiny tensors,
#: 18-21 us; CUDA's own launch call (a few us) is not in it, nor the GPU host's faster or slower CPU
LAUNCH_SECONDS = 20e-6


@dataclass(frozen=True)
class Cluster:
    """Per-device numbers of a cluster of identical nodes (docs/planning.md, "Calibration").

    Bandwidths are bytes/s one device can send (NVLink inside a node, its NIC across
    nodes); latencies are seconds per ring step, so a collective's achieved bus bandwidth
    grows with its message size; ``efficiency`` scales the bandwidth per collective kind
    (e.g. ``{"all_to_all": 0.6}``). ``compute_efficiency``: the fraction of ``peak_flops``
    matrix products reach; ``attention_efficiency``: the same for flash attention
    up to ``attention_length`` keys per query, beyond which it falls as
    ``(attention_length / keys) ** attention_length_exponent`` (fitted to long-sequence runs);
    ``memory_efficiency``: the fraction of ``memory_bandwidth`` the other (unfused) kernels
    reach; ``compiled_traffic``: the fraction of their memory traffic left once
    ``torch.compile`` fuses them; ``overlap``: the fraction of weight traffic (FSDP gathers,
    gradient reductions) that can hide under compute; ``inter_overlap``: the same for the part of
    it that crosses nodes (None: ``overlap``). ``peak_fp8_flops``: the dense FP8 peak
    (None: the device has no FP8 matmuls); ``float8_efficiency``: the fraction of it Float8
    matmuls reach (``cost(..., float8=True)``). ``async_tp_overlap``: the fraction of the
    tensor-parallel activation collectives asynchronous TP hides under compute
    (``cost(..., async_tp=True)``). ``host_bandwidth``: bytes/s one device copies to or from
    pinned host memory; ``host_memory_bandwidth``: what an update on the host reaches per device
    (offload_params, activation_offloading; docs/memory.md). ``launch_seconds``: the host's
    seconds per op an eager step launches (the step takes at least its launches' host time)."""
    name: str
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    peak_flops: float = 989e12
    memory_bytes: float = 80e9
    memory_bandwidth: float = 3.35e12
    compute_efficiency: float = 0.6
    attention_efficiency: float = 0.35
    attention_length: int = 8192             # key length up to which attention reaches attention_efficiency
    attention_length_exponent: float = 0.0   # beyond it, efficiency x (attention_length / keys) ** exponent
    memory_efficiency: float = 0.8
    compiled_traffic: float = 1.0
    overlap: float = 1.0
    inter_overlap: float | None = None   # the fraction of cross-node weight traffic that hides (None: overlap)
    peak_fp8_flops: float | None = None
    float8_efficiency: float = 0.56
    async_tp_overlap: float = 0.0
    host_bandwidth: float = 25e9        # bytes/s between one device and pinned host memory, each way (PCIe)
    host_memory_bandwidth: float = 50e9  # bytes/s of host memory one device's offloaded update reaches
    launch_seconds: float = LAUNCH_SECONDS   # host seconds per op an eager step launches (0: not charged)
    efficiency: dict = field(default_factory=dict, hash=False, compare=False)
    about: str = field(default="", hash=False, compare=False)     # what the preset is, in words

    def with_(self, **kw) -> "Cluster":
        """A copy with some numbers changed."""
        return replace(self, **kw)

    def link(self, mesh: Mesh, axes: tuple[str, ...], rank: int = 0) -> tuple[str, float, float]:
        """(``"intra"``/``"inter"``, bandwidth, latency) of a collective over ``axes``: inside a
        node when every member of ``rank``'s group is on the node of ``rank`` (ranks fill nodes
        in mesh order, last axis fastest)."""
        group = mesh.group(rank, axes)
        nodes = {r // self.devices_per_node for r in group}
        if len(nodes) == 1:
            return "intra", self.intra_bandwidth, self.intra_latency
        return "inter", self.inter_bandwidth, self.inter_latency

    def collective_seconds(self, kind: str, bytes_sent: int, group_size: int, link: tuple[str, float, float]) -> float:
        """Alpha-beta time of one collective: latency x steps + bytes / bandwidth
        (:meth:`collective_parts`)."""
        return sum(self.collective_parts(kind, bytes_sent, group_size, link))

    def collective_parts(self, kind: str, bytes_sent: int, group_size: int,
                         link: tuple[str, float, float]) -> tuple[float, float]:
        """(latency, transfer) seconds of one collective sending ``bytes_sent`` (the ring's
        bytes) by the faster of NCCL's algorithms: the ring (latency x ring steps + bytes /
        bandwidth) and, for an all-reduce, the tree (2 ceil(log2 g) steps, each rank sending
        the whole buffer twice: g / (g - 1) x the ring's bytes), which NCCL picks for small
        all-reduces over many ranks."""
        if group_size <= 1:
            return 0.0, 0.0
        _, bw, lat = link
        bw = bw * self.efficiency.get(kind, 1.0)
        ring = (STEPS[kind](group_size) * lat, bytes_sent / bw)
        if kind != "all_reduce":
            return ring
        tree = (2 * math.ceil(math.log2(group_size)) * lat, bytes_sent * group_size / (group_size - 1) / bw)
        return min(ring, tree, key=sum)

    def bus_bandwidth(self, kind: str, message_bytes: float, group_size: int, where: str = "intra") -> float:
        """nccl-tests' bus bandwidth of one collective whose full message (all-reduce: the
        buffer; all-gather: the gathered result) is ``message_bytes``: algorithm bandwidth
        (message / time) x the ring factor (2(g-1)/g all-reduce, (g-1)/g the others), so that
        large messages approach the link's bandwidth and small ones pay the latency."""
        bw, lat = ((self.intra_bandwidth, self.intra_latency) if where == "intra"
                   else (self.inter_bandwidth, self.inter_latency))
        factor = (2 if kind == "all_reduce" else 1) * (group_size - 1) / group_size
        seconds = self.collective_seconds(kind, factor * message_bytes, group_size, (where, bw, lat))
        return message_bytes / seconds * factor

    def placement(self, mesh: Mesh) -> dict[str, str]:
        """Which mesh axes stay inside a node (``"intra"``) and which cross nodes."""
        return {a: self.link(mesh, (a,))[0] for a in mesh.axis_names if mesh.shape[a] > 1}


#: fitted by plan.fit_cluster to torchtitan's Llama 3.1 8B Float8 rows (plan/references.py): the
#: fraction of the FP8 dense peak (1979 TFLOP/s on H100) its Float8 matmuls reach
FLOAT8_FIT = 0.57

#: fitted to torchtitan's Llama 3.1 70B rows (FSDP 32 x TP 8, 829 and 876 tokens/s/GPU without and
#: with async TP, plan/references.py): the fraction of the TP activation collectives that
#: asynchronous TP hides under compute (the ratio gives 0.357)
ASYNC_TP_FIT = 0.36

#: fitted by plan.fit_cluster to torchtitan's Llama 3.1 8B long-sequence rows (Table 2: FSDP 8 at
#: 32k, FSDP 2 x CP 4 at 131k; plan/references.py): attention past 8192 keys per query reaches
#: attention_efficiency x (8192 / keys) ** 0.21 (0.26 of peak at 32k, 0.19 at 262k)
ATTENTION_LENGTH_FIT = 0.21

#: fitted by plan.fit_cluster to torchtitan's Llama 3.1 8B bf16 rows (plan/references.py):
#: matmuls 0.56 of peak, compile leaves 0.60 of the unfused kernels' memory traffic, 0.94 of
#: the weight traffic overlaps compute; fixed: flash attention 0.35 of peak (FlashAttention-3
#: paper: FlashAttention-2 reaches 35% on H100), unfused kernels 0.8 of memory bandwidth, the
#: NIC at 90% of its line rate (docs/planning.md, "Calibration")
H100_FIT = dict(compute_efficiency=0.56, attention_efficiency=0.35, memory_efficiency=0.8, compiled_traffic=0.59,
                overlap=0.94, peak_fp8_flops=1979e12, float8_efficiency=FLOAT8_FIT, async_tp_overlap=ASYNC_TP_FIT,
                attention_length=8192, attention_length_exponent=ATTENTION_LENGTH_FIT)

#: fitted by plan.fit_cluster to Megatron-LM's GPT 1.7B row (48 H100 SXM at 700 W, data parallel
#: only, so the rate is the compute's; plan/references.py): the fraction of the bf16 peak its
#: matmuls reach. Against the Grand Teton fit's 0.56 it carries the 700 W clocks (torchtitan's
#: hosts ran at 500 W) and Transformer Engine's kernels; the 7.1B-32B rows are held out
MEGATRON_FIT = 0.68

#: fitted by plan.fit_cluster to MaxText's Llama 2 7B rows on 2 and 16 A3 VMs (plan/references.py; the
#: 1-, 4- and 8-VM rows are held out): the fraction of the cross-VM gradient all-reduce that hides
#: under compute over GPUDirect-TCPX, whose received packets land in GPU bounce buffers that
#: NCCL's unpack kernels (src/device/network/unpack/) copy out on the GPU, beside the compute
TCPX_OVERLAP_FIT = 0.28

PRESETS = {
    # Grand Teton (torchtitan's published runs): H100 96 GB HBM2e 2.4 TB/s at 500 W, NVLink 4,
    # 400 Gb/s RDMA per GPU
    "h100x8-gt": Cluster("h100x8-gt", 8, 450e9, 45e9, peak_flops=989e12, memory_bytes=96e9, memory_bandwidth=2.4e12,
                         **H100_FIT, about="Grand Teton nodes as torchtitan published their runs on: 8 x H100 "
                         "96 GB HBM2e (2.4 TB/s) at 500 W, NVLink 4, a 400 Gb/s NIC per GPU; the calibration preset "
                         "(the time model is fitted to these runs)"),
    # H100 SXM 80 GB at 700 W: the Grand Teton fit (conservative: lower clocks at 500 W), NVLink 4
    # (450 GB/s per direction), one 400 Gb/s NIC per GPU, bf16 dense peak
    "h100x8": Cluster("h100x8", 8, 450e9, 45e9, peak_flops=989e12, memory_bytes=80e9, memory_bandwidth=3.35e12,
                      **H100_FIT, about="8 x H100 SXM 80 GB (3.35 TB/s) per node, NVLink 4, a 400 Gb/s NIC per "
                      "GPU; the Grand Teton fit (likely conservative at 700 W)"),
    # H100 SXM 80 GB at 700 W running Megatron-LM with Transformer Engine: the h100x8 numbers with
    # the matmul efficiency of Megatron's published runs
    "h100x8-te": Cluster("h100x8-te", 8, 450e9, 45e9, peak_flops=989e12, memory_bytes=80e9, memory_bandwidth=3.35e12,
                         **{**H100_FIT, "compute_efficiency": MEGATRON_FIT},
                         about="8 x H100 SXM 80 GB at 700 W as Megatron-LM published its runs on (Transformer "
                         "Engine kernels): h100x8 with matmuls at 0.69 of peak, fitted to Megatron's GPT 1.7B row "
                         "(h100x8's 0.56 was fitted to torchtitan's 500 W hosts); for plans of Megatron-like "
                         "kernels"),
    # Google Cloud A3 (a3-highgpu-8g): 8 x H100 SXM 80 GB at 700 W, NVLink 4, GPUDirect-TCPX over 4 x
    # 200 Gb/s NICs per 8 GPUs (100 Gb/s per GPU); the h100x8-te efficiencies (cuBLAS matmuls and
    # cuDNN flash attention at 700 W, fused elementwise kernels)
    "a3x8": Cluster("a3x8", 8, 450e9, 11.25e9, peak_flops=989e12, memory_bytes=80e9, memory_bandwidth=3.35e12,
                    **{**H100_FIT, "compute_efficiency": MEGATRON_FIT, "inter_overlap": TCPX_OVERLAP_FIT},
                    about="Google Cloud A3 VMs (a3-highgpu-8g) as MaxText published its H100 rows on: 8 x H100 SXM "
                    "80 GB at 700 W, NVLink 4, GPUDirect-TCPX with 4 x 200 Gb/s NICs per VM (100 Gb/s per GPU); "
                    "h100x8-te's efficiencies, 0.26 of the cross-VM traffic hidden under compute (fitted to "
                    "MaxText's 2- and 16-VM rows)"),
    "h200x8": Cluster("h200x8", 8, 450e9, 45e9, peak_flops=989e12, memory_bytes=141e9, memory_bandwidth=4.8e12,
                      **H100_FIT, about="8 x H200 141 GB (4.8 TB/s) per node, NVLink 4, a 400 Gb/s NIC per GPU; the "
                      "H100 fit with the H200's memory (one H200 run measured 8-11% below it)"),
    # not fitted: NVLink 3 (300 GB/s per direction), one 200 Gb/s NIC per GPU; FlashAttention-2
    # reaches 50-73% of peak on A100 (its paper)
    "a100x8": Cluster("a100x8", 8, 300e9, 22.5e9, peak_flops=312e12, memory_bytes=80e9, memory_bandwidth=2.0e12,
                      attention_efficiency=0.5, about="8 x A100 80 GB (2.0 TB/s) per node, NVLink 3, a 200 Gb/s "
                      "NIC per GPU; not fitted to measured runs"),
    # not fitted: PCIe nodes without NVLink: 4 GPUs, 64 GB/s PCIe 5, 100 Gb/s Ethernet
    "l40sx4": Cluster("l40sx4", 4, 25e9, 12.5e9, intra_latency=10e-6, inter_latency=30e-6, peak_flops=362e12,
                      memory_bytes=48e9, memory_bandwidth=0.864e12, peak_fp8_flops=733e12,
                      about="4 x L40S 48 GB per node on PCIe 5 (no NVLink), 100 Gb/s Ethernet; not fitted to "
                      "measured runs"),
}


def describe_presets() -> str:
    """One paragraph per preset: what it is, its memory, peak and links (``--cluster help``)."""
    lines = []
    for name, c in PRESETS.items():
        lines.append(f"{name}: {c.about}.\n    {c.devices_per_node} devices per node, "
                     f"{c.memory_bytes / 2 ** 30:.1f} GiB "
                     f"({c.memory_bytes / 1e9:.0f} GB) each, {c.peak_flops / 1e12:.0f} TFLOP/s bf16 peak, links "
                     f"{c.intra_bandwidth / 1e9:.0f} GB/s inside a node and {c.inter_bandwidth / 1e9:.1f} GB/s "
                     f"across nodes per device")
    return "\n".join(lines)


def cluster(name_or_cluster: "str | Cluster") -> Cluster:
    """A preset by name (``h100x8-gt``, ``h100x8``, ``h100x8-te``, ``a3x8``, ``h200x8``, ``a100x8``,
    ``l40sx4``) or the cluster itself."""
    if isinstance(name_or_cluster, Cluster):
        return name_or_cluster
    if name_or_cluster not in PRESETS:
        raise ValueError(f"unknown cluster {name_or_cluster!r}; choose one of {sorted(PRESETS)} or build "
                         f"functional_pp.plan.Cluster(...)")
    return PRESETS[name_or_cluster]
