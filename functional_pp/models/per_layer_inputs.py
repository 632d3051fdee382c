"""Per-layer input embeddings (Gemma 4 E2B / E4B's ``hidden_size_per_layer_input``;
``Config.per_layer_input``): beside the main embedding, every token gets one small vector per
layer, which that layer adds to its residual stream through a gate.

The vectors (``batch seq per_layer`` for each layer) are data each layer reads: they are made once
from the tokens and the (scaled) main embedding by :func:`inputs` and passed to the layer as an
argument (models/llama.py's ``layer``), as transformers' ``Gemma4TextModel`` does:

- ``embed_tokens_per_layer`` (``vocab x layers * per_layer``) rows times ``sqrt(per_layer)``;
- plus the main embedding through ``per_layer_model_projection`` (``hidden -> layers * per_layer``)
  times ``hidden ** -0.5``, each layer's part normed by ``per_layer_projection_norm``;
- the sum times ``2 ** -0.5``.

In each layer, after the MLP (:func:`branch`): ``x + norm(proj(act(gate(x)) * input))`` with
``per_layer_input_gate`` (hidden -> per_layer), the MLP's activation, ``per_layer_projection``
(per_layer -> hidden) and ``post_per_layer_input_norm``."""
from __future__ import annotations

from typing import Any, Callable

import torch

from functional_pp import ops
from functional_pp.parallel.named import Named

__all__ = ["init_model", "init_layer", "inputs", "branch", "MODEL_PARAMS"]

MODEL_PARAMS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
"""The model-level parameters of the per-layer inputs (the first pipeline stage's, with the embedding)."""


def init_model(cfg: Any, w: Callable, param: Callable, ones: str, dtype: torch.dtype) -> dict:
    """The declarations of the model-level tables: the per-layer embedding (a table of rows, its
    ``vocab`` split like the main one's), the projection of the main embedding and its norm."""
    width = cfg.layers * cfg.per_layer_input
    return {"embed_tokens_per_layer": w((cfg.vocab, width), "vocab per_layer_all"),
            "per_layer_model_projection": w((cfg.hidden, width), "hidden per_layer_all"),
            "per_layer_projection_norm": param((cfg.per_layer_input,), "per_layer", init=ones, dtype=dtype)}


def init_layer(cfg: Any, w: Callable, norm: Callable, out_std: float) -> dict:
    """The declarations of one layer's gate, projection and norm."""
    return {"per_layer_input_gate": w((cfg.hidden, cfg.per_layer_input), "hidden per_layer"),
            "per_layer_projection": w((cfg.per_layer_input, cfg.hidden), "per_layer hidden", out_std),
            "post_per_layer_input_norm": norm()}


def inputs(params: dict, tokens: Named, x: Named, cfg: Any, norm: Callable) -> list[Named]:
    """Each layer's input (``batch seq per_layer``) for ``tokens`` and their scaled main embedding
    ``x`` (``batch seq hidden``); ``norm(x, weight)`` the model's RMSNorm."""
    rows = ops.embed(params["embed_tokens_per_layer"], tokens)
    rows = rows * torch.tensor(cfg.per_layer_input ** 0.5, dtype=rows.data.dtype).item()
    proj = ops.einsum("batch seq hidden, hidden per_layer_all -> batch seq per_layer_all", x,
                      params["per_layer_model_projection"]) * cfg.hidden ** -0.5
    split = {"per_layer_layers": cfg.layers, "per_layer": cfg.per_layer_input}
    proj = norm(ops.split_dim(proj, "per_layer_all", split), params["per_layer_projection_norm"])
    both = (proj + ops.split_dim(rows, "per_layer_all", split)) * 2.0 ** -0.5
    return ops.unbind(both, "per_layer_layers")


def branch(p: dict, x: Named, per_layer: Named, act: Callable[[Named], Named],
           norm_at: Callable[[dict, str, Named], Named]) -> Named:
    """The residual branch of one layer's per-layer input ``per_layer`` (``batch seq per_layer``)
    on the residual stream ``x`` (``batch res_seq hidden``)."""
    h = ops.rename(x, res_seq="seq")                      # sequence parallelism: all-gather
    g = act(ops.einsum("batch seq hidden, hidden per_layer -> batch seq per_layer", h, p["per_layer_input_gate"]))
    out = ops.einsum("batch seq per_layer, per_layer hidden -> batch seq hidden", g * per_layer,
                     p["per_layer_projection"])
    return norm_at(p, "post_per_layer_input_norm", ops.rename(out, seq="res_seq"))
