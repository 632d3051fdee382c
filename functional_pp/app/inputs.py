"""What a run starts from: the model (a preset, or a Hugging Face ``base_model`` directory read
slice by slice on every device), its tokenizer and the training / held-out data. Used by :mod:`functional_pp.app.loop`; see ``docs/finetune.md``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from functional_pp.config import ConfigError, TrainConfig, model_config

__all__ = ["model_config", "load_tokenizer", "RunData", "load_data", "data_paths", "check_batches", "base_params",
           "frozen_in_compute_dtype"]


def load_tokenizer(cfg: TrainConfig):
    """The run's tokenizer (``tokenizer``, ``data.tokenizer`` or ``base_model``'s), or None
    for byte-level training."""
    path = cfg.tokenizer or cfg.data.tokenizer
    if cfg.tokenizer_use_mistral_common:
        from functional_pp.data.mistral_tokenizer import MistralCommonTokenizer
        try:
            return MistralCommonTokenizer(path or cfg.base_model)
        except (FileNotFoundError, ValueError, ImportError) as exc:
            raise ConfigError(f"tokenizer_use_mistral_common: {exc}") from exc
    if path is None and cfg.base_model is not None and (Path(cfg.base_model) / "tokenizer.json").is_file():
        path = cfg.base_model
    if path is None:
        if cfg.base_model is not None and (cfg.datasets or cfg.data.path):
            raise ConfigError(f"base_model {cfg.base_model!r} has no tokenizer.json: give tokenizer: "
                              f"PATH (a tokenizer.json or a directory holding one)")
        if cfg.special_tokens:
            raise ConfigError(f"special_tokens {cfg.special_tokens} need a tokenizer (this run is "
                              f"byte-level): give tokenizer: PATH or remove them")
        return None
    from functional_pp.data.tokenizer import HFTokenizer
    try:
        tok = HFTokenizer(path, model_dir=cfg.base_model)
        if cfg.tokens:
            tok.add_tokens(cfg.tokens)
        if cfg.special_tokens:
            tok.set_special_tokens(cfg.special_tokens)
        return tok
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"tokenizer: {exc}") from exc


def _data_settings(cfg: TrainConfig) -> dict:
    """Every config value the tokenized datasets depend on (data/prepared.py's key)."""
    import dataclasses
    keys = ("sequence_len", "sample_packing", "val_set_size", "seed", "train_on_inputs", "chat_template",
            "chat_template_jinja", "eot_tokens", "chat_template_kwargs", "excess_length_strategy",
            "min_sample_len", "dataset_exact_deduplication", "special_tokens", "tokens", "tokenizer", "base_model",
            "tokenizer_use_mistral_common")
    from functional_pp.version import __version__
    return {"datasets": [dataclasses.asdict(e) for e in cfg.datasets], "data_tokenizer": cfg.data.tokenizer,
            **{k: getattr(cfg, k) for k in keys}, "template_files": _template_files(cfg),
            "functional_pp": __version__}


def _template_files(cfg: TrainConfig) -> dict:
    """The contents' hashes of the ``.jinja`` files named by ``chat_template_jinja`` (top level
    and per dataset): an edited template tokenizes again (the key holds the path, not the text)."""
    import hashlib
    out = {}
    for jinja in [cfg.chat_template_jinja, *(getattr(e, "chat_template_jinja", None) for e in cfg.datasets)]:
        if isinstance(jinja, str) and len(jinja) < 4096 and "\n" not in jinja and Path(jinja).is_file():
            out[jinja] = hashlib.sha256(Path(jinja).read_bytes()).hexdigest()
    return out


def data_paths(cfg: TrainConfig) -> list:
    """The files the training tokens are read from: the datasets (or ``data.path``) and the
    tokenizer's."""
    tok = cfg.tokenizer or cfg.data.tokenizer
    toks = [tok] if tok else ([Path(cfg.base_model) / n for n in ("tokenizer.json", "tokenizer_config.json",
                                                                    "special_tokens_map.json", "config.json",
                                                                    "chat_template.jinja", "tekken.json")]
                              if cfg.base_model else [])
    return [e.path for e in cfg.datasets or []] + ([cfg.data.path] if cfg.data.path and not cfg.datasets else []) + toks


@dataclass
class RunData:
    """Training tokens (a corpus or a token stream), held-out tokens, the tokenizer."""

    train: Any
    val: Any | None
    tokenizer: Any | None

    @property
    def vocab_size(self) -> int:
        return int(self.train.vocab_size)


def load_data(cfg: TrainConfig) -> RunData:
    """Read ``datasets`` (or the single ``data`` corpus) into training and held-out tokens."""
    tok = load_tokenizer(cfg)
    if cfg.processor_type:                 # (images: the processor's own tokenizer encodes the rows)
        from functional_pp.data.tokenizer import HFTokenizer
        tok = HFTokenizer(cfg.base_model, model_dir=cfg.base_model)
    try:
        if cfg.datasets:
            from functional_pp.data.formats import build_streams

            def build():
                return build_streams(cfg.datasets, tok, seq_len=cfg.sequence_len,
                                     sample_packing=cfg.sample_packing,
                                     val_set_size=cfg.val_set_size, seed=cfg.seed,
                                     train_on_inputs=cfg.train_on_inputs,
                                     chat_template=cfg.chat_template,
                                     chat_template_jinja=cfg.chat_template_jinja,
                                     eot_tokens=cfg.eot_tokens,
                                     chat_template_kwargs=cfg.chat_template_kwargs,
                                     excess_length_strategy=cfg.excess_length_strategy,
                                     min_sample_len=cfg.min_sample_len,
                                     deduplicate=cfg.dataset_exact_deduplication,
                                     vision=image_settings(cfg))
            if cfg.dataset_prepared_path is None or cfg.processor_type:    # (images: encoded at each start)
                train, val = build()
            else:
                from functional_pp.data.prepared import load_or_build
                train, val, what = load_or_build(cfg.dataset_prepared_path, _data_settings(cfg),
                                                 data_paths(cfg), build)
                train.prepared = what
            return RunData(train, val, tok)
        from functional_pp.data import load_corpus
        if cfg.tokenizer_use_mistral_common:
            raise ConfigError("data.path with tokenizer_use_mistral_common: give the files as datasets: "
                              "[{path: ..., type: completion}]")
        corpus = load_corpus(cfg.data.path, kind=cfg.data.kind,
                             tokenizer=tok.tok if tok is not None else None,
                             max_bytes=cfg.data.max_bytes, pattern=cfg.data.pattern,
                             text_field=cfg.data.text_field)
        val = None
        if cfg.val_set_size > 0:
            frac = cfg.val_set_size if cfg.val_set_size < 1 else (
                cfg.val_set_size * (cfg.sequence_len + 1) / len(corpus))
            corpus, val = corpus.split(frac)
        return RunData(corpus, val, tok)
    except (FileNotFoundError, NotADirectoryError, ValueError, ImportError) as exc:
        raise ConfigError(f"data: {exc}") from exc


def image_settings(cfg: TrainConfig) -> dict | None:
    """``processor_type``: base_model's processor and how its model cuts images (build_streams' ``vision``)."""
    if not cfg.processor_type:
        return None
    from functional_pp.config.models import model_config
    from functional_pp.data.chat import template_names, template_text
    from functional_pp.data.vision_chat import load_processor
    from functional_pp.models import (gemma4_unified, gemma4_vision, glm4v_vision, internvl, lfm2_vl, llama4_vision,
                                      qwen_vision)
    mc = model_config(cfg)
    v = mc.vision
    proc = load_processor(cfg.base_model)
    name = cfg.chat_template
    if name == "jinja" or (name and name in template_names()):    # (Axolotl: the named template renders the rows)
        import dataclasses
        text = template_text(name) if name != "jinja" else cfg.chat_template_jinja
        if name == "jinja" and Path(str(text)).is_file():
            text = Path(text).read_text()
        replies = "[/INST]" if name == "pixtral" and not cfg.train_on_inputs else None   # (its Pixtral strategy)
        proc = dataclasses.replace(proc, chat_template=text, reply_after=replies)
    # (the towers whose processor lays images out its own way; the others read Pixtral's or LLaVA's)
    own = {**dict.fromkeys(qwen_vision.TOWERS + glm4v_vision.TOWERS, "qwen"),
           **dict.fromkeys(gemma4_vision.TOWERS + gemma4_unified.TOWERS, "gemma4"),
           **dict.fromkeys(llama4_vision.TOWERS, "llama4"), **dict.fromkeys(lfm2_vl.TOWERS, "lfm2_vl"),
           **dict.fromkeys(internvl.TOWERS, "internvl")}
    if own.get(v.tower, proc.layout) != proc.layout or (v.tower not in own and proc.layout in own.values()):
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s processor lays images out as {proc.layout}'s, "
                         f"its model's vision tower is {v.tower}: the files disagree")
    if proc.layout in _OWN_SETTINGS:
        return _OWN_SETTINGS[proc.layout](cfg, proc, v)
    token = proc.media_ids()[0]
    if own.get(v.tower) == "qwen":
        if (proc.patch, proc.merge, token) != (v.patch_size, v.merge, v.image_token_id) or \
                getattr(proc.image_processor, "temporal_patch_size", v.temporal_patch) != v.temporal_patch:
            raise ValueError(f"processor_type: base_model {cfg.base_model}'s image processor cuts {proc.patch}-pixel "
                             f"patches merged {proc.merge} x {proc.merge} with image token id {token}, its model "
                             f"{v.patch_size}-pixel patches (patch_size) merged {v.merge} x {v.merge} "
                             f"(spatial_merge_size) with image_token_id {v.image_token_id}: the files disagree")
        return {"processor": proc, "patch": v.patch_size, "merge": v.merge, "image_token_id": v.image_token_id,
                "qwen": {"side": v.side, "channels": v.channels, "temporal_patch": v.temporal_patch,
                         "resample": v.resample, "raster": v.tower == "paddleocr_vl"}}
    if proc.patch != v.patch_size * v.merge or token != v.image_token_id:
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s processor cuts images in {proc.patch}-pixel "
                         f"tokens with image token id {token}, its model in {v.patch_size * v.merge} (patch_size x "
                         f"spatial_merge_size) with image_token_index {v.image_token_id}: the files disagree")
    clip = v.tower == "clip"
    if clip and (proc.layout != "llava" or proc.extra != (v.select_strategy == "full")):
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s processor ({proc.layout}) writes {proc.extra} "
                         f"image tokens beyond the patches, its model's CLIP tower gives "
                         f"{int(v.select_strategy == 'full')} (vision_feature_select_strategy "
                         f"{v.select_strategy!r}): the files disagree")
    return {"processor": proc, "patch": v.patch_size, "merge": v.merge, "image_token_id": v.image_token_id,
            "class_token": ("kept" if v.select_strategy == "full" else "dropped") if clip else None,
            "image_size": v.image_size if clip else None, "groups": mc.image_groups_attend}


