"""LoRA (Hu et al. 2021, as ``peft`` implements it): ``y = x W + scale * (dropout(x) A) B`` for
the targeted weights ``W``, ``A`` initialised uniform (peft's Kaiming), ``B`` zeros, ``scale =
alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

For a weight with dimensions ``in... out...`` (``in_dims`` leading ones contracted, from the
declaration's ``meta``, 1 by default) ``A`` has ``in... lora_r`` and ``B`` ``lora_r out...``:
the rules that shard ``W`` shard them, so column- and row-parallel TP follow (a row-parallel
weight's adapter gives a pending sum, added to the base's before the one TP collective), and
FSDP shards ``A`` like ``W``. The adapters live beside their weights: the adapter of
``layers.0.self_attn.q_proj`` is ``layers.0.self_attn.lora.q_proj.{lora_A,lora_B}`` (so a layer's
adapters are in its subtree: its FSDP unit, the dry-run's repeated layers);
:func:`split` and :func:`joined` move between that tree and ``(base tree, {weight path:
adapter})``. :func:`adapt` wraps a loss (or forward) so that each targeted weight reaches
``ops.einsum`` as a :class:`LoraWeight`, which computes both terms. With ``dora=True`` each
adapter also has a magnitude ``lora_magnitude`` over the weight's output dimensions (DoRA,
functional_pp/adapters/dora.py), set from the base by :func:`init_magnitudes`."""
from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from functional_pp._torch import is_tracing
from functional_pp.adapters import nvfp4_merge
from functional_pp.adapters.dora import MAGNITUDE, full_row_norm, row_norm
from functional_pp.core.runtime import per_thread
from functional_pp.core.tree import Param, leaves_with_paths, map_with_path, param, path_str
from functional_pp.ops.dropout import dropout as drop
from functional_pp.ops.einsum import einsum, parse_pattern, register_operand
from functional_pp.ops.fake_quant import nvfp4_scale_of, snap_nvfp4
from functional_pp.ops.quantized import is_quantized, realize, stand_in
from functional_pp.parallel.named import Named, make_named
from functional_pp.quant.weights import QuantizedWeight

RANK = "lora_r"
EXPERTS = "experts"     # a weight with this dimension holds one matrix per expert: one adapter each
KEY = "lora"            # the entry of a module's dict holding its weights' adapters
_calls = per_thread("adapters.lora")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What to adapt and how (the names of peft's ``LoraConfig`` and Axolotl's keys).
    ``target_modules``: module names (a weight whose path ends with one) or one regex matched
    against the whole path, as peft; ``target_linear``: every weight of two or more dimensions
    without a ``vocab`` dimension, nor a score head's ``labels`` (peft's ``all-linear``);
    ``modules_to_save``: modules trained
    whole (e.g. ``lm_head``); ``unfrozen_parameters``: regexes (matched from the start of the
    path or of the Hugging Face name) of further parameters to train; ``dora``: DoRA (peft's
    ``use_dora``), a trained magnitude per output feature of each adapted weight."""
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str | None = None
    target_linear: bool = False
    modules_to_save: tuple[str, ...] = ()
    rslora: bool = False
    dora: bool = False
    unfrozen_parameters: tuple[str, ...] = ()
    #: ``(owner, borrower)`` module names: the borrower's adapter uses the ``lora_A`` of the owner
    #: beside it (its own ``lora_B``): peft's one adapter of a fused weight, e.g. transformers 5's
    #: ``experts.gate_up_proj`` (``target_parameters``) is ``(("gate", "up"),)``
    shared_a: tuple[tuple[str, str], ...] = ()
    #: Axolotl's ``nvfp4_merge_aware``: each adapted weight trains as ``Q(W + scale A B)``, the merged
    #: weight through NVFP4 and back (adapters/nvfp4_merge.py), what the merged export writes
    nvfp4_merge_aware: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA: r (lora_r) must be an integer >= 1, got {self.r!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha == 0:
            raise ValueError(f"LoRA: alpha (lora_alpha) must be a finite number other than 0, got {alpha!r}: the "
                             f"adapters are scaled by alpha / r (alpha / sqrt(r) with rslora), so 0 makes them change "
                             f"nothing and learn nothing; use e.g. lora_alpha = 2 x lora_r")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoRA: dropout (lora_dropout) must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is None and not self.target_linear:
            raise ValueError("LoRA: name the weights to adapt: target_modules (lora_target_modules: [q_proj, "
                             "v_proj] or a regex) or target_linear: true (lora_target_linear)")
        for name in ("target_modules", "modules_to_save", "unfrozen_parameters"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        object.__setattr__(self, "shared_a", tuple(tuple(pair) for pair in self.shared_a))
        if any(len(pair) != 2 for pair in self.shared_a):
            raise ValueError(f"LoRA: shared_a must hold (owner, borrower) module-name pairs, got {self.shared_a!r}")
        if self.nvfp4_merge_aware and self.dora:
            raise ValueError("LoRA: nvfp4_merge_aware with DoRA (use_dora) is not supported (Axolotl skips DoRA "
                             "modules): turn one of them off")

    @property
    def scale(self) -> float:
        """The adapter's factor: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def _matches_module(path: str, names: tuple[str, ...] | str, model_type: str = "llama") -> bool:
    if isinstance(names, str):                       # peft: one regex, matched against the whole name
        return any(re.fullmatch(names, name) is not None for name in _module_names(path, model_type))
    return any(path == n or path.endswith("." + n) for n in names)


