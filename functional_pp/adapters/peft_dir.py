"""The PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), what
``peft.PeftModel.from_pretrained`` loads: our adapters (``in... lora_r`` / ``lora_r out...``)
as peft's ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]`` of the Hugging Face
module that holds the base weight (flattened in the order the base weight's import uses); a DoRA
magnitude (``out...``) as peft's ``lora_magnitude_vector`` ``[out]``."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from functional_pp.adapters.dora import MAGNITUDE
from functional_pp.adapters.lora import LoraConfig, split
from functional_pp.adapters.peft_fused import model_type_of, part_names
from functional_pp.models.llama_hf import MULTIMODAL, RENAMED, hf_name, module_renamed

PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_MAGNITUDE = "lora_magnitude_vector"


def module_name(path: str, model_type: str = "llama") -> str:
    """The Hugging Face module of our weight path in ``model_type``'s model
    (``layers.0.self_attn.q_proj`` -> ``model.layers.0.self_attn.q_proj``; Phi's ``o_proj`` ->
    ``model.layers.0.self_attn.dense``); in a multimodal wrapper's (``llama_hf.MULTIMODAL``: LFM2-VL,
    InternVL, Mistral 3, LLaVA, ...) transformers 5's: its text family's module under
    ``model.language_model.``, the tower's and projector's under ``model.``."""
    name = hf_name(path)
    if name is not None and ".experts." in name:
        raise ValueError(f"PEFT adapter: {path!r} adapts the experts ({name}), which transformers 5 fuses into "
                         f"3-D parameters (peft's target_parameters, gate and up sharing one lora_A); writing "
                         f"expert adapters to a PEFT directory is not built: export the merged model instead "
                         f"(functional-pp export, docs/adapters.md)")
    if name is None or not name.endswith(".weight"):
        raise ValueError(f"PEFT adapter: our weight {path!r} has no Hugging Face module (not in the mapping table)")
    if model_type in MULTIMODAL and model_type not in RENAMED:    # (a wrapper with its own names: RENAMED, Llama 4)
        name = module_renamed(path, MULTIMODAL[model_type] or "llama")
        name = re.sub(r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", name)
        return re.sub(r"^model\.(?!vision_tower\.|multi_modal_projector\.)", "model.language_model.", name)[:-len(".weight")]
    return module_renamed(path, model_type)[:-len(".weight")]


def to_peft(lora: dict, model_type: str = "llama") -> dict[str, torch.Tensor]:
    """Full adapter tensors ``{weight path: {"lora_A", "lora_B"}}`` (``adapters.split``) -> peft's
    state dict (``model_type``'s module names: for a family with fused modules see :func:`save_adapter`)."""
    out = {}
    for path, ab in lora.items():
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[-1]
        m = PREFIX + module_name(path, model_type)
        out[m + ".lora_A.weight"] = a.reshape(-1, r).T.contiguous()
        out[m + ".lora_B.weight"] = b.reshape(r, -1).T.contiguous()
        if MAGNITUDE in ab:
            out[m + "." + PEFT_MAGNITUDE] = ab[MAGNITUDE].reshape(-1).contiguous()
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def from_peft(tensors: dict[str, torch.Tensor], decls: Any, model_type: str = "llama",
              module_scale: Callable[[str], float] | None = None, scale: float | None = None,
              saved_names: Any = None) -> dict:
    """peft's state dict -> our full adapter tensors ``{weight path: {"lora_A", "lora_B"}}``,
    shaped as the adapters of ``decls`` (``adapters.init``); every adapter of ``decls`` must be
    there, and nothing else. ``model_type`` names the modules (Phi-3's fused ``qkv_proj`` /
    ``gate_up_proj`` adapters are split into the parts', ``adapters/peft_fused.py``);
    ``module_scale(module)``, the scale peft applies to a module, must equal ``scale``, the run's;
    ``saved_names``: the tensors of the ``modules_to_save`` (read by :func:`load_saved_modules`)."""
    from functional_pp.adapters.peft_fused import fused_module, split_fused_peft
    base_decls, want = split(decls)
    if scale is None or module_scale is None:
        module_scale = scale = None
    fused = {p: ab for p, ab in want.items() if fused_module(p, model_type) is not None}
    out, used = {}, set()
    if fused:
        stripped = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        out, names = split_fused_peft(stripped, base_decls, fused, model_type, module_scale or (lambda m: 1.0),
                                      scale if scale is not None else 1.0)
        used = {PREFIX + n for n in names}
    for path, ab in want.items():
        if path in fused:
            continue
        module = module_name(path, model_type)
        m = PREFIX + module
        names = (m + ".lora_A.weight", m + ".lora_B.weight")
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"PEFT adapter: {missing[0]} is missing (for {path}); the adapter was made for other "
                             f"target modules or another model")
        a, b = tensors[names[0]], tensors[names[1]]
        A, B = ab["lora_A"], ab["lora_B"]
        r = A.shape[-1]
        if a.shape != (r, A_in := _numel(A.shape[:-1])) or b.shape != (_numel(B.shape[1:]), r):
            raise ValueError(f"PEFT adapter: {path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                             f"[{r}, {A_in}] / [{_numel(B.shape[1:])}, {r}] (rank r={r} from the config)")
        if scale is not None and not math.isclose(module_scale(module), scale, rel_tol=1e-12):
            raise ValueError(f"PEFT adapter: {module} is scaled {module_scale(module):g} (its rank and alpha in the "
                             f"adapter's adapter_config.json), the run's adapters {scale:g}: set lora_alpha / lora_r "
                             f"/ peft_use_rslora as the adapter was trained")
        out[path] = {"lora_A": a.T.reshape(A.shape).to(A.dtype), "lora_B": b.T.reshape(B.shape).to(B.dtype)}
        used.update(names)
        if MAGNITUDE in ab:
            name, M = m + "." + PEFT_MAGNITUDE, ab[MAGNITUDE]
            if name not in tensors or tuple(tensors[name].shape) != (_numel(M.shape),):
                raise ValueError(f"PEFT adapter: {name} [{_numel(M.shape)}] is missing or misshapen (for {path}): "
                                 f"the config has use_dora: true")
            out[path][MAGNITUDE] = tensors[name].reshape(M.shape).to(M.dtype)
            used.add(name)
    extra = sorted(set(tensors) - used - set(saved_names or ()))
    if extra:
        raise ValueError(f"PEFT adapter: tensors {extra[:3]} match no adapter of the config (target modules "
                         f"{sorted({p.rsplit('.', 1)[-1] for p in want})}) nor its modules_to_save")
    return {p: out[p] for p in want}


def _pattern_value(pattern: dict | None, module: str, default: float) -> float:
    """peft's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the end of the
    module's name (a regex), else ``default``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def module_scales(conf: dict) -> Callable[[str], float]:
    """``module -> scale`` peft applies to that module's adapter (``adapter_config.json``
    ``conf``: ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``; per module through
    ``rank_pattern`` and ``alpha_pattern``)."""
    def scale(module: str) -> float:
        r = _pattern_value(conf.get("rank_pattern"), module, conf["r"])
        alpha = _pattern_value(conf.get("alpha_pattern"), module, conf["lora_alpha"])
        return alpha / (math.sqrt(r) if conf.get("use_rslora") else r)
    return scale


def peft_config(cfg: LoraConfig, targets: list[str], base_model: str | None = None, model_type: str = "llama") -> dict:
    """``adapter_config.json`` of a LoRA run adapting ``targets`` (our paths; their modules named
    as in ``model_type``'s model)."""
    modules = {module_name(p, model_type).rsplit(".", 1)[-1] for p in targets}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": float(cfg.dropout),
            "target_modules": sorted(modules), "use_rslora": cfg.rslora,
            "use_dora": cfg.dora, "modules_to_save": list(cfg.modules_to_save) or None, "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}


def _saved_paths(modules: Any, tree: Any, model_type: str) -> dict[str, str]:
    """``{our path: peft tensor name}`` of the weights of ``tree`` inside one of the ``modules``
    (``modules_to_save``), refusing one without a Hugging Face tensor of its own."""
    from functional_pp.adapters.peft_fused import fused_module
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.models.llama_hf import file_name, hf_kind
    out = {}
    for path, _ in leaves_with_paths(tree):
        if not any("." + m + "." in "." + path + "." for m in modules):
            continue
        where = file_name(path, model_type)
        if where is None or hf_kind(path, model_type) is None or fused_module(path, model_type) is not None:
            raise ValueError(f"PEFT adapter: modules_to_save {path!r} has no Hugging Face module of its own in "
                             f"{model_type}'s files: export the merged model (functional-pp export "
                             f"--merge-adapter) instead")
        out[path] = PREFIX + where[0]
    if modules and not out:
        raise ValueError(f"PEFT adapter: modules_to_save {list(modules)} match no parameter")
    return out


def load_saved_modules(path: str | os.PathLike, decls: Any, lora: LoraConfig, base_model: str | None = None) -> dict:
    """``{our path: full tensor}`` of the run's ``modules_to_save`` (``lora``) from a PEFT adapter
    directory (peft writes them whole under their Hugging Face names), in our layout and the
    dtype of ``decls``; every one must be there."""
    from safetensors import safe_open

    from functional_pp.adapters.lora import split
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.models.llama_hf import KINDS, hf_kind
    base = split(decls)[0]
    model_type = model_type_of(base_model or _dir_base(path))
    names = _saved_paths(lora.modules_to_save, base, model_type)
    by_path, out = dict(leaves_with_paths(base)), {}
    with safe_open(str(Path(path) / WEIGHTS), framework="pt") as f:
        have = set(f.keys())
        for p, name in names.items():
            d = by_path[p]
            kind = KINDS[hf_kind(p, model_type)]
            if name not in have or tuple(f.get_slice(name).get_shape()) != kind.hf_shape(tuple(d.shape)):
                raise ValueError(f"PEFT adapter {path}: {name} {list(kind.hf_shape(tuple(d.shape)))} is missing or "
                                 f"misshapen (for modules_to_save {p}): the adapter was saved without it")
            t = f.get_tensor(name)
            out[p] = kind.read(t, tuple(slice(0, n) for n in d.shape), tuple(d.shape)).contiguous().to(d.dtype)
    return out


def _dir_base(path: str | os.PathLike) -> str | None:
    f = Path(path) / CONFIG
    return json.loads(f.read_text()).get("base_model_name_or_path") if f.is_file() else None


def _modules_to_save(cfg: LoraConfig, base: Any, model_type: str) -> dict[str, torch.Tensor]:
    """peft's tensors of the ``modules_to_save`` (trained whole): each weight under its Hugging
    Face name in ``model_type``'s files, in their layout (``base_model.model.lm_head.weight``)."""
    if not cfg.modules_to_save:
        return {}
    from functional_pp.core.tree import leaves_with_paths
    from functional_pp.models.llama_hf import KINDS, hf_kind
    if base is None:
        raise ValueError(f"PEFT adapter export: modules_to_save {list(cfg.modules_to_save)} are trained whole: pass "
                         f"the full base tree (base=adapters.split(params)[0]) to write them")
    weights = dict(leaves_with_paths(base))
    return {name: KINDS[hf_kind(p, model_type)].to_hf(weights[p].detach()).contiguous()
            for p, name in _saved_paths(cfg.modules_to_save, base, model_type).items()}


def save_adapter(out: str | os.PathLike, lora: dict, cfg: LoraConfig, base_model: str | None = None,
                 base: Any = None, model_type: str | None = None) -> Path:
    """Write the PEFT adapter directory of full adapter tensors ``lora`` (``{weight path:
    {"lora_A", "lora_B"}}``, ``adapters.split(params)[1]``). ``model_type`` (default: from
    ``base_model``'s ``config.json``, else ``llama``) names the modules; ``modules_to_save`` are
    written whole under their Hugging Face names (as peft writes them); a family that fuses
    weights (Phi-3) gets one exact adapter per fused module (``adapters/peft_fused.py``, its
    rank and alpha in ``rank_pattern`` / ``alpha_pattern``), which needs ``base`` (the full base
    tree, ``adapters.split(params)[0]``)."""
    from safetensors.torch import save_file

    from functional_pp.adapters.peft_fused import fused_module, fused_peft
    model_type = model_type or model_type_of(base_model)
    saved = _modules_to_save(cfg, base, model_type)
    fused = {p for p in lora if fused_module(p, model_type) is not None}
    if fused and base is None:
        raise ValueError(f"PEFT adapter export: {sorted(fused)[0]} is part of a fused {model_type} module: pass the "
                         f"full base tree (base=adapters.split(params)[0]) to write its fused adapter")
    tensors = to_peft({p: ab for p, ab in lora.items() if p not in fused}, model_type)
    tensors.update(saved)
    conf = peft_config(cfg, [p for p in lora if p not in fused], base_model, model_type)
    if fused:
        more, ranks, alphas = fused_peft({p: lora[p] for p in fused}, base, model_type, cfg.scale, cfg.rslora)
        tensors.update({PREFIX + k: v.contiguous() for k, v in more.items()})
        conf["target_modules"] = sorted(set(conf["target_modules"]) | {m.rsplit(".", 1)[-1] for m in ranks})
        conf["rank_pattern"], conf["alpha_pattern"] = ranks, alphas
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(conf, indent=2))
    save_file(tensors, str(out / WEIGHTS))
    return out


