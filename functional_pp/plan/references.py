"""Published training runs the time model is calibrated on (docs/planning.md, "Calibration"):
each row is a setup (model, mesh, batch, sequence, activation checkpointing, compile) and its
measured tokens/s per GPU, with the source. :func:`predict` dry-runs the setup and costs it.

The dry-run runs this project's Llama on the row's mesh. What the published run did
differently is passed to :func:`functional_pp.plan.cost`: ``torch.compile`` (``compiled``)
and torchtitan's op-level selective activation checkpointing (``selective_ac="op"``; the rows'
memory is dry-run with the same policy, ``remat="selective_alternate"``), Float8 linear layers (``float8``), asynchronous TP
(``async_tp``), and, for every row, its TP/SP activation sums in bf16
(``activation_sums="bfloat16"``: torchtitan reduces activations in their own dtype where this
project's step widens them to float32).

Each row is ``fitted`` (the presets' fitted numbers were chosen on it: :data:`FITTED`) or
``held_out`` (never seen by a fit: :data:`HELD_OUT`), and carries the tolerance its
prediction is held to (5%, or the one achieved and why) and, where published, the peak
memory the run reserved."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace

import torch

from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.models import llama
from functional_pp.ops.loss import logits_as_torch_cross_entropy, logits_widened_whole
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
    model: "str | llama.Config"      # a key of CONFIGS ("llama3_8b", "gpt_1.7B") or the Config itself
    mesh: tuple[tuple[str, int], ...]
    local_batch: int                 # sequences per data-parallel rank per step
    seq: int
    tokens_per_s_per_gpu: float
    source: str
    compiled: bool = False
    selective_ac: str | None = None  # torchtitan's "op" policy; full AC is remat=True
    remat: bool | str = False      # True: full AC; "selective": every matmul's result kept;
    #                                "selective_alternate": every second one recomputed (torchtitan's op policy)
    schedule: str | None = None      # pipeline schedule (pp > 1)
    micro_batches: int = 1
    virtual_stages: int = 1
    notes: str = ""
    options: tuple = field(default=())
    float8: bool = False             # torchtitan's Float8 linear layers (dynamic tensorwise scaling)
    float8_all_gather: bool = False  # and their weights' FSDP all-gathers in fp8 (enable_fsdp_float8_all_gather)
    async_tp: bool = False           # torchtitan's asynchronous TP (collectives fused with the matmuls)
    tp_comm_overlap: bool = False    # Megatron's --tp-comm-overlap (Transformer Engine's chunked overlap)
    distributed_optimizer: bool = False   # Megatron's distributed optimizer (ZeRO-1)
    fused_recompute: bool = False    # XLA fuses the recomputed elementwise kernels (MaxText's remat policies)
    split: str = "fitted"            # "fitted": a preset's numbers were fitted on it; "held_out": never
    cluster: str = "h100x8-gt"       # the preset describing the run's hardware
    tolerance: float = 0.05          # the relative error of the prediction the tests hold it to
    why: str = ""                    # why the tolerance is wider than 5%
    memory_gib: float | None = None  # published peak memory of the run (GiB)
    memory_kind: str = "reserved"    # what it measured: "reserved" (torchtitan's log) or "allocated"
    memory_remat: bool | str | None = None   # the dry-run's remat for the memory (None: ``remat``)
    memory_tolerance: float = 0.10
    memory_why: str = ""
    # the loss the run computed over a whole vocabulary: "torch" (``F.cross_entropy`` of the
    # fp32 logits, torchtitan's) or "framework" (``ops.cross_entropy``'s one-pass rows)
    loss: str = "framework"

    @property
    def devices(self) -> int:
        n = 1
        for _, s in self.mesh:
            n *= s
        return n

    def cost_options(self) -> dict:
        return {"compiled": self.compiled, "selective_ac": self.selective_ac, "float8": self.float8,
                "float8_all_gather": self.float8_all_gather,
                "activation_sums": "bfloat16", "async_tp": self.async_tp, "tp_comm_overlap": self.tp_comm_overlap,
                "distributed_optimizer": self.distributed_optimizer, "fused_recompute": self.fused_recompute}


#: how the 8B rows' memory is dry-run
SELECTIVE_MEMORY = ("dry-run with torchtitan's own policy (remat='selective_alternate': q, v, w1, w2 and attention "
                    "kept, k, o, w3 recomputed) and its loss (F.cross_entropy of the fp32 logits: three logits-sized "
                    "fp32 buffers at its backward's peak), the allocator's cached blocks and FSDP2's stream pools "
                    "(docs/planning.md, \"Reserved memory\")")
#: and what the compiled rows add to it
COMPILED_MEMORY = (SELECTIVE_MEMORY + "; the compiled layers' saved tensors are modelled (the partitioner drops the "
                   "last matmul's result the policy keeps: 4.0 GiB of torchtitan's measured 5.4 and 5.0 GiB less "
                   "than eager); the loss is not compiled (torchtitan's at 9dec370)")


def _table(name: str, tps: float, mesh, compiled: bool, table: str, float8: bool = False,
           memory: float | None = None) -> Reference:
    return Reference(name, "llama3_8b", mesh, 2, 8192, tps, f"{TORCHTITAN_2024}, {table}", compiled=compiled,
                     loss="torch", selective_ac="op", float8=float8,
                     memory_gib=memory, memory_remat="selective_alternate",
                     notes=f"FSDP, {'Float8' if float8 else 'bf16 (no Float8)'}, selective op-level AC; memory "
                           + (COMPILED_MEMORY if compiled else SELECTIVE_MEMORY))


#: the bf16 rows the presets are fitted to (all rows: within 5%, tests/plan/test_plan_held_out.py)
LLAMA3_8B = (
    _table("8B FSDP 8, eager", 5762, (("dp_shard", 8),), False, "Table 1", memory=82.4),
    _table("8B FSDP 8, compiled", 6667, (("dp_shard", 8),), True, "Table 1", memory=77.0),
    _table("8B FSDP 128, eager", 5605, (("dp_shard", 128),), False, "Table 3", memory=67.0),
    _table("8B FSDP 128, compiled", 6514, (("dp_shard", 128),), True, "Table 3", memory=62.0),
)


def _405b(name: str, tps: float, schedule: str, virtual: int, memory: float, **kw) -> Reference:
    return Reference(name, "llama3_405b", (("pp", 8), ("dp_shard", 8), ("tp", 8)), 32, 8192, tps,
                     f"{TORCHTITAN_2024}, Table 5", compiled=True, loss="torch", remat=True, schedule=schedule,
                     micro_batches=8,
                     virtual_stages=virtual, float8=True, async_tp=True, split="held_out", memory_gib=memory, **kw,
                     notes="compile + Float8 + async TP, full AC, "
                           "8 micro-batches (torchtitan's default: as many as stages), interleaved with 2 "
                           "stages per rank (its default); 128 layers here (126 do not split into 16 stages)")


#: torchtitan's 405B pipeline rows: held out (no fit has seen them)
LLAMA3_405B = (
    _405b("405B FSDP 8 x TP 8 x PP 8, 1F1B", 100, "1f1b", 1, 82.5),
    _405b("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B", 128, "interleaved_1f1b", 2, 72.7),
)

def _70b(name: str, tps: float, async_tp: bool, memory: float, **kw) -> Reference:
    return Reference(name, "llama3_70b", (("dp_shard", 32), ("tp", 8)), 16, 8192, tps, f"{TORCHTITAN_2024}, Table 4",
                     loss="torch", compiled=True, remat=True, float8=True, async_tp=async_tp, memory_gib=memory, **kw,
                     notes="compile + Float8, full AC" + (" + async TP" if async_tp else "")
                           + "; sequence length not stated in the table: 8192 assumed (the other tables')")


#: torchtitan's 70B rows on 256 H100 (FSDP 32 x TP 8): without and with async TP; the
#: presets' ``async_tp_overlap`` is fitted to their ratio
LLAMA3_70B = (
    _70b("70B FSDP 32 x TP 8", 829, False, 71.9),
    _70b("70B FSDP 32 x TP 8, async TP", 876, True, 67.6),
)

#: the Float8 rows (compiled): ``float8_efficiency`` of the presets is fitted to them
LLAMA3_8B_FLOAT8 = (
    _table("8B FSDP 8, compiled + Float8", 8532, (("dp_shard", 8),), True, "Table 1", float8=True),
    _table("8B FSDP 128, compiled + Float8", 8380, (("dp_shard", 128),), True, "Table 3", float8=True),
)

def _cp(cp: int, tps: float, split: str, tolerance: float = 0.05) -> Reference:
    seq = 32768 * cp
    return Reference(f"8B FSDP {8 // cp} x CP {cp}, seq {seq:,}", "llama3_8b",
                     (("dp_shard", 8 // cp),) + ((("cp", cp),) if cp > 1 else ()), 1, seq, tps,
                     f"{TORCHTITAN_2024}, Table 2", compiled=True, loss="torch", remat=True, float8=True, split=split,
                     tolerance=tolerance, why="" if tolerance == 0.05 else
                     "the attention-length law (Cluster.attention_length_exponent) is fitted to the 32k and 131k "
                     "rows; Table 2's 65k row is faster, and its 262k row slower, than one power of the key length "
                     "gives (per token, 32k to 65k adds half of what each later doubling adds)",
                     notes=f"compile + Float8, full AC, local batch 1, FSDP over dp_shard x cp, CP {cp} (ring "
                           f"attention over the sequence); memory not compared (near the 96 GB limit, the "
                           f"allocator's cache fills what is free)")


#: torchtitan's long-sequence rows (8 H100): the presets' ``attention_length_exponent`` is fitted to
#: the 32k and 131k rows; the 65k and 262k rows are held out
LLAMA3_8B_LONG = (
    _cp(1, 3890, "fitted"),
    _cp(2, 2540, "held_out", 0.17),
    _cp(4, 1071, "fitted"),
    _cp(8, 548, "held_out", 0.11),
)

WHITEFIBER_2025 = ("torchtitan's llama3-8b_h200_202506_trainy-whitefiber.md (its benchmarks folder) (torch "
                   "2.8.0a0+5228986c39, torchtitan e7c0cae, June 2025; Trainy on WhiteFiber): 8 H200 per host on "
                   "NVLink, 400 Gb/s (CX-7) per GPU; llama3_8b.toml (seq 8192, selective op AC), local batch 2, "
                   "compile, Float8 with Float8 FSDP all-gathers, TPS and memory at the 100th step")


def _whitefiber(nodes: int, tps: float, memory: float, memory_tolerance: float = 0.10,
                memory_why: str = "") -> Reference:
    return Reference(f"8B FSDP {8 * nodes} on H200, compiled + Float8", "llama3_8b", (("dp_shard", 8 * nodes),), 2,
                     8192, tps, WHITEFIBER_2025, compiled=True, loss="fused", selective_ac="op", float8=True,
                     float8_all_gather=True, split="held_out", cluster="h200x8",
                     memory_gib=memory, memory_remat="selective_alternate", memory_tolerance=memory_tolerance,
                     memory_why=memory_why,
                     notes=f"{nodes} hosts of 8 H200; FSDP over all, the layers' weights gathered in fp8 "
                           f"(--float8.enable_fsdp_float8_all_gather); the loss compiled on its own (torchtitan "
                           f"compiles it with the model since early 2025); memory dry-run with torchtitan's op-level "
                           f"policy and Float8's buffers (estimate(float8=True, float8_all_gather=True)); the output "
                           f"head stays bf16 (llama3_8b.toml's float8.filter_fqns = ['output'])")


#: torchtitan's 8B rows on 32 and 64 H200 (June 2025): out of sample (hardware and software)
LLAMA3_8B_H200 = (_whitefiber(4, 10938, 47.96),
                  _whitefiber(8, 10753, 46.97))

GPU_H200 = ("this project's benchmarks/gpu.py on one H200 (torch 2.11.0+cu130, 2026-12-04; docs/gpu.md): the "
            "functional step eager, bf16 with fp32 masters, AdamW; the tokens/s of the timed steps as issue 44 "
            "reports them (the kept JSON, benchmarks/results/gpu_h200_torch2.11_2026-12-04.json, holds the kernel "
            "time, 179.8 ms a step, and the peak, 42,188,671,488 bytes allocated)")

#: this project's own GPU run: Llama-3.2-1B's shape on one H200, 4 x 2048 tokens, eager
OWN_GPU = (Reference("1B on one H200, eager (benchmarks/gpu.py)", "llama3_1b", (), 4, 2048, 37600, GPU_H200,
                     split="held_out", cluster="h200x8", tolerance=0.14,
                     why="the GPU idles 38 ms of the 218 ms step (its 2,920 kernels take 179.8 ms); the model "
                         "charges the device's work (193 ms: 7% above the kernels' time) and the host's launches "
                         "(2,388 at the measured 20 us: 48 ms, hidden under the device's queue), not what else "
                         "idles the GPU (the kept trace has no timeline; the host alone would need 91 us a launch)",
                     memory_gib=42188671488 / 2 ** 30, memory_kind="allocated",
                     notes="torch.cuda.max_memory_allocated over one step (the benchmark's peak)"),)

MEGATRON = ("Megatron-LM's README, 'Training Speed and Scalability' (images/model_table.png, July 2024): GPT models on "
            "H100 (700 W SXM, 8 per node), vocabulary 131,072, sequence 4096, data parallel 48, global batch 192, "
            "DP communication overlapped (--overlap-grad-reduce --overlap-param-gather: the distributed optimizer), "
            "TP communication overlapped (--tp-comm-overlap); per-GPU TFLOP/s counted by Megatron's "
            "72 B s l h^2 (1 + s/6h + V/12hl) per step (no recomputation), converted here to tokens/s")


def _megatron_tokens(tflops: float, hidden: int, layers: int, seq: int = 4096, vocab: int = 131072) -> float:
    """Tokens/s per GPU from Megatron's per-GPU TFLOP/s (its FLOPs per token, no recomputation)."""
    return tflops * 1e12 / (72 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers)))


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, tflops: float, split: str,
              pp: int = 1, batch: int = 192) -> Reference:
    mesh = ((("pp", pp),) if pp > 1 else ()) + (("dp_replicate", 48),) + ((("tp", tp),) if tp > 1 else ())
    local = batch // 48
    how = (f"{local} sequences per data-parallel rank as {local} micro-batches of 1 on Megatron's default 1F1B "
           f"schedule (neither is stated; interleaved with 2 virtual stages predicts +2.0%)" if pp > 1 else
           f"{local} sequences per data-parallel rank, run as one micro-batch of {local}: Megatron's micro-batch "
           f"size is not stated, and either sends one gradient reduction per step")
    return Reference(f"Megatron GPT {size}, DP 48 x TP {tp}" + (f" x PP {pp}" if pp > 1 else ""), f"gpt_{size}", mesh,
                     local, 4096, _megatron_tokens(tflops, hidden, layers),
                     f"{MEGATRON}, the {size} row ({tflops} TFLOP/s)", compiled=True, tp_comm_overlap=True,
                     distributed_optimizer=True, split=split, cluster="h100x8-te", micro_batches=local if pp > 1 else 1,
                     schedule="1f1b" if pp > 1 else None,
                     notes=f"{heads} heads, hidden {hidden}, {layers} layers, batch {batch} ({how}); GPT as this "
                           f"project's Llama with MHA, LayerNorm, a 4h GeLU MLP, untied embeddings; compiled "
                           f"(Transformer Engine's fused kernels); costed with Megatron's distributed optimizer and "
                           f"TP overlap")