def _module_names(path: str, model_type: str = "llama") -> tuple[str, ...]:
    """The names a peft regex may be written against: our path, its Hugging Face module name in
    ``model_type``'s model (``model.layers.0.self_attn.q_proj``; LFM2's ``feed_forward.w1``) and that
    module inside a multimodal checkpoint's text decoder (``model.language_model.layers.0...``:
    Axolotl's Gemma 4 and LFM2-VL examples)."""
    hf = _hf_name(path, model_type)
    if hf is not None and not hf.endswith(".weight"):   # (a bias belongs to its module; peft adapts the weight)
        return (path,)
    if hf is None or not hf.startswith("model."):
        return (path,) if hf is None else (path, hf.rsplit(".", 1)[0])
    module = hf.rsplit(".", 1)[0]
    return path, module, "model.language_model." + module.removeprefix("model.")


def check_names(decls: Any, target_modules: Sequence[str] = (), modules_to_save: Sequence[str] = (),
                unfrozen_parameters: Sequence[str] = (), *, only_unfrozen: bool = False,
                model_type: str = "llama") -> None:
    """Refuse a module name of ``target_modules`` or ``modules_to_save`` that matches no parameter
    of ``decls`` (a misspelt one left its module unadapted or frozen, silently), naming the key,
    the names and the model's module names. A regex of ``unfrozen_parameters`` that matches
    nothing is warned about by name (Axolotl's examples write patterns for a model's multimodal
    layout, ``^model.language_model.*``, or for an ``lm_head`` tied to the embedding), and refused
    when none matches and they are all that is trained (``only_unfrozen``: no adapter)."""
    paths = [p for p, _ in leaves_with_paths(decls)]
    hf_names = ([h for h in (_hf_name(p, model_type) for p in paths) if h is not None]
                if unfrozen_parameters else [])
    unmatched = {
        "target_modules (lora_target_modules)":
            [n for n in target_modules if not any(_matches_module(p, (n,)) for p in paths)],
        "modules_to_save (lora_modules_to_save)":
            [m for m in modules_to_save if not any("." + m + "." in "." + p + "." for p in paths)],
        "unfrozen_parameters": [r for r in unfrozen_parameters
                                if not any(unfrozen_regex(r).match(p) for p in paths + hf_names)]}
    modules = sorted({c for p in paths for c in p.split(".") if not c.isdigit()})
    other_architectures = _absent_linear_names(unmatched["target_modules (lora_target_modules)"], target_modules)
    if other_architectures:        # peft adapts the names a model has (q_proj on latent attention: none)
        unmatched["target_modules (lora_target_modules)"] = [n for n in unmatched["target_modules (lora_target_modules)"]
                                                             if n not in other_architectures]
        warnings.warn(f"lora_target_modules {other_architectures} name linear weights this model does not have "
                      f"(another architecture's; peft adapts the others): adapting the others only", stacklevel=2)
    for key, names in unmatched.items():
        if not names:
            continue
        message = (f"LoRA: {key} {names} match no parameter of the model (a misspelt name would leave it "
                   f"frozen); the model's modules are named {modules}")
        if key != "unfrozen_parameters":
            raise ValueError(message)
        message += (f" (regexes matched from the start of a path such as {paths[0]!r} or of its Hugging Face "
                    f"name such as {hf_names[0] if hf_names else None!r})")
        if only_unfrozen and len(names) == len(unfrozen_parameters):
            raise ValueError(message)
        warnings.warn(message.removeprefix("LoRA: ") + ": those patterns train nothing", stacklevel=2)


