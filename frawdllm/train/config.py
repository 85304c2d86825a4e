"""Training configuration: one dataclass per job, every field a CLI flag and a YAML key.

`TrainConfig` holds what the shared loop needs (optimizer, schedule, budget, dtype,
checkpoints, logging). A job extends it: `PretrainConfig` adds the model (a preset plus
field overrides) and the data; `FinetuneConfig` (sft, dpo: align/config.py) and
`TranslateConfig` (train/translation_config.py) add theirs the same way.

A run is described by layers, later ones winning:

    defaults  <  the run's saved config.yaml (with --resume)  <  YAML file (--config FILE)  <  flags

and the run directory's `config.yaml` is the merged result, loadable with `--config`.
Values are validated once, here; the loop trusts them.
"""

from __future__ import annotations

import math
import os
import re
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ..config import (ModelConfig, check_fields, config_class, get_config, is_integer, positions_override,
                      typed_overrides)
from ..errors import ConfigError, short_repr

SCHEDULES = ("cosine", "linear", "wsd", "constant", "noam")
# How text files split into documents (data.sources reads them; defined here, where the CLI's
# options can read them without importing the data package, which imports torch)
DOC_SPLITS = ("blank", "line", "file")
DTYPES = ("auto", "fp32", "bf16", "fp16")
COMPILE_CHOICES = ("auto", "true", "false")
PARALLEL_CHOICES = ("ddp", "fsdp")
_BOOLEAN_WORDS = {"true": "true", "on": "true", "yes": "true", "1": "true",
                  "false": "false", "off": "false", "no": "false", "0": "false", "auto": "auto"}


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with the help text its CLI flag shows."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(h|m|s)?", re.IGNORECASE)
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds in "90", "100s", "5m", "1.5h" or "1h30m"."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        value = str(text).strip().replace(" ", "")
        pos, seconds, units = 0, 0.0, []
        for match in _DURATION.finditer(value):
            if match.start() != pos:
                break
            units.append((match.group(2) or "").lower())
            seconds += float(match.group(1)) * _SECONDS[units[-1] or "s"]
            pos = match.end()
        # units once each, largest first, and a bare number alone ("5m5m", "1m1h" or "1h30" are typos)
        in_order = [_SECONDS[u] for u in units if u] == sorted({_SECONDS[u] for u in units if u}, reverse=True)
        if not value or pos != len(value) or not in_order or ("" in units and len(units) > 1):
            raise ConfigError(f"cannot read {text!r} as a duration; use e.g. 90, 100s, 5m, 1h30m")
    if not 0 < seconds < math.inf:  # (nan and inf too: YAML's .inf, or 400 digits)
        raise ConfigError(f"a duration must be positive and finite, got {text!r}")
    return seconds


def _check_duration(name: str, text: str) -> None:
    """`text` read as a duration, or a ConfigError that names the field (and so the flag or
    the file that gave it: see `build_config`)."""
    try:
        parse_duration(text)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


WARMUP_HELP = "Steps of linear warmup to the peak (from peak/warmup at the first step)."
EVAL_INTERVAL_HELP = ("Evaluate (and checkpoint) every this many steps; 0 = only at the end (and at the start "
                      "under --max-time, to time it).")


