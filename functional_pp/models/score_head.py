"""A score head over the decoder (``Config.score_head``; docs/reward_models.md): ``score``
(hidden -> num_labels) in place of the LM head, as transformers' ``*ForSequenceClassification``
(a reward model: each sequence's scores at its last non-pad token) and ``*ForTokenClassification``
(a process reward model: every token's scores). The decoder's trunk is :func:`llama.hidden_states`,
so every family, layout and adapter of the decoder serves both heads.

The last token is chosen on the host (``data/reward_data.py``'s ``last_token_mask``, transformers' rule: the rightmost
token that is not the pad id) and enters as a one-hot ``batch seq`` mask, so the selection is an
einsum that holds on any layout (a split sequence contributes its part and is summed)."""
from __future__ import annotations

from functional_pp import ops
from functional_pp.parallel.named import Named

__all__ = ["HEADS", "token_scores", "sequence_scores", "head_from_hf", "head_to_hf"]

#: Config.score_head -> the suffix of transformers' class replacing ``ForCausalLM``
HEADS = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}


def _score(x: Named, params: dict, cfg) -> Named:
    rest = " ".join(d for d in x.dims if d != "hidden")
    out = ops.einsum(f"{rest} hidden, hidden labels -> {rest} labels", x, params["score"])
    return out + params["score_bias"] if cfg.score_bias else out


def token_scores(params: dict, tokens: Named, cfg, layer_fn=None, segments: Named | None = None) -> Named:
    """Every token's scores (batch seq labels): *ForTokenClassification's logits."""
    from functional_pp.models import llama
    _need_head(cfg)
    return _score(llama.hidden_states(params, tokens, cfg, layer_fn, segments), params, cfg)


def sequence_scores(params: dict, tokens: Named, last: Named, cfg, layer_fn=None) -> Named:
    """Each sequence's scores (batch labels) at the position ``last`` (batch seq, one-hot:
    ``data.reward_data.last_token_mask``) marks: *ForSequenceClassification's pooled logits."""
    from functional_pp.models import llama
    _need_head(cfg)
    x = llama.hidden_states(params, tokens, cfg, layer_fn)
    pooled = ops.einsum("batch seq hidden, batch seq -> batch hidden", x, last.map(lambda t: t.to(x.data.dtype)))
    return _score(pooled, params, cfg)


def _need_head(cfg) -> None:
    if cfg.score_head is None:
        raise ValueError("the model has no score head (Config.score_head is None: an LM head); set score_head "
                         "'sequence' (reward model) or 'token' (process reward model)")


def head_from_hf(hf: dict) -> dict:
    """The Config fields of the score head a config.json's ``architectures`` names (none for a
    causal LM): ``score_head``, ``num_labels`` (``num_labels`` or ``id2label``'s size),
    ``score_bias`` (token classification's ``token_classification_bias``, default True) and
    ``pad_token_id``."""
    arch = " ".join(hf.get("architectures") or [])
    head = next((h for h, suffix in HEADS.items() if suffix in arch), None)
    if head is None:
        return {}
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    return dict(score_head=head, num_labels=int(labels), pad_token_id=hf.get("pad_token_id"),
                score_bias=bool(hf.get("token_classification_bias", True)) if head == "token" else False)


def head_to_hf(cfg, out: dict) -> dict:
    """``out`` (a causal LM's config.json) as the class of ``cfg.score_head``."""
    if cfg.score_head is None:
        return out
    arch = out["architectures"][0]
    if arch.endswith(HEADS[cfg.score_head]):
        return out
    base = arch[:-len("ForCausalLM")] if arch.endswith("ForCausalLM") else arch.removesuffix("LMHeadModel")
    out = {**out, "architectures": [base + HEADS[cfg.score_head]], "num_labels": cfg.num_labels,
           "id2label": {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
           "label2id": {f"LABEL_{i}": i for i in range(cfg.num_labels)}, "pad_token_id": cfg.pad_token_id}
    if cfg.score_head == "token":
        out.update(token_classification_bias=cfg.score_bias, classifier_dropout=0.0)
    return out