def _absent_linear_names(unmatched: Sequence[str], target_modules: Sequence[str]) -> list[str]:
    """Of the ``unmatched`` target names, the decoder's linear weights of another architecture
    (``q_proj`` where latent attention has ``q_a_proj``), when some other target matches: peft
    adapts the names a model has; a name of no architecture (a misspelling) is not among them."""
    from functional_pp.models.quantize import LINEAR_BLOCK_DIMS
    known = [n for n in unmatched if n in LINEAR_BLOCK_DIMS]
    return known if len(unmatched) < len(target_modules) else []


def targets(decls: Any, cfg: LoraConfig, model_type: str = "llama") -> list[str]:
    """The paths of the weights ``cfg`` adapts (declarations ``decls``), in tree order, a regex
    matched against the module names of ``model_type``'s model; a name that matches no parameter is
    refused (:func:`check_names`)."""
    check_names(decls, cfg.target_modules if isinstance(cfg.target_modules, tuple) else (),
                cfg.modules_to_save, cfg.unfrozen_parameters)
    found, candidates = [], []
    for path, d in leaves_with_paths(decls):
        bias = path.rsplit(".", 1)[-1].endswith("bias")     # (q_bias: heads head_dim, two dims, no matrix)
        linear = (isinstance(d, Param) and len(d.dims) >= 2 and "vocab" not in d.dims and not bias
                  and not d.meta.get("embedding")         # (a table of rows: GPT-2's positions)
                  and d.meta.get("linear", True))         # (declared not a linear: a scan's A_log, conv taps)
        named = cfg.target_modules is not None and _matches_module(path, cfg.target_modules, model_type)
        if linear and EXPERTS in d.dims:             # stacked experts and the router: by name only
            if named:                                # (peft's all-linear leaves them too)
                found.append(path)
            continue
        if linear:
            candidates.append(path)
        if named and not linear:
            raise ValueError(f"LoRA: target {path!r} (dimensions {getattr(d, 'dims', None)}) is not a linear weight "
                             f"LoRA can adapt (two or more dimensions, none of them vocab); train it whole with "
                             f"modules_to_save (lora_modules_to_save) instead")
        head = "labels" in getattr(d, "dims", ())      # (a score head: peft's all-linear leaves the output layer)
        if linear and (named or (cfg.target_linear and not head)):
            found.append(path)
    if not found:
        names = sorted({p.rsplit(".", 1)[-1] for p in candidates})
        raise ValueError(f"LoRA: target_modules {cfg.target_modules!r} match no linear weight; the model's are "
                         f"named {names} (e.g. lora_target_modules: [q_proj, v_proj])")
    return found


def init(decls: Any, cfg: LoraConfig, model_type: str = "llama") -> Any:
    """``decls`` with the adapters' declarations beside the targeted weights (``...lora.NAME``):
    ``lora_A`` over ``in... lora_r`` (uniform +-1/sqrt(fan_in), peft's Kaiming) and ``lora_B`` over
    ``lora_r out...`` (zeros); the leading ``in_dims`` dimensions (the declaration's ``meta``,
    1 by default) are the ones a linear contracts. A weight with an ``experts`` dimension
    (``experts hidden mlp``) gets one adapter per expert: ``experts`` leads both ``lora_A``
    (``experts hidden lora_r``) and ``lora_B`` (``experts lora_r mlp``), so the rule that splits
    the experts (expert parallelism) splits their adapters too. With DoRA also ``lora_magnitude``
    over ``out...``, declared as ones: :func:`init_magnitudes` sets it to the weight's norms. A regex of
    ``target_modules`` names the modules of ``model_type``'s model (:func:`targets`)."""
    by_path = dict(leaves_with_paths(decls))
    lora = {}
    found = targets(decls, cfg, model_type)
    owners = _owners(found, cfg)
    for path in found:
        d = by_path[path]
        lead = (EXPERTS,) if EXPERTS in d.dims and len(d.dims) >= 3 else ()    # (a router, hidden experts: a linear)
        if lead and d.dims[0] != EXPERTS:
            raise ValueError(f"LoRA: expert weight {path!r} has dimensions {d.dims}; its adapters need "
                             f"{EXPERTS!r} first")
        shape, dims = d.shape[len(lead):], d.dims[len(lead):]
        e = d.shape[:len(lead)]
        k = int(d.meta.get("in_dims", 1))
        fan_in = math.prod(shape[:k])
        lora[path] = {"lora_A": param(e + shape[:k] + (cfg.r,), lead + dims[:k] + (RANK,), init="uniform",
                                      scale=1.0 / math.sqrt(fan_in), dtype=d.dtype),
                      "lora_B": param(e + (cfg.r,) + shape[k:], lead + (RANK,) + dims[k:], init="zeros",
                                      dtype=d.dtype)}
        if path in owners:                               # its A is its owner's (shared_a)
            owner = by_path[owners[path]]
            if tuple(owner.shape[:len(lead) + k]) != tuple(d.shape[:len(lead) + k]):
                raise ValueError(f"LoRA: shared_a: {path!r} {tuple(d.shape)} and {owners[path]!r} "
                                 f"{tuple(owner.shape)} contract different inputs: they cannot share lora_A")
            del lora[path]["lora_A"]
        if cfg.dora:
            if EXPERTS in d.dims:
                raise ValueError(f"LoRA: DoRA (use_dora) on expert weight {path!r} is not supported; target no "
                                 f"expert weights (gate, up, down or the router of a mixture of experts) or turn "
                                 f"DoRA off")
            lora[path][MAGNITUDE] = param(d.shape[k:], d.dims[k:], init="ones", dtype=d.dtype)
    return joined(decls, lora)


