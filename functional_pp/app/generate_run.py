"""``functional-pp generate SOURCE --prompt TEXT ...`` (docs/generation.md, "From the command
line"): the model of a training run's output directory (its newest checkpoint, adapters merged;
the run's tokenizer and chat template) or of a Hugging Face directory; the prompts tokenized as
transformers' ``tokenizer(text)`` (with ``chat``: one user turn rendered by the chat template
with its generation prompt, as ``apply_chat_template(add_generation_prompt=True)``), generated
in one left-padded batch by :func:`functional_pp.models.sampling.generate`, on one device or
under a layout (``dp_shard_size`` x ``tp_size``, FSDP x TP) on simulated devices or torchrun's
processes; each completion ends before its first stop token (the tokenizer's EOS, its chat
end-of-turn token, the run's ``eot_tokens``) and is decoded without special tokens."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from functional_pp.config import ConfigError
from functional_pp.models.sampling import check_compile

__all__ = ["GenerationModel", "load_model", "encode_prompts", "mesh_for", "complete", "decode_completion",
           "as_json", "LAYOUT_KEYS"]

#: the layout keys generation takes (from the run's config or ``--set``): data parallel and FSDP x TP
LAYOUT_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size")


@dataclass
class GenerationModel:
    """A model to generate from: its config, whole parameters, tokenizer, chat template (None:
    none), stop tokens and the layout keys of the run that trained it."""

    cfg: Any
    params: dict
    tokenizer: Any
    template: str | None
    stop_ids: list[int]
    layout: dict
    source: str


def load_model(source: str | os.PathLike, step: int | None = None) -> GenerationModel:
    """The model of run directory / checkpoint ``source`` (its newest checkpoint, or ``step``)
    or of Hugging Face directory ``source``; a missing or empty source raises ConfigError."""
    p = Path(source)
    if not p.exists():
        raise ConfigError(f"{source}: no such directory (give a training run's output directory or a Hugging "
                          f"Face model directory)")
    from functional_pp.checkpoint import format as fmt
    is_run = ((p / "checkpoints").is_dir() or (p / fmt.INDEX).is_file() or (p / fmt.LATEST).exists()
              or any(fmt.STEP_RE.match(c.name) for c in p.iterdir() if c.is_dir()))
    if not is_run and (p / "config.json").is_file():
        return _hf_model(p)
    if not is_run:
        raise ConfigError(f"{source}: holds no checkpoint (checkpoints/) and no Hugging Face config.json; train "
                          f"first (functional-pp train CONFIG) or give a run's output directory")
    return _run_model(p, step)


def _hf_model(p: Path) -> GenerationModel:
    from functional_pp.checkpoint.hf import config_from_hf, load_hf_llama
    from functional_pp.data.formats import ByteTokenizer
    from functional_pp.data.tokenizer import HFTokenizer
    try:
        _refuse_uncached(config_from_hf(p), p)        # (config.json alone: before the weights load)
        cfg, params = load_hf_llama(p, dtype=torch.float32)
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    tok = HFTokenizer(p) if (p / "tokenizer.json").is_file() else ByteTokenizer()
    return GenerationModel(cfg, params, tok, tok.chat_template, _stops(tok, [], p), {}, str(p))


def _run_model(p: Path, step: int | None) -> GenerationModel:
    from functional_pp.app.export import full_params, resolve_run_checkpoint
    from functional_pp.checkpoint import CheckpointError
    from functional_pp.checkpoint import format as fmt
    from functional_pp.checkpoint.hf import config_from_index
    try:
        ckpt = resolve_run_checkpoint(p, step)
        index = fmt.read_index(ckpt)
        cfg = config_from_index(index)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"{p}: {exc} (train first, or name a step that was saved)") from exc
    _refuse_uncached(cfg, p)
    meta, run = index.get("metadata") or {}, index.get("config") or {}
    params = full_params(ckpt)
    if meta.get("lora") is not None:              # the adapters merged: a plain model, as export does
        from functional_pp.adapters import LoraConfig, merge
        from functional_pp.app.export import run_nvfp4_scales
        lora = LoraConfig(**meta["lora"])
        params = merge(params, lora, run_nvfp4_scales(params, lora, meta.get("base_model")))
    tok = _run_tokenizer(meta, run)
    template = None
    if tok.chat_template is not None or run.get("chat_template") or run.get("chat_template_jinja"):
        from functional_pp.data.chat import resolve_template
        try:
            template = resolve_template(run.get("chat_template"), run.get("chat_template_jinja"),
                                        tok.chat_template)[0]
        except ValueError:
            template = None                       # (refused with its reason only when --chat asks for it)
    layout = {k: run[k] for k in LAYOUT_KEYS + ("cp_size", "pp_size", "ep_size") if isinstance(run.get(k), int)}
    return GenerationModel(cfg, params, tok, template, _stops(tok, run.get("eot_tokens") or [], meta.get("base_model")),
                           layout, str(p))


def _refuse_uncached(cfg: Any, source: Path) -> None:
    """Refuse, before the weights load, a model that cannot sample with a key / value cache
    (``ModelFamily.sampling_refusal``: LFM2's conv layers, Gated DeltaNet layers)."""
    from functional_pp.models import LLAMA
    refusal = LLAMA.sampling_refusal(cfg, "functional-pp generate")
    if refusal:
        raise ConfigError(f"{source}: {refusal}")


def _run_tokenizer(meta: dict, run: dict):
    """The run's tokenizer (the one saved with added tokens, or base_model's), or bytes."""
    from functional_pp.data.formats import ByteTokenizer
    from functional_pp.data.tokenizer import HFTokenizer
    folder = meta.get("tokenizer_dir")
    if folder is None or not Path(folder).exists():
        return ByteTokenizer()
    tok = HFTokenizer(folder, model_dir=meta.get("base_model"))
    if run.get("special_tokens"):
        tok.set_special_tokens(run["special_tokens"])
    return tok


def _stops(tok: Any, eot_tokens: Sequence[str], model_dir: str | os.PathLike | None = None) -> list[int]:
    """The tokenizer's EOS, its chat end-of-turn token, the run's ``eot_tokens`` (one token each)
    and every ``eos_token_id`` of the model's ``generation_config.json`` / ``config.json`` (a
    list in Llama 3's: transformers' ``generate`` stops at each)."""
    ids = [getattr(tok, "eos_id", None), getattr(tok, "chat_eos_id", None)]
    ids += [tok.token_to_id(t) for t in eot_tokens]
    for name in ("generation_config.json", "config.json"):
        f = Path(model_dir) / name if model_dir is not None else None
        if f is not None and f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    return [int(i) for n, i in enumerate(ids) if i is not None and i not in ids[:n]]


def encode_prompts(model: GenerationModel, texts: Sequence[str], chat: bool, max_new_tokens: int) -> list[list[int]]:
    """The prompts' token ids; an empty prompt, a chat without a template, or a prompt that with
    ``max_new_tokens`` exceeds the model's context raises ConfigError naming it."""
    if not texts:
        raise ConfigError("give at least one --prompt TEXT")
    if chat and model.template is None:
        raise ConfigError(f"--chat: {model.source} has no chat template (the tokenizer's chat_template, or the "
                          f"run's chat_template key); drop --chat or use a model with one")
    out = []
    for i, text in enumerate(texts, 1):
        if not text.strip():
            raise ConfigError(f"--prompt {i} is empty; give the text to continue")
        if chat:
            from functional_pp.data.chat import render
            rendered = render(model.template, [{"role": "user", "content": text}],
                              getattr(model.tokenizer, "special_tokens", None) or {}, add_generation_prompt=True)[0]
            ids = model.tokenizer.encode(rendered)
        else:
            ids = model.tokenizer.encode_as_transformers(text)
        context = model.cfg.max_seq
        if len(ids) + max_new_tokens > context:
            raise ConfigError(f"--prompt {i} is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                              f"{len(ids) + max_new_tokens} positions, past the model's context of {context} "
                              f"(max_position_embeddings); shorten the prompt or lower --max-new-tokens")
        out.append(ids)
    return out


def mesh_for(layout: dict, world_size: int):
    """The mesh of ``world_size`` devices for layout keys ``layout`` (``dp_shard_size`` takes
    what ``dp_replicate_size`` x ``tp_size`` leave when not given); cp / pp / ep are refused."""
    from functional_pp.core.mesh import Mesh
    for key in ("cp_size", "pp_size", "ep_size"):
        if layout.get(key, 1) != 1:
            raise ConfigError(f"generate: {key}={layout[key]} is not supported (generation splits the batch "
                              f"and the weights: {', '.join(LAYOUT_KEYS)}); --set {key}=1")
    tp, rep = layout.get("tp_size", 1), layout.get("dp_replicate_size", 1)
    shard = layout.get("dp_shard_size", -1)
    if shard in (-1, None) or tp * rep * shard != world_size:
        if world_size % (tp * rep):
            raise ConfigError(f"generate: tp_size={tp} x dp_replicate_size={rep} does not divide the "
                              f"{world_size} devices; --set tp_size=... to a divisor")
        shard = world_size // (tp * rep)
    return Mesh(dp_replicate=rep, dp_shard=shard, tp=tp)


def complete(model: GenerationModel, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, world_size: int = 1,
             layout: dict | None = None, simulate: bool | None = None, compile: bool | str = False
             ) -> list[list[int]]:
    """Each prompt's new tokens (up to ``max_new_tokens``, its stop token included when drawn):
    one left-padded batch, on one device or on ``world_size`` devices laid out by ``layout``
    (simulated, or this process's rank under torchrun: ``simulate`` False): the weights FSDP x
    TP, the rows split over the data axes when they divide them (else computed on every device),
    every device drawing one device's tokens. ``compile``: a compiled decode step
    (``generate(compile=...)``)."""
    from functional_pp.models.sampling import left_padded
    pad = model.stop_ids[0] if model.stop_ids else 0
    from functional_pp.app.world import select_device
    from functional_pp.devices.launch import under_torchrun
    mesh = None if world_size == 1 else mesh_for({**model.layout, **(layout or {})}, world_size)
    tokens, mask = left_padded([list(p) for p in prompt_ids], pad)
    torchrun = simulate is False or (simulate is None and under_torchrun())
    device = select_device(not torchrun and world_size > 1, world_size, torchrun)   # (None: the CPU)
    run = functools.partial(_generate_on_device, model, tokens, mask, pad, device,
                            dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, compile=compile))
    if mesh is None:
        out = run()
    else:
        import functional_pp as fpp
        got = fpp.launch(run, mesh, simulate=simulate)
        out = got[0] if isinstance(got, list) else got
    stops = set(model.stop_ids)
    result = []
    for i in range(len(prompt_ids)):
        new = out[i, tokens.size(1):].tolist()
        end = next((k for k, t in enumerate(new) if t in stops), None)
        result.append(new if end is None else new[:end + 1])
    return result


