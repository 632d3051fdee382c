"""Training configuration: a YAML file with Accelerate / Axolotl names, parsed and checked
before any work is done.

The schema is declared once: the dataclasses below, each field with its type and help text
(``functional-pp train --help`` prints it, see :func:`config_help`). ``TrainConfig.from_yaml``
(or ``from_dict``) rewrites Axolotl / Accelerate aliases (``config.aliases``), checks every key
and value with the generic validator of ``config.schema`` and reports *all* problems of a file
at once; ``cfg.validate(world_size)`` checks what depends on the device count, the model and
the data. Every problem raises :class:`ConfigError` saying what to change (``docs/config.md``).

Example::

    dp_shard_size: 2          # FSDP over 2 devices
    tp_size: 2
    micro_batch_size: 4       # per data-parallel rank
    sequence_len: 128
    learning_rate: 3e-3       # YAML 1.1 reads this as a string: accepted as a number
    max_steps: 100
    model: {preset: tiny}     # or base_model: path/to/hf_llama_dir
    datasets: [{path: data.jsonl, type: alpaca}]
    logging: {output_dir: runs/fsdp_tp, log_every: 10}
    checkpoint: {save_every: 50, keep_last: 2}
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from .aliases import normalize
from .schema import ConfigError, Issues, fld, help_text, parse_section, suggest
from .sections import (PRESETS, CheckpointConfig, DataConfig, DatasetConfig, LoggingConfig,
                              ModelConfig)

__all__ = ["ConfigError", "TrainConfig", "ModelConfig", "DataConfig", "DatasetConfig",
           "LoggingConfig", "CheckpointConfig", "MESH_KEYS", "PRESETS", "apply_overrides",
           "config_help"]

MESH_KEYS = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard",
             "cp_size": "cp", "tp_size": "tp"}
ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_epsilon")
SGD_KEYS = ("momentum",)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "logging": LoggingConfig,
             "checkpoint": CheckpointConfig}


# ----------------------------------------------------------------------------- the config
@dataclass
class TrainConfig:
    """Everything a training run needs. Build with :meth:`from_yaml` / :meth:`from_dict`;
    call :meth:`validate` with the world size before doing any work."""

    # mesh (Accelerate's ParallelismConfig names)
    dp_replicate_size: int = fld(1, "replicated data parallelism (the HSDP outer axis)")
    dp_shard_size: int = fld(1, "sharded data parallelism: FSDP / ZeRO-3 over N devices; -1: "
                                "the rest of the world")
    cp_size: int = fld(1, "context parallelism: the sequence split over N devices (ring "
                          "attention); alias context_parallel_size")
    tp_size: int = fld(1, "tensor parallelism over N devices; alias tensor_parallel_size")
    sequence_parallel: bool = fld(False, "split the residual stream's sequence over tp too")
    num_processes: int | None = fld(None, "Accelerate: the world size the config expects "
                                          "(checked against torchrun / --simulate)")
    # batch (Axolotl names)
    micro_batch_size: int = fld(1, "sequences per data-parallel rank per micro-step")
    gradient_accumulation_steps: int = fld(1, "micro-steps per optimizer step")
    global_batch_size: int | None = fld(None, "sequences per optimizer step (derives "
                                              "gradient_accumulation_steps)")
    sequence_len: int = fld(128, "tokens per sequence")
    sample_packing: bool = fld(True, "pack documents into full sequences, EOS between them, "
                                     "attention never crossing a document boundary; false: one "
                                     "document per row, padded")
    # optimization
    learning_rate: float = fld(3e-4, "peak learning rate")
    lr_scheduler: Literal["constant", "cosine", "linear"] = fld(
        "cosine", "constant | cosine | linear (aliases constant_with_warmup, "
                  "cosine_with_restarts)")
    warmup_steps: int = fld(0, "linear warmup steps")
    warmup_ratio: float | None = fld(None, "warmup as a fraction of max_steps (instead of "
                                           "warmup_steps)")
    min_learning_rate: float = fld(0.0, "learning rate at the end of the decay")
    cosine_min_lr_ratio: float | None = fld(None, "min_learning_rate as a fraction of "
                                                  "learning_rate")
    max_steps: int = fld(100, "optimizer steps (wins over num_epochs)")
    num_epochs: int | None = fld(None, "epochs over the training data when max_steps is not "
                                       "given")
    weight_decay: float = fld(0.0, "decoupled weight decay (matrices only)")
    max_grad_norm: float | None = fld(1.0, "clip the global gradient norm; null: no clipping")
    optimizer: Literal["adamw", "sgd"] = fld("adamw", "adamw | sgd (aliases adamw_torch, "
                                                      "adamw_torch_fused)")
    adam_beta1: float = fld(0.9, "AdamW beta1")
    adam_beta2: float = fld(0.95, "AdamW beta2")
    adam_epsilon: float = fld(1e-8, "AdamW epsilon")
    momentum: float = fld(0.0, "SGD momentum")
    seed: int = fld(0, "seed of initialization and data order")
    precision: str = fld("fp32", "fp32 | bf16 | fp16 (bf16: fp32 master weights; alias "
                                 "mixed_precision)")
    bf16: bool | Literal["auto"] | None = fld(None, "Axolotl: true = precision bf16; auto: bf16 "
                                                    "where the GPU supports it, else fp32")
    fp16: bool | None = fld(None, "Axolotl: true = precision fp16")
    tf32: bool | None = fld(None, "allow TF32 matmuls on CUDA")
    activation_checkpointing: bool = fld(False, "recompute each layer in backward (alias "
                                                "gradient_checkpointing)")
    compile: bool | str = fld(False, "torch.compile the step: true, or a backend name (alias "
                                     "torch_compile, torch_compile_backend)")
    on_nonfinite: Literal["skip", "raise"] = fld("skip", "a non-finite loss/gradient: skip the "
                                                         "step or stop")
    peak_flops_per_device: float | None = fld(None, "peak FLOP/s of one device, for MFU "
                                                    "(known GPUs are detected)")
    max_consecutive_skips: int | None = fld(10, "stop the run after this many non-finite steps "
                                                "in a row; null: never stop")
    collective_timeout: float | None = fld(None, "seconds a device waits for a peer in a "
                                                 "collective before the run fails naming it")
    layout: Literal["manual", "auto"] = fld("manual", "auto: functional_pp.plan picks the mesh and "
                                                      "rules for the devices at hand (docs/planning.md)")
    # model and data
    base_model: str | None = fld(None, "a local Hugging Face Llama directory (config.json + "
                                       "safetensors) to start from; its tokenizer is used")
    tokenizer: str | None = fld(None, "tokenizer.json or a directory holding it (default: "
                                      "base_model's)")
    chat_template: str | None = fld(None, "default chat template of chat_template datasets: "
                                          "tokenizer_default | chatml")
    train_on_inputs: bool = fld(False, "alpaca / chat: also train on prompt tokens")
    datasets: list | None = fld(None, "training data: a list of entries (path, type, ...); see "
                                      "the datasets keys below")
    val_set_size: float = fld(0.0, "held-out share of the data: a fraction < 1 or a count of "
                                   "sequences")
    eval_steps: int | None = fld(None, "held-out loss every N steps (default: at log steps "
                                       "and at the end when val_set_size > 0)")
    resume_from_checkpoint: bool | str | None = fld(None, "true: continue from the newest "
                                                          "checkpoint of the output directory; "
                                                          "a path: from that checkpoint")
    # metrics
    use_tensorboard: bool = fld(False, "also log to TensorBoard (output_dir/tensorboard)")
    wandb_project: str | None = fld(None, "also log to Weights & Biases in this project")
    wandb_mode: Literal["online", "offline", "disabled"] | None = fld(
        None, "W&B mode (offline needs no network)")
    wandb_name: str | None = fld(None, "W&B run name")
    wandb_entity: str | None = fld(None, "W&B entity")
    # sections
    model: ModelConfig = fld(help="model preset and overrides (training from scratch)",
                             factory=ModelConfig)
    data: DataConfig = fld(help="a single corpus (when there is no datasets list)",
                           factory=DataConfig)
    rules: dict = fld(help="logical axis -> mesh axis / list / null, replacing the defaults",
                      factory=dict)
    logging: LoggingConfig = fld(help="output directory and progress line", factory=LoggingConfig)
    checkpoint: CheckpointConfig = fld(help="checkpoint saving", factory=CheckpointConfig)
    name: str = "train"            # from the YAML file name; names the default output dir

    # ------------------------------------------------------------------ parsing
    @classmethod
    def valid_keys(cls) -> list[str]:
        """Top-level keys a config may have (besides aliases)."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "name"]

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "TrainConfig":
        """Read a YAML config; ``overrides`` are ``key=value`` strings (dotted keys for
        sections, values parsed as YAML) applied before checking."""
        import yaml
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {p}: {exc}; save it as UTF-8 text "
                              f"readable by this user") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: the config must be a mapping of keys to values")
        d = apply_overrides(d, overrides or [])
        return cls.from_dict(d, name=p.stem, source=str(p))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "train", source: str = "") -> "TrainConfig":
        """Build from a mapping, checking key names and value types; every problem is
        reported at once."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"the config must be a mapping of keys to values, got {d!r}")
        issues = Issues(source)
        raw, notes = normalize(dict(d), issues)
        skip = ("model", "data", "rules", "logging", "checkpoint", "datasets")
        top = parse_section(cls, raw, "", issues, skip=skip)
        if "name" in raw:
            issues.add("unknown key 'name' (the run is named after the config file)")
            top.pop("name", None)
        optimizer = top.get("optimizer", "adamw")
        foreign = SGD_KEYS if optimizer == "adamw" else ADAM_KEYS
        for k in foreign:
            if k in top:
                issues.add(f"{k} does not apply to optimizer {optimizer!r}; remove it or set "
                           f"optimizer: {'sgd' if optimizer == 'adamw' else 'adamw'}")
        rules = raw.get("rules") or {}
        if not isinstance(rules, Mapping):
            issues.add(f"'rules' must map logical axes to mesh axes, got {rules!r}")
            rules = {}
        for k, v in rules.items():
            ok = v is None or isinstance(v, str) or (isinstance(v, (list, tuple))
                                                     and all(isinstance(a, str) for a in v))
            if not ok:
                issues.add(f"rules.{k} must be a mesh axis name, a list of them or null, got {v!r}")
        sections = {key: sec(**parse_section(sec, raw.get(key), key, issues))
                    for key, sec in _SECTIONS.items() if key != "model"}
        datasets = _parse_datasets(raw.get("datasets"), issues)
        cfg = cls(**top, model=ModelConfig.from_value(raw.get("model"), issues), **sections,
                  datasets=datasets,
                  rules={str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in rules.items()},
                  name=name)
        cfg._given = set(raw)
        cfg.notes = notes
        if "model" in raw and cfg.base_model is not None:
            issues.add("give either base_model (start from a Hugging Face directory) or model "
                       "(a preset, trained from scratch), not both")
        cfg._check_values(issues)         # values that parsed are range-checked too
        issues.raise_if_any()
        return cfg

    def _check_values(self, issues: Issues | None = None) -> None:
        own = issues is None
        issues = issues if issues is not None else Issues()
        add = issues.add
        for k in MESH_KEYS:
            v = getattr(self, k)
            if v < 1 and not (k == "dp_shard_size" and v == -1):
                add(f"{k} must be >= 1 (or -1 for dp_shard_size: the rest of the world), got {v}")
        for k in ("micro_batch_size", "gradient_accumulation_steps", "sequence_len", "max_steps"):
            if getattr(self, k) < 1:
                add(f"{k} must be >= 1, got {getattr(self, k)}")
        for k in ("global_batch_size", "num_epochs", "eval_steps", "num_processes"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                add(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.warmup_steps < 0:
            add(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            add(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            add(f"max_grad_norm must be > 0 (or null to disable clipping), got {self.max_grad_norm}")
        for k in ("warmup_ratio", "cosine_min_lr_ratio"):
            v = getattr(self, k)
            if v is not None and not 0 <= v <= 1:
                add(f"{k} must be in [0, 1], got {v}")
        if self.warmup_ratio is not None and "warmup_steps" in self._given:
            add("give warmup_steps or warmup_ratio, not both")
        if self.cosine_min_lr_ratio is not None and "min_learning_rate" in self._given:
            add("give min_learning_rate or cosine_min_lr_ratio, not both")
        if not 0 <= self.val_set_size or (self.val_set_size >= 1 and not float(self.val_set_size).is_integer()):
            add(f"val_set_size must be a fraction in [0, 1) or a whole count of sequences, got "
                f"{self.val_set_size}")
        if self.lr_scheduler != "constant" and self.warmup() > self.max_steps:
            add(f"warmup_steps={self.warmup()} exceeds max_steps={self.max_steps} (the "
                f"{self.lr_scheduler} schedule decays after warmup); lower it, e.g. --set "
                f"warmup_steps={self.max_steps // 2}")
        try:
            self.precision = self.resolved_precision()
        except ConfigError as exc:
            add(str(exc))
        if self.max_consecutive_skips is not None and self.max_consecutive_skips < 1:
            add(f"max_consecutive_skips must be >= 1 (or null: never stop), got "
                f"{self.max_consecutive_skips}")
        if self.collective_timeout is not None and not self.collective_timeout > 0:
            add(f"collective_timeout must be a positive number of seconds (or null: the default), "
                f"got {self.collective_timeout}")
        if isinstance(self.compile, str):
            import torch._dynamo
            from ..layer_compile import split_mode
            backends = torch._dynamo.list_backends(exclude_tags=())
            name = next((m for m in split_mode(self.compile) if isinstance(m, str)), None)  # "per_layer:x"
            if name is not None and name not in backends:
                add(f"compile: unknown torch.compile backend {name!r}{suggest(name, backends)} "
                    f"(or \"per_layer\" / \"per_layer:<backend>\")")
        if self.logging.log_every < 1:
            add(f"logging.log_every must be >= 1, got {self.logging.log_every}")
        if self.checkpoint.save_every < 0:
            add(f"checkpoint.save_every must be >= 0 (0: no periodic saves), got "
                f"{self.checkpoint.save_every}")
        if self.checkpoint.keep_last is not None and self.checkpoint.keep_last < 1:
            add(f"checkpoint.keep_last must be >= 1 (or null: keep all), got {self.checkpoint.keep_last}")
        if self.data.max_bytes is not None and self.data.max_bytes < 1:
            add(f"data.max_bytes must be >= 1 (or null: no cap), got {self.data.max_bytes}")
        if self.data.kind in ("text", "dir", "jsonl") and self.data.path is None:
            add(f"data.kind {self.data.kind!r} needs data.path")
        if self.datasets and self.data.path is not None:
            add("give either datasets (a list) or data.path, not both")
        if own:
            issues.raise_if_any()

    def resolved_precision(self) -> str:
        """``precision``, reconciled with Axolotl's ``bf16`` / ``fp16`` flags."""
        p = self.precision.lower()
        aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "no": "fp32"}
        p = aliases.get(p, p)
        if p not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"precision {self.precision!r} is not supported"
                              f"{suggest(p, ('fp32', 'bf16', 'fp16'))} (choose fp32, bf16, fp16)")
        bf16 = _bf16_supported() if self.bf16 == "auto" else self.bf16
        flags = [f for f, on in (("bf16", bf16), ("fp16", self.fp16)) if on]
        if len(flags) > 1:
            raise ConfigError("bf16 and fp16 are both true; choose one")
        if flags:
            if "precision" in self._given and p != flags[0]:
                raise ConfigError(f"{flags[0]}: true contradicts precision: {self.precision}")
            p = flags[0]
        return p

    # ------------------------------------------------------------------ derived values
    def warmup(self) -> int:
        """Warmup steps: ``warmup_steps``, or ``ceil(warmup_ratio x max_steps)``."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * self.max_steps)
        return self.warmup_steps

    def min_lr(self) -> float:
        """``min_learning_rate``, or ``cosine_min_lr_ratio x learning_rate``."""
        if self.cosine_min_lr_ratio is not None:
            return self.cosine_min_lr_ratio * self.learning_rate
        return self.min_learning_rate

    def set_epochs(self, steps_per_epoch: int) -> None:
        """``max_steps = num_epochs x steps_per_epoch`` when ``num_epochs`` is given and
        ``max_steps`` is not (as Axolotl: max_steps wins)."""
        if self.num_epochs is not None and "max_steps" not in self._given:
            self.max_steps = max(1, self.num_epochs * steps_per_epoch)
            self._given.add("max_steps")
            self._check_values()

    def output_dir(self) -> Path:
        """``logging.output_dir``, or ``runs/<config name>``."""
        return Path(self.logging.output_dir or f"runs/{self.name}")

    def mesh_sizes(self, world_size: int | None = None) -> dict[str, int]:
        """Mesh axis sizes; ``dp_shard_size: -1`` takes what the world size leaves."""
        sizes = {axis: getattr(self, key) for key, axis in MESH_KEYS.items()}
        if sizes["dp_shard"] == -1:
            rest = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
            if world_size is None:
                raise ConfigError("dp_shard_size: -1 needs a known world size (torchrun or --simulate N)")
            if world_size % rest:
                raise ConfigError(f"dp_shard_size: -1 cannot fill a world of {world_size} devices: "
                                  f"dp_replicate_size x cp_size x tp_size = {rest} does not divide it")
            sizes["dp_shard"] = world_size // rest
        return sizes

    def mesh(self, world_size: int | None = None):
        """The :class:`functional_pp.Mesh`."""
        from ..mesh import Mesh
        return Mesh(**self.mesh_sizes(world_size))

    def build_rules(self, mesh=None):
        """``llama.default_rules`` with the config's ``rules`` entries replacing (null: removing)
        the defaults."""
        from ..layout import Rules
        from ..models import llama
        rules = llama.default_rules(sequence_parallel=self.sequence_parallel)
        try:
            rules = rules.replace(**{k: (tuple(v) if isinstance(v, list) else v)
                                     for k, v in self.rules.items()})
            if mesh is not None:
                rules.check(mesh)
        except ValueError as exc:
            raise ConfigError(f"rules: {exc}") from exc
        assert isinstance(rules, Rules)
        return rules

    def batch_axes(self, mesh, rules) -> tuple[str, ...]:
        """Mesh axes that split the batch (size > 1)."""
        return tuple(a for a in rules["batch"] if mesh.shape[a] > 1)

    def seq_axes(self, mesh, rules) -> tuple[str, ...]:
        """Mesh axes that split the sequence (context parallelism)."""
        return rules.resolve(("batch", "seq"), None, mesh)[1]

    def dp_size(self, mesh, rules) -> int:
        return math.prod(mesh.shape[a] for a in self.batch_axes(mesh, rules))

    def grad_accum(self, mesh, rules) -> int:
        """Micro-batches per step (derived from ``global_batch_size`` if that is given)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        return self.global_batch_size // (self.micro_batch_size * self.dp_size(mesh, rules))

    def global_batch(self, mesh, rules) -> int:
        """Sequences per optimizer step: micro_batch_size x gradient_accumulation_steps x dp."""
        return self.micro_batch_size * self.grad_accum(mesh, rules) * self.dp_size(mesh, rules)

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int | None = None, *, launcher: str = "") -> None:
        """Check everything that must hold before training starts: the mesh covers
        ``world_size`` devices (``launcher`` names where that number comes from), the batch and
        sequence split evenly, the model's dimensions divide by their mesh axes, the data and
        tokenizer paths exist. Raises :class:`ConfigError`."""
        self._check_values()            # again, for configs built without from_dict
        if self.num_processes is not None and world_size is not None and self.num_processes != world_size:
            raise ConfigError(f"num_processes: {self.num_processes} but {launcher or 'the world size'} "
                              f"gives {world_size} devices; fix one of them")
        sizes = self.mesh_sizes(world_size)
        product = math.prod(sizes.values())
        if world_size is not None and product != world_size:
            dims = " x ".join(f"{k}={getattr(self, k) if getattr(self, k) != -1 else sizes[a]}"
                              for k, a in MESH_KEYS.items())
            raise ConfigError(f"the mesh needs {product} devices ({dims} = {product}) but "
                              f"{launcher or 'the world size'} gives {world_size}; choose sizes "
                              f"whose product is {world_size}")
        mesh = self.mesh(world_size)
        rules = self.build_rules(mesh)
        known = self._logical_axes()
        for logical in self.rules:
            if logical not in known:
                raise ConfigError(f"rules: unknown logical axis '{logical}'"
                                  f"{suggest(logical, sorted(known))}")
        b_axes = self.batch_axes(mesh, rules)
        dp = self.dp_size(mesh, rules)
        if self.global_batch_size is not None:
            per = self.micro_batch_size * dp
            if self.global_batch_size % per:
                raise ConfigError(
                    f"global_batch_size={self.global_batch_size} is not divisible by "
                    f"micro_batch_size x dp = {self.micro_batch_size} x {dp} = {per} (dp = "
                    f"{' x '.join(f'{a}={mesh.shape[a]}' for a in b_axes) or '1'})")
            accum = self.global_batch_size // per
            if "gradient_accumulation_steps" in self._given and accum != self.gradient_accumulation_steps:
                raise ConfigError(
                    f"global_batch_size={self.global_batch_size} != micro_batch_size x "
                    f"gradient_accumulation_steps x dp = {self.micro_batch_size} x "
                    f"{self.gradient_accumulation_steps} x {dp} = "
                    f"{self.micro_batch_size * self.gradient_accumulation_steps * dp}; give one of "
                    f"global_batch_size and gradient_accumulation_steps")
        s_axes = self.seq_axes(mesh, rules)
        if len(s_axes) > 1:
            raise ConfigError(f"rules: the sequence may be split over one mesh axis (context "
                              f"parallelism), not {s_axes}")
        cp = mesh.shape[s_axes[0]] if s_axes else 1
        if cp > 1 and self.sequence_len % (2 * cp):
            raise ConfigError(
                f"sequence_len={self.sequence_len} is not divisible by 2 x cp_size = {2 * cp} "
                f"(context parallelism with causal load balancing cuts the sequence into "
                f"2 x cp_size chunks); use a multiple of {2 * cp}")
        if self.base_model is not None and not (Path(self.base_model) / "config.json").is_file():
            raise ConfigError(f"base_model {self.base_model!r} is not a Hugging Face model directory "
                              f"(no {Path(self.base_model).resolve() / 'config.json'}); give a local "
                              f"directory with config.json and safetensors (nothing is downloaded)")
        model = model_config(self)
        try:
            micro_global = self.micro_batch_size * dp
            shape = (micro_global, self.sequence_len, model.hidden)
            for dims in (("batch", "seq", "hidden"), ("batch", "res_seq", "hidden")):
                rules.resolve(dims, shape, mesh, name=f"activations ({' '.join(dims)})")
            from ..models import llama
            from ..tree import leaves_with_paths
            for path, decl in leaves_with_paths(llama.init(model)):
                rules.resolve(decl.axes, decl.shape, mesh, name=f"parameter {path}")
        except ValueError as exc:
            what = f"base_model {self.base_model!r}" if self.base_model else f"model preset {self.model.preset!r}"
            raise ConfigError(f"{exc} ({what}, mesh "
                              f"{dict(mesh.shape)})") from exc
        issues = Issues()
        if self.data.path is not None and not Path(self.data.path).exists():
            issues.add(f"data.path {self.data.path!r} does not exist (looked for "
                       f"{Path(self.data.path).resolve()}); fix the path or remove it to train "
                       f"on the Python standard library")
        if self.data.tokenizer is not None and not Path(self.data.tokenizer).is_file():
            issues.add(f"data.tokenizer {self.data.tokenizer!r} does not exist (looked for "
                       f"{Path(self.data.tokenizer).resolve()})")
        for i, entry in enumerate(self.datasets or []):
            if not Path(entry.path).exists():
                issues.add(f"datasets[{i}].path {entry.path!r} does not exist (looked for "
                           f"{Path(entry.path).resolve()})")
        for key in ("base_model", "tokenizer"):
            v = getattr(self, key)
            if v is not None and not Path(v).exists():
                issues.add(f"{key} {v!r} does not exist (looked for {Path(v).resolve()}); "
                           f"give a local Hugging Face directory (nothing is downloaded)")
        issues.raise_if_any()

    @staticmethod
    def _logical_axes() -> set[str]:
        from ..models import llama
        from ..tree import leaves_with_paths
        axes = {"batch", "seq", "res_seq"}
        for _, decl in leaves_with_paths(llama.init(llama.Config.tiny())):
            axes.update(decl.axes)
        return axes

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """A JSON-able dict that :meth:`from_dict` reads back."""
        foreign = SGD_KEYS if self.optimizer == "adamw" else ADAM_KEYS
        out = {k: getattr(self, k) for k in self.valid_keys()
               if k not in foreign and k not in _SECTIONS and k not in ("rules", "datasets")}
        for k in ("warmup_steps", "min_learning_rate"):      # one of each pair was given
            if k not in self._given and k.replace("_steps", "_ratio") in out:
                out.pop(k)
        if self.warmup_ratio is None:
            out.pop("warmup_ratio")
        if self.cosine_min_lr_ratio is None:
            out.pop("cosine_min_lr_ratio")
        else:
            out.pop("min_learning_rate", None)
        if self.base_model is None:
            out["model"] = self.model.to_dict()
        out["datasets"] = (None if self.datasets is None
                           else [dataclasses.asdict(e) for e in self.datasets])
        for key in ("data", "logging", "checkpoint"):
            out[key] = dataclasses.asdict(getattr(self, key))
        out["rules"] = dict(self.rules)
        return out

    def __post_init__(self) -> None:
        self._given: set[str] = set()
        self.notes: list[str] = []      # keys accepted without effect, and why


