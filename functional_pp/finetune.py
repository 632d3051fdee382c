"""What a run starts from: the model (a preset, or a Hugging Face ``base_model`` directory read
slice by slice on every device), its tokenizer, the training / held-out data, and the device
a single-process run uses. Used by :mod:`functional_pp.trainer`; see ``docs/finetune.md``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, TrainConfig, model_config

__all__ = ["model_config", "load_tokenizer", "RunData", "load_data", "check_batches", "base_params",
           "select_device", "peak_flops", "describe_device"]


def load_tokenizer(cfg: TrainConfig):
    """The run's tokenizer (``tokenizer``, ``data.tokenizer`` or ``base_model``'s), or None
    for byte-level training."""
    path = cfg.tokenizer or cfg.data.tokenizer
    if path is None and cfg.base_model is not None and (Path(cfg.base_model) / "tokenizer.json").is_file():
        path = cfg.base_model
    if path is None:
        if cfg.base_model is not None and (cfg.datasets or cfg.data.path):
            raise ConfigError(f"base_model {cfg.base_model!r} has no tokenizer.json: give tokenizer: "
                              f"PATH (a tokenizer.json or a directory holding one)")
        return None
    from .data.tokenizer import HFTokenizer
    try:
        return HFTokenizer(path, model_dir=cfg.base_model)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise ConfigError(f"tokenizer: {exc}") from exc


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
    try:
        if cfg.datasets:
            from .data.formats import build_streams
            train, val = build_streams(cfg.datasets, tok, seq_len=cfg.sequence_len,
                                       sample_packing=cfg.sample_packing,
                                       val_set_size=cfg.val_set_size, seed=cfg.seed,
                                       train_on_inputs=cfg.train_on_inputs,
                                       chat_template=cfg.chat_template)
            return RunData(train, val, tok)
        from .data import load_corpus
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


def check_batches(cfg: TrainConfig, data: RunData, global_batch: int) -> int:
    """Steps per epoch of the training data; raises :class:`ConfigError` when the training or
    held-out tokens cannot fill a batch of ``global_batch`` sequences."""
    from .data import DataLoader
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


def base_params(cfg: TrainConfig, model_cfg, decls: Any, mesh, rules, device=None) -> Any:
    """This device's shards of ``base_model``'s weights as named parameters (inside
    :func:`functional_pp.launch`: only the rows / columns of each tensor it holds are read)."""
    from .checkpoint import hf
    from .named import Named
    from .tree import map_with_path
    tensors = hf.load_hf_params(cfg.base_model, model_cfg, decls, dtype=torch.float32, mesh=mesh,
                                rules=rules, device=device)

    def wrap(p, x, d):
        return Named(x, d.axes, rules.resolve(d.axes, d.shape, mesh, name=p), sizes=d.shape, is_param=True)
    return map_with_path(wrap, tensors, decls)


def select_device(simulate: bool, world_size: int, torchrun: bool,
                  cuda_available: bool | None = None) -> torch.device | None:
    """The device of this process's parameters: the local GPU under torchrun, ``cuda:0`` for a
    single-device run on a machine with a GPU, else the CPU (None)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        return None
    if torchrun:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if world_size == 1:
        return torch.device("cuda", 0)
    return None


#: dense bf16 peak FLOP/s by GPU name (substring match, first hit wins)
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("A10G", 70e12), ("L40S", 362e12), ("L4", 121e12),
             ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12))


def peak_flops(device: torch.device | None, name: str | None = None) -> float | None:
    """Peak bf16 FLOP/s of a known GPU (None: unknown or CPU; set peak_flops_per_device)."""
    if name is None:
        if device is None or device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16:
        if key in name:
            return flops
    return None


def describe_device(device: torch.device | None, simulate: bool, world_size: int) -> str:
    """``cuda:0 (NVIDIA H100 ...)`` / ``cpu`` / ``N simulated devices on the CPU``."""
    if device is not None and device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if simulate and world_size > 1:
        return f"{world_size} simulated devices on the CPU"
    return "cpu"