def _llama4_settings(cfg: TrainConfig, proc: Any, v: Any) -> dict:
    """Llama 4's image settings: its tiles (each with a trailing class token's slot), once the
    processor's files and the model's agree on the tile, the patch, the merge and ``<|patch|>``."""
    patch_id = proc.tokenizer.convert_tokens_to_ids(proc.patch_token)
    have = (proc.image_processor.size, proc.patch, proc.extra, patch_id)
    want = (v.image_size, v.patch_size, v.grid ** 2 // v.merge ** 2, v.image_token_id)
    if have != want:
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s processor makes tiles of {have[0]} pixels, "
                         f"{have[1]}-pixel patches, {have[2]} {proc.patch_token} tokens (id {have[3]}) per tile; its "
                         f"model {want[0]} (image_size), {want[1]} (patch_size), {want[2]} (pixel_shuffle_ratio) with "
                         f"image_token_index {want[3]}: the files disagree")
    return {"processor": proc, "patch": v.patch_size, "merge": v.merge, "image_token_id": v.image_token_id,
            "class_token": "trailing", "image_size": v.image_size}

def _lfm2_vl_settings(cfg: TrainConfig, proc: Any, v: Any) -> dict:
    """LFM2-VL's image settings (SigLIP2's patches, downsampled), once its processor's files and the model's agree."""
    token = proc.media_ids()[0]
    if (proc.patch, proc.merge, token) != (v.patch_size, v.merge, v.image_token_id):
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s image processor cuts {proc.patch}-pixel "
                         f"patches downsampled {proc.merge} x {proc.merge} with image token id {token}, its model "
                         f"{v.patch_size}-pixel patches (patch_size) downsampled {v.merge} x {v.merge} "
                         f"(downsample_factor) with image_token_id {v.image_token_id}: the files disagree")
    return {"processor": proc, "patch": v.patch_size, "merge": v.merge, "image_token_id": v.image_token_id,
            "siglip2": {"side": v.side, "channels": v.channels}}