#: Megatron-LM's weak-scaling rows without pipeline parallelism and the 70B row with PP 2 (the
#: 119B-462B rows use PP 4-16 with schedules and virtual stages the README does not state, and on
#: which their bubble depends): the ``h100x8-te`` preset's matmul efficiency is fitted to the 1.7B
#: row (data parallel only); the others are held out
MEGATRON_GPT = (
    _megatron("1.7B", 16, 2048, 24, 1, 408.8, "fitted"),
    _megatron("7.1B", 32, 4096, 30, 2, 465.9, "held_out"),
    _megatron("16B", 48, 6144, 32, 4, 489.1, "held_out"),
    _megatron("32B", 56, 7168, 48, 8, 459.6, "held_out"),
    _megatron("70B", 64, 8192, 84, 8, 419.7, "held_out", pp=2, batch=384),
)


MAXTEXT = ("MaxText's configs/a3/llama_2_7b/README.md (April 2024, commit efb6d9e4a; now "
           "src/maxtext/configs/gpu/a3/llama_2_7b/): Llama 2 7B on 1-16 A3 VMs (8 H100 each), its N-VM scripts: "
           "ici_fsdp_parallelism=8, dcn_data_parallelism=N, per_device_batch_size=4, max_target_length=4096, "
           "attention=cudnn_flash_te, remat_policy=minimal_flash, fp32 weights, bf16 activations, AdamW; "
           "TFLOP/s per chip counted (maxtext_utils.py at that commit) as 6 x all parameters + 6 x heads x layers "
           "x head_dim x seq (causal attention halved) per token, converted here to tokens/s")

