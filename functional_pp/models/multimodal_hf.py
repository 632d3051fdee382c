"""The ``config.json`` of a multimodal class around its text decoder's and its tower's: the envelope
each vision family's writer fills (``config_to_hf`` of the modules of ``llama_hf.VISION_HF``, pixtral_hf)."""
from __future__ import annotations

from typing import Any


def wrapped_config(model_type: str, cls: str, text: dict, vision: dict, tie_default: bool,
                   text_config: dict | None = None, **extra: Any) -> dict:
    """``model_type``'s ``config.json`` (class ``cls``): ``text_config`` (default ``text``, its
    ``architectures`` dropped) and ``vision`` as its sub-configs, then ``extra``, ``text``'s
    ``tie_word_embeddings`` (``tie_default`` where it has none: the class's default) and its ``dtype``."""
    sub = {k: x for k, x in (text if text_config is None else text_config).items() if k != "architectures"}
    out = {"model_type": model_type, "architectures": [cls], "text_config": sub, "vision_config": vision, **extra,
           "tie_word_embeddings": text.get("tie_word_embeddings", tie_default)}
    if "dtype" in text:
        out["dtype"] = text["dtype"]
    return out