def _internvl_settings(cfg: TrainConfig, proc: Any, v: Any) -> dict:
    """InternVL's image settings (tiles, each class slot dropped), once its processor's files and the model's agree."""
    token = proc.media_ids()[0]
    if (proc.patch, proc.extra, token) != (v.image_size, (v.grid // v.merge) ** 2, v.image_token_id):
        raise ValueError(f"processor_type: base_model {cfg.base_model}'s processor cuts {proc.patch}-pixel "
                         f"tiles of {proc.extra} image tokens (image_seq_length) with image token id {token}, "
                         f"its model {v.image_size}-pixel tiles (image_size) of {(v.grid // v.merge) ** 2} with "
                         f"image_token_id {v.image_token_id}: the files disagree")
    return {"processor": proc, "patch": v.patch_size, "merge": v.merge, "image_token_id": v.image_token_id,
            "class_token": "dropped", "image_size": v.image_size}


#: the layouts whose image settings their own function gives (the others: Qwen's, Pixtral's, LLaVA's, below)
_OWN_SETTINGS = {"llama4": _llama4_settings, "lfm2_vl": _lfm2_vl_settings, "internvl": _internvl_settings}



def check_batches(cfg: TrainConfig, data: RunData, global_batch: int) -> int:
    """Steps per epoch of the training data; raises :class:`ConfigError` when the training or
    held-out tokens cannot fill a batch of ``global_batch`` sequences."""
    from functional_pp.data import DataLoader
    steps = 0
    for part, tokens in (("", data.train), (" (held-out part)", data.val)):
        if tokens is None:
            continue
        try:
            loader = DataLoader(tokens, global_batch_size=global_batch, seq_len=cfg.sequence_len,
                                seed=cfg.seed, drop_last=not part)
        except ValueError as exc:
            raise ConfigError(f"data{part}: {exc}") from exc
        steps = steps or loader.steps_per_epoch
    return steps


def base_params(cfg: TrainConfig, model_cfg, decls: Any, mesh, rules, device=None, run_decls: Any = None) -> Any:
    """This device's shards of ``base_model``'s weights as named parameters (inside
    :func:`functional_pp.launch`: only the rows / columns of each tensor it holds are read), each
    in the dtype ``run_decls`` (the run's declarations, :func:`frozen_and_adapters`) give it: a
    frozen weight in the compute dtype (:func:`frozen_in_compute_dtype`), a trained one in fp32
    (default: all fp32). The ``lora_modules_to_save`` come from ``lora_model_dir`` when it holds
    them (peft writes them there)."""
    from functional_pp.adapters import split
    from functional_pp.checkpoint import hf
    from functional_pp.core.runtime import current_rank
    from functional_pp.core.tree import leaves_with_paths, map_with_path
    from functional_pp.parallel.sharding import shard
    wanted = {p: d.dtype for p, d in leaves_with_paths(split(run_decls)[0])} if run_decls is not None else {}

    def dtype_of(path: str) -> torch.dtype:
        return wanted.get(path, torch.float32)
    grow = bool(cfg.tokens or cfg.resize_token_embeddings_to_32x)
    quant = cfg.base_quantization()
    saved = _saved_modules(cfg, decls)        # lora_modules_to_save from lora_model_dir, whole
    fresh = new_score_head(cfg, model_cfg)
    if quant is None:
        tensors = hf.load_hf_params(cfg.base_model, model_cfg, decls, dtype=dtype_of, mesh=mesh,
                                    rules=rules, device=device, grow_vocab=grow, fresh=fresh, seed=cfg.seed)
        if saved:
            by_path = dict(leaves_with_paths(decls))
            mine = {p: x.to(dtype_of(p)) for p, x in saved.items()}
            mine = shard(mine, {p: by_path[p] for p in mine}, mesh, rules, current_rank()) if mesh is not None else mine
            tensors = map_with_path(lambda p, x: mine[p].to(x.device) if p in mine else x, tensors)
    else:       # whole weights quantized (as bitsandbytes does), then this device's shards of the codes
        from functional_pp.models.quantize import quantize_linear_weights
        full = hf.load_hf_params(cfg.base_model, model_cfg, decls, dtype=torch.float32, grow_vocab=grow,
                                 fresh=fresh, seed=cfg.seed)
        full = map_with_path(lambda p, x: saved.get(p, x), full)
        full, decls = quantize_linear_weights(full, decls, quant["kind"], double_quant=quant["double_quant"],
                                              experts=quant["experts"])
        full = map_with_path(lambda p, x: x.to(dtype_of(p)) if x.is_floating_point() else x, full)
        return _this_devices(full, decls, mesh, rules, device)
    return _named_params(tensors, decls, mesh, rules)


def _this_devices(full: Any, decls: Any, mesh, rules, device=None) -> Any:
    """This device's shards (on ``device``) of the whole tensors ``full``, as named parameters."""
    from functional_pp.core.runtime import current_rank
    from functional_pp.core.tree import map_with_path
    from functional_pp.parallel.sharding import shard
    tensors = shard(full, decls, mesh, rules, current_rank()) if mesh is not None else full
    if device is not None:
        tensors = map_with_path(lambda p, x: x.to(device), tensors)
    return _named_params(tensors, decls, mesh, rules)


def _named_params(tensors: Any, decls: Any, mesh, rules) -> Any:
    """This device's tensors as the named parameters ``decls`` declare, laid out by ``rules``."""
    from functional_pp.core.tree import map_with_path
    from functional_pp.parallel.named import Named

    def wrap(p, x, d):
        return Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name=p), sizes=d.shape, is_param=True)
    return map_with_path(wrap, tensors, decls)