def _owners(paths: list[str], cfg: LoraConfig) -> dict[str, str]:
    """``{borrower path: owner path}`` of the adapted ``paths`` under ``cfg.shared_a`` (siblings:
    the same parent); a borrower whose owner is not adapted is refused by name."""
    out = {}
    adapted = set(paths)
    for owner, borrower in cfg.shared_a:
        for path in paths:
            parent, _, name = path.rpartition(".")
            if name != borrower:
                continue
            mine = f"{parent}.{owner}" if parent else owner
            if mine not in adapted:
                raise ValueError(f"LoRA: {path!r} shares lora_A with {mine!r} (shared_a), which is not adapted: "
                                 f"target both")
            out[path] = mine
    return out


def with_shared_a(lora: dict, cfg: LoraConfig) -> dict:
    """``lora`` (weight path -> adapter) with each borrower's adapter holding its owner's
    ``lora_A`` (the same tensor: gradients of both uses reach it)."""
    owners = _owners(list(lora), cfg)
    return {p: ({**ab, "lora_A": lora[owners[p]]["lora_A"]} if p in owners and "lora_A" not in ab else ab)
            for p, ab in lora.items()}


def joined(base: Any, lora: dict) -> Any:
    """The tree with adapters: ``base`` with each ``lora[weight path]`` (``{"lora_A", "lora_B"}``)
    put beside its weight, under the ``"lora"`` entry of the weight's dict."""
    out = _copy(base)
    for path, ab in lora.items():
        node, name = _parent(out, path), path.rpartition(".")[2]
        if KEY in node and not isinstance(node[KEY], dict):
            raise ValueError(f"LoRA: {path.rpartition('.')[0] or 'the top level'} has a parameter named "
                             f"{KEY!r}: that name is where adapters go")
        node.setdefault(KEY, {})[name] = ab
    return out


