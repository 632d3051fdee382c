"""EBFT's scoring and training forwards (docs/preference.md "EBFT"): one row per sample (the
layout before, ``doc[:a] + sample`` padded to ``sequence_len``, rebuilt here) against one
block-parallel row per document (``functional_pp/preference/ebft_layout.py``, what runs now).

    python benchmarks/ebft_layout.py                         # sequence_len 256, Axolotl's defaults
    python benchmarks/ebft_layout.py --seq 1024 --old-rows 16

For one document of ``--seq`` random tokens with Axolotl's default blocks (stride 8, context 8,
8 tokens, 4 samples each) on a small random Llama, it prints for each layout the tokens it runs,
the FLOPs of the loss's forward + backward and of the feature model's forward counted by
``torch.utils.flop_counter`` (attention through SDPA's math backend, so that every product is
counted: dense, masked entries included), and the CPU time of one forward + backward (median of
``--repeats``). The one-row-per-sample layout is run on ``--old-rows`` of its rows and scaled
by its rows / ``--old-rows``: its rows all have ``--seq`` tokens and the loss is a sum over rows,
so its FLOPs scale exactly (its time about linearly). With ``--check`` (small ``--seq`` only) the
two layouts' losses are compared first.

    python benchmarks/ebft_layout.py --seq 1024 --memory

``--memory``: the block-parallel row only, its attention's prefix mask built whole (one dense
``L x L`` mask per row, as before ``ops/query_chunks.py``) against by blocks of
``QUERY_CHUNK`` queries (each recomputed in backward, against the keys up to its last query): the
peak memory of one forward + backward of the loss beyond the parameters (torch's memory profiler,
``tests/memtrack.py``), the FLOPs (SDPA's math backend) and the CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import functional_pp as fpp
from functional_pp.core.tree import leaves_with_paths, tree_map
from functional_pp.data.ebft_documents import Document
from functional_pp.models import llama
from functional_pp.parallel import sharding
from functional_pp.parallel.init import init_params
from functional_pp.preference.ebft import feature_layer_indices, strided_anchors
from functional_pp.preference.ebft_layout import LAYOUT_KEYS
from functional_pp.preference.ebft_rollout import EBFTRollout, ebft_batch
from functional_pp.preference.ebft_spec import EBFTSpec
from functional_pp.preference.weighted_logps import weighted_logps_objective


def one_row_per_sample(doc: Document, anchors: list[int], samples: torch.Tensor, advantages: torch.Tensor,
                       spec: EBFTSpec, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The layout before: a row ``doc[:a] + sample`` per sample (its tokens labelled at the
    positions that sampled them) and the document's own row (its cross-entropy), each of
    ``len(doc.tokens)`` tokens."""
    seq, n, gen = len(doc.tokens), spec.n_samples_per_prompt, spec.generate_max_len
    rows, count = [], len(anchors) * n * gen

    def add(tok, lab, w):
        t = torch.full((seq,), pad_id)
        t[:len(tok)] = torch.tensor(tok)
        lb, wt = torch.full((seq,), -100), torch.zeros(seq)
        for pos, label in lab:
            lb[pos], wt[pos] = label, w
        rows.append((t, lb, wt))
    for b, a in enumerate(anchors):
        for j in range(n):
            s = samples[b, j].tolist()
            add(list(doc.tokens[:a]) + s, [(a - 1 + k, t) for k, t in enumerate(s)],
                spec.rl_coef * float(advantages[b, j]) / count)
    targets = [(t - 1, lab) for t, lab in enumerate(doc.labels) if t > 0 and lab != -100]
    add(list(doc.tokens), targets, spec.ce_coef / len(targets))
    out = {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(("tokens", "labels", "weights"))}
    out["step_tokens"] = torch.full(out["tokens"].shape, float((out["labels"] != -100).sum()))
    return out