def loftq_params(cfg: TrainConfig, model_cfg, base_decls: Any, decls: Any, mesh, rules, device=None) -> Any:
    """This device's shards of the base model and its adapters initialised by LoftQ (``peft:
    {loftq_config: ...}``, adapters/loftq.py): every weight read whole in fp32, the adapted ones
    replaced by their quantized form and their adapters by the SVD of the rest (peft's
    ``init_lora_weights="loftq"``), then laid out by the rules as any other run's."""
    from functional_pp.adapters import joined, split
    from functional_pp.adapters.loftq import adapted_in_dims, loftq_init
    from functional_pp.adapters.peft_fused import fused_module, model_type_of
    from functional_pp.checkpoint import hf
    from functional_pp.core.tree import leaves_with_paths, map_with_path
    lq = cfg.loftq()
    want = split(decls)[1]
    model_type = model_type_of(cfg.base_model)
    fused = sorted(p for p in want if fused_module(p, model_type) is not None)
    if fused:
        raise ConfigError(f"peft.loftq_config: {fused[0]} is a part of a fused Hugging Face module "
                          f"({fused_module(fused[0], model_type)}), whose LoftQ factors the fused matrix: not "
                          f"supported; remove peft.loftq_config or that target")
    full = hf.load_hf_params(cfg.base_model, model_cfg, base_decls, dtype=torch.float32,
                             grow_vocab=bool(cfg.tokens or cfg.resize_token_embeddings_to_32x),
                             fresh=new_score_head(cfg, model_cfg), seed=cfg.seed)
    flat = dict(leaves_with_paths(full))
    try:
        weights, factors = loftq_init(flat, want, adapted_in_dims(base_decls, want), lq["bits"],
                                      lq["iters"])
    except ValueError as exc:
        raise ConfigError(f"peft.loftq_config: {exc}") from exc
    dtypes = {p: d.dtype for p, d in leaves_with_paths(split(decls)[0])}
    base = map_with_path(lambda p, x: weights.get(p, x).to(dtypes.get(p, torch.float32)), full)
    params = joined(base, {p: {k: v.to(torch.float32) for k, v in ab.items()} for p, ab in factors.items()})
    return _this_devices(params, decls, mesh, rules, device)