def _parent(tree: Any, path: str) -> dict:
    """The dict that holds the weight at ``path`` (a plain walk: traceable by torch.compile)."""
    node = tree
    for part in path.split(".")[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if not isinstance(node, dict):
        raise ValueError(f"LoRA: weight {path!r} is not an entry of a dict (its adapter goes beside it)")
    return node


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def split(tree: Any) -> tuple[Any, dict]:
    """``(base tree, {weight path: {"lora_A", "lora_B"}})`` of a tree with adapters."""
    lora: dict = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                here = f"{path}.{k}" if path else str(k)
                if k == KEY and isinstance(v, dict):
                    for name, ab in v.items():
                        lora[f"{path}.{name}" if path else name] = ab
                else:
                    out[k] = walk(v, here)
            return out
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
        return node
    return walk(tree, ""), lora


def _hf_name(path: str, model_type: str = "llama") -> str | None:
    """The Hugging Face name of ``path`` in the files of ``model_type`` (a fused tensor's name
    for its parts: DBRX's ``transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight``)."""
    from functional_pp.models.llama_hf import file_name
    try:
        r = file_name(path, model_type)
    except (KeyError, ValueError):
        r = None
    return r[0] if r else None


def unfrozen_regex(pattern: str) -> re.Pattern:
    """An ``unfrozen_parameters`` pattern as Axolotl compiles it (``LayerNamePattern``): its dots
    literal (except in ``.+``; one already escaped stays so), matched from the start of a name."""
    return re.compile(re.sub(r"(?<!\\)\.(?!\+)", "\\.", pattern))


def unfrozen(patterns: Sequence[str], modules: Sequence[str] = (), model_type: str = "llama") -> Callable[[Any], Any]:
    """A trainable mask (``train_step(trainable=...)``): the parameters whose path or Hugging Face
    name (in the files of ``model_type``) a regex of ``patterns`` matches from its start (Axolotl's
    ``unfrozen_parameters``),
    and those inside one of the ``modules`` (a path component, e.g. ``lm_head``; ``lora``: the
    adapters); every other parameter frozen."""
    compiled = [unfrozen_regex(p) for p in patterns]

    def trains(path: str) -> bool:
        if any(("." + m + ".") in "." + path + "." for m in modules):
            return True
        hf = _hf_name(path, model_type) if compiled else None
        return any(p.match(path) or (hf is not None and p.match(hf)) for p in compiled)

    def mask(params: Any) -> Any:
        return map_with_path(lambda path, x: trains(path), params)
    return mask


def frozen_under(mask: Callable[[Any], Any] | None, roots: Sequence[str]) -> Callable[[Any], Any]:
    """``mask`` (a trainable mask; None: every parameter trains) with every parameter under one of
    ``roots`` (a top-level module, e.g. ``vision_tower``; its adapters too) frozen as well."""
    def frozen(path: str) -> bool:
        return path.split(".", 1)[0] in roots

    def masked(params: Any) -> Any:
        base = map_with_path(lambda path, x: True, params) if mask is None else mask(params)
        return map_with_path(lambda path, t: bool(t) and not frozen(path), base)
    return masked


def trainable(cfg: LoraConfig, model_type: str = "llama") -> Callable[[Any], Any]:
    """The trainable mask of a LoRA run: the adapters, the ``modules_to_save`` and the
    ``unfrozen_parameters`` (Hugging Face names of ``model_type``'s files); every other parameter frozen."""
    return unfrozen(cfg.unfrozen_parameters, cfg.modules_to_save + (KEY,), model_type)


class LoraWeight(NamedTuple):
    """A targeted weight as the model's einsum receives it: the base weight, its adapter and
    their factor (a pytree node: FSDP gathers its parts with the layer's units); with DoRA its
    magnitude over the weight's output dimensions."""
    base: Named
    lora_A: Named
    lora_B: Named
    scale: float
    dropout: float = 0.0
    seed: int = 0
    magnitude: Named | None = None
    nvfp4: bool = False
    #: merge-aware NVFP4's per-tensor scale as the checkpoint stores it (``weight_scale_2``: 0-dim,
    #: or one per expert), replicated; None: computed from ``base`` (:func:`nvfp4_scale_of`)
    nvfp4_scale: Named | None = None

    def __named_einsum__(self, pattern: str, operands: Sequence[Any], i: int) -> Named:
        """``einsum(pattern, ...)`` with this weight as operand ``i``: the base contraction plus
        ``scale`` times the adapter's, their pending sums added before they are completed; with
        DoRA the sum times ``magnitude / ||W + scale A B||`` (peft's ``DoraLinearLayer``: with
        dropout ``x W + (g - 1) dropout(x) W + g scale dropout(x) A B``)."""
        ins, out = parse_pattern(pattern, len(operands))
        if len(operands) != 2:
            raise ValueError(f"LoRA: einsum {pattern!r} with an adapted weight needs exactly two operands")
        x, x_dims = operands[1 - i], ins[1 - i]
        contracted = [d for d in ins[i] if d not in out]
        a_in = list(self.lora_A.dims[:-1])
        if sorted(contracted) != sorted(a_in):
            raise ValueError(f"LoRA: einsum {pattern!r} contracts {contracted} of the adapted weight, but its "
                             f"lora_A has {a_in}: declare the weight's meta in_dims={len(contracted)} "
                             f"(its leading dimensions that a linear contracts)")
        if self.nvfp4:
            return self._nvfp4_einsum(pattern, x, x_dims, out, i, contracted)
        y = einsum(pattern, *[self.base if j == i else x for j, x in enumerate(operands)])
        if self.dropout:
            x = drop(x, self.dropout, self.seed)
        delta = einsum(f"{' '.join(x_dims)}, {' '.join(self.lora_A.dims)}, {' '.join(self.lora_B.dims)} -> "
                       f"{' '.join(out)}", x, self.lora_A, self.lora_B) * self.scale
        if self.magnitude is None:
            return _summed(y, delta)
        g = self.magnitude / row_norm(self.base, self.lora_A, self.lora_B, self.scale)
        if not self.dropout:
            return _summed(y, delta) * g
        dropped = einsum(pattern, *[self.base if j == i else x for j in range(2)])
        return y + dropped * (g - 1) + delta * g

    def _nvfp4_einsum(self, pattern: str, x: Named, x_dims: Sequence[str], out: Sequence[str], i: int,
                      contracted: Sequence[str]) -> Named:
        """Merge-aware NVFP4 (``nvfp4_merge_aware``): ``x Q(W + scale A B)``; with dropout plus
        ``scale (dropout(x) - x) A B``, which vanishes in evaluation (Axolotl's ``merge_aware_linear``)."""
        if self.magnitude is not None:
            raise ValueError("LoRA: nvfp4_merge_aware with DoRA (use_dora) is not supported: turn one of them off")
        w = snap_nvfp4(self._merged(), self._nvfp4_scale(()), contracted, pattern)
        y = einsum(pattern, *[w if j == i else x for j in range(2)])
        if not self.dropout:
            return y
        rest = drop(x, self.dropout, self.seed) - x
        return y + einsum(f"{' '.join(x_dims)}, {' '.join(self.lora_A.dims)}, {' '.join(self.lora_B.dims)} -> "
                          f"{' '.join(out)}", rest, self.lora_A, self.lora_B) * self.scale

    def _merged(self) -> Named:
        """``W + scale A B`` (contracted over the rank, per expert for expert weights)."""
        base = self.base
        if is_quantized(base):          # a quantized stack (quantize_moe_experts): in its codes' layout
            base = realize(base, stand_in(base).split, self.lora_A.data.dtype, "LoRA expert weight")
        pattern = (f"{' '.join(self.lora_A.dims)}, {' '.join(self.lora_B.dims)} -> "
                   f"{' '.join(base.dims)}")
        return base + einsum(pattern, self.lora_A, self.lora_B) * self.scale

    def __named_weight__(self) -> Named:
        """The adapted weight as one named value, ``W + scale * A B`` (contracted over the rank,
        per expert for expert weights): for ops that take the weight itself rather than an
        einsum with it (``ops.experts``). Gradients reach ``A`` and ``B``; the base stays frozen."""
        if self.dropout:
            raise ValueError("LoRA: lora_dropout > 0 on expert weights is not supported (their adapters are "
                             "merged into the weight for the experts' grouped matmuls, which drops no input); "
                             "set lora_dropout: 0 or target no expert weights")
        if not self.nvfp4:
            return self._merged()
        lead = self.base.dims[:1] if self.base.dims[0] == EXPERTS and self.lora_A.dims[0] == EXPERTS else ()
        contracted = [d for d in self.lora_A.dims[:-1] if d not in lead]
        return snap_nvfp4(self._merged(), self._nvfp4_scale(lead), contracted, "LoRA expert weight")

    def _nvfp4_scale(self, lead: Sequence[str]) -> Named:
        """The per-tensor scale(s) the merged weight is snapped with: the stored ones, else the base's."""
        return nvfp4_scale_of(self.base, lead) if self.nvfp4_scale is None else self.nvfp4_scale


def _summed(y: Named, delta: Named) -> Named:
    """``y + delta``; two pending sums of one type added locally (one TP collective for both)."""
    if (y.partial and y.partial == delta.partial and y.dims == delta.dims and y.split == delta.split
            and y.vary == delta.vary):
        return make_named(y.data + delta.data, y.dims, y.split, y.vary, y.partial, y._sizes)
    return y + delta


register_operand(LoraWeight, lambda pattern, operands, i: operands[i].__named_einsum__(pattern, operands, i))


def apply(params: Any, cfg: LoraConfig, nvfp4_scales: dict[str, torch.Tensor] | None = None) -> Any:
    """The base tree of ``params`` (a tree with adapters, :func:`init`) with each adapted weight
    replaced by its :class:`LoraWeight` (what :func:`adapt` hands the model). ``nvfp4_scales``
    (``nvfp4_merge_aware``; weight path -> the base checkpoint's stored per-tensor scale, 0-dim or
    one per expert: ``checkpoint.hf.nvfp4_stored_scales``): the scales the merged weights are
    snapped with; None: each computed from its base weight."""
    base, lora = split(params)
    if not lora:
        raise ValueError("LoRA: the parameters hold no adapter: initialise them from adapters.init(decls, cfg)")
    seed = 0
    if cfg.dropout:
        if is_tracing():
            raise ValueError("LoRA: lora_dropout > 0 under a compiled step is not supported (its mask seed "
                             "advances on the host); set lora_dropout: 0 or compile: false")
        seed = _calls.__dict__.setdefault("n", 0)
        _calls.n = seed + 1
    missing = sorted(set(lora) - _weight_paths(base))
    if missing:
        raise ValueError(f"LoRA: adapters for {missing[:3]} name no parameter of the model")
    lora = with_shared_a(lora, cfg)
    out = _copy(base)
    for i, (path, ab) in enumerate(lora.items()):       # (each call site its own dropout seed)
        node, name = _parent(out, path), path.rpartition(".")[2]
        if cfg.dora != (MAGNITUDE in ab):
            raise ValueError(f"LoRA: the adapter of {path} {'has no' if cfg.dora else 'has a'} {MAGNITUDE} but "
                             f"dora={cfg.dora}: initialise the adapters with adapters.init(decls, cfg) of this "
                             f"config")
        stored = _stored_scale(path, node[name], ab["lora_A"], nvfp4_scales) if cfg.nvfp4_merge_aware else None
        node[name] = LoraWeight(node[name], ab["lora_A"], ab["lora_B"], cfg.scale, float(cfg.dropout),
                                seed * 1_000_003 + i + 1, ab.get(MAGNITUDE), cfg.nvfp4_merge_aware, stored)
    return out


def _stored_scale(path: str, base: Any, lora_a: Named, scales: dict[str, torch.Tensor] | None) -> Named | None:
    """The stored NVFP4 per-tensor scale of the adapted weight ``path`` as a replicated named value
    (``experts`` for an expert stack: snapping takes each device's experts), on ``base``'s device;
    None without ``scales``. A weight ``scales`` misses, or a scale of the wrong size, is refused."""
    if scales is None:
        return None
    if path not in scales:
        raise ValueError(f"LoRA: nvfp4_merge_aware: no stored per-tensor scale for the adapted weight {path} "
                         f"(the scales hold {sorted(scales)[:3]}...): read them for every target "
                         f"(checkpoint.hf.nvfp4_stored_scales)")
    per_expert = base.dims[0] == EXPERTS and lora_a.dims[0] == EXPERTS
    want = (base._sizes[0],) if per_expert else ()
    t = scales[path]
    if tuple(t.shape) != want:
        raise ValueError(f"LoRA: nvfp4_merge_aware: the stored per-tensor scale of {path} has shape "
                         f"{tuple(t.shape)}, expected {want} ({'one per expert' if per_expert else 'one'})")
    data = t.to(device=base.data.device, dtype=torch.float32)
    dims = (EXPERTS,) if per_expert else ()
    return make_named(data, dims, ((),) * len(dims), frozenset(), sizes=want)


def _weight_paths(tree: Any) -> set[str]:
    """The paths of the weights of ``tree``, a quantized weight (QLoRA's frozen base) one weight."""
    paths, _, _ = optree.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight),
                                                none_is_leaf=False)
    return {path_str(p) for p in paths}