@dataclass
class TrainConfig:
    """Settings of the shared training loop."""

    out: str = option("runs/pretrain", "Run directory: config, metrics, checkpoints, the best model.")
    resume: bool = option(False, "Continue the run in --out from its latest checkpoint.")
    overwrite: bool = option(False, "Start over in an --out that already holds a run (deletes it).")
    seed: int = option(1337, "Seed of the weights' initialisation, dropout and data order.")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps.")
    dtype: str = option("auto", "fp32, bf16 or fp16 autocast; auto = fp32 where the hardware has no "
                                "native bf16, else whichever of bf16 and fp32 the first steps time faster "
                                "(on a GPU: bf16 where it has it).", choices=DTYPES)
    compile: str | bool = option("auto", "torch.compile the training step: true, false, or auto = only where its "
                                  "warm-up pays back within the budget (measured, cached per machine).",
                          choices=COMPILE_CHOICES)
    # batch and budget
    batch_size: int = option(16, "Sequences per micro-batch.")
    grad_accum: int = option(1, "Micro-batches per optimizer step.")
    max_steps: int | None = option(None, "Stop after this many optimizer steps; none clears a config file's "
                                         "(or a resumed run's).", none_clears=True)
    max_tokens: int | None = option(None, "Stop after this many training tokens; none clears a config file's "
                                           "(or a resumed run's).",
                                    none_clears=True)
    max_time: str | None = option(None, "Stop after this much time, e.g. 100s, 5m, 1h30m (evals included); "
                                        "none clears a config file's (or a resumed run's).")
    # optimizer
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr_ratio: float = option(0.1, "Floor of the decay, as a fraction of the peak (cosine, linear, wsd; "
                                      "noam and constant have none).")
    schedule: str = option("cosine", "Decay after warmup: cosine, linear, wsd (warmup-stable-decay), constant, "
                                              "noam (inverse square root of the step).", choices=SCHEDULES)
    warmup_steps: int = option(100, WARMUP_HELP)
    decay_fraction: float = option(0.2, "wsd: the final fraction of the run after warmup spent decaying.")
    weight_decay: float = option(0.1, "AdamW weight decay, applied to matrices only.")
    decay_embeddings: bool = option(False, "Also apply weight decay to the embedding matrices.")
    beta1: float = option(0.9, "AdamW beta1.")
    beta2: float = option(0.95, "AdamW beta2.")
    grad_clip: float = option(1.0, "Clip the gradients' global norm to this (0 = off).")
    # evaluation, checkpoints, logging
    eval_interval: int = option(250, EVAL_INTERVAL_HELP)
    eval_batches: int = option(20, "Validation batches per evaluation.")
    keep_last: int = option(2, "Checkpoints to keep (the best one by val loss is kept too).")
    log_interval: int = option(10, "Write a metrics line every this many steps.")
    sample_tokens: int = option(64, "Tokens to sample at each evaluation (0 = none).")
    sample_prompt: str = option("", "Prompt of the samples written at each evaluation.")
    max_bad_steps: int = option(5, "Stop after this many NaN/inf losses in a row.")
    peak_tflops: float | None = option(None, "Peak TFLOP/s for MFU (default: measure a matmul at start).")
    progress: bool = option(True, "Show a progress bar.")
    tensorboard: bool = option(False, "Also log to TensorBoard (OUT/tensorboard).")
    wandb: bool = option(False, "Also log to Weights & Biases (offline unless WANDB_MODE says otherwise).")
    wandb_project: str = option("frawdllm", "W&B project name.")
    # several processes (torchrun, or --nproc N)
    parallel: str = option("ddp", "Under torchrun: ddp (each rank holds the whole model) or fsdp (weights, "
                                  "gradients and AdamW moments sharded over the ranks).", choices=PARALLEL_CHOICES)
    dist_timeout: str = option("10m", "Under torchrun: how long a rank waits for the others in a collective "
                                      "before the run stops (a dead rank never hangs the rest).")

    def __post_init__(self) -> None:
        positive = ("batch_size", "grad_accum", "eval_batches", "keep_last", "log_interval", "max_bad_steps")
        _require_integers(self, positive, lambda v: v >= 1, "a positive integer")
        _require_integers(self, ("max_steps", "max_tokens"), lambda v: v is None or v >= 1, "a positive integer")
        _require_integers(self, ("warmup_steps", "eval_interval", "sample_tokens"), lambda v: v >= 0,
                          "an integer >= 0")
        _require_integers(self, ("seed",), lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")  # (numpy's, torch's)
        _require("lr", self.lr, lambda v: v > 0, "a finite positive number")
        _require("min_lr_ratio", self.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]")
        _require("decay_fraction", self.decay_fraction, lambda v: 0 < v <= 1, "in (0, 1]")
        _require("weight_decay", self.weight_decay, lambda v: v >= 0, "a finite number >= 0")
        _require("grad_clip", self.grad_clip, lambda v: v >= 0, "a finite number >= 0 (0 = off)")
        for name in ("beta1", "beta2"):
            _require(name, getattr(self, name), lambda v: 0 <= v < 1, "in [0, 1)")
        _require("peak_tflops", self.peak_tflops, lambda v: v is None or v > 0, "a finite positive number")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        self.compile = _compile_setting(self.compile)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if str(self.max_time).strip().lower() in ("none", "null", "off"):  # (a flag clearing a config's)
            self.max_time = None
        if self.max_time is not None:
            self.max_time = str(self.max_time)
            _check_duration("max_time", self.max_time)
        if self.parallel not in PARALLEL_CHOICES:
            raise ConfigError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}; got {self.parallel!r}")
        self.dist_timeout = str(self.dist_timeout)
        _check_duration("dist_timeout", self.dist_timeout)
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues a run and --overwrite deletes it; choose one")

    @property
    def max_time_s(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time)

    @property
    def has_budget(self) -> bool:
        return any(v is not None for v in (self.max_steps, self.max_tokens, self.max_time))

    def require_budget(self) -> None:
        """A run must end: one line when no budget is given (checked before anything is written)."""
        if not self.has_budget:
            raise ConfigError("give a budget: --max-steps, --max-tokens or --max-time")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def effective(values: dict) -> dict:
        """A config's values (a saved config.yaml's too) as the run uses them, defaults that
        depend on other settings resolved (none here; `FinetuneConfig`'s LoRA alpha)."""
        return values

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        check_fields(cls, data, f"{cls.__name__} field")
        return cls(**{k: _coerce(cls, k, v) for k, v in data.items()})