def new_score_head(cfg: TrainConfig, model_cfg: Any) -> tuple[str, ...]:
    """The score head's parameter paths when ``base_model`` is a causal LM read under one
    (``reward_model`` / ``process_reward_model``): initialised from the run's seed, as
    transformers initialises the head its files lack; empty otherwise."""
    import json

    from functional_pp.models.score_head import head_from_hf
    if getattr(model_cfg, "score_head", None) is None:
        return ()
    hf_cfg = json.loads((Path(cfg.base_model) / "config.json").read_text())
    return () if head_from_hf(hf_cfg) else ("score", "score_bias")


def _saved_modules(cfg: TrainConfig, decls: Any) -> dict:
    """``{path: full tensor}`` of the ``lora_modules_to_save`` a ``lora_model_dir`` holds (trained
    whole, as peft writes them), else empty."""
    lora = cfg.lora_config()
    if lora is None or cfg.lora_model_dir is None or not lora.modules_to_save:
        return {}
    from functional_pp.adapters.peft_dir import load_saved_modules
    try:
        return load_saved_modules(cfg.lora_model_dir, decls, lora, cfg.base_model)
    except ValueError as exc:
        raise ConfigError(f"lora_model_dir: {exc}") from exc


def frozen_in_compute_dtype(decls: Any, trainable: Any, precision: str) -> Any:
    """``decls`` with every frozen floating-point parameter declared in the compute dtype of
    ``precision`` (bf16 / fp16): the step casts the parameters to it every step and keeps frozen
    ones in their dtype (no fp32 master), so holding them in it is the same computation in half
    the bytes (a LoRA / QLoRA base). Trained parameters (fp32 masters), fp32 runs and quantized
    codes are left as they are."""
    import dataclasses

    from functional_pp.core.tree import leaves_with_paths, map_with_path
    from functional_pp.step.train import PRECISIONS
    compute = PRECISIONS[precision]
    if compute is None or trainable is None:
        return decls
    trained = dict(leaves_with_paths(trainable(decls)))
    return map_with_path(lambda p, d: d if trained[p] or not d.dtype.is_floating_point
                         else dataclasses.replace(d, dtype=compute), decls)