#: Llama 2 7B's parameters (embedding and head included: MaxText's count)
LLAMA2_7B_PARAMETERS = 6_738_415_616


def _maxtext_tokens(tflops: float, seq: int = 4096) -> float:
    """Tokens/s per chip from MaxText's TFLOP/s per chip (its April 2024 count)."""
    return tflops * 1e12 / (6 * LLAMA2_7B_PARAMETERS + 6 * 32 * 32 * 128 * seq)


def _maxtext(vms: int, tflops: float, split: str = "held_out", tolerance: float = 0.05, why: str = "") -> Reference:
    mesh = ((("dp_replicate", vms),) if vms > 1 else ()) + (("dp_shard", 8),)
    return Reference(f"MaxText Llama 2 7B, {vms} A3 VM{'s' if vms > 1 else ''} (DP {vms} x FSDP 8)", "llama2_7b",
                     mesh, 4, 4096, _maxtext_tokens(tflops), f"{MAXTEXT}, the {vms}x A3 row ({tflops} TFLOP/s)",
                     compiled=True, remat="selective", fused_recompute=True, split=split, cluster="a3x8",
                     tolerance=tolerance, why=why,
                     notes="FSDP 8 inside the VM, data parallel across VMs (HSDP); XLA's fusion as compiled; "
                           "remat_policy=minimal_flash (every matmul's and attention's result saved, the other "
                           "kernels recomputed) as remat='selective', what it recomputes fused by XLA into the "
                           "backward kernels that read it (fused_recompute)")


