"""Prompts for online training (``rl: grpo``, docs/preference.md "GRPO"): each record of a
``datasets:`` entry becomes a prompt (TRL's ``prompt`` column: a text, or a conversation
rendered with the run's chat template and its generation prompt) and the record's other
columns, which reward functions receive as keyword arguments (TRL's ``GRPOTrainer``).

``type:`` omitted: the records as they are (``field_prompt``, default ``prompt``). ``type:
module.func`` (Axolotl's user-defined transform, e.g. ``rwd.gsm8k_transform``):
``module.func(cfg)`` returns ``transform(record) -> record`` (or ``(transform, map_kwargs)``
with ``remove_columns``); the transform's output updates the record, as ``datasets.map`` does.
The module is imported from the config's directory, the working directory or ``sys.path``.

:class:`PromptLoader` gives each step's prompts, the same on every device (mesh-independent):
step ``t``'s are ``perm[t*P:(t+1)*P]`` of epoch ``t // steps_per_epoch``'s permutation."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from functional_pp.data.formats import ByteTokenizer, _records, _with_bos

__all__ = ["Prompt", "PromptSet", "PromptLoader", "build_prompts", "import_dotted", "importable_from"]


@dataclass
class Prompt:
    """One prompt: its token ids, the dataset's ``prompt`` value and the record's other columns."""

    ids: list[int]
    raw: Any
    columns: dict


@dataclass
class PromptSet:
    """The prompts of a run, each leaving room for ``max_completion_length`` tokens in ``seq_len``."""

    prompts: list[Prompt]
    vocab_size: int
    pad_id: int
    name: str
    dropped: int = 0                       # prompts too long for seq_len - max_completion_length, left out
    duplicates: int = 0
    stats: list = field(default_factory=list)
    unit = "prompts"
    #: the named dimensions of a GRPO batch's tensors (the training step's ``batch_dims``)
    batch_dims = {k: "batch seq" for k in ("tokens", "labels", "advantages", "step_rows", "step_tokens",
                                           "chunk_tokens", "step_chunks", "old_logps")}

    def __len__(self) -> int:
        return len(self.prompts)

    def split(self, n_val: int, seed: int) -> tuple["PromptSet", "PromptSet"]:
        """``(train, held out)``: ``n_val`` prompts chosen by the seed held out (as
        ``val_set_size`` holds out preference pairs), each keeping its order."""
        held = set(np.random.default_rng([seed, 7]).permutation(len(self.prompts))[len(self.prompts) - n_val:].tolist())
        train = [x for i, x in enumerate(self.prompts) if i not in held]
        val = [x for i, x in enumerate(self.prompts) if i in held]
        return (PromptSet(train, self.vocab_size, self.pad_id, self.name, self.dropped, self.duplicates, self.stats),
                PromptSet(val, self.vocab_size, self.pad_id, f"{self.name}[val]"))

    @property
    def tokens(self) -> np.ndarray:
        """Every prompt's token ids, one after another (what the ranks of a run compare)."""
        return np.concatenate([np.asarray(p.ids, dtype=np.int64) for p in self.prompts])


@contextlib.contextmanager
def importable_from(*dirs: str | Path | None) -> Iterator[None]:
    """Modules in ``dirs`` (and the working directory) importable inside, as Axolotl's
    ``importlib.import_module`` of a module beside the config."""
    added = [str(Path(d).resolve()) for d in (*dirs, ".") if d is not None]
    added = [d for i, d in enumerate(added) if d not in added[:i] and d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def _forget_if_shadowed(module: str, dirs: tuple) -> None:
    """A module of that name imported earlier from another file (another run's config folder in
    the same process) is forgotten when one of ``dirs`` holds its file: the config's own wins."""
    cached = sys.modules.get(module)
    if cached is None:
        return
    rel = Path(*module.split("."))
    for d in (*dirs, "."):
        if d is None:
            continue
        for here in (Path(d) / rel.with_suffix(".py"), Path(d) / rel / "__init__.py"):
            if here.is_file():
                if Path(getattr(cached, "__file__", "") or "").resolve() != here.resolve():
                    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
                        del sys.modules[name]
                return


def import_dotted(name: str, what: str, key: str, dirs: tuple = ()) -> Callable:
    """The callable ``module.func`` (``pkg.module.func``) named by ``key``; errors name the key."""
    module, _, attr = str(name).rpartition(".")
    if not module:
        raise ValueError(f"{key}: {name!r} is not a dotted path module.function ({what})")
    _forget_if_shadowed(module, dirs)
    with importable_from(*dirs):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"{key}: cannot import module {module!r} for {name!r} ({exc}); put {module}.py "
                             f"beside the config or in the working directory, or on PYTHONPATH") from exc
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: module {module!r} ({getattr(mod, '__file__', '?')}) has no function {attr!r}")
    return fn