def _bf16_supported() -> bool:
    import torch
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _parse_datasets(value: Any, issues: Issues) -> list[DatasetConfig] | None:
    if value is None:
        return None
    if isinstance(value, (str, Mapping)):
        value = [value]
    if not isinstance(value, list) or not value:
        issues.add(f"datasets must be a non-empty list of entries (path, type, ...), got {value!r}")
        return None
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            entry = {"path": entry}
        kw = parse_section(DatasetConfig, entry, f"datasets[{i}]", issues)
        if isinstance(entry, Mapping) and "path" not in entry:
            issues.add(f"datasets[{i}] needs a path")
            continue
        if "path" in kw:
            out.append(DatasetConfig(**kw))
    return out


def config_help() -> str:
    """Every config key with its type, default and help (``functional-pp train --help``)."""
    from .aliases import ALIASES, UNSUPPORTED
    text = help_text([("top-level keys", TrainConfig), ("model (training from scratch)", ModelConfig),
                      ("datasets entries", DatasetConfig), ("data", DataConfig),
                      ("logging", LoggingConfig), ("checkpoint", CheckpointConfig)])
    aliases = ", ".join(f"{a} -> {c}" for a, (c, _) in sorted(ALIASES.items()))
    refused = ", ".join(sorted(UNSUPPORTED))
    return (f"{text}\naliases (Axolotl / Accelerate): {aliases}; parallelism_config: "
            f"{{parallelism_config_dp_replicate_size, ..._dp_shard_size, ..._tp_size, "
            f"..._cp_size}}\nrefused with the reason (no meaning here): {refused}")


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply ``key=value`` overrides (``data.path=x.txt``, ``tp_size=2``); values are YAML."""
    import copy

    import yaml
    out = copy.deepcopy(d)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {exc}") from exc
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None or (isinstance(child, str) and part == "model"):
                child = {"preset": child} if isinstance(child, str) else {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:i + 1])!r} is not a section")
            node = child
        node[parts[-1]] = value
        _drop_other_spellings(out, key)
    return out


def _drop_other_spellings(d: dict, key: str) -> None:
    """An override replaces the key under any of its names (``output_dir`` and
    ``logging.output_dir`` are one key)."""
    from .aliases import ALIASES
    canonical = ALIASES[key][0] if key in ALIASES else key
    for name in [a for a, (c, _) in ALIASES.items() if c == canonical] + [canonical]:
        if name == key:
            continue
        parts = name.split(".")
        node = d
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)


def model_config(cfg: TrainConfig):
    """The ``llama.Config``: from ``base_model/config.json``, or the preset and overrides."""
    if cfg.base_model is None:
        return cfg.model.build()
    from ..checkpoint import hf
    from ..checkpoint.format import CheckpointError
    try:
        return hf.config_from_hf(Path(cfg.base_model))
    except (CheckpointError, KeyError) as exc:
        raise ConfigError(f"base_model {cfg.base_model!r}: {exc}") from exc