def adapt(fn: Callable[..., Any], cfg: LoraConfig,
          nvfp4_scales: dict[str, torch.Tensor] | None = None) -> Callable[..., Any]:
    """``fn(params, ...)`` (a loss or forward over the base tree) as a function of the tree with
    adapters (:func:`init`): each targeted weight applied with its adapter (``nvfp4_scales``:
    :func:`apply`'s, moved to the parameters' device once)."""
    placed: dict = {}

    def on_device(params: Any) -> dict[str, torch.Tensor] | None:
        if nvfp4_scales is None:
            return None
        device = next((x.data.device for x in optree.tree_leaves(params, none_is_leaf=False)
                       if isinstance(x, Named)), torch.device("cpu"))
        if device not in placed:                # (once: a copy to the device per step would sync the host)
            placed[device] = {p: t.to(device=device, dtype=torch.float32) for p, t in nvfp4_scales.items()}
        return placed[device]

    def adapted(params: dict, *args: Any, **kwargs: Any) -> Any:
        return fn(apply(params, cfg, on_device(params)), *args, **kwargs)
    adapted.__name__ = getattr(fn, "__name__", "adapted")
    return adapted


def init_magnitudes(params: Any, cfg: LoraConfig) -> Any:
    """``params`` (named, inside :func:`functional_pp.launch`: any layout) with each DoRA
    magnitude set to its weight's norms ``||W + scale A B||`` (peft's initialisation: the norms
    of ``W`` while ``B`` is zero), in the magnitude's own layout; unchanged without DoRA."""
    if not cfg.dora:
        return params
    from functional_pp.parallel.fsdp.regather import relayout
    base, lora = split(params)
    out = {}
    for path, ab in lora.items():
        w = _parent(base, path)[path.rpartition(".")[2]]
        m = ab[MAGNITUDE]
        norm = relayout(row_norm(w, ab["lora_A"], ab["lora_B"], cfg.scale), m.split, "DoRA magnitude init")
        out[path] = {**ab, MAGNITUDE: m.replace(data=norm.data.to(m.data.dtype))}
    return joined(base, out)