def read_config(path: str | os.PathLike, model_type: str | None = None) -> LoraConfig:
    """The :class:`LoraConfig` of a PEFT adapter directory (refusing what we cannot apply): its
    ``target_modules`` in our names (a fused module of ``model_type``, default the adapter's
    ``base_model_name_or_path``'s, names its parts: Phi-3's ``qkv_proj`` -> ``q_proj``,
    ``k_proj``, ``v_proj``). Per-module ranks and alphas (``rank_pattern`` / ``alpha_pattern``) are
    checked module by module when the adapters are read (:func:`load_adapter`)."""
    conf = json.loads((Path(path) / CONFIG).read_text())
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {conf.get('peft_type')!r}: only LORA adapters can be loaded")
    if conf.get("fan_in_fan_out") or conf.get("bias", "none") != "none":
        raise ValueError(f"{path}: fan_in_fan_out / bias adapters are not supported (bias must be 'none')")
    targets = conf.get("target_modules")
    model_type = model_type or model_type_of(conf.get("base_model_name_or_path"))
    common = dict(r=conf["r"], alpha=conf["lora_alpha"], dropout=conf.get("lora_dropout", 0.0),
                  rslora=bool(conf.get("use_rslora")), dora=bool(conf.get("use_dora")))
    if targets == "all-linear":
        return LoraConfig(target_linear=True, **common)
    return LoraConfig(target_modules=targets if isinstance(targets, str) else part_names(targets, model_type),
                      modules_to_save=tuple(conf.get("modules_to_save") or ()), **common)