#: MaxText's A3 (H100) rows: the a3x8 preset's ``inter_overlap`` (the cross-VM traffic hidden over
#: GPUDirect-TCPX) is fitted to the 2- and 16-VM rows, the ends of the cross-VM range; the 1-VM row
#: (no cross-VM traffic: h100x8-te's efficiencies, fitted to Megatron's 1.7B row) and the 4- and
#: 8-VM rows are held out
EIGHT_VMS = ("the 8-VM row measured faster than the 4-VM one (409 against 407 TFLOP/s) where the ring all-reduce "
             "across VMs sends 1.75 / 1.5 times the bytes: the cross-VM traffic exposed is 0.30 s at both, the "
             "model's grows with the ring's bytes (0.34 and 0.40 s)")

MAXTEXT_A3 = (
    _maxtext(1, 492),
    _maxtext(2, 422, "fitted"),
    _maxtext(4, 407),
    _maxtext(8, 409, tolerance=0.07, why=EIGHT_VMS),
    _maxtext(16, 375, "fitted"),
)


def _gpt(hidden: int, layers: int, heads: int):
    return lambda: llama.Config(vocab=131072, hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
                                mlp=4 * hidden, mlp_gated=False, mlp_act="gelu", norm_kind="layer",
                                tie_embeddings=False)