def _generate_on_device(model: GenerationModel, tokens: torch.Tensor, mask: torch.Tensor, pad: int,
                        device: torch.device | None, kw: dict) -> torch.Tensor:
    """The batch's tokens on this device (its shards of the parameters under a launch), the
    parameters and prompts moved to ``device`` (None: kept on the CPU); returned on the CPU."""
    from functional_pp.core.runtime import current_context
    from functional_pp.core.tree import tree_map
    from functional_pp.models import llama
    from functional_pp.models.sampling import generate
    from functional_pp.parallel import sharding
    decls = llama.init(model.cfg, torch.float32)
    ctx = current_context(required=False)
    forward = functools.partial(llama.forward, cfg=model.cfg)
    tokens, mask = (tokens, mask) if device is None else (tokens.to(device), mask.to(device))

    def placed(tree):
        return tree if device is None else tree_map(lambda x: x.to(device), tree)
    if ctx is None:
        params = sharding.named_tree(placed(model.params), decls)
        return generate(forward, params, tokens, attention_mask=mask, eos_id=model.stop_ids or None, pad_id=pad,
                        **kw).cpu()
    import functional_pp as fpp
    rules = llama.default_rules()
    if tokens.size(0) % ctx.mesh.axis_size(("dp_replicate", "dp_shard")):
        rules = rules.replace(batch=None)         # rows the data axes cannot split: every device computes all
    with fpp.use_rules(rules):
        local = placed(sharding.shard(model.params, decls, ctx.mesh, rules, fpp.current_rank()))
        return generate(forward, sharding.named_tree(local, decls), tokens, attention_mask=mask,
                        eos_id=model.stop_ids or None, pad_id=pad, **kw).cpu()


