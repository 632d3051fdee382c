"""Published training runs the time model is calibrated on (docs/planning.md, "Calibration"):
each row is a setup (model, mesh, batch, sequence, activation checkpointing, compile) and its
measured tokens/s per GPU, with the source. :func:`predict` dry-runs the setup and costs it.

The dry-run runs this project's Llama on the row's mesh. What the published run did
differently is passed to :func:`functional_pp.plan.cost`: ``torch.compile`` (``compiled``)
and torchtitan's op-level selective activation checkpointing (``selective_ac="op"``), which
this project does not implement, Float8 linear layers (``float8``), asynchronous TP
(``async_tp``), and, for every row, its TP/SP activation sums in bf16
(``activation_sums="bfloat16"``: torchtitan reduces activations in their own dtype where this
project's step widens them to float32)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.models import llama
from functional_pp.plan.cluster import Cluster
from functional_pp.plan.dryrun import LayoutEstimate, estimate
from functional_pp.plan.timing import StepTime, cost

TORCHTITAN_2024 = ("torchtitan's llama3_h100_202412_torchtitan.md (its benchmarks folder) (torch 1963fc8, torchtitan 9dec370, "
                   "Dec 2024): Grand Teton hosts, 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W) per host on NVLink, "
                   "400 Gb/s RDMA per GPU")


@dataclass(frozen=True)
class Reference:
    """One published measurement and its setup."""
    name: str
    model: str                       # a llama.Config preset: "llama3_8b", "llama3_405b"
    mesh: tuple[tuple[str, int], ...]
    local_batch: int                 # sequences per data-parallel rank per step
    seq: int
    tokens_per_s_per_gpu: float
    source: str
    compiled: bool = False
    selective_ac: str | None = None  # torchtitan's "op" policy; full AC is remat=True
    remat: bool = False
    schedule: str | None = None      # pipeline schedule (pp > 1)
    micro_batches: int = 1
    virtual_stages: int = 1
    notes: str = ""
    options: tuple = field(default=())
    float8: bool = False             # torchtitan's Float8 linear layers (dynamic tensorwise scaling)
    async_tp: bool = False           # torchtitan's asynchronous TP (collectives fused with the matmuls)

    @property
    def devices(self) -> int:
        n = 1
        for _, s in self.mesh:
            n *= s
        return n

    def cost_options(self) -> dict:
        return {"compiled": self.compiled, "selective_ac": self.selective_ac, "float8": self.float8,
                "activation_sums": "bfloat16", "async_tp": self.async_tp}


def _table(name: str, tps: float, mesh, compiled: bool, table: str, float8: bool = False) -> Reference:
    return Reference(name, "llama3_8b", mesh, 2, 8192, tps, f"{TORCHTITAN_2024}, {table}", compiled=compiled,
                     selective_ac="op", float8=float8,
                     notes=f"FSDP, {'Float8' if float8 else 'bf16 (no Float8)'}, selective op-level AC")


#: the bf16 rows the presets are fitted to and the tests hold within 15%
LLAMA3_8B = (
    _table("8B FSDP 8, eager", 5762, (("dp_shard", 8),), False, "Table 1"),
    _table("8B FSDP 8, compiled", 6667, (("dp_shard", 8),), True, "Table 1"),
    _table("8B FSDP 128, eager", 5605, (("dp_shard", 128),), False, "Table 3"),
    _table("8B FSDP 128, compiled", 6514, (("dp_shard", 128),), True, "Table 3"),
)


def _405b(name: str, tps: float, schedule: str, virtual: int) -> Reference:
    return Reference(name, "llama3_405b", (("pp", 8), ("dp_shard", 8), ("tp", 8)), 32, 8192, tps,
                     f"{TORCHTITAN_2024}, Table 5", compiled=True, remat=True, schedule=schedule, micro_batches=8,
                     virtual_stages=virtual, float8=True, async_tp=True,
                     notes="compile + Float8 + async TP, full AC, "
                           "8 micro-batches (torchtitan's default: as many as stages), interleaved with 2 "
                           "stages per rank (its default); 128 layers here (126 do not split into 16 stages)")


#: torchtitan's 405B pipeline rows (their ratio is held within 15%)
LLAMA3_405B = (
    _405b("405B FSDP 8 x TP 8 x PP 8, 1F1B", 100, "1f1b", 1),
    _405b("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B", 128, "interleaved_1f1b", 2),
)

def _70b(name: str, tps: float, async_tp: bool) -> Reference:
    return Reference(name, "llama3_70b", (("dp_shard", 32), ("tp", 8)), 16, 8192, tps, f"{TORCHTITAN_2024}, Table 4",
                     compiled=True, remat=True, float8=True, async_tp=async_tp,
                     notes="compile + Float8, full AC" + (" + async TP" if async_tp else "")
                           + "; sequence length not stated in the table: 8192 assumed (the other tables')")


#: torchtitan's 70B rows on 256 H100 (FSDP 32 x TP 8): without and with async TP; the
#: presets' ``async_tp_overlap`` is fitted to their ratio
LLAMA3_70B = (
    _70b("70B FSDP 32 x TP 8", 829, False),
    _70b("70B FSDP 32 x TP 8, async TP", 876, True),
)

#: the Float8 rows (compiled): ``float8_efficiency`` of the presets is fitted to them
LLAMA3_8B_FLOAT8 = (
    _table("8B FSDP 8, compiled + Float8", 8532, (("dp_shard", 8),), True, "Table 1", float8=True),
    _table("8B FSDP 128, compiled + Float8", 8380, (("dp_shard", 128),), True, "Table 3", float8=True),
)

CONFIGS = {
    "llama3_8b": llama.Config.llama3_8b,
    "llama3_70b": llama.Config.llama3_70b,      # Llama 3.1 70B: 80 layers, hidden 8192, 64 heads, 8 kv heads
    # Llama 3.1 405B: 126 layers in the published model, 128 here so that 16 stages divide them
    "llama3_405b": lambda: llama.Config.llama3_70b(hidden=16384, layers=128, heads=128, mlp=53248),
}


def rules_for(ref: Reference) -> Rules:
    """FSDP over dp_shard, TP over tp with sequence parallelism, the layers over pp
    (torchtitan's layouts)."""
    axes = dict(ref.mesh)
    rules = llama.default_rules(fsdp=True, sequence_parallel=axes.get("tp", 1) > 1)
    return rules.replace(layers="pp") if axes.get("pp", 1) > 1 else rules


_cache: dict = {}


def reference_estimate(ref: Reference) -> LayoutEstimate:
    """The dry-run of ``ref``'s setup (cached: the rows share meshes)."""
    key = (ref.model, ref.mesh, ref.local_batch, ref.seq, ref.remat, ref.schedule, ref.virtual_stages)
    if key not in _cache:
        cfg = CONFIGS[ref.model]()
        mesh = Mesh(**dict(ref.mesh))
        dp = mesh.shape.get("dp_replicate", 1) * mesh.shape.get("dp_shard", 1)
        batch = {k: ((ref.local_batch * dp, ref.seq), "batch seq") for k in ("tokens", "labels")}
        _cache[key] = estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), mesh,
                               rules_for(ref), batch, precision="bf16", remat=ref.remat, timeline=False,
                               grad_accum=ref.micro_batches, schedule=ref.schedule or "1f1b",
                               virtual_stages=ref.virtual_stages)
    return _cache[key]


def predict(ref: Reference, cl: "Cluster | str") -> tuple[float, StepTime]:
    """Predicted tokens/s per GPU of ``ref`` on ``cl`` and the step time it comes from."""
    t = cost(reference_estimate(ref), cl, **ref.cost_options())
    axes = dict(ref.mesh)        # a data-parallel rank's batch is shared by its pp x cp x tp devices
    dp = axes.get("dp_replicate", 1) * axes.get("dp_shard", 1)
    return ref.local_batch * dp * ref.seq / ref.devices / t.step_s, t