CONFIGS = {
    "llama3_1b": lambda: llama.Config.llama3_1b(rope_scaling=None),   # as benchmarks/gpu.py runs it
    "gpt_1.7B": _gpt(2048, 24, 16), "gpt_7.1B": _gpt(4096, 30, 32), "gpt_16B": _gpt(6144, 32, 48),
    "gpt_32B": _gpt(7168, 48, 56), "gpt_70B": _gpt(8192, 84, 64),
    "llama3_8b": llama.Config.llama3_8b,
    "llama2_7b": lambda: llama.Config(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, mlp=11008,
                                      rope_theta=10000.0, rope_scaling=None, max_seq=4096),
    "llama3_70b": llama.Config.llama3_70b,      # Llama 3.1 70B: 80 layers, hidden 8192, 64 heads, 8 kv heads
    # Llama 3.1 405B: 126 layers in the published model, 128 here so that 16 stages divide them
    "llama3_405b": lambda: llama.Config.llama3_70b(hidden=16384, layers=128, heads=128, mlp=53248),
}


#: benchmarks/gpu.py's sides: (JSON key, compiled)
GPU_SIDES = (("functional_eager", False), ("functional", True))
#: the preset for a GPU benchmarks/gpu.py names
GPU_PRESETS = (("H200", "h200x8"), ("H100", "h100x8"), ("A100", "a100x8"), ("L40S", "l40sx4"))