def _transform(entry: Any, cfg: Mapping, dirs: tuple, where: str, index: int) -> tuple[Callable | None, list]:
    """The entry's record transform and the columns it removes (none without ``type``)."""
    if entry.type is None:
        return None, []
    build = import_dotted(entry.type, "a dataset transform, Axolotl's user-defined GRPO type",
                          f"{where}.type", dirs)
    params = inspect.signature(build).parameters
    made = build(cfg, **({"dataset_idx": index} if "dataset_idx" in params or any(
        p.kind is p.VAR_KEYWORD for p in params.values()) else {}))
    fn, kwargs = (made if isinstance(made, tuple) else (made, {}))
    if not callable(fn):
        raise ValueError(f"{where}.type: {entry.type}(cfg) returned {type(fn).__name__}, not a transform function")
    return fn, list((kwargs or {}).get("remove_columns") or [])


def _prompt_ids(tok: Any, raw: Any, template: str | None, where: str) -> list[int]:
    """A prompt's token ids as TRL's ``GRPOTrainer``: a text tokenized with the tokenizer's special
    tokens; a conversation rendered with the chat template and its generation prompt."""
    if isinstance(raw, str):
        return _with_bos(tok, tok.encode(raw), None)[0]
    if isinstance(raw, list) and raw and all(isinstance(m, dict) and "role" in m and "content" in m for m in raw):
        from functional_pp.data.chat import render
        text = render(template, raw, getattr(tok, "special_tokens", None) or {}, add_generation_prompt=True)[0]
        return tok.encode(text)
    raise ValueError(f"{where}: the prompt must be a text or a list of messages ({{role, content}}), got "
                     f"{type(raw).__name__} {str(raw)[:60]!r}")


