"""Hugging Face safetensors directories <-> functional decoder parameters: reading a model
directory (single file or sharded with an index; pickles refused) and writing one (shards +
index + ``config.json``), for every ``model_type`` of
:data:`functional_pp.models.llama_hf.MODEL_TYPES` (llama, mistral, qwen2, qwen3, ...; the
``load_hf_llama`` / ``save_hf_llama`` names are kept for all of them). The name / layout
mapping it applies lives beside the model, in :mod:`functional_pp.models.llama_hf`
(re-exported here under its old names).

Import reads, on every device inside :func:`functional_pp.launch`, only the rows/columns of
each HF tensor that its shard needs (``safe_open(...).get_slice``). Pickle files are refused.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from functional_pp.checkpoint import format as fmt
from functional_pp.checkpoint.consolidate import write_sharded_set
from functional_pp.checkpoint.hf_unheld import unheld_items
from functional_pp.checkpoint.format import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                             CheckpointNotFoundError, UnsafeFormatError)
from functional_pp.checkpoint.load import _where
from functional_pp.core.layout import Rules, block_slices
from functional_pp.core.mesh import Mesh
from functional_pp.core.tree import leaves_with_paths, map_with_path
from functional_pp.parallel.init import init_block
from functional_pp.parallel.shard_map import active_rules
from functional_pp.quant import bnb_serialized
from functional_pp.checkpoint.hf_nvfp4 import nvfp4_items, nvfp4_quantization_config
from functional_pp.quant.fp4 import NVFP4_BLOCK, dequantize_mxfp4, dequantize_nvfp4
from functional_pp.quant.gptq import dequantize_gptq, gptq_format

__all__ = [
    "LLAMA_TABLE", "IGNORED_HF", "hf_name", "our_path", "config_from_hf", "config_to_hf",
    "load_hf_llama", "load_hf_params", "save_hf_llama", "export_checkpoint_to_hf",
    "permute_for_rotate_half", "unpermute_from_rotate_half", "fuse_rows", "experts_linearized", "nvfp4_names",
    "check_nvfp4_targets", "nvfp4_stored_scales",
]

from functional_pp.models.gemma4_hf import export_config
from functional_pp.models.llama_hf import (IGNORED_BY_TYPE, IGNORED_HF, KINDS, LLAMA_TABLE,
                                           UnsupportedHFConfig, check_exportable, constants_of,
                                           also_read, config_from_hf_dict, config_to_hf, file_name, head_groups,
                                           hf_kind, hf_name, our_path,
                                           permute_for_rotate_half, unpermute_from_rotate_half)
from functional_pp.models.remote_code_hf import with_file_layout


def _kind_of(path: str, model_type: str = "llama") -> str:
    kind = hf_kind(path, model_type)
    if kind is None:
        raise CheckpointMismatchError(f"{path}: no entry of the HF decoder table maps this parameter")
    return kind


def config_from_hf(hf: dict | str | os.PathLike):
    """``llama.Config`` from an HF ``config.json`` dict (or its path, or the model directory);
    see :func:`functional_pp.models.llama_hf.config_from_hf_dict`. Unreadable files and
    unsupported settings raise checkpoint errors."""
    if not isinstance(hf, dict):
        p = Path(hf)
        p = p / "config.json" if p.is_dir() else p
        try:
            hf = json.loads(p.read_text())
        except OSError as exc:
            raise CheckpointNotFoundError(f"cannot read {p}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise CheckpointCorruptError(f"{p} is not valid JSON: {exc}") from exc
        if isinstance(hf, dict):              # (the names its files hold: Replit's MPT)
            hf = with_file_layout(hf, p.parent)
    try:
        return config_from_hf_dict(hf)
    except UnsupportedHFConfig as exc:
        raise CheckpointMismatchError(str(exc)) from exc


# --------------------------------------------------------------------------- import
def _refuse_pickles(p: Path) -> None:
    pickles = sorted(c.name for c in p.iterdir() if c.suffix.lower() in fmt.PICKLE_SUFFIXES
                     or c.name == "pytorch_model.bin.index.json")
    hint = (f"Convert it once to safetensors in an environment where you trust the files, e.g. "
            f"`transformers.LlamaForCausalLM.from_pretrained({str(p)!r})"
            f".save_pretrained(OUT_DIR, safe_serialization=True)`, then import OUT_DIR.")
    if pickles:
        raise UnsafeFormatError(
            f"{p} holds only pickle-based weights {pickles}: refusing to load them (unpickling "
            f"can execute arbitrary code, so functional_pp never calls torch.load). {hint}")
    raise CheckpointNotFoundError(f"no model.safetensors or model.safetensors.index.json in {p}")


def _hf_files(p: Path) -> tuple[Path, dict[str, str] | None, list[str]]:
    """(root, weight_map or None, safetensors files) of an HF model directory or file."""
    if p.is_file():
        if p.suffix.lower() in fmt.PICKLE_SUFFIXES:
            raise fmt.pickle_refusal(p)
        if p.name.endswith(".index.json"):
            p = p.parent
        else:
            return p.parent, None, [p.name]
    if not p.is_dir():
        raise CheckpointNotFoundError(f"no Hugging Face checkpoint at {p}: the path does not exist")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{index} is not a valid safetensors index: {exc}") from exc
        return p, weight_map, sorted(set(weight_map.values()))
    if (p / "model.safetensors").is_file():
        return p, None, ["model.safetensors"]
    _refuse_pickles(p)
    raise AssertionError  # unreachable


def require_weights(path: str | Path) -> list[Path]:
    """The safetensors files of the Hugging Face model at ``path``, every one present (what an
    import will read), checked before any work: raises :class:`CheckpointNotFoundError` (no
    weights, or a file the index lists is missing) or :class:`UnsafeFormatError` (pickles only)."""
    root, _, files = _hf_files(Path(path))
    found = [fmt.inside(root, f, str(root / "model.safetensors.index.json")) for f in files]
    missing = [p.name for p in found if not p.is_file()]
    if missing:
        raise CheckpointNotFoundError(f"{root / 'model.safetensors.index.json'} lists {len(missing)} weight "
                                      f"file(s) that are missing: {', '.join(missing[:4])}"
                                      f"{' ...' if len(missing) > 4 else ''}")
    return found


class _HFReader:
    """Lazily opened safetensors files of one HF checkpoint; headers describe every tensor."""

    def __init__(self, root: Path, weight_map: dict[str, str] | None, files: list[str]):
        self.root, self.weight_map, self.files = root, weight_map, files
        self.stack = ExitStack()
        self.handles: dict[str, Any] = {}
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}   # name -> file, shape, dtype

    def __enter__(self) -> "_HFReader":
        try:
            for f in self.files:
                h = self._open(f)
                for key in h.keys():
                    if self.weight_map is not None and self.weight_map.get(key) != f:
                        continue
                    sl = h.get_slice(key)
                    self.entries[key] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except BaseException:
            self.stack.close()
            raise
        if self.weight_map is not None:
            lost = sorted(k for k in self.weight_map if k not in self.entries)
            if lost:
                raise CheckpointCorruptError(
                    f"{self.root / 'model.safetensors.index.json'} lists tensors its files lack: "
                    f"{lost[:6]}{' ...' if len(lost) > 6 else ''}")
        self.members: dict[str, list[str]] = {}
        self.hidden: dict[str, tuple[str, tuple[int, ...], str]] = {}    # entries folded into another's
        self._bnb4_entries()
        self._gptq_entries()
        self._linearized_entries()
        self._nvfp4_entries()
        self._stack_experts()
        self._mxfp4_entries()
        return self

    def _fold(self, key: str) -> str:
        """Take ``key`` out of the entries (read as part of another one); its file."""
        self.hidden[key] = self.entries.pop(key)
        return self.hidden[key][0]

    def _file(self, key: str) -> str:
        return (self.entries.get(key) or self.hidden[key])[0]

    def _bnb4_entries(self) -> None:
        """One dequantized entry ``{name}`` (the weight's shape and dtype) for each serialized
        bitsandbytes 4-bit weight (quant/bnb_serialized.py: a pre-quantized checkpoint, such as
        Axolotl's ``...-bnb-nf4-bf16``), its codes, scales and quant state folded into it."""
        self.bnb4: dict[str, tuple[dict, dict[str, str]]] = {}
        fp4 = [k for k in self.entries if k.endswith(bnb_serialized.STATE_SUFFIX["fp4"])]
        if fp4:
            raise CheckpointMismatchError(f"{self.root}: {fp4[0]}: bitsandbytes FP4 weights are not read (NF4 "
                                          f"checkpoints are, dequantized); use the checkpoint before quantization")
        suffix = bnb_serialized.STATE_SUFFIX["nf4"]
        for key in [k for k in self.entries if k.endswith(suffix)]:
            name = key[:-len(suffix)]
            parts = {s: name + s for s in bnb_serialized.COMPONENTS if name + s in self.entries}
            if name not in self.entries or not {".absmax", ".quant_map"} <= set(parts):
                raise CheckpointCorruptError(f"{self.root}: {key} without {name} and its .absmax / .quant_map "
                                             f"(a bitsandbytes 4-bit weight is all of them)")
            try:
                state = bnb_serialized.read_state(self._open(self.entries[key][0]).get_tensor(key), name)
            except ValueError as exc:
                raise CheckpointMismatchError(f"{self.root}: {exc}") from exc
            for k in (key, *parts.values()):
                self._fold(k)
            self.bnb4[name] = (state, parts)
            self.entries[name] = (self.entries[name][0], tuple(state["shape"]), _SAFETENSORS_DTYPE[state["dtype"]])

    def _gptq_entries(self) -> None:
        """One dequantized entry ``{prefix}.weight`` (HF ``[out, in]``, the scales' dtype) for each
        GPTQ linear ``{prefix}.qweight`` / ``.qzeros`` / ``.scales`` (/ ``.g_idx``), read per
        ``config.json``'s ``quantization_config`` (quant/gptq.py)."""
        self.gptq: dict[str, tuple[str, ...]] = {}
        prefixes = [k[:-len(".qweight")] for k in self.entries if k.endswith(".qweight")]
        if not prefixes:
            return
        conf = self.root / "config.json"
        try:
            qc = json.loads(conf.read_text()).get("quantization_config")
            self.gptq_format = gptq_format(qc, str(conf))
        except (OSError, ValueError) as exc:
            raise CheckpointMismatchError(f"{self.root}: {prefixes[0]}.qweight: {exc}") from exc
        bits, group = self.gptq_format.bits, self.gptq_format.group_size
        per = 32 // bits
        for pre in prefixes:
            parts = [f"{pre}.{c}" for c in ("qweight", "qzeros", "scales")]
            lost = [k for k in parts if k not in self.entries]
            if lost or f"{pre}.weight" in self.entries:
                raise CheckpointCorruptError(f"{self.root}: {pre}.qweight with {lost or f'{pre}.weight'}: a GPTQ "
                                             f"linear is its qweight, qzeros and scales (and g_idx), no weight")
            (qw, qwt), (qz, qzt), (sc, sct) = ((self.entries[k][1], self.entries[k][2]) for k in parts)
            inp, out = (qw[0] * per, qw[1]) if len(qw) == 2 else (0, 0)
            groups = 1 if group == -1 else -(-inp // group)
            gi = self.entries.get(f"{pre}.g_idx")
            if (qwt, qzt) != ("I32", "I32") or qw != (inp // per, out) or qz != (groups, out // per) \
                    or sc != (groups, out) or out % per or (gi is not None and gi[1] != (inp,)):
                raise CheckpointCorruptError(
                    f"{self.root}: {pre}: qweight {qwt} {list(qw)}, qzeros {qzt} {list(qz)}, scales {list(sc)}"
                    f"{'' if gi is None else f', g_idx {list(gi[1])}'} are not a {bits}-bit GPTQ linear of group "
                    f"size {group} (int32 qweight [in*{bits}/32, out], int32 qzeros [groups, out*{bits}/32], "
                    f"scales [groups, out], g_idx [in])")
            if gi is not None:
                parts.append(f"{pre}.g_idx")
            file = self.entries[parts[0]][0]
            for k in parts:
                self._fold(k)
            self.entries[f"{pre}.weight"] = (file, (out, inp), sct)
            self.gptq[f"{pre}.weight"] = tuple(parts)

    def _linearized_entries(self) -> None:
        """Axolotl's linearized Llama 4 experts (``...experts.{gate,up,down}_projs.{j}.weight``, each
        expert's projection an ``nn.Linear`` [out, in]) as transformers' stacked tensors:
        ``...experts.gate_up_proj`` [E, in, 2 * out] (gate, then up) and ``...experts.down_proj`` [E, in, out]."""
        self.linearized: dict[str, list[list[str]]] = {}
        groups: dict[str, dict[str, dict[int, str]]] = {}
        for key in self.entries:
            m = _LINEARIZED.match(key)
            if m:
                groups.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["j"])] = key
        for pre, by_proj in groups.items():
            n = {len(by_proj.get(p, ())) for p in ("gate", "up", "down")}
            keys = {p: [by_proj.get(p, {}).get(j) for j in range(max(n))] for p in ("gate", "up", "down")}
            shapes = {p: {self.entries[k][1] for k in ks if k is not None} for p, ks in keys.items()}
            if len(n) != 1 or any(None in ks for ks in keys.values()) or any(len(v) != 1 for v in shapes.values()) \
                    or shapes["gate"] != shapes["up"]:
                raise CheckpointCorruptError(
                    f"{self.root}: the linearized experts of {pre} are not gate_projs / up_projs / down_projs "
                    f"numbered 0..E-1 alike with one shape each: "
                    f"{ {p: (sorted(v), sorted(shapes[p])) for p, v in by_proj.items()} }")
            (out, inp), = shapes["gate"]
            (h, f), = shapes["down"]
            dt = self.entries[keys["gate"][0]][2]
            files = [self._fold(k) for ks in keys.values() for k in ks]
            self.entries[f"{pre}.gate_up_proj"] = (files[0], (max(n), inp, 2 * out), dt)
            self.entries[f"{pre}.down_proj"] = (files[0], (max(n), f, h), dt)
            self.linearized[f"{pre}.gate_up_proj"] = [keys["gate"], keys["up"]]
            self.linearized[f"{pre}.down_proj"] = [keys["down"]]

    def _nvfp4_entries(self) -> None:
        """One dequantized entry ``{name}.weight`` [out, in] float32 for each NVFP4 linear of a
        ModelOpt checkpoint (``quant_algo: NVFP4``): ``weight`` (uint8 [out, in / 2]: E2M1 codes, the
        even input in the low nibble), ``weight_scale`` (float8_e4m3fn [out, in / 16]) and
        ``weight_scale_2`` (fp32, one per tensor), as torchao's ``NVFP4Tensor.dequantize``; the
        activations' ``input_scale`` is not used (the inputs are not quantized here)."""
        self.nvfp4: dict[str, tuple[str, str, str]] = {}
        for key in [k for k in self.entries if k.endswith(".weight_scale_2")]:
            pre = key.removesuffix("_scale_2")
            name, scale = pre, pre + "_scale"
            if name not in self.entries or scale not in self.entries:
                raise CheckpointCorruptError(f"{self.root}: {key} without {name} and {scale} (a ModelOpt NVFP4 "
                                             f"weight is all three)")
            (_, codes, ct), (_, scales, st) = self.entries[name], self.entries[scale]
            if ct != "U8" or st != "F8_E4M3" or len(codes) < 2 or tuple(scales) != (
                    *codes[:-1], codes[-1] * 2 // NVFP4_BLOCK):
                raise CheckpointCorruptError(f"{self.root}: {name} {ct} {list(codes)} with {scale} {st} {list(scales)} "
                                             f"is not NVFP4 (uint8 codes [..., in/2], float8_e4m3fn scales [..., in/16])")
            for k in (key, scale, *([pre.removesuffix(".weight") + ".input_scale"]
                                    if pre.removesuffix(".weight") + ".input_scale" in self.entries else [])):
                self._fold(k)
            self.entries[name] = (self.entries[name][0], (*codes[:-1], codes[-1] * 2), "F32")
            self.nvfp4[name] = (name, scale, key)

    def _mxfp4_entries(self) -> None:
        """One dequantized entry ``{name}`` [*lead, in, out] float32 for each MXFP4 pair
        ``{name}_blocks`` (uint8 [*lead, out, in / 32, 16]) + ``{name}_scales`` (uint8
        [*lead, out, in / 32]): gpt-oss's experts as its hub checkpoints store them, read as
        transformers' ``Mxfp4Config(dequantize=True)`` reads them."""
        self.mxfp4: dict[str, tuple[str, str]] = {}
        for key in list(self.entries):
            name = key.removesuffix("_blocks")
            if name == key or f"{name}_scales" not in self.entries:
                continue
            (_, blocks, bt), (_, scales, st) = self.entries[key], self.entries[f"{name}_scales"]
            if bt != "U8" or st != "U8" or len(blocks) < 3 or blocks[:-1] != scales:
                raise CheckpointCorruptError(f"{self.root}: {key} {bt} {list(blocks)} with {name}_scales {st} "
                                             f"{list(scales)} is not MXFP4 (uint8 blocks [..., out, in/32, 16] "
                                             f"and uint8 scales [..., out, in/32])")
            *lead, out, groups, half = blocks
            self.entries[name] = (self.entries[key][0], (*lead, groups * half * 2, out), "F32")
            self.members[name] = [key, f"{name}_scales"]
            self.mxfp4[name] = (key, f"{name}_scales")

    def _stack_experts(self) -> None:
        """One stacked entry ``...experts.{name}`` [E, *shape] for the per-expert tensors
        ``...experts.{j}.{name}`` j = 0..E-1 (the MoE rows of the table, kind ``experts_linear``); the
        same for per-head norms ``...norms.{j}.{name}`` (StableLM's q/k LayerNorms, kind ``per_head``)."""
        groups: dict[str, dict[int, str]] = {}
        for key in self.entries:
            m = _EXPERT.match(key)
            if m:
                groups.setdefault(f"{m['pre']}.{m['group']}.{m['post']}", {})[int(m["j"])] = key
        for name, by_index in groups.items():
            keys = [by_index.get(j) for j in range(len(by_index))]
            shapes = {self.entries[k][1] for k in keys if k is not None}
            if None in keys or len(shapes) != 1:
                raise CheckpointCorruptError(f"{self.root}: the experts of {name} are not numbered 0..{len(keys) - 1} "
                                             f"with one shape: {sorted(by_index)} {sorted(shapes)}")
            f, shape, dt = self.entries[keys[0]]
            self.entries[name] = (f, (len(keys), *shape), dt)
            self.members[name] = keys

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def _open(self, f: str):
        if f not in self.handles:
            path = fmt.inside(self.root, f, str(self.root / "model.safetensors.index.json"))
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path}: listed in the index but missing")
            try:
                self.handles[f] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # SafetensorError, OSError
                raise CheckpointCorruptError(f"cannot read {path}: not a valid safetensors file "
                                             f"(truncated or corrupted?): {exc}") from exc
        return self.handles[f]

    def slice(self, name: str):
        if name in self.nvfp4:
            get = lambda k: self._open(self._file(k)).get_tensor(k)        # noqa: E731
            return _Whole(lambda: dequantize_nvfp4(*(get(k) for k in self.nvfp4[name])))
        if name in self.mxfp4:
            blocks, scales = (self._open(self.entries[k][0]).get_slice(k) for k in self.mxfp4[name])
            return _Mxfp4(blocks, scales, self.entries[name][1])
        if name in self.gptq:
            return _Gptq([self._open(self._file(k)).get_slice(k) for k in self.gptq[name]], self.gptq_format,
                         self.entries[name][1])
        if name in self.bnb4:
            state, parts = self.bnb4[name]
            get = lambda k: self._open(self._file(k)).get_tensor(k)        # noqa: E731
            absmax, quant_map, nested_absmax, nested_map = (get(parts[s]) if s in parts else None
                                                            for s in bnb_serialized.COMPONENTS)
            return _Whole(lambda: bnb_serialized.dequantize_bnb4(get(name), absmax, quant_map, state, nested_absmax,
                                                                 nested_map))
        if name in self.linearized:
            return _Linearized([[self.slice(k) for k in ks] for ks in self.linearized[name]], self.entries[name][1])
        if name in self.members:
            return _Stacked([self.slice(k) for k in self.members[name]])
        return self._open(self._file(name)).get_slice(name)


_EXPERT = re.compile(r"^(?P<pre>.+)\.(?P<group>experts|norms)\.(?P<j>\d+)\.(?P<post>.+)$")
_LINEARIZED = re.compile(r"^(?P<pre>.+\.experts)\.(?P<proj>gate|up|down)_projs\.(?P<j>\d+)\.weight$")
_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def experts_linearized(path: str | os.PathLike) -> bool:
    """Whether the HF checkpoint at ``path`` holds Axolotl's linearized Llama 4 experts (one
    ``nn.Linear`` per expert: ``...experts.gate_projs.{j}.weight``); reads the headers only."""
    root, weight_map, files = _hf_files(Path(path))
    names = set(weight_map or ())
    for f in files if weight_map is None else ():
        with safe_open(str(fmt.inside(root, f, str(root))), framework="pt") as h:
            names.update(h.keys())
    return any(_LINEARIZED.match(k) for k in names)


class _Whole:
    """A slice handle of a tensor made whole on first use (a dequantized weight)."""

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make, self.t = make, None

    def __getitem__(self, idx):
        if self.t is None:
            self.t = self.make()
        return self.t[idx]


class _Linearized:
    """A slice handle of ``[E, in, sum(out)]`` from per-expert ``[out, in]`` linear weights, each
    part's experts in turn along the last dimension (gate, then up: ``gate_up_proj``)."""

    def __init__(self, parts: list[list], shape: tuple[int, ...]):
        self.parts, self.shape = parts, shape

    def __getitem__(self, idx):
        idx = tuple(idx) if isinstance(idx, tuple) else (idx,)
        idx += (slice(None),) * (3 - len(idx))
        (e0, e1, es), (i0, i1, is_), (o0, o1, os_) = (s.indices(n) for s, n in zip(idx, self.shape))
        if es != 1 or is_ != 1 or os_ != 1:
            raise ValueError("linearized experts are read in contiguous ranges")
        width = self.shape[2] // len(self.parts)
        out = []
        for j in range(e0, e1):
            cols = [part[j][max(o0, b) - b:min(o1, b + width) - b, i0:i1].T
                    for part, b in zip(self.parts, range(0, self.shape[2], width)) if max(o0, b) < min(o1, b + width)]
            out.append(torch.cat(cols, -1))
        return torch.stack(out)


class _Stacked:
    """A slice handle of per-expert tensors stacked along a new first dimension."""

    def __init__(self, slices: list):
        self.slices = slices

    def __getitem__(self, idx):
        first, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        return torch.stack([self.slices[j][rest] for j in range(*first.indices(len(self.slices)))])


class _Mxfp4:
    """A slice handle of the dequantized ``[*lead, in, out]`` of MXFP4 ``blocks`` / ``scales``
    (:class:`_HFReader`): reads only the blocks of the region's rows and groups of 32 inputs."""

    def __init__(self, blocks, scales, shape: tuple[int, ...]):
        self.blocks, self.scales, self.shape = blocks, scales, shape

    def __getitem__(self, idx):
        idx = tuple(idx) if isinstance(idx, tuple) else (idx,)
        idx += (slice(None),) * (len(self.shape) - len(idx))
        ranges = [s.indices(n) for s, n in zip(idx, self.shape)]
        if any(step != 1 for _, _, step in ranges):
            raise ValueError("MXFP4 tensors are read in contiguous ranges")
        *lead, (i0, i1, _), (o0, o1, _) = ranges
        g0, g1 = i0 // 32, -(-i1 // 32)
        rows = (*(slice(a, b) for a, b, _ in lead), slice(o0, o1), slice(g0, g1))
        w = dequantize_mxfp4(self.blocks[rows], self.scales[rows])          # [*lead, out, groups * 32]
        return w[..., i0 - g0 * 32:i1 - g0 * 32].transpose(-1, -2)


class _Gptq:
    """A slice handle of the dequantized HF ``[out, in]`` weight of a GPTQ linear
    (:class:`_HFReader`): reads only the int32s, zero points, scales and groups of the region."""

    def __init__(self, parts: list, fmt, shape: tuple[int, int]):
        self.parts, self.fmt, self.shape = parts, fmt, shape

    def __getitem__(self, idx):
        idx = tuple(idx) if isinstance(idx, tuple) else (idx,)
        idx += (slice(None),) * (2 - len(idx))
        (o0, o1, os_), (i0, i1, is_) = (s.indices(n) for s, n in zip(idx, self.shape))
        if os_ != 1 or is_ != 1:
            raise ValueError("GPTQ weights are read in contiguous ranges")
        per = 32 // self.fmt.bits
        qweight, qzeros, scales, *g_idx = self.parts
        if g_idx:
            groups = g_idx[0][i0:i1]
        else:
            group = self.shape[1] if self.fmt.group_size == -1 else self.fmt.group_size
            groups = torch.arange(i0, i1, dtype=torch.int32) // group
        w = dequantize_gptq(qweight[i0 // per:-(-i1 // per), o0:o1], qzeros[:, o0 // per:-(-o1 // per)],
                            scales[:, o0:o1], groups, self.fmt, i0 % per, o0 % per)       # [in, out]
        return w.T


def _placement(mesh: Mesh | None, rules: Rules | None, rank: int | None):
    mesh, rank = _where(mesh, rank)
    return mesh, rules if rules is not None else active_rules(required=False), rank


def load_hf_params(path: str | os.PathLike, cfg, decls: Any = None, *,
                   dtype: torch.dtype | Callable[[str], torch.dtype | None] | None = None,
                   mesh: Mesh | None = None, rules: Rules | None = None, rank: int | None = None,
                   device: torch.device | str | None = None, strict: bool = True,
                   grow_vocab: bool = False, fresh: tuple[str, ...] = (), seed: int = 0) -> dict:
    """The parameter tree of ``llama.init(cfg)`` (or ``decls``) from an HF Llama checkpoint.

    Without a mesh (or without rules) tensors come back whole; inside ``launch`` (mesh and rank
    default to the running device's, rules to the active ones) each device gets its own shards,
    reading only the needed rows/columns. ``dtype`` casts (default: the file's dtype); a function of
    the parameter path gives each its own (a frozen base in the compute dtype, say).
    ``strict`` refuses HF tensors the table does not map (e.g. biases). ``grow_vocab``: a config
    vocabulary larger than the file's (added tokens) gives the embedding and head rows past the
    file's the mean of its rows, as transformers' ``resize_token_embeddings`` (mean resizing).
    ``fresh``: parameter paths not read but initialised from their declarations with ``seed`` (a
    score head over a causal LM's files, as transformers initialises a head the files lack)."""
    from functional_pp.models import llama

    if decls is None:
        decls = llama.init(cfg, dtype if isinstance(dtype, torch.dtype) else torch.float32)
    mesh, rules, rank = _placement(mesh, rules, rank)
    root, weight_map, files = _hf_files(Path(path))
    with _HFReader(root, weight_map, files) as reader:
        plan, missing, problems, used = {}, [], [], set()
        for name, parts in _file_tensors(decls, cfg):
            if all(p in fresh for p, _, _ in parts):
                continue
            axis = _row_axis(parts)
            want = _fused_shape([kind.hf_shape(tuple(d.shape)) for _, kind, d in parts], axis)
            for_ = " + ".join(p for p, _, _ in parts)
            name = next((n for n in also_read(name, getattr(cfg, "model_type", "llama"), cfg) if n in reader.entries), name)
            if name not in reader.entries:
                missing.append(f"{name} (for {for_})")
                continue
            used.add(name)
            used.update(reader.members.get(name, ()))
            have = reader.entries[name][1]
            grown = (grow_vocab and len(parts) == 1 and "vocab" in parts[0][2].dims and len(have) == len(want)
                     and have[0] < want[0] and tuple(have[1:]) == tuple(want[1:]))
            if have != want and not grown:
                problems.append(f"{name}: shape mismatch: file {have}, expected {want} (for " + ", ".join(
                    f"{p} {tuple(d.shape)} [{' '.join(d.dims)}]" for p, _, d in parts) + " from the config)")
            offset = 0
            n = head_groups(name, cfg)                   # (parts held group by group: GPT-NeoX, Qwen3-Next)
            interleaved = n is not None
            groups = [kind.hf_shape(tuple(d.shape))[axis] // n for _, kind, d in parts] if interleaved else None
            alternating = getattr(parts[0][1], "alternating", False)   # (gpt-oss's gate_up_proj)
            for j, (p, kind, d) in enumerate(parts):     # a part of a fused tensor: its rows from ``offset``
                rows = kind.hf_shape(tuple(d.shape))[axis]   # (or, k/v head by k/v head, part j's rows of each)
                plan[p] = (name, kind, d, (_ALTERNATE, j, len(parts), axis) if len(parts) > 1 and alternating
                           else (_HEADS, j, groups) if len(parts) > 1 and interleaved
                           else (offset, rows, axis) if len(parts) > 1 else (_GROWN, have[0]) if grown else None)
                offset += rows
            for const, value in constants_of(parts[0][0], getattr(cfg, "model_type", "llama"), cfg):   # (xIELU's beta and eps)
                if const not in reader.entries:
                    missing.append(f"{const} (the constant {value} beside {parts[0][0]})")
                    continue
                used.add(const)
                got = reader._open(reader.entries[const][0]).get_tensor(const).float().reshape(-1)
                if got.numel() != 1 or abs(got.item() - value) > 1e-2 * abs(value):
                    problems.append(f"{const}: {got.tolist()}, but the functional decoder's is the constant {value}")
        ignorable = [re.compile(f"^{x}$") for x in IGNORED_HF + IGNORED_BY_TYPE.get(getattr(cfg, "model_type", ""), ())
                     + IGNORED_BY_TYPE.get(getattr(cfg, "text_of", None) or "", ())]
        if cfg.tie_embeddings or getattr(cfg, "score_head", None):     # (a score head: a causal LM's head unread)
            ignorable.append(re.compile(r"^lm_head\.(weight|bias)$"))
        if getattr(cfg, "kv_shared_layers", 0):   # (Gemma 4 E2B / E4B's files: the shared layers' own k/v, unread
            shared = "|".join(str(i) for i in range(cfg.layers - cfg.kv_shared_layers, cfg.layers))   # as by transformers)
            ignorable.append(re.compile(rf"^(.*\.)?layers\.({shared})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight$"))
        unexpected = sorted(n for n in reader.entries
                            if n not in used and not any(r.match(n) for r in ignorable))
        if missing or problems or (strict and unexpected):
            msg = (f"Hugging Face checkpoint {root} does not match the "
                   f"{getattr(cfg, 'model_type', 'llama')} config:")
            if missing:
                msg += f"\n  missing tensors ({len(missing)}): " + ", ".join(missing[:12])
            if strict and unexpected:
                msg += (f"\n  unexpected tensors ({len(unexpected)}, not in the mapping table): "
                        + ", ".join(unexpected[:12]))
            raise CheckpointMismatchError(msg + "".join(f"\n  {x}" for x in problems))

        def read(p: str, d: Any) -> torch.Tensor:
            shape = tuple(d.shape)
            if mesh is not None and rules is not None:
                region = block_slices(shape, rules.resolve(d.dims, shape, mesh, name=p), mesh, rank)
            else:
                region = tuple(slice(0, n) for n in shape)
            if p in fresh:
                t = init_block(d, p, seed, region)
                want = dtype(p) if callable(dtype) else dtype
                t = t.to(want) if want is not None else t
                return t.to(device) if device is not None else t
            name, kind, _, rows = plan[p]
            try:
                sl = reader.slice(name)
                if rows is not None and rows[0] is _GROWN:
                    sl = _GrownRows(sl, rows[1])
                elif rows is not None and rows[0] is _ALTERNATE:
                    sl = _AlternateRows(sl, *rows[1:])
                elif rows is not None and rows[0] is _HEADS:
                    sl = _HeadRows(sl, *rows[1:])
                elif rows is not None:
                    sl = _Rows(sl, *rows)
                t = kind.read(sl, region, shape)
            except Exception as exc:
                raise CheckpointCorruptError(f"{root}: cannot read tensor {name!r}: {exc}") from exc
            t = t.contiguous()
            want = dtype(p) if callable(dtype) else dtype
            if want is not None:
                t = t.to(want)
            return t.to(device) if device is not None else t
        return map_with_path(read, decls)


def _file_tensors(decls: Any, cfg) -> list[tuple[str, list[tuple[str, Any, Any]]]]:
    """The tensors of the HF files of ``cfg.model_type``, in declaration order: each file name
    with the ``(path, kind, decl)`` of the parameters it holds (several: a fused tensor, its
    parts in order along the rows)."""
    mt = getattr(cfg, "model_type", "llama")
    out: dict[str, list] = {}
    for p, d in leaves_with_paths(decls):
        found = file_name(p, mt, cfg)
        if found is None:
            raise CheckpointMismatchError(f"{p}: no entry of the HF decoder table maps this parameter")
        name, part = found
        out.setdefault(name, []).append((part, p, KINDS[_kind_of(p, mt)], d))
    return [(name, [(p, kind, d) for _, p, kind, d in sorted(parts, key=lambda x: x[0])])
            for name, parts in out.items()]


def _fused_shape(shapes: list[tuple[int, ...]], axis: int = 0) -> tuple[int, ...]:
    """The HF shape of parts stacked along the rows, dimension ``axis`` (one part: its own shape)."""
    if len(shapes) == 1:
        return shapes[0]
    return (*shapes[0][:axis], sum(s[axis] for s in shapes), *shapes[0][axis + 1:])


def _row_axis(parts: list) -> int:
    """The dimension of the HF tensor along which ``parts`` (``(path, kind, decl)``) are fused:
    the rows (0), the rows of each expert for the experts' kinds (1: Granite MoE's input_linear)."""
    return getattr(parts[0][1], "row_axis", 0)


_GROWN, _HEADS, _ALTERNATE = object(), object(), object()


class _AlternateRows:
    """A slice handle of part ``j`` of ``n`` parts of an HF tensor that alternate entry by entry
    along dimension ``axis`` (gpt-oss's ``gate_up_proj``: gate, up, gate, up, ...)."""

    def __init__(self, sl, j: int, n: int, axis: int):
        self.sl, self.j, self.n, self.axis = sl, j, n, axis

    def __getitem__(self, idx):
        idx = list(idx) if isinstance(idx, tuple) else [idx]
        first = idx[self.axis]
        if first.step not in (None, 1) or first.stop is None:
            raise ValueError("fused tensor parts are read in contiguous row ranges")
        start = first.start or 0
        idx[self.axis] = slice(start * self.n, first.stop * self.n)
        block = self.sl[tuple(idx)]
        return block[(slice(None),) * self.axis + (slice(self.j, None, self.n),)]


class _HeadRows:
    """A slice handle of part ``j`` of a fused HF tensor that holds its parts group by group, one
    group per k/v head, ``sizes[i]`` rows of part i in each (GPT-NeoX's ``query_key_value``:
    head h's q, k and v rows; Falcon's: the q heads sharing k/v head g, then its k, then its v)."""

    def __init__(self, sl, j: int, sizes: list[int]):
        self.sl, self.size, self.offset, self.group = sl, sizes[j], sum(sizes[:j]), sum(sizes)

    def __getitem__(self, idx):
        first, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        start, stop = first.start or 0, first.stop
        if first.step not in (None, 1) or stop is None:
            raise ValueError("fused tensor parts are read in contiguous row ranges")
        blocks = []
        for g in range(start // self.size, -(-stop // self.size)):       # each group's rows of the part
            lo, hi = max(start, g * self.size), min(stop, (g + 1) * self.size)
            base = g * self.group + self.offset - g * self.size
            blocks.append(self.sl[(slice(base + lo, base + hi), *rest)])
        return torch.cat(blocks)


class _GrownRows:
    """A slice handle of an HF vocabulary tensor with rows past the file's ``n`` (added tokens):
    those rows are the mean of the file's rows (transformers' mean resizing, without its noise)."""

    def __init__(self, sl, n: int):
        self.sl, self.n = sl, n

    def __getitem__(self, idx):
        first, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        start, stop = first.start or 0, first.stop
        kept = self.sl[(slice(start, min(stop, self.n)), *rest)] if start < self.n else None
        if stop <= self.n:
            return kept
        mean = self.sl[(slice(0, self.n), *rest)].to(torch.float32).mean(0, keepdim=True)
        new = mean.expand(stop - max(start, self.n), *mean.shape[1:])
        return new if kept is None else torch.cat([kept.to(torch.float32), new]).to(kept.dtype)


class _Rows:
    """A slice handle of the rows ``[offset, offset + n)`` (along dimension ``axis``) of a fused HF tensor."""

    def __init__(self, sl, offset: int, n: int, axis: int = 0):
        self.sl, self.offset, self.n, self.axis = sl, offset, n, axis

    def __getitem__(self, idx):
        idx = list(idx) if isinstance(idx, tuple) else [idx]
        start, stop, step = idx[self.axis].indices(self.n)
        if step != 1:
            raise ValueError("fused tensor parts are read in contiguous row ranges")
        idx[self.axis] = slice(self.offset + start, self.offset + stop)
        return self.sl[tuple(idx)]


def load_hf_llama(path: str | os.PathLike, *, dtype: torch.dtype | None = None, mesh: Mesh | None = None,
                  rules: Rules | None = None, rank: int | None = None,
                  device: torch.device | str | None = None, strict: bool = True):
    """``(cfg, params)`` from an HF Llama directory (``config.json`` + ``model.safetensors`` or a
    sharded set with ``model.safetensors.index.json``); sharded like :func:`load_hf_params`."""
    p = Path(path)
    root = p if p.is_dir() else p.parent
    cfg = config_from_hf(root / "config.json")
    if cfg.model_type == "llama4_text" and experts_linearized(p):      # (Axolotl's: written back so on export)
        import dataclasses
        cfg = dataclasses.replace(cfg, experts_linearized=True)
    return cfg, load_hf_params(p, cfg, dtype=dtype, mesh=mesh, rules=rules, rank=rank, device=device,
                               strict=strict)


# --------------------------------------------------------------------------- export
def _parse_size(size: int | str | None) -> int | None:
    if size is None or isinstance(size, int):
        if size is not None and size <= 0:
            raise CheckpointError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if not m:
        raise CheckpointError(f"cannot parse max_shard_size {size!r} (use bytes, '500MB', '2GiB')")
    unit = m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(unit[0] if unit != "B" else " "))


def _write_hf(out: Path, cfg, items: list[tuple[str, torch.dtype, tuple, Callable]],
              max_shard_size: int | str | None, dtype: torch.dtype) -> Path:
    """Write ``config.json`` and the tensors (one file, or shards + index) into ``out``,
    replacing any ``model*.safetensors`` / index already there."""
    limit = _parse_size(max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if stale.is_file():
            stale.unlink()
    write_sharded_set(out, items, {"format": "pt"}, limit, single_file=True)
    fmt.write_text_atomic(out / "config.json", json.dumps(config_to_hf(cfg, dtype), indent=2))
    return out


def _items(cfg, get: Callable[[str], tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
           dtype: torch.dtype | None) -> tuple[list, torch.dtype]:
    """HF-named lazy tensor items for every parameter of ``llama.init(cfg)``, in table order."""
    from functional_pp.models import llama

    try:
        check_exportable(cfg)                 # before any tensor is written
    except UnsupportedHFConfig as exc:
        raise CheckpointMismatchError(str(exc)) from exc
    items, dtypes = [], set()
    for name, parts in _file_tensors(llama.init(cfg), cfg):
        produced = []
        for p, kind, d in parts:
            shape, have, produce = get(p)
            if tuple(shape) != tuple(d.shape):
                raise CheckpointMismatchError(f"{p}: shape {tuple(shape)} but the config declares "
                                              f"{tuple(d.shape)} [{' '.join(d.dims)}]")
            produced.append((kind, produce, kind.hf_shape(tuple(shape))))
            dt = dtype or have
            dtypes.add(dt)

        axis = getattr(produced[0][0], "row_axis", 0)

        def make(produced=produced, dt=dt, axis=axis, name=name):     # one tensor, or the parts fused along the rows
            return fuse_rows([kind.to_hf(produce()).to(dt) for kind, produce, _ in produced], cfg, axis,
                             alternating=getattr(produced[0][0], "alternating", False), name=name)
        shape = _fused_shape([s for *_, s in produced], axis)
        if getattr(produced[0][0], "stacked", False):     # the experts (per-head norms): one tensor each in the files
            held: dict = {}                  # the stacked tensor, made once for its experts in turn

            def expert(j, make=make, held=held, last=shape[0] - 1):
                whole = held.setdefault("t", None) if "t" in held else held.setdefault("t", make())
                if j == last:
                    held.clear()
                return whole[j].contiguous()
            for j in range(shape[0]):
                at = produced[0][0].stacked_at          # (".experts." or ".norms.")
                items.append((name.replace(at, f"{at}{j}.", 1), dt, shape[1:],
                              lambda j=j, expert=expert: expert(j)))
        else:
            items.append((name, dt, shape, make))
        for const, value in constants_of(parts[0][0], getattr(cfg, "model_type", "llama"), cfg):     # (xIELU's beta and eps)
            items.append((const, dt, (), lambda value=value, dt=dt: torch.tensor(value, dtype=dt)))
    if getattr(cfg, "experts_linearized", False):
        items = _linearized_items(items)
    return items, (dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32))


def _linearized_items(items: list) -> list:
    """``items`` with each ``...experts.gate_up_proj`` [E, in, 2 * out] / ``...experts.down_proj``
    [E, in, out] written as Axolotl's linearized experts: ``...experts.{gate,up,down}_projs.{j}.weight``
    [out, in], one per expert (the stacked tensor made once for all of them)."""
    out = []
    for name, dt, shape, make in items:
        m = re.match(r"^(?P<pre>.+\.experts)\.(?P<what>gate_up|down)_proj$", name)
        if m is None:
            out.append((name, dt, shape, make))
            continue
        experts, inp, width = shape
        projs = ("gate", "up") if m["what"] == "gate_up" else ("down",)
        w = width // len(projs)
        held = {"left": experts * len(projs)}

        def part(j, k, make=make, held=held, w=w):
            if "t" not in held:
                held["t"] = make()
            t = held["t"][j, :, k * w:(k + 1) * w].T.contiguous()
            held["left"] -= 1
            if not held["left"]:
                held.clear()
            return t
        for k, proj in enumerate(projs):
            for j in range(experts):
                out.append((f"{m['pre']}.{proj}_projs.{j}.weight", dt, (w, inp), lambda j=j, k=k, part=part: part(j, k)))
    return out


def fuse_rows(parts: list[torch.Tensor], cfg, axis: int = 0, alternating: bool = False,
              name: str | None = None) -> torch.Tensor:
    """The HF tensor of ``parts`` (each in HF's layout) fused along the rows (dimension ``axis``:
    1 for the experts' ``[E, out, in]``): one part after the other (Phi-3, Granite MoE), or head
    by k/v head (:data:`~functional_pp.models.llama_hf.HEAD_INTERLEAVED`: each k/v head's rows of every
    part in turn; :data:`~functional_pp.models.llama_hf.HEAD_GROUPED`: by the groups of the tensor ``name``), or
    entry by entry (``alternating``: gpt-oss's ``gate_up_proj``); one part is itself."""
    if len(parts) == 1:
        return parts[0]
    if alternating:
        return torch.stack(parts, axis + 1).flatten(axis, axis + 1)
    k = head_groups(name or "", cfg)
    if k is not None:                                                # one group of rows per k/v head
        return torch.cat([t.reshape(k, -1, *t.shape[1:]) for t in parts], 1).reshape(-1, *parts[0].shape[1:])
    return torch.cat(parts, axis)


def save_hf_llama(params: dict, cfg, out: str | os.PathLike, *, max_shard_size: int | str | None = None,
                  dtype: torch.dtype | None = None, base_model: str | os.PathLike | None = None,
                  copied: list | None = None, nvfp4: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a FULL parameter tree (single device, or ``gather_tree``-ed) as an HF directory
    loadable by ``from_pretrained`` of the class of ``cfg.model_type`` (``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``); sharded with an index when
    ``max_shard_size`` (bytes or ``"2GB"``) is given. ``dtype`` casts (default: as stored).
    ``base_model``: its tensors the model does not hold are copied in unchanged
    (checkpoint/hf_unheld.py), their names appended to ``copied``. ``nvfp4`` (parameter path ->
    per-tensor scale, :func:`nvfp4_names`): those weights written in ModelOpt's NVFP4 layout and
    base_model's other NVFP4 weights copied from it (checkpoint/hf_nvfp4.py)."""
    flat = dict(leaves_with_paths(params))
    cfg = export_config(cfg)                  # (a multimodal Gemma 4's text decoder: Gemma4ForCausalLM)

    def get(p: str):
        if p not in flat:
            raise CheckpointMismatchError(f"parameter {p} (HF {hf_name(p)}) is missing from the tree")
        t = flat[p]
        t = getattr(t, "data", t) if not isinstance(t, torch.Tensor) else t
        return tuple(t.shape), t.dtype, (lambda t=t: t.detach())
    items, dt = _items(cfg, get, dtype)
    if nvfp4 is None:
        return _write_hf(Path(out), cfg, _with_unheld(items, cfg, base_model, copied), max_shard_size, dt)
    if base_model is None:
        raise CheckpointMismatchError("nvfp4_merge_aware: the NVFP4 merged export needs base_model (its NVFP4 "
                                      "layout and quantization_config)")
    out = _write_hf(Path(out), cfg, nvfp4_items(items, base_model, nvfp4_names(cfg, nvfp4)), max_shard_size, dt)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = nvfp4_quantization_config(base_model)
    fmt.write_text_atomic(out / "config.json", json.dumps(config, indent=2))
    return out


def nvfp4_names(cfg, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{Hugging Face tensor name: 0-dim per-tensor scale}`` of ``scales`` (our parameter path: a
    0-dim scale, or one per expert of an expert stack, whose files hold one tensor per expert)."""
    out = {}
    for path, (names, stacked) in _nvfp4_file_names(cfg, list(scales)).items():
        out.update(zip(names, scales[path]) if stacked else {names[0]: scales[path]})
    return out


def check_nvfp4_targets(base_model: str | os.PathLike, paths: list[str]) -> None:
    """Refuse, before any work, an ``nvfp4_merge_aware`` target (our weight paths ``paths``) that its
    merged export could not write in base_model's NVFP4 layout: a part of a fused tensor of the files,
    or a weight base_model does not store as NVFP4 (naming it)."""
    from functional_pp.checkpoint.hf_nvfp4 import check_stored
    names = _nvfp4_file_names(config_from_hf(base_model), paths)
    check_stored(base_model, [n for ns, _ in names.values() for n in ns])


def nvfp4_stored_scales(base_model: str | os.PathLike, paths: list[str]) -> dict[str, torch.Tensor]:
    """``{our weight path: base_model's stored per-tensor scale}`` of the ``nvfp4_merge_aware``
    targets ``paths`` (ModelOpt's ``weight_scale_2``: 0-dim, or stacked one per expert, whose files
    hold one tensor per expert): the scales Axolotl snaps with. Refused as :func:`check_nvfp4_targets`."""
    from functional_pp.checkpoint.hf_nvfp4 import stored_scales
    names = _nvfp4_file_names(config_from_hf(base_model), paths)
    stored = stored_scales(base_model, [n for ns, _ in names.values() for n in ns])
    return {p: torch.stack([stored[n] for n in ns]) if stacked else stored[ns[0]]
            for p, (ns, stacked) in names.items()}


def _nvfp4_file_names(cfg, paths: list[str]) -> dict[str, tuple[list[str], bool]]:
    """``{our path: (its Hugging Face tensor names, whether one per expert)}`` of ``paths``; a part
    of a fused tensor (several of our weights in one of the files) is refused by name: ModelOpt
    quantizes it with one per-tensor scale."""
    from functional_pp.models import llama
    out, wanted = {}, set(paths)
    for name, parts in _file_tensors(llama.init(cfg), cfg):
        mine = [p for p, _, _ in parts if p in wanted]
        if not mine:
            continue
        if len(parts) > 1 or getattr(cfg, "experts_linearized", False):
            raise CheckpointMismatchError(f"nvfp4_merge_aware: {mine[0]} is a part of the fused tensor {name} of the "
                                          f"Hugging Face files ({', '.join(p for p, _, _ in parts)}), which ModelOpt "
                                          f"quantizes with one per-tensor scale: not supported; target other weights")
        kind, decl = parts[0][1], parts[0][2]
        if getattr(kind, "stacked", False):
            at = kind.stacked_at
            out[mine[0]] = ([name.replace(at, f"{at}{j}.", 1) for j in range(decl.shape[0])], True)
        else:
            out[mine[0]] = ([name], False)
    return out


def _with_unheld(items: list, cfg, base_model, copied: list | None) -> list:
    """``items`` and base_model's tensors that they do not hold (:func:`hf_unheld.unheld_items`)."""
    extra = unheld_items(base_model, cfg, [name for name, *_ in items])
    if copied is not None:
        copied.extend(name for name, *_ in extra)
    return items + extra


def config_from_index(index: dict):
    """The Llama ``Config`` a checkpoint was saved with, read from its index."""
    from dataclasses import fields

    from functional_pp.models.llama import Config

    names = {f.name for f in fields(Config)}
    saved = index.get("config")
    meta = index.get("metadata") or {}
    model = (saved or {}).get("model") if isinstance(saved, dict) else None
    for c in (meta.get("model_config") if isinstance(meta, dict) else None, saved, model):
        if isinstance(c, dict) and c and set(c) <= names:
            return Config.from_dict(c)
    if isinstance(model, dict) and "preset" in model and set(model) - {"preset"} <= names:
        return Config.preset(model["preset"], **{k: v for k, v in model.items() if k != "preset"})
    raise CheckpointError("the checkpoint's config does not describe a Llama model (no "
                          "metadata.model_config, llama.Config dict or model preset); pass cfg=")


def export_checkpoint_to_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, cfg=None, *,
                            key: str = "params", step: int | None = None,
                            max_shard_size: int | str | None = None,
                            dtype: torch.dtype | None = None, base_model: str | os.PathLike | None = None,
                            copied: list | None = None) -> Path:
    """Export a sharded functional_pp checkpoint (a step directory or a root) as an HF
    directory: :func:`~functional_pp.checkpoint.consolidate` (with :func:`hf_name` as name map)
    into a scratch folder, then each tensor is transformed to HF's layout one at a time.
    ``cfg`` defaults to the ``config`` saved with the checkpoint (``cfg.to_dict()``, or under
    ``"model"``). ``base_model``: its tensors the model does not hold are copied in unchanged
    (checkpoint/hf_unheld.py), their names appended to ``copied``."""
    from functional_pp.checkpoint.consolidate import consolidate

    ckpt = fmt.resolve_checkpoint(checkpoint, step)
    if cfg is None:
        cfg = config_from_index(fmt.read_index(ckpt))
    cfg = export_config(cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / f".consolidate-{secrets.token_hex(4)}"
    try:
        merged = consolidate(ckpt, scratch, key=key, name_map=hf_name)
        with safe_open(str(merged), framework="pt") as h:
            names = set(h.keys())

            def get(p: str):
                name = hf_name(p)
                if name not in names:
                    raise CheckpointMismatchError(f"{ckpt}: parameter {key}.{p} (HF {name}) is "
                                                  f"missing from the checkpoint")
                sl = h.get_slice(name)
                return (tuple(sl.get_shape()), fmt.dtype_from_name(_st_name(sl.get_dtype())),
                        lambda name=name: h.get_tensor(name))
            items, dt = _items(cfg, get, dtype)
            return _write_hf(out, cfg, _with_unheld(items, cfg, base_model, copied), max_shard_size, dt)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _st_name(code: str) -> str:
    for dt in fmt._ST_DTYPES:
        if fmt.st_dtype_code(dt) == code:
            return fmt.dtype_name(dt)
    raise CheckpointError(f"unsupported safetensors dtype {code}")