def gpu_rows(result: dict, tolerance: float = 0.14, why: str = "") -> tuple[Reference, ...]:
    """Held-out rows from a ``benchmarks/gpu.py`` result (its JSON, loaded): one per model
    and functional side whose timed steps it holds (``tokens_per_s``), on the preset of the
    GPU it names; its peak (``torch.cuda.max_memory_allocated``) as allocated memory. A GPU
    without a preset is refused by name."""
    device = result.get("device", "")
    preset = next((p for name, p in GPU_PRESETS if name in device), None)
    if preset is None:
        raise ValueError(f"gpu_rows: no cluster preset describes {device!r}; add one to plan.cluster.PRESETS "
                         f"and to references.GPU_PRESETS ({', '.join(n for n, _ in GPU_PRESETS)} have one)")
    rows = []
    for name, row in result.get("rows", {}).items():
        m = row["model"]
        cfg = llama.Config.llama3_1b(hidden=m["hidden"], layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"],
                                     mlp=m["mlp"], vocab=m["vocab"], tie_embeddings=m["tied"], rope_scaling=None)
        for side, compiled in GPU_SIDES:
            got = row.get(side, {})
            if not got.get("tokens_per_s"):
                continue
            peak = got.get("peak_memory_bytes")
            rows.append(Reference(f"{name} {side} on one {device} ({result.get('date', '')})", cfg, (),
                                  row["batch"], row["seq"], got["tokens_per_s"],
                                  f"benchmarks/gpu.py on {device}, torch {result.get('torch')}, {result.get('date')}",
                                  compiled=compiled, split="held_out", cluster=preset, tolerance=tolerance,
                                  why=why, memory_gib=peak / 2 ** 30 if peak else None, memory_kind="allocated"))
    return tuple(rows)


#: every row: those a preset's numbers were fitted on, and those held out
ROWS = (LLAMA3_8B + LLAMA3_8B_FLOAT8 + LLAMA3_70B + LLAMA3_8B_LONG + LLAMA3_405B + LLAMA3_8B_H200 + OWN_GPU
        + MEGATRON_GPT + MAXTEXT_A3)
FITTED = tuple(r for r in ROWS if r.split == "fitted")
HELD_OUT = tuple(r for r in ROWS if r.split == "held_out")


def rules_for(ref: Reference) -> Rules:
    """FSDP over dp_shard x cp (torchtitan's; MaxText's inside a VM, under data parallelism across
    VMs; none on a mesh of dp_replicate alone: Megatron's data parallelism), TP over tp with
    sequence parallelism, the layers over pp."""
    axes = dict(ref.mesh)
    rules = llama.default_rules(fsdp="dp_shard" in axes or "dp_replicate" not in axes,
                                sequence_parallel=axes.get("tp", 1) > 1)
    return rules.replace(layers="pp") if axes.get("pp", 1) > 1 else rules


_cache: dict = {}