def adapter_params(cfg: TrainConfig, decls: dict, mesh, rules, device=None) -> Any:
    """This device's shards of the LoRA adapters of ``decls`` as named parameters ``{weight path:
    {"lora_A", "lora_B"}}`` (``adapters.split``):
    from ``lora_model_dir`` (a PEFT adapter directory) when given, else initialised as peft
    does (``A`` uniform, ``B`` zeros) from the run's seed."""
    from functional_pp.adapters import split
    from functional_pp.core.runtime import current_rank
    from functional_pp.core.tree import map_with_path
    from functional_pp.parallel.init import init as init_named
    from functional_pp.parallel.named import Named
    from functional_pp.parallel.sharding import shard
    want = split(decls)[1]
    if cfg.lora_model_dir is None:
        return init_named(lambda: want, mesh=mesh, rules=rules, seed=cfg.seed, device=device)
    from functional_pp.adapters.peft_dir import load_adapter
    try:
        full = load_adapter(cfg.lora_model_dir, decls, cfg.lora_config(), cfg.base_model)
    except ValueError as exc:
        raise ConfigError(f"lora_model_dir: {exc}") from exc
    local = shard(full, want, mesh, rules, current_rank()) if mesh is not None else full

    def wrap(p, x, d):
        x = x.to(torch.float32) if device is None else x.to(device=device, dtype=torch.float32)
        return Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name=p), sizes=d.shape, is_param=True)
    return map_with_path(wrap, local, want)


