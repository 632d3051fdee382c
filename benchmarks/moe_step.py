"""Mixture-of-experts training step on one device, side by side in one run: our Qwen3-MoE step
(``fpp.train_step`` of ``llama.loss`` with experts, eager) against transformers' own
``Qwen3MoeForCausalLM`` trained with ``torch.optim.AdamW`` (its experts' ``eager`` loop and,
where torch provides it, its ``grouped_mm`` kernel), and the MoE layer alone against a
plain-torch reference of the same algorithm (sort the (token, expert) pairs, one matmul per
expert, ``index_add`` back).

    python benchmarks/moe_step.py                    # CPU, fp32
    python benchmarks/moe_step.py --steps 5 --batch 2 --seq 64

Both full steps start from the same weights (ours are loaded from transformers' files) and
their first-step losses (cross-entropy + router_aux_loss_coef x the load-balancing loss) are
printed side by side. Timing: median wall time per step after one warm-up step; peak memory:
torch.profiler's CPU allocator events over one step plus the live state, as
benchmarks/single_device.py measures it."""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from single_device import peak_memory  # noqa: E402

import functional_pp as fpp  # noqa: E402
from functional_pp.checkpoint import hf  # noqa: E402
from functional_pp.core.layout import Rules  # noqa: E402
from functional_pp.models import llama  # noqa: E402
from functional_pp.ops.experts import experts  # noqa: E402


def hf_model(args):
    import transformers
    conf = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.hidden // 8, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_mlp, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(conf)


def timed(step, batch, steps):
    step(batch)                                            # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Ours:
    def __init__(self, cfg, params):
        self.mesh = fpp.Mesh()
        self.train = fpp.train_step(functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(1e-4), mesh=self.mesh,
                                    rules=Rules())
        self.state = None
        self.params = params

    def step(self, batch):
        self.state, m = self.train(self.state, batch)
        return float(m["loss"])

    def live_state(self):
        return self.state


class HF:
    def __init__(self, model, impl):
        self.model = model
        model.config._experts_implementation = impl
        model.config._attn_implementation = "sdpa"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(self, batch):
        out = self.model(input_ids=batch["tokens"])
        loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch["labels"].reshape(-1))
        loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)

    def live_state(self):
        return [list(self.model.parameters()), self.opt.state_dict()["state"]]


def reference_moe(x, router, gate, up, down, top_k):
    """Plain torch, the same algorithm as ops.experts on one device."""
    probs = torch.softmax(x @ router, dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = torch.arange(x.shape[0]).repeat_interleave(top_k)[order]
    rows = x[tok]
    outs = [F.silu(r @ gate[e]) * (r @ up[e]) @ down[e]
            for e, r in enumerate(rows.split(torch.bincount(flat, minlength=gate.shape[0]).tolist()))]
    return torch.zeros_like(x).index_add(0, tok, torch.cat(outs) * w.reshape(-1)[order][:, None])


def layer_bench(args):
    g = torch.Generator().manual_seed(0)
    T, H, E, Fm = args.batch * args.seq, args.hidden, args.experts, args.moe_mlp
    x = torch.randn(T, H, generator=g)
    ws = [torch.randn(H, E, generator=g), torch.randn(E, H, Fm, generator=g) * H ** -0.5,
          torch.randn(E, H, Fm, generator=g) * H ** -0.5, torch.randn(E, Fm, H, generator=g) * Fm ** -0.5]

    def ours():
        p = [w.clone().requires_grad_() for w in ws]
        out, _ = experts(fpp.wrap(x, "tok hidden"), fpp.wrap(p[0], "hidden experts"), fpp.wrap(p[1], "experts hidden mlp"),
                         fpp.wrap(p[2], "experts hidden mlp"), fpp.wrap(p[3], "experts mlp hidden"), top_k=args.top_k,
                         normalize=True)
        out.value().square().sum().backward()
        return out.value()

    def plain():
        p = [w.clone().requires_grad_() for w in ws]
        out = reference_moe(x, *p, args.top_k)
        out.square().sum().backward()
        return out
    torch.testing.assert_close(ours(), plain(), rtol=1e-4, atol=1e-5)
    return {"ours": timed(lambda _: ours(), None, args.steps), "plain torch": timed(lambda _: plain(), None, args.steps)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-mlp", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = hf_model(args)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = hf.load_hf_llama(d)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    tokens = args.batch * args.seq
    print(f"Qwen3-MoE: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"expert mlp {args.moe_mlp}; batch {args.batch} x {args.seq}; fp32, {torch.get_num_threads()} threads")

    def run_ours():
        ours = Ours(cfg, params)
        from functional_pp.parallel import sharding
        ours.state = ours.train.init(sharding.named_tree(params, llama.init(cfg)))
        first = ours.step(batch)
        return first, timed(ours.step, batch, args.steps), peak_memory(ours, batch, "cpu")["peak_bytes"]
    rows = [("ours (fpp.train_step, eager)", *fpp.launch(run_ours, fpp.Mesh())[0])]
    impls = ["eager"] + (["grouped_mm"] if hasattr(torch.nn.functional, "grouped_mm") else [])
    for impl in impls:
        side = HF(hf_model(args), impl)
        first = side.step(batch)
        rows.append((f"transformers ({impl} experts) + AdamW", first, timed(side.step, batch, args.steps),
                     peak_memory(side, batch, "cpu")["peak_bytes"]))
    print(f"{'full training step':44s} {'first loss':>10s} {'s/step':>8s} {'tokens/s':>9s} {'peak MiB':>9s}")
    for name, first, t, peak in rows:
        print(f"{name:44s} {first:10.5f} {t:8.4f} {tokens / t:9.0f} {peak / 2**20:9.1f}")
    print(f"{'the MoE layer alone (forward + backward)':44s} {'s':>8s}")
    for name, t in layer_bench(args).items():
        print(f"{name:44s} {t:8.4f}")


if __name__ == "__main__":
    main()