@dataclass
class PretrainConfig(TrainConfig):
    """`frawd pretrain`: a model (preset + overrides, or an existing model directory) on a corpus."""

    # a command-line flag for one of these clears a config file's other (--tokenizer char over vocab_size: 2048)
    ALTERNATIVES: ClassVar[tuple[tuple[str, str], ...]] = (("tokenizer", "vocab_size"),)

    preset: str = option("tiny", "Model preset: tiny, small, base, 100m, tiny-llama, small-llama.")
    model: dict = option({}, "ModelConfig field overrides (YAML mapping; on the command line --set F=V).")
    data: str = option("stdlib", "Corpus (stdlib, file, folder, glob, .jsonl, .parquet, hf:NAME) "
                                 "or a folder of prepared shards (train.bin, val.bin, meta.json).")
    text_field: str = option("text", "JSONL field / Parquet column holding the text.")
    doc_split: str = option("blank", "How text files split into documents: blank, line or file.",
                            choices=DOC_SPLITS)
    tokenizer: str | None = option(None, "A tokenizer kind to train on --data (bpe, char, byte) or the path of "
                                         "a tokenizer.json (or a folder holding one); default: bpe, or the "
                                         "--init-from model's tokenizer.json.")
    vocab_size: int | None = option(None, "BPE vocabulary size to train (default: the preset's).")
    val_fraction: float = option(0.005, "Share of the corpus held out for validation.")
    init_from: str | None = option(None, "Start from the weights of this model directory (an imported GPT-2, a "
                                         "finished run's model/): its config.json replaces --preset, its "
                                         "tokenizer.json is the default --tokenizer; fresh optimizer, step 0.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, dict):
            raise ConfigError(f"model must be a mapping of ModelConfig fields, got {self.model!r}")
        self.model = typed_overrides(config_class(self.preset), self.model)  # (YAML reads 1e-6 as text)
        # an unknown preset or a bad field is named before any work
        if get_config(self.preset, **self.model).__class__ is not ModelConfig:
            raise ConfigError(f"{self.preset} is an encoder-decoder preset: train it with `frawd translate train`")
        _require("val_fraction", self.val_fraction, lambda v: 0 <= v < 1, "in [0, 1)")
        if self.doc_split not in DOC_SPLITS:  # (with prepared shards too, where it is unused)
            raise ConfigError(f"doc_split must be one of {', '.join(DOC_SPLITS)}; got {self.doc_split!r}")
        _require_integers(self, ("vocab_size",), lambda v: v is None or v >= 1, "a positive integer")


def _compile_setting(value: Any) -> str:
    """`compile` as auto, true or false (YAML and older configs give booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    word = _BOOLEAN_WORDS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if word is None:
        raise ConfigError(f"compile must be auto, true or false; got {value!r}")
    return word


def _require(name: str, value: Any, ok, what: str) -> None:
    """`value` passes `ok`, else one line saying `name` must be `what`. A `what` that promises
    an integer also refuses floats (2.5, and 16.0 too) and booleans; None is left to `ok`.
    nan and inf are refused whatever `ok` says (`--lr inf` passed `v > 0` and failed later)."""
    integer = is_integer(value)
    finite = not isinstance(value, float) or math.isfinite(value)
    try:
        good = finite and ok(value) and (integer or value is None or "integer" not in what)
    except TypeError:
        good = False
    if not good:
        raise ConfigError(f"{name} must be {what}, got {short_repr(value)}")


def _require_integers(cfg: Any, names: tuple[str, ...], ok, what: str) -> None:
    """`_require` for integer fields; a numpy integer becomes a plain int (config.yaml holds it)."""
    for name in names:
        value = getattr(cfg, name)
        _require(name, value, ok, what)
        if value is not None:
            setattr(cfg, name, int(value))


def _coerce(cls: type, name: str, value: Any) -> Any:
    """YAML reads `3e-4` as a string and `1` where a float is meant: fix such values."""
    hint = typing.get_type_hints(cls)[name]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in options and str not in options and isinstance(value, str) and value.lower() in ("none", "null"):
        return None  # (--max-steps none: a flag clearing a config file's value)
    if value is None or any(isinstance(value, o) and not (o is int and isinstance(value, bool))
                            for o in options if isinstance(o, type)):
        return value
    for target in (float, int):
        if target in options and isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                return target(value)
            except ValueError:
                pass
    if str in options and isinstance(value, (int, float, bool)):
        return str(value)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping",
             type(None): "null"}
    wanted = " or ".join(dict.fromkeys(names.get(o, getattr(o, "__name__", str(o))) for o in options))
    raise ConfigError(f"{name}: expected {wanted}, got {short_repr(value)}")


def field_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in fields(cls):
        out[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A config file as a mapping: YAML, or TOML for a `.toml` file (FrawdError on a missing
    or malformed file), its paths with `~` expanded (see expand_home)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {path} is a folder; give a YAML or .toml file (a run's is RUN/config.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    parse = _toml().loads if path.suffix.lower() == ".toml" else yaml.safe_load
    try:
        data = parse(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except (yaml.YAMLError, ValueError) as exc:  # (tomllib.TOMLDecodeError is a ValueError)
        language = "YAML" if parse is yaml.safe_load else "TOML"
        raise ConfigError(f"{path}: not valid {language} ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields at the top level (`key: value` lines; "
                          f"TOML in a file named .toml)")
    return expand_home(data)


def expand_home(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with `~` expanded in `out` and the other paths (rundir.PATH_FIELDS): the shell
    expands `--out ~/run` on a command line, but nothing expands `out: ~/run` in a config file,
    which would make a folder named `~` in the working directory."""
    from .rundir import PATH_FIELDS

    return {key: os.path.expanduser(value) if key in ("out", *PATH_FIELDS) and isinstance(value, str) else value
            for key, value in values.items()}


def _toml() -> types.ModuleType:
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        raise ConfigError("TOML config files need Python 3.11 or later; write the config as YAML") from None
    return tomllib


def build_config(cls: type, config_file: str | Path | None = None, flags: dict[str, Any] | None = None,
                 model_overrides: dict[str, Any] | None = None) -> Any:
    """Merge defaults < the run's saved config (when resuming) < `config_file` < `flags`.

    `flags` maps field names to values, None meaning "not given". `model_overrides`
    (from --set) are merged key by key into the `model` mapping, if `cls` has one.
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    from_file = load_config_file(config_file) if config_file else {}
    try:  # (checked here, the message names the file to fix)
        check_fields(cls, from_file, f"{cls.__name__} field")
    except ConfigError as exc:
        raise ConfigError(f"{config_file}: {exc}") from None
    out = flags.get("out", from_file.get("out", field_defaults(cls).get("out")))
    if out is not None and "out" in {f.name for f in fields(cls)}:
        try:  # (read here, before the fields are checked: `out: [a]` was a TypeError traceback)
            out = _coerce(cls, "out", out)
        except ConfigError as exc:
            raise ConfigError(f"{config_file}: {exc}" if "out" in from_file else str(exc)) from None
    for pair in getattr(cls, "ALTERNATIVES", ()):  # a flag for one of two alternatives clears the file's other
        if sum(name in flags for name in pair) == 1:
            from_file = {k: v for k, v in from_file.items() if k in flags or k not in pair}
    resume = flags.get("resume", from_file.get("resume", False))
    from .rundir import CONFIG_FILE  # (the run's saved config)

    saved_path = Path(out) / CONFIG_FILE if out else None
    saved = load_config_file(saved_path) if resume and saved_path is not None and saved_path.is_file() else {}
    merged = {**saved, **from_file, **flags}
    if "model" in {f.name for f in fields(cls)}:
        layers = (saved.get("model"), from_file.get("model"), model_overrides)
        for layer in layers:
            if layer is not None and not isinstance(layer, dict):
                raise ConfigError(f"model must be a mapping of ModelConfig fields, got {layer!r}")
        merged["model"] = {}
        for layer in layers:
            if layer:
                merged["model"].update({**layer, **positions_override(layer, merged["model"].get("pos_encoding"))})
    elif model_overrides:
        raise ConfigError(f"{cls.__name__} has no model fields to --set")
    try:
        cfg = cls.from_dict(merged)
        _refuse_unused_schedule_flags(cfg, flags)
        return cfg
    except ConfigError as exc:  # a bad value: name the file it came from, when a file gave it
        if saved:  # a resume's flag that changes what the run was trained as: that is what is wrong
            from .rundir import RESUME_FIXED, refuse_fixed  # (--lora-rank 0 over the run's alpha blamed config.yaml)

            refuse_fixed(cls, saved_path.parent, [(k, saved[k], v) for k, v in flags.items()
                                                  if k in RESUME_FIXED and k in saved and saved[k] != v])
        layers = ((flags, model_overrides, None), (from_file, from_file.get("model"), config_file),
                  (saved, saved.get("model"), saved_path))
        source = _source_of(str(exc), layers)
        if source is None:
            raise ConfigError(_named_as_typed(str(exc), flags)) from None
        raise ConfigError(f"{source}: {exc}") from None


def _refuse_unused_schedule_flags(cfg: Any, flags: dict) -> None:
    """--min-lr-ratio given with a schedule that has no floor (noam, constant), or
    --decay-fraction with one that has no separate decay phase (all but wsd), where they would
    do nothing: refused. (A config file may hold them all: a run's config.yaml, rerun, lists
    every field.)"""
    schedule = getattr(cfg, "schedule", None)
    if "min_lr_ratio" in flags and schedule in ("noam", "constant"):
        why = "decays as 1/sqrt(step), with no floor" if schedule == "noam" else "does not decay"
        raise ConfigError(f"--min-lr-ratio {cfg.min_lr_ratio}: the {schedule} schedule {why}; leave it out, "
                          "or choose a schedule that decays to it (--schedule cosine, linear or wsd)")
    if "decay_fraction" in flags and schedule is not None and schedule != "wsd":
        raise ConfigError(f"--decay-fraction {cfg.decay_fraction}: only the wsd schedule has a decay phase (the "
                          f"{schedule} schedule's shape spans the whole run); leave it out, or give --schedule wsd")


def _named_as_typed(message: str, flags: dict) -> str:
    """A config error's message (it starts with the field's name) with the field named as the
    flag that gave it, where a flag did: `--batch-size must be ...`, not `batch_size must be ...`
    (`cli.flags` makes every field's flag `--` + its name with dashes)."""
    field = _leading_field(message)
    if field is None or field not in flags:
        return message
    return "--" + field.replace("_", "-") + message[len(field):]


def _leading_field(message: str) -> str | None:
    """The field a config error's message starts with (its first identifier, or the unknown
    field it names), if any."""
    match = re.match(r"unknown (?:config )?field '(\w+)'|([A-Za-z_]\w*)", message)
    return (match.group(1) or match.group(2)) if match else None


def _source_of(message: str, layers: tuple) -> str | None:
    """The file whose value a config error's message names (it starts with the field's name,
    and may name others with their values: "n_embd (128) must be divisible by n_head (3)"):
    of `layers` ((fields, model fields, file), highest first), the first that sets one of
    them; None where that is the command line (the --set n_head=3 that broke a file's n_embd)."""
    field = _leading_field(message)
    if field is None:
        return None
    named = {field, *re.findall(r"\b([a-z_][a-z0-9_]*) \(", message)}
    for values, model, source in layers:
        if any(name in values or (isinstance(model, dict) and name in model) for name in named):
            return None if source is None else str(source)
    return None


def dump_yaml(cfg: TrainConfig, header: str = "") -> str:
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)
    return header + body


__all__ = ["TrainConfig", "PretrainConfig", "parse_duration", "load_config_file", "dump_yaml", "build_config", "option",
           "field_defaults", "SCHEDULES", "DTYPES", "COMPILE_CHOICES"]