def _loss_context(loss: str):
    """How the dry-run computes ``loss`` (``Reference.loss``): "framework", the 16-bit logits
    widened whole (as this project's compiled step and its first GPU run did); "torch", torch's
    ``F.cross_entropy`` of the widened logits (DTensor's loss parallel when the vocabulary is
    split); "fused", the loss compiled on its own (inductor keeps the 16-bit logits and each
    row's log-sum-exp and writes the 16-bit gradient: what the framework's eager row chunks hold)."""
    if loss == "torch":
        return logits_as_torch_cross_entropy()
    if loss == "fused":
        return contextlib.nullcontext()
    if loss == "framework":
        return logits_widened_whole()
    raise ValueError(f"Reference.loss: {loss!r} is not one of 'framework', 'torch', 'fused'")


def reference_estimate(ref: Reference, compiled_layers: bool = False,
                       expandable_segments: bool = False, float8: bool = False) -> LayoutEstimate:
    """The dry-run of ``ref``'s setup (cached: the rows share meshes); ``compiled_layers``: its
    layers saving what a compiled layer saves (``estimate(compiled=True)``, for the memory). Its
    reserved memory is FSDP2's (``fsdp2_streams``): every row with FSDP ran torch's ``fully_shard``
    (torchtitan's), with no effect on the others. ``expandable_segments``: the allocator's setting
    (torchtitan's launcher sets it; the published rows do not say: off, CUDA's default).
    ``float8``: with the row's Float8 linear layers' buffers (``Reference.float8``,
    ``float8_all_gather``: ``estimate(float8=...)``; the memory's dry-run, the time model costs
    Float8 on the dry-run without them)."""
    f8 = (ref.float8, ref.float8_all_gather) if float8 else (False, False)
    key = (repr(ref.model), ref.mesh, ref.local_batch, ref.seq, ref.remat, ref.schedule, ref.virtual_stages,
           compiled_layers, expandable_segments, ref.loss, f8)
    if key not in _cache:
        cfg = ref.model if isinstance(ref.model, llama.Config) else CONFIGS[ref.model]()
        mesh = Mesh(**dict(ref.mesh)) if ref.mesh else Mesh()
        dp = mesh.shape.get("dp_replicate", 1) * mesh.shape.get("dp_shard", 1)
        batch = {k: ((ref.local_batch * dp, ref.seq), "batch seq") for k in ("tokens", "labels")}
        # every row's program widened its logits whole; torchtitan's ran torch's cross-entropy
        with _loss_context(ref.loss):
            _cache[key] = estimate(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), mesh,
                                   rules_for(ref), batch, precision="bf16", remat=ref.remat, timeline=False,
                                   grad_accum=ref.micro_batches, schedule=ref.schedule or "1f1b",
                                   virtual_stages=ref.virtual_stages, compiled=compiled_layers,
                                   fsdp2_streams=True, expandable_segments=expandable_segments,
                                   float8=f8[0], float8_all_gather=f8[1])
    return _cache[key]


def memory_estimate(ref: Reference) -> LayoutEstimate:
    """The dry-run whose memory stands for ``ref``'s: its own, or with ``memory_remat`` (the 8B
    rows' torchtitan op-level policy, ``"selective_alternate"``, which the time model costs as
    ``selective_ac="op"`` on a dry-run without checkpointing); a
    compiled row's layers save what torch.compile's partitioner keeps (torchtitan compiles each
    block on its own)."""
    if ref.memory_remat is None:
        return reference_estimate(ref, ref.compiled, float8=True)
    return reference_estimate(replace(ref, remat=ref.memory_remat, selective_ac=None), ref.compiled, float8=True)


def predicted_memory(ref: Reference) -> int:
    """Predicted bytes of what ``ref`` measured: reserved (the caching allocator's model) or allocated."""
    est = memory_estimate(ref)
    return est.reserved_bytes if ref.memory_kind == "reserved" else est.peak_bytes


def predict(ref: Reference, cl: "Cluster | str | None" = None) -> tuple[float, StepTime]:
    """Predicted tokens/s per GPU of ``ref`` on ``cl`` (default: the row's own preset) and the
    step time it comes from."""
    t = cost(reference_estimate(ref), cl or ref.cluster, **ref.cost_options())
    axes = dict(ref.mesh)        # a data-parallel rank's batch is shared by its pp x cp x tp devices
    dp = axes.get("dp_replicate", 1) * axes.get("dp_shard", 1)
    return ref.local_batch * dp * ref.seq / ref.devices / t.step_s, t
