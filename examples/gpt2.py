"""A GPT-2-style decoder written only from functional_pp's public ops, with its own dimension
names: a second model family next to Llama (see README, "Writing your own model").

Features: learned positions, LayerNorm with bias, biases added by name broadcasting, tanh-GELU,
tied embeddings, a fused qkv projection split with ``unbind``, a cross-head mixing einsum
("talking heads" after attention), an MLP-mixer-style causal token-mixing einsum over the
sequence, and dropout whose mask is the same on every layout.

Dimension names: batch, tok (the sequence inside a block), res_tok (the residual stream's
sequence, derived from tok), embd, head, kv_head (keys/values, derived from head), head_mix
(derived from head), hd, ff, vocab, qkv, and pos/pos_in (position tables and the mixer).

Run ``python examples/gpt2.py`` to train a tiny model on 8 simulated devices."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import functional_pp as fpp


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    embd: int = 32
    layers: int = 2
    heads: int = 4
    ff: int = 128
    max_pos: int = 16
    eps: float = 1e-5
    init_std: float = 0.02
    token_mixing: bool = True     # an MLP-mixer block over the sequence in every layer
    dropout: float = 0.0
    tie: bool = True              # the output head is the token embedding (GPT-2)
    layered: bool = True          # each block an fpp.layer: one FSDP unit, remat, per-layer compile

    @property
    def hd(self) -> int:
        return self.embd // self.heads


def init(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """Parameter declarations (shapes, dimension names, initializers)."""
    def w(shape, axes, std=cfg.init_std):
        return fpp.param(shape, axes, init="normal", scale=std, dtype=dtype)

    def zeros(shape, axes):
        return fpp.param(shape, axes, init="zeros", dtype=dtype)

    def ln():
        return {"weight": fpp.param((cfg.embd,), "embd", init="ones", dtype=dtype), "bias": zeros((cfg.embd,), "embd")}

    H, D, E = cfg.heads, cfg.hd, cfg.embd
    layers = []
    for _ in range(cfg.layers):
        layer = {
            "ln_1": ln(),
            "attn": {"c_attn": {"weight": w((E, 3, H, D), "embd qkv head hd"), "bias": zeros((3, H, D), "qkv head hd")},
                     "mix": w((H, H), "head head_mix", 0.3),
                     "c_proj": {"weight": w((H, D, E), "head hd embd"), "bias": zeros((E,), "embd")}},
            "ln_2": ln(),
            "mlp": {"c_fc": {"weight": w((E, cfg.ff), "embd ff"), "bias": zeros((cfg.ff,), "ff")},
                    "c_proj": {"weight": w((cfg.ff, E), "ff embd"), "bias": zeros((E,), "embd")}},
        }
        if cfg.token_mixing:
            layer["ln_3"] = ln()
            layer["mixer"] = {"weight": w((cfg.max_pos, cfg.max_pos), "pos pos_in", 0.1),
                              "bias": zeros((cfg.max_pos, E), "pos embd")}
        layers.append(layer)
    tree = {"wte": w((cfg.vocab, E), "vocab embd"), "wpe": w((cfg.max_pos, E), "pos embd", 0.01),
            "h": layers, "ln_f": ln()}
    if not cfg.tie:
        tree["lm_head"] = w((E, cfg.vocab), "embd vocab")
    return tree


def rules(tp: bool = True, fsdp: bool = True, sequence_parallel: bool = False) -> fpp.Rules:
    """Batch over dp_replicate x dp_shard, tok over cp (load-balanced for causal attention),
    heads/ff/vocab over tp, FSDP along embd; derived names follow their parents."""
    r = dict(batch=("dp_replicate", "dp_shard"), tok=fpp.balanced("cp"),
             res_tok=fpp.inherit("tok", "tp") if sequence_parallel else fpp.inherit("tok"),
             kv_head=fpp.inherit("head"), head_mix=fpp.inherit("head"),
             tok_in=None)          # the token mixer's input sequence is whole on purpose
    if tp:
        r.update(head="tp", ff="tp", vocab="tp")
    if fsdp:
        r["embd"] = ("dp_shard", "cp")
    return fpp.Rules(r)


def _linear_bias(x, p, pattern):
    return fpp.ops.einsum(pattern, x, p["weight"]) + p["bias"]      # the bias broadcasts by name


def attention_block(p: dict, x, cfg: Config, seed):
    h = fpp.ops.layer_norm(x, p["ln_1"]["weight"], p["ln_1"]["bias"], dim="embd", eps=cfg.eps)
    h = fpp.ops.rename(h, res_tok="tok")
    a = p["attn"]
    qkv = _linear_bias(h, a["c_attn"], "batch tok embd, embd qkv head hd -> batch tok qkv head hd")
    q, k, v = fpp.ops.unbind(qkv, "qkv")                            # fused projection, split by index
    k, v = fpp.ops.rename(k, head="kv_head"), fpp.ops.rename(v, head="kv_head")
    o = fpp.ops.attention(q, k, v, causal=True, batch="batch", seq="tok", heads="head", kv_heads="kv_head",
                          head_dim="hd")
    o = fpp.ops.einsum("batch tok head hd, head head_mix -> batch tok head_mix hd", o, a["mix"])   # cross-head
    o = fpp.ops.rename(o, head_mix="head")
    out = _linear_bias(o, a["c_proj"], "batch tok head hd, head hd embd -> batch tok embd")
    out = fpp.ops.dropout(out, cfg.dropout, seed)
    return fpp.ops.rename(out, tok="res_tok")


def mlp_block(p: dict, x, cfg: Config, seed):
    h = fpp.ops.layer_norm(x, p["ln_2"]["weight"], p["ln_2"]["bias"], dim="embd", eps=cfg.eps)
    h = fpp.ops.rename(h, res_tok="tok")
    m = p["mlp"]
    h = fpp.ops.gelu(_linear_bias(h, m["c_fc"], "batch tok embd, embd ff -> batch tok ff"), approximate="tanh")
    out = _linear_bias(h, m["c_proj"], "batch tok ff, ff embd -> batch tok embd")
    out = fpp.ops.dropout(out, cfg.dropout, seed)
    return fpp.ops.rename(out, tok="res_tok")


def token_mixing_block(p: dict, x, cfg: Config, seq: int):
    """A causal MLP-mixer step over the sequence: out[t] = sum_{s<=t} W[t, s] x[s] + b[t]. Under
    context parallelism the sequence is gathered in its layout's order for the contraction."""
    h = fpp.ops.layer_norm(x, p["ln_3"]["weight"], p["ln_3"]["bias"], dim="embd", eps=cfg.eps)
    h = fpp.ops.rename(h, res_tok="tok_in")                         # every token as an input
    mx = p["mixer"]
    w = fpp.ops.slice_dim(fpp.ops.slice_dim(mx["weight"], "pos", 0, seq), "pos_in", 0, seq)
    w = fpp.ops.rename(w, pos="tok", pos_in="tok_in")               # rows laid out like the sequence
    causal = fpp.named(torch.tril(torch.ones(seq, seq, dtype=torch.bool)), "tok tok_in")
    w = fpp.ops.where(causal, w, 0.0)
    b = fpp.ops.rename(fpp.ops.slice_dim(mx["bias"], "pos", 0, seq), pos="tok")
    out = fpp.ops.einsum("batch tok_in embd, tok tok_in -> batch tok embd", h, w) + b
    return fpp.ops.rename(out, tok="res_tok")


