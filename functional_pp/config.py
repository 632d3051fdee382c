"""Training configuration: a YAML file with Accelerate / Axolotl names, parsed and checked
before any work is done.

``TrainConfig.from_yaml(path)`` (or ``from_dict``) checks key names (suggesting the closest
valid key) and value types; ``cfg.validate(world_size)`` checks everything that depends on the
device count, the model and the data: mesh size, batch and sequence divisibility, model
dimensions against the rules, data and tokenizer paths. Every problem raises
:class:`ConfigError` with a message that says what to change.

Example::

    dp_shard_size: 2          # FSDP over 2 devices
    tp_size: 2
    micro_batch_size: 4       # per data-parallel rank
    sequence_len: 128
    learning_rate: 3.0e-3
    max_steps: 100
    model: {preset: tiny}     # or "model: tiny"; other keys override the preset
    data: {path: null}        # null: the Python standard library's source, as bytes
    logging: {output_dir: runs/fsdp_tp, log_every: 10}
    checkpoint: {save_every: 50, keep_last: 2}
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ConfigError", "TrainConfig", "ModelConfig", "DataConfig", "LoggingConfig",
           "CheckpointConfig", "MESH_KEYS", "apply_overrides"]

MESH_KEYS = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard",
             "cp_size": "cp", "tp_size": "tp"}
SCHEDULERS = ("constant", "cosine", "linear")
OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
PRESETS = ("tiny", "1b", "8b", "70b")
ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_epsilon")
SGD_KEYS = ("momentum",)


class ConfigError(ValueError):
    """A problem with the training config, found before any work; says what to change."""


# ----------------------------------------------------------------------------- helpers
def _suggest(key: str, valid: list[str] | tuple[str, ...]) -> str:
    hint = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {hint[0]!r}?" if hint else f" (valid keys: {', '.join(sorted(valid))})"


def _check_keys(d: Mapping, valid: list[str] | tuple[str, ...], where: str) -> None:
    for key in d:
        if key not in valid:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"unknown key '{prefix}{key}'{_suggest(str(key), valid)}")


_NONE = type(None)


def _type_name(types: tuple) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping", _NONE: "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check_type(name: str, value: Any, types: tuple) -> Any:
    """``value`` if it has one of ``types`` (ints are accepted as floats; bools are not ints)."""
    if isinstance(value, bool):
        ok = bool in types
    elif isinstance(value, int):
        ok = int in types or float in types
        if ok and int not in types:
            value = float(value)
    else:
        ok = isinstance(value, tuple(t for t in types if t is not bool))
    if not ok:
        raise ConfigError(f"{name} must be {_type_name(types)}, got {value!r}")
    return value


def _from_section(cls, d: Any, where: str):
    """Build a section dataclass from a mapping, checking keys and types."""
    if d is None:
        return cls()
    if not isinstance(d, Mapping):
        raise ConfigError(f"'{where}' must be a mapping of keys to values, got {d!r}")
    valid = [f.name for f in dataclasses.fields(cls)]
    _check_keys(d, valid, where)
    kwargs = {k: _check_type(f"{where}.{k}", v, cls.TYPES[k]) for k, v in d.items()}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """``preset`` (tiny | 1b | 8b | 70b) plus overrides of :class:`llama.Config` fields."""

    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)

    @classmethod
    def from_value(cls, value: Any) -> "ModelConfig":
        if value is None:
            return cls()
        if isinstance(value, str):
            value = {"preset": value}
        if not isinstance(value, Mapping):
            raise ConfigError(f"'model' must be a preset name or a mapping, got {value!r}")
        from .models import llama
        fields = [f.name for f in dataclasses.fields(llama.Config)]
        d = dict(value)
        preset = d.pop("preset", "tiny")
        if preset not in PRESETS:
            raise ConfigError(f"model.preset {preset!r} is not a preset{_suggest(str(preset), PRESETS)} "
                              f"(presets: {', '.join(PRESETS)})")
        _check_keys(d, ["preset", *fields], "model")
        defaults = llama.Config.tiny()
        for k, v in d.items():
            default = getattr(defaults, k)
            if k == "rope_scaling":
                types = (dict, _NONE)
            elif k == "head_dim":
                types = (int, _NONE)
            else:
                types = (type(default),)
            d[k] = _check_type(f"model.{k}", v, types)
        return cls(preset, d)

    def build(self):
        """The :class:`functional_pp.models.llama.Config`."""
        from .models import llama
        from .ops.rotary import Llama3Scaling
        kw = dict(self.overrides)
        if isinstance(kw.get("rope_scaling"), Mapping):
            kw["rope_scaling"] = Llama3Scaling(**kw["rope_scaling"])
        try:
            return llama.Config.preset(self.preset, **kw)
        except TypeError as exc:
            raise ConfigError(f"model: {exc}") from exc

    def to_dict(self) -> dict:
        return {"preset": self.preset, **self.overrides}


@dataclass
class DataConfig:
    """Corpus: ``path`` (None: the standard library's ``*.py`` as bytes), ``kind``
    (auto | stdlib | text | dir | jsonl), optional ``tokenizer`` (a ``tokenizer.json``),
    ``max_bytes`` of raw text, ``pattern`` for directories, ``text_field`` for jsonl."""

    path: str | None = None
    kind: str = "auto"
    tokenizer: str | None = None
    max_bytes: int | None = 8 * 1024 * 1024
    pattern: str | None = None
    text_field: str = "text"

    TYPES = {"path": (str, _NONE), "kind": (str,), "tokenizer": (str, _NONE),
             "max_bytes": (int, _NONE), "pattern": (str, _NONE), "text_field": (str,)}


@dataclass
class LoggingConfig:
    """Where outputs go and how often the progress line is printed."""

    output_dir: str | None = None
    log_every: int = 10
    plot: bool = True

    TYPES = {"output_dir": (str, _NONE), "log_every": (int,), "plot": (bool,)}


@dataclass
class CheckpointConfig:
    """``save_every`` N steps (0: never periodically), ``keep_last`` K (null: keep all),
    ``save_final``: also save when training ends."""

    save_every: int = 0
    keep_last: int | None = 3
    save_final: bool = True

    TYPES = {"save_every": (int,), "keep_last": (int, _NONE), "save_final": (bool,)}


# ----------------------------------------------------------------------------- the config
_TOP_TYPES: dict[str, tuple] = {
    "dp_replicate_size": (int,), "dp_shard_size": (int,), "cp_size": (int,), "tp_size": (int,),
    "sequence_parallel": (bool,),
    "micro_batch_size": (int,), "gradient_accumulation_steps": (int,),
    "global_batch_size": (int, _NONE), "sequence_len": (int,),
    "learning_rate": (float,), "lr_scheduler": (str,), "warmup_steps": (int,),
    "min_learning_rate": (float,), "max_steps": (int,), "weight_decay": (float,),
    "max_grad_norm": (float, _NONE), "optimizer": (str,),
    "adam_beta1": (float,), "adam_beta2": (float,), "adam_epsilon": (float,), "momentum": (float,),
    "seed": (int,), "precision": (str,), "bf16": (bool, _NONE), "fp16": (bool, _NONE),
    "activation_checkpointing": (bool,), "compile": (bool, str), "on_nonfinite": (str,),
    "peak_flops_per_device": (float, _NONE),
}
_SECTIONS = ("model", "data", "rules", "logging", "checkpoint")


@dataclass
class TrainConfig:
    """Everything a training run needs. Build with :meth:`from_yaml` / :meth:`from_dict`;
    call :meth:`validate` with the world size before doing any work."""

    # mesh (Accelerate's ParallelismConfig names); dp_shard_size -1: the rest of the world
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    # batch (Axolotl names): micro_batch_size rows per data-parallel rank per micro-step
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    sequence_len: int = 128
    # optimization
    learning_rate: float = 3e-4
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    min_learning_rate: float = 0.0
    max_steps: int = 100
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    optimizer: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    momentum: float = 0.0
    seed: int = 0
    precision: str = "fp32"
    bf16: bool | None = None
    fp16: bool | None = None
    activation_checkpointing: bool = False
    compile: bool | str = False
    on_nonfinite: str = "skip"
    peak_flops_per_device: float | None = None
    # sections
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rules: dict = field(default_factory=dict)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    name: str = "train"            # from the YAML file name; names the default output dir

    # ------------------------------------------------------------------ parsing
    @classmethod
    def valid_keys(cls) -> list[str]:
        """Top-level keys a config may have."""
        return [*_TOP_TYPES, *_SECTIONS]

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
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: the config must be a mapping of keys to values")
        d = apply_overrides(d, overrides or [])
        return cls.from_dict(d, name=p.stem)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "train") -> "TrainConfig":
        """Build from a mapping, checking key names and value types."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"the config must be a mapping of keys to values, got {d!r}")
        _check_keys(d, cls.valid_keys(), "")
        top = {k: _check_type(k, v, _TOP_TYPES[k]) for k, v in d.items() if k in _TOP_TYPES}
        optimizer = str(top.get("optimizer", "adamw")).lower()
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer {optimizer!r} is not supported{_suggest(optimizer, OPTIMIZERS)} "
                              f"(choose {' or '.join(OPTIMIZERS)})")
        top["optimizer"] = optimizer
        foreign = SGD_KEYS if optimizer == "adamw" else ADAM_KEYS
        for k in foreign:
            if k in top:
                raise ConfigError(f"{k} does not apply to optimizer {optimizer!r}; remove it or set "
                                  f"optimizer: {'sgd' if optimizer == 'adamw' else 'adamw'}")
        rules = d.get("rules") or {}
        if not isinstance(rules, Mapping):
            raise ConfigError(f"'rules' must map logical axes to mesh axes, got {rules!r}")
        for k, v in rules.items():
            ok = v is None or isinstance(v, str) or (isinstance(v, (list, tuple))
                                                     and all(isinstance(a, str) for a in v))
            if not ok:
                raise ConfigError(f"rules.{k} must be a mesh axis name, a list of them or null, "
                                  f"got {v!r}")
        cfg = cls(**top,
                  model=ModelConfig.from_value(d.get("model")),
                  data=_from_section(DataConfig, d.get("data"), "data"),
                  rules={str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in rules.items()},
                  logging=_from_section(LoggingConfig, d.get("logging"), "logging"),
                  checkpoint=_from_section(CheckpointConfig, d.get("checkpoint"), "checkpoint"),
                  name=name)
        cfg._given = set(d)
        cfg._check_values()
        return cfg

    def _check_values(self) -> None:
        for k in MESH_KEYS:
            v = getattr(self, k)
            if v < 1 and not (k == "dp_shard_size" and v == -1):
                raise ConfigError(f"{k} must be >= 1 (or -1 for dp_shard_size: the rest of the "
                                  f"world), got {v}")
        positive = ("micro_batch_size", "gradient_accumulation_steps", "sequence_len", "max_steps")
        for k in positive:
            if getattr(self, k) < 1:
                raise ConfigError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0 (or null to disable clipping), got "
                              f"{self.max_grad_norm}")
        sched = self.lr_scheduler.lower()
        if sched not in SCHEDULERS:
            raise ConfigError(f"lr_scheduler {self.lr_scheduler!r} is not supported"
                              f"{_suggest(sched, SCHEDULERS)} (choose {', '.join(SCHEDULERS)})")
        self.lr_scheduler = sched
        if self.lr_scheduler != "constant" and self.warmup_steps > self.max_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps} "
                              f"(the {self.lr_scheduler} schedule decays after warmup); lower it, "
                              f"e.g. --set warmup_steps={self.max_steps // 2}")
        self.precision = self.resolved_precision()
        if self.on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {self.on_nonfinite!r}")
        if isinstance(self.compile, str):
            import torch._dynamo
            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile not in backends:
                raise ConfigError(f"compile: unknown torch.compile backend {self.compile!r}"
                                  f"{_suggest(self.compile, backends)}")
        if self.logging.log_every < 1:
            raise ConfigError(f"logging.log_every must be >= 1, got {self.logging.log_every}")
        if self.checkpoint.save_every < 0:
            raise ConfigError(f"checkpoint.save_every must be >= 0 (0: no periodic saves), got "
                              f"{self.checkpoint.save_every}")
        if self.checkpoint.keep_last is not None and self.checkpoint.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 (or null: keep all), got "
                              f"{self.checkpoint.keep_last}")
        if self.data.max_bytes is not None and self.data.max_bytes < 1:
            raise ConfigError(f"data.max_bytes must be >= 1 (or null: no cap), got {self.data.max_bytes}")
        kinds = ("auto", "stdlib", "text", "dir", "jsonl")
        if self.data.kind not in kinds:
            raise ConfigError(f"data.kind {self.data.kind!r} is not supported"
                              f"{_suggest(self.data.kind, kinds)} (choose {', '.join(kinds)})")
        if self.data.kind in ("text", "dir", "jsonl") and self.data.path is None:
            raise ConfigError(f"data.kind {self.data.kind!r} needs data.path")

    def resolved_precision(self) -> str:
        """``precision``, reconciled with Axolotl's ``bf16`` / ``fp16`` flags."""
        p = self.precision.lower()
        aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "no": "fp32"}
        p = aliases.get(p, p)
        if p not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not supported"
                              f"{_suggest(p, PRECISIONS)} (choose {', '.join(PRECISIONS)})")
        flags = [f for f in ("bf16", "fp16") if getattr(self, f)]
        if len(flags) > 1:
            raise ConfigError("bf16 and fp16 are both true; choose one")
        if flags:
            if "precision" in self._given and p != flags[0]:
                raise ConfigError(f"{flags[0]}: true contradicts precision: {self.precision}")
            p = flags[0]
        return p

    # ------------------------------------------------------------------ derived values
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
        from .mesh import Mesh
        return Mesh(**self.mesh_sizes(world_size))

    def build_rules(self, mesh=None):
        """``llama.default_rules`` with the config's ``rules`` entries replacing (null: removing)
        the defaults."""
        from .layout import Rules
        from .models import llama
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
                                  f"{_suggest(logical, sorted(known))}")
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
        model = self.model.build()
        try:
            micro_global = self.micro_batch_size * dp
            shape = (micro_global, self.sequence_len, model.hidden)
            for dims in (("batch", "seq", "hidden"), ("batch", "res_seq", "hidden")):
                rules.resolve(dims, shape, mesh, name=f"activations ({' '.join(dims)})")
            from .models import llama
            from .tree import leaves_with_paths
            for path, decl in leaves_with_paths(llama.init(model)):
                rules.resolve(decl.axes, decl.shape, mesh, name=f"parameter {path}")
        except ValueError as exc:
            raise ConfigError(f"{exc} (model preset {self.model.preset!r}, mesh "
                              f"{dict(mesh.shape)})") from exc
        if self.data.path is not None and not Path(self.data.path).exists():
            raise ConfigError(f"data.path {self.data.path!r} does not exist (looked for "
                              f"{Path(self.data.path).resolve()}); fix the path or remove it to "
                              f"train on the Python standard library")
        if self.data.tokenizer is not None and not Path(self.data.tokenizer).is_file():
            raise ConfigError(f"data.tokenizer {self.data.tokenizer!r} does not exist (looked for "
                              f"{Path(self.data.tokenizer).resolve()})")

    @staticmethod
    def _logical_axes() -> set[str]:
        from .models import llama
        from .tree import leaves_with_paths
        axes = {"batch", "seq", "res_seq"}
        for _, decl in leaves_with_paths(llama.init(llama.Config.tiny())):
            axes.update(decl.axes)
        return axes

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """A JSON-able dict that :meth:`from_dict` reads back."""
        foreign = SGD_KEYS if self.optimizer == "adamw" else ADAM_KEYS
        out = {k: getattr(self, k) for k in _TOP_TYPES if k not in foreign}
        out["model"] = self.model.to_dict()
        out["data"] = {f.name: getattr(self.data, f.name) for f in dataclasses.fields(DataConfig)}
        out["rules"] = dict(self.rules)
        out["logging"] = {f.name: getattr(self.logging, f.name) for f in dataclasses.fields(LoggingConfig)}
        out["checkpoint"] = {f.name: getattr(self.checkpoint, f.name)
                             for f in dataclasses.fields(CheckpointConfig)}
        return out

    def __post_init__(self) -> None:
        self._given: set[str] = set()


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
    return out