def build_prompts(entries: list, tokenizer: Any, *, seq_len: int, max_completion_length: int,
                  chat_template: str | None = None, chat_template_jinja: str | None = None,
                  cfg: Mapping | None = None, config_dir: str | Path | None = None) -> PromptSet:
    """The prompts of ``datasets:`` entries; one longer than ``seq_len - max_completion_length``
    tokens is left out and counted; none left is an error naming the shortest. A conversation is
    rendered with ``chat_template`` (a name, or ``jinja`` with ``chat_template_jinja``; default
    the tokenizer's, else ChatML). ``cfg`` (the config as a mapping) is what a transform
    ``module.function(cfg)`` receives; ``config_dir`` where its module is looked for first."""
    from functional_pp.data.chat import resolve_template
    tok = tokenizer or ByteTokenizer()
    room = seq_len - max_completion_length
    if room < 1:
        raise ValueError(f"sequence_len {seq_len} leaves no room for a prompt before max_completion_length "
                         f"{max_completion_length} tokens: raise sequence_len")
    template = None
    prompts, dropped, shortest = [], 0, None
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]: {entry.path}"
        if not Path(entry.path).exists():
            raise FileNotFoundError(f"{where}: no such file or directory")
        fn, removed = _transform(entry, dict(cfg or {}), (config_dir,), f"datasets[{i}]", i)
        key = getattr(entry, "field_prompt", None) or "prompt"
        for n, rec in enumerate(_records(Path(entry.path), entry.ds_type, entry.split, where), start=1):
            if fn is not None:
                out = fn(rec, tokenizer=tok) if "tokenizer" in inspect.signature(fn).parameters else fn(rec)
                if not isinstance(out, Mapping):
                    raise ValueError(f"{where}: record {n}: the transform {entry.type} returned "
                                     f"{type(out).__name__}, not a record (a mapping with 'prompt')")
                rec = {**{k: v for k, v in rec.items() if k not in removed}, **out}
            if key not in rec:
                raise ValueError(f"{where}: record {n} has no field {key!r} (its fields: {sorted(rec)}); set "
                                 f"field_prompt, or give a type: module.function transform that writes 'prompt'")
            raw = rec[key]
            if not isinstance(raw, str) and template is None:
                own = getattr(tok, "chat_template", None)
                template = resolve_template(chat_template or "tokenizer_default_fallback_chatml", chat_template_jinja,
                                            own, where="chat_template")[0]
            ids = _prompt_ids(tok, raw, template, f"{where}: record {n}")
            if not ids:
                raise ValueError(f"{where}: record {n}: the prompt is empty")
            if len(ids) > room:
                dropped += 1
                shortest = len(ids) if shortest is None else min(shortest, len(ids))
                continue
            prompts.append(Prompt(ids, raw, {k: v for k, v in rec.items() if k != key}))
    names = ", ".join(Path(e.path).name for e in entries)
    if not prompts:
        raise ValueError(f"no prompt of {names} fits sequence_len {seq_len} - max_completion_length "
                         f"{max_completion_length} = {room} tokens "
                         + (f"(the shortest has {shortest}): raise sequence_len" if dropped else
                            "(the datasets hold no record)"))
    pad = tok.eos_id if tok.eos_id is not None else 0
    return PromptSet(prompts, int(tok.vocab_size), int(pad), names, dropped)


class PromptLoader:
    """Each step's ``prompts_per_step`` prompts (indices into the set), the same on every device;
    the leftover prompts of an epoch are skipped (TRL's sampler drops them too)."""

    def __init__(self, prompts: PromptSet, *, prompts_per_step: int, seed: int = 0,
                 generation_key: int | None = None) -> None:
        if len(prompts) < prompts_per_step:
            raise ValueError(f"{len(prompts)} prompts (of {prompts.name}) are fewer than one step's "
                             f"{prompts_per_step} (the global batch / num_generations): lower micro_batch_size / "
                             f"gradient_accumulation_steps or add prompts")
        self.prompts, self.per_step, self.seed = prompts, int(prompts_per_step), seed
        self.steps_per_epoch = max(1, len(prompts) // self.per_step)
        self.step = 0
        #: the key of the completions' sampling (checkpointed with the position)
        self.generation_key = int(seed if generation_key is None else generation_key)
        #: what the user of the prompts keeps between steps (GRPO: the generation a later step
        #: reuses), checkpointed with the position: JSON values
        self.carry: dict | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def indices(self, step: int) -> np.ndarray:
        epoch, i = divmod(int(step), self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
        return order[i * self.per_step:(i + 1) * self.per_step]

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> list[Prompt]:
        out = [self.prompts.prompts[j] for j in self.indices(self.step)]
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        out = {"step": int(self.step), "prompts_per_step": self.per_step, "num_prompts": len(self.prompts),
               "seed": int(self.seed), "generation_key": self.generation_key}
        return out if self.carry is None else {**out, "carry": self.carry}

    def load_state_dict(self, state: Mapping[str, Any], check_tokens: bool = True) -> None:
        mine = self.state_dict()
        for key in ("prompts_per_step", "num_prompts"):
            if check_tokens and key in state and state[key] != mine[key]:
                raise ValueError(f"loader state has {key}={state[key]}, but this loader has {key}={mine[key]}")
        self.step = int(state["step"])
        self.generation_key = int(state.get("generation_key", self.generation_key))
        self.carry = state.get("carry")