def block(p: dict, x, cfg: Config, seed: int, seq: int):
    """One transformer block: attention, MLP and (optionally) token mixing, each a residual branch."""
    x = x + attention_block(p, x, cfg, seed)
    x = x + mlp_block(p, x, cfg, seed + 1)
    if cfg.token_mixing:
        x = x + token_mixing_block(p, x, cfg, seq)
    return x


layer = fpp.layer(block)     # the model's repeated layer (FSDP gathers its weights as one unit)


def forward(params: dict, tokens, cfg: Config, seed=0):
    """Logits (batch tok vocab) for integer ``tokens`` (batch tok)."""
    seq = tokens.size("tok")
    if seq > cfg.max_pos:
        raise ValueError(f"gpt2: sequence of {seq} tokens is longer than max_pos={cfg.max_pos}")
    wte = fpp.tied(params["wte"]) if cfg.tie else params["wte"]  # one gather for both use sites
    pos = fpp.ops.positions("tok", seq)
    x = fpp.ops.embed(wte, tokens) + fpp.ops.embed(params["wpe"], pos, vocab="pos")
    x = fpp.ops.rename(x, tok="res_tok")
    body = layer if cfg.layered else block
    for i, p in enumerate(params["h"]):
        x = body(p, x, cfg, seed * 1000 + 2 * i, seq)
    x = fpp.ops.layer_norm(x, params["ln_f"]["weight"], params["ln_f"]["bias"], dim="embd", eps=cfg.eps)
    x = fpp.ops.rename(x, res_tok="tok")
    head = wte if cfg.tie else params["lm_head"]
    return fpp.ops.einsum("batch tok embd, vocab embd -> batch tok vocab", x, head)


def loss(params: dict, batch: dict, cfg: Config, seed=0):
    """Mean next-token cross-entropy; ``batch`` holds named ``tokens`` and ``labels`` (batch tok)."""
    return fpp.ops.cross_entropy(forward(params, batch["tokens"], cfg, seed), batch["labels"])


BATCH_DIMS = {"tokens": "batch tok", "labels": "batch tok"}


def main() -> None:
    import functools

    cfg = Config()
    mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)
    rules_ = rules(sequence_parallel=True)
    step = fpp.train_step(functools.partial(loss, cfg=cfg), fpp.optim.adamw(1e-2), mesh=mesh, rules=rules_,
                          batch_dims=BATCH_DIMS)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (8, cfg.max_pos + 1), generator=g)
    full = {"tokens": data[:, :-1], "labels": data[:, 1:]}

    def device():
        state = step.init(fpp.init(init, cfg, mesh=mesh, rules=rules_, seed=0))
        with fpp.use_rules(rules_):
            batch = {k: fpp.named(v, BATCH_DIMS[k]) for k, v in full.items()}   # this device's block
        for _ in range(5):
            state, m = step(state, batch)
            if fpp.current_rank() == 0:
                print(f"step {m['step']}: loss {m['loss']:.4f}")
    fpp.launch(device, mesh)


if __name__ == "__main__":
    main()
