"""The hidden states between a model's layers, recorded by wrapping its layer function
(transformers' ``output_hidden_states``): one mechanism for any model whose trunk calls a
``layer_fn(p, x, ...)`` per layer (``llama.hidden_states``, ``llama.forward``, ...)."""
from __future__ import annotations

from typing import Callable

from functional_pp.parallel.named import Named

__all__ = ["LayerRecorder"]


class LayerRecorder:
    """A layer function that calls ``layer_fn`` and records its input to the first layer (the
    embeddings) and each layer's output, in order: ``states[i]`` is the residual stream after
    ``i`` layers, ``states[0]`` the embeddings (transformers' ``hidden_states[i]`` but the last,
    which transformers gives after the final norm)."""

    def __init__(self, layer_fn: Callable) -> None:
        self.layer_fn = layer_fn
        self.states: list[Named] = []

    def __call__(self, p: dict, x: Named, *args, **kwargs) -> Named:
        if not self.states:
            self.states.append(x)
        out = self.layer_fn(p, x, *args, **kwargs)
        self.states.append(out)
        return out