def frozen_and_adapters(cfg: TrainConfig, lora: Any, loss_fn: Any, decls: Any) -> tuple:
    """``(loss, declarations, trainable mask)`` of the run: with ``adapter: lora`` the adapted
    loss, the declarations with the adapters and the LoRA mask; with ``unfrozen_parameters``
    alone the base loss and only those parameters trained; else everything trained;
    ``freeze_mm_modules`` freezes the vision encoder and projector besides. The frozen
    parameters are declared in the run's compute dtype (:func:`frozen_in_compute_dtype`)."""
    loss, decls, trainable = _frozen_and_adapters(cfg, lora, loss_fn, decls)
    if getattr(cfg, "freeze_mm_modules", False):
        from functional_pp import adapters
        from functional_pp.models.pixtral import TOWERS
        trainable = adapters.frozen_under(trainable, TOWERS)
    return loss, frozen_in_compute_dtype(decls, trainable, cfg.resolved_precision()), trainable


def _frozen_and_adapters(cfg: TrainConfig, lora: Any, loss_fn: Any, decls: Any) -> tuple:
    from functional_pp.adapters.peft_fused import decoder_type_of, model_type_of
    qat = cfg.qat_config()
    if qat is not None:             # (full fine-tuning only: checks.check_qat)
        from functional_pp.config import ConfigError
        from functional_pp.core.tree import leaves_with_paths
        from functional_pp.ops import fake_quant
        if any(".experts." in f".{p}." for p, _ in leaves_with_paths(decls)):
            raise ConfigError("qat on a mixture-of-experts model is not supported (its router and experts): "
                              "remove qat")
        loss_fn = fake_quant.adapt(loss_fn, qat)
    from functional_pp import adapters
    from functional_pp.config import ConfigError
    from functional_pp.core.tree import leaves_with_paths
    if lora is not None:
        try:
            scales = None
            if lora.nvfp4_merge_aware and cfg.base_model is not None:   # (what its merged export can write)
                from functional_pp.checkpoint.hf import nvfp4_stored_scales   # (Axolotl's: weight_scale_2)
                scales = nvfp4_stored_scales(cfg.base_model, adapters.targets(decls, lora))
            out = (adapters.adapt(loss_fn, lora, scales),
                   adapters.init(decls, lora, decoder_type_of(cfg.base_model)),
                   adapters.trainable(lora, model_type_of(cfg.base_model)))
        except ValueError as exc:
            raise ConfigError(f"adapter: {cfg.adapter}: {exc}") from exc
        quant = cfg.base_quantization()
        if quant is None:
            return out
        from functional_pp.models.quantize import quantized_decls
        which = "load_in_8bit" if quant["kind"] == "int8" else "adapter: qlora / load_in_4bit"
        if cfg.base_model is None:
            raise ConfigError(f"{which}: quantizes base_model's weights: set base_model (a Hugging Face directory)")
        try:
            qdecls = quantized_decls(out[1], quant["kind"], double_quant=quant["double_quant"],
                                     experts=quant["experts"])
        except ValueError as exc:
            raise ConfigError(f"{which}: {exc}") from exc
        trained = [p for p, t in leaves_with_paths(out[2](qdecls)) if t and ".lora." not in "." + p]
        quantized = {p for p, _ in leaves_with_paths(qdecls)} - {p for p, _ in leaves_with_paths(out[1])}
        clash = sorted(p for p in trained if p in quantized)
        if clash:
            raise ConfigError(f"{which}: {clash[0].rpartition('.')[0]} is quantized (frozen) but lora_modules_to_save "
                              f"/ unfrozen_parameters train it: train it through its adapter instead")
        return out[0], qdecls, out[2]
    if cfg.unfrozen_parameters:
        try:
            adapters.check_names(decls, unfrozen_parameters=cfg.unfrozen_parameters, only_unfrozen=True,
                                 model_type=model_type_of(cfg.base_model))
        except ValueError as exc:
            raise ConfigError(str(exc).removeprefix("LoRA: ")) from exc
        return loss_fn, decls, adapters.unfrozen(cfg.unfrozen_parameters, (), model_type_of(cfg.base_model))
    return loss_fn, decls, None