def delta(a: torch.Tensor, b: torch.Tensor, scale: float, per_expert: bool = False) -> torch.Tensor:
    """The full weight update ``scale * A B`` (contracted over the rank) of one adapter;
    ``per_expert``: an expert weight's (``experts`` leading both A and B), one per expert."""
    if per_expert:
        e, r = a.shape[0], a.shape[-1]
        return torch.bmm(a.reshape(e, -1, r), b.reshape(e, r, -1)).reshape(a.shape[:-1] + b.shape[2:]) * scale
    return torch.tensordot(a, b, dims=([a.ndim - 1], [0])) * scale


def nvfp4_scales(params: Any, cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """``{weight path: NVFP4 per-tensor scale}`` of each adapted weight of ``params`` (full tensors
    of a tree with adapters): the scales ``nvfp4_merge_aware`` snaps the merged weights with (0-dim,
    or one per expert of an expert weight), computed from the base weights: where the base
    checkpoint stores them (``checkpoint.hf.nvfp4_stored_scales``) training uses those instead."""
    base, lora = split(params)
    weights = dict(leaves_with_paths(base))
    return {p: nvfp4_merge.per_tensor_scale(w, ab["lora_A"].ndim + ab["lora_B"].ndim - 3 == w.ndim)
            for p, ab in with_shared_a(lora, cfg).items() for w in (weights[p],)}


def merge(params: Any, cfg: LoraConfig, nvfp4_scales: dict[str, torch.Tensor] | None = None) -> Any:
    """Full tensors of a tree with adapters -> the base tree with every adapter merged into its
    weight (``W + scale * A B``; with DoRA times ``magnitude / ||W + scale * A B||`` per output
    feature): a plain model. ``nvfp4_merge_aware``: ``Q(W + scale A B)`` with the scales of
    ``nvfp4_scales`` (:func:`apply`'s; None: :func:`nvfp4_scales`, computed from the base)."""
    base, lora = split(params)
    lora = with_shared_a(lora, cfg)

    def merged(path: str, w: Any) -> Any:
        ab = lora.get(path)
        if ab is None:
            return w
        wide = torch.promote_types(w.dtype, torch.float32)       # (16-bit weights: the sum in fp32, rounded once)
        a, b = ab["lora_A"].to(wide), ab["lora_B"].to(wide)
        per_expert = a.ndim + b.ndim - 3 == w.ndim          # (experts lead A and B: counted once)
        new = w.to(wide) + delta(a, b, cfg.scale, per_expert)
        if cfg.nvfp4_merge_aware:               # what training's forward computed: Q(W + scale A B)
            if nvfp4_scales is not None and path not in nvfp4_scales:
                raise ValueError(f"LoRA: nvfp4_merge_aware: no stored per-tensor scale for the adapted weight {path}")
            stored = None if nvfp4_scales is None else nvfp4_scales[path]
            new = nvfp4_merge.snapped(w.to(wide), new, a.ndim - 1 - int(per_expert), per_expert, stored)
        if MAGNITUDE in ab:
            new = new * (ab[MAGNITUDE].to(wide) / full_row_norm(w.to(wide), a, b, cfg.scale))
        return new.to(w.dtype)
    return map_with_path(merged, base)