def rows(batch: dict, at: slice) -> dict:
    return {k: fpp.wrap(v[at], "batch seq") for k, v in batch.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--old-rows", type=int, default=32, help="rows of the one-row-per-sample layout run (scaled)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare the two layouts' losses first")
    ap.add_argument("--memory", action="store_true", help="the block-parallel row's peak memory: its mask whole "
                                                          "against by blocks of queries")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = llama.Config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                       mlp=2 * args.hidden, max_seq=args.seq)
    decls = llama.init(cfg)
    full = tree_map(lambda x: x.requires_grad_(), init_params(decls, seed=0))
    weights = [w for _, w in leaves_with_paths(full)]
    params = sharding.named_tree(full, decls)
    spec = EBFTSpec(ce_coef=0.03)          # Axolotl's defaults: stride 8, context 8, 8 tokens, 4 samples
    g = torch.Generator().manual_seed(0)
    tokens = tuple(torch.randint(1, args.vocab, (args.seq,), generator=g).tolist())
    doc = Document(tokens, tokens)
    anchors = strided_anchors(args.seq, stride=spec.stride, context_length=spec.context_length,
                              generate_max_len=spec.generate_max_len)
    n, gen = spec.n_samples_per_prompt, spec.generate_max_len
    samples = torch.randint(1, args.vocab, (len(anchors), n, gen), generator=g)
    advantages = torch.randn(len(anchors), n, generator=g)
    r = EBFTRollout([doc], [anchors], [samples], [advantages], [advantages], [advantages], [advantages])
    new, old = ebft_batch(r, spec, 0), one_row_per_sample(doc, anchors, samples, advantages, spec)
    objective = weighted_logps_objective(lambda p, t, **layout: llama.forward(p, t, cfg, **layout))
    layers = feature_layer_indices(spec.feature_layers, cfg.layers)

    def step(batch):
        loss = objective(params, batch).value()
        torch.autograd.grad(loss, weights)
        return float(loss)

    def features(batch):
        with torch.no_grad():
            ins = {k: batch[k] for k in LAYOUT_KEYS if k in batch}
            return llama.layer_states(params, batch["tokens"], cfg, layers, **ins)

    if args.memory:
        return memory(step, rows(new, slice(None)), args.repeats)
    if args.check:
        got, want = step(rows(new, slice(None))), step(rows(old, slice(None)))
        print(f"loss: block-parallel {got:.6f}, one row per sample {want:.6f}")
        assert abs(got - want) <= 1e-4 * abs(want) + 1e-6
    k = min(args.old_rows, len(old["tokens"]))
    layouts = {"one row per sample": (rows(old, slice(0, k)), len(old["tokens"]) / k),
               "block-parallel row": (rows(new, slice(None)), 1.0)}
    print(f"sequence_len {args.seq}: {len(anchors)} blocks x {n} samples of {gen} tokens; Llama hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}; {torch.get_num_threads()} threads")
    result = {}
    for name, (batch, scale) in layouts.items():
        shape = tuple(batch["tokens"].data.shape)
        with sdpa_kernel(SDPBackend.MATH):
            with FlopCounterMode(display=False) as fc:
                step(batch)
            train_flops = fc.get_total_flops() * scale
            with FlopCounterMode(display=False) as fc:
                features(batch)
            feature_flops = fc.get_total_flops() * scale
        step(batch)                                        # (warm-up)
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            step(batch)
            times.append((time.process_time() - t0) * scale)
        result[name] = (train_flops, feature_flops, statistics.median(times))
        rows_all = round(shape[0] * scale)
        print(f"  {name:20s} {rows_all:4d} rows x {shape[1]:5d} tokens = {rows_all * shape[1]:7d} tokens; "
              f"loss fwd+bwd {train_flops / 1e9:9.2f} GFLOP, features fwd {feature_flops / 1e9:8.2f} GFLOP, "
              f"CPU {result[name][2]:8.2f} s per fwd+bwd" + (f" (scaled from {shape[0]} rows)" if scale != 1 else ""))
    (a, b) = result.values()
    print(f"  ratio one row per sample / block-parallel: loss FLOPs {a[0] / b[0]:.1f}x, feature FLOPs "
          f"{a[1] / b[1]:.1f}x, CPU time {a[2] / b[2]:.1f}x")


def memory(step, batch: dict, repeats: int) -> None:
    """The row's forward + backward with the prefix mask whole and by blocks of queries: peak
    memory, FLOPs and CPU time (median of ``repeats``); the losses equal."""
    import sys
    from pathlib import Path

    from functional_pp.ops import query_chunks
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from memtrack import peak_memory
    length = int(batch["tokens"].data.shape[1])
    blocks = query_chunks.QUERY_CHUNK
    out = {}
    for name, chunk in (("mask whole", length), (f"blocks of {blocks} queries", blocks)):
        query_chunks.QUERY_CHUNK = chunk
        step(batch)                                        # (warm-up)
        with peak_memory() as p:
            loss = step(batch)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            step(batch)
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            step(batch)
            times.append(time.process_time() - t0)
        out[name] = (p.bytes, fc.get_total_flops(), statistics.median(times), loss)
        print(f"  {name:22s} row of {length} tokens: peak {p.bytes / 2 ** 20:8.1f} MiB, loss fwd+bwd "
              f"{fc.get_total_flops() / 1e9:8.2f} GFLOP, CPU {out[name][2]:6.2f} s, loss {loss:.6f}")
    query_chunks.QUERY_CHUNK = blocks
    (a, b) = out.values()
    assert abs(a[3] - b[3]) <= 1e-5 * abs(a[3]) + 1e-6
    print(f"  ratio whole / blocks: peak {a[0] / b[0]:.1f}x, FLOPs {a[1] / b[1]:.2f}x, CPU time {a[2] / b[2]:.2f}x")


if __name__ == "__main__":
    main()