def load_adapter(path: str | os.PathLike, decls: Any, lora: LoraConfig | None = None,
                 base_model: str | None = None) -> dict:
    """Full adapter tensors (``{weight path: {"lora_A", "lora_B"}}``) from a PEFT adapter directory, for the
    declarations ``decls`` (``adapters.init`` with :func:`read_config`'s config, or the run's
    ``lora``, whose scale every module's must equal); ``base_model``'s ``config.json`` names the
    modules (a Phi-3 adapter's fused ones are split into our parts', ``adapters/peft_fused.py``)."""
    from safetensors.torch import load_file
    f = Path(path) / WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS} (a PEFT adapter directory has {CONFIG} and {WEIGHTS})")
    conf = json.loads((Path(path) / CONFIG).read_text()) if (Path(path) / CONFIG).is_file() else None
    scales = module_scales(conf) if conf is not None and lora is not None else None
    model_type = model_type_of(base_model or (conf or {}).get("base_model_name_or_path"))
    saved = (_saved_paths(lora.modules_to_save, split(decls)[0], model_type).values()
             if lora is not None and lora.modules_to_save else ())
    return from_peft(load_file(str(f)), decls, model_type, scales, lora.scale if lora is not None else None, saved)


__all__ = ["from_peft", "load_adapter", "load_saved_modules", "module_name", "module_scales", "peft_config",
           "read_config", "save_adapter", "to_peft"]
