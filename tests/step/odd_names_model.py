"""A tiny model written from the public ops with dimension names unlike Llama's (``rows tok``
for the batch, ``feat`` sharded by FSDP) and no ``fpp.layer``: the FSDP tests' model of
"any model" (tests/step/test_zero3_any_model.py)."""
from __future__ import annotations

import torch

import functional_pp as fpp

VOCAB, FEAT, HID = 32, 8, 16
BATCH_DIMS = {"tokens": "rows tok", "labels": "rows tok"}
RULES = fpp.Rules(rows="dp_shard", feat="dp_shard")     # data over dp_shard, weights sharded along feat


def init(dtype: torch.dtype = torch.float64, tie: bool = False) -> dict:
    def w(shape, dims):
        return fpp.param(shape, dims, init="normal", scale=0.3, dtype=dtype)
    tree = {"emb": w((VOCAB, FEAT), "vocab feat"), "up": w((FEAT, HID), "feat hid"),
            "down": w((HID, FEAT), "hid feat")}
    if not tie:
        tree["head"] = w((FEAT, VOCAB), "feat vocab")
    return tree


def loss(p: dict, batch: dict, tie: bool = False):
    """Embedding, a residual MLP, an LM head (the embedding table itself when ``tie``: a
    parameter used at two sites, not declared ``fpp.tied``)."""
    x = fpp.ops.embed(p["emb"], batch["tokens"])
    h = fpp.ops.gelu(fpp.ops.einsum("rows tok feat, feat hid -> rows tok hid", x, p["up"]))
    x = x + fpp.ops.einsum("rows tok hid, hid feat -> rows tok feat", h, p["down"])
    if tie:
        logits = fpp.ops.einsum("rows tok feat, vocab feat -> rows tok vocab", x, p["emb"])
    else:
        logits = fpp.ops.einsum("rows tok feat, feat vocab -> rows tok vocab", x, p["head"])
    return fpp.ops.cross_entropy(logits, batch["labels"])


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (4, 9), generator=g)
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