def generation_memory(model: GenerationModel, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
                      world_size: int = 1, layout: dict | None = None) -> str:
    """The dry run of generating the prompts (one left-padded batch) on one device of the
    layout ``complete`` would use (:func:`functional_pp.plan.estimate_generation`), as text:
    weights, key / value cache, one forward's temporaries and the peak, per device."""
    from functional_pp.app.report import human_bytes
    from functional_pp.core.mesh import Mesh
    from functional_pp.models import llama
    from functional_pp.plan.generation import estimate_generation
    mesh = Mesh() if world_size == 1 else mesh_for({**model.layout, **(layout or {})}, world_size)
    batch, length = len(prompt_ids), max(len(p) for p in prompt_ids)
    rules = llama.default_rules()
    if batch % mesh.axis_size(("dp_replicate", "dp_shard")):
        rules = rules.replace(batch=None)         # as complete(): every device computes all the rows
    est = estimate_generation(functools.partial(llama.forward, cfg=model.cfg), llama.init(model.cfg, torch.float32),
                              mesh, rules, batch=batch, prompt=length, new_tokens=max_new_tokens)
    sizes = " x ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
    return "\n".join([
        f"generation memory per device ({sizes}; {batch} rows x ({length} prompt + {max_new_tokens} new) tokens):",
        f"  weights            {human_bytes(est.param_bytes)}",
        f"  key / value cache  {human_bytes(est.cache_bytes)}",
        f"  forward            {human_bytes(est.forward_bytes)}",
        f"  peak               {human_bytes(est.peak_bytes)}"])


def decode_completion(model: GenerationModel, ids: Sequence[int]) -> tuple[str, str]:
    """``(text, finish_reason)``: the completion decoded without its stop token and special
    tokens; ``"stop"`` when it ended at a stop token, else ``"length"``."""
    stopped = bool(ids) and int(ids[-1]) in set(model.stop_ids)
    body = list(ids[:-1]) if stopped else list(ids)
    return model.tokenizer.decode(body, skip_special_tokens=True), "stop" if stopped else "length"


def as_json(prompts: Sequence[str], completions: Sequence[Sequence[int]], model: GenerationModel) -> str:
    """The machine-readable output: one object per prompt (prompt, completion, ids, finish reason)."""
    rows = []
    for text, ids in zip(prompts, completions):
        completion, reason = decode_completion(model, ids)
        rows.append({"prompt": text, "completion": completion, "completion_ids": [int(i) for i in ids],
                     "finish_reason": reason})
    return json.dumps({"completions": rows}, ensure_ascii=False)
