"""The model directory: the one on-disk format of a FrawdLLM model.

    config.json              ModelConfig as JSON, plus "format_version"; an encoder-decoder's
                             (Seq2SeqConfig) also says "model_type": "seq2seq"
    model.safetensors        weights (safetensors: never pickle)
    tokenizer.json           Hugging Face `tokenizers` format (optional)
    generation_config.json   sampling defaults (optional)

Each file is written to a temporary name and renamed, so a crash never leaves a torn
file; a save that fails removes the folder it created. Loading trusts nothing in the
folder and raises `FrawdError` with one clear line:

- config.json: every field's type and range is checked (`ModelConfig`), format_version
  must be an integer this version reads;
- model.safetensors: its header (names, dtypes, shapes) is compared with the shapes the
  config implies before anything is allocated, so a config that asks for more than the
  file holds costs nothing to refuse; the position tables a config implies may not be
  larger than the weights (or 64 MiB);
- a file that is a symbolic link leading outside the folder is refused (links within
  the folder are followed), so a shared folder cannot make us read files elsewhere.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import ModelConfig, Seq2SeqConfig
from .errors import ConfigError, FrawdError
from .io import atomic_path, undo_on_error, write_json_atomic
from .memory import position_table_bytes

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
IMPORTABLE = ("gpt2", "llama")  # the transformers model_types `frawd import --from-hf` converts
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TIED_KEY = "lm_head.weight"
WEIGHT_DTYPES = ("F32", "F16", "BF16")
TABLE_ALLOWANCE = 64 * 2**20  # position tables this size are fine whatever the weights' size


def save_model_dir(model: torch.nn.Module, directory: str | Path, tokenizer: Any = None,
                   generation_config: dict[str, Any] | None = None) -> Path:
    if str(directory) == "":  # (Path("") is the current folder: the files landed there)
        raise FrawdError("cannot save: the directory is an empty path")
    directory = Path(directory)
    cfg: ModelConfig = model.config
    if directory.exists() and not directory.is_dir():
        raise FrawdError(f"cannot save {directory}: it exists and is not a directory")
    if tokenizer is not None and not (isinstance(tokenizer, (str, Path)) or hasattr(tokenizer, "save")):
        raise TypeError(f"tokenizer must be a Tokenizer, a tokenizers.Tokenizer or the path of a tokenizer.json; "
                        f"got {type(tokenizer).__name__}")
    checked = _as_tokenizer(tokenizer) if tokenizer is not None else None
    if checked is not None:  # (a tokenizer with ids past the embeddings: no command could load the folder)
        checked.check_fits(cfg.vocab_size, f"cannot save {directory}")
    elif tokenizer is None:  # the folder's own tokenizer.json stays: it must fit the new model too
        _check_kept_tokenizer(directory, cfg.vocab_size)
    state = {k: v.detach().contiguous().cpu() for k, v in plain_state(model, f"cannot save {directory}").items()}
    if cfg.tie_embeddings:
        state.pop(TIED_KEY)  # the same tensor as the token embedding; stored once
    problem = tables_too_large(cfg, sum(t.numel() * t.element_size() for t in state.values()))
    if problem:  # (no loader would read the folder back)
        raise FrawdError(f"cannot save {directory}: {problem}, which every loader refuses to build")
    with undo_on_error(directory):
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / WEIGHTS_FILE) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt", "frawdllm_format_version": str(FORMAT_VERSION)})
        write_json_atomic(directory / CONFIG_FILE, {"format_version": FORMAT_VERSION, **cfg.to_dict()})
        if tokenizer is not None:
            save_tokenizer(tokenizer, directory / TOKENIZER_FILE)
        if generation_config is not None:
            write_json_atomic(directory / GENERATION_CONFIG_FILE, generation_config)
    return directory


def _check_kept_tokenizer(directory: Path, vocab_size: int) -> None:
    """Refuse a save without a tokenizer into a folder whose tokenizer.json (from an earlier
    save) has ids past the new model's vocabulary: no command could load the folder."""
    from .tokenizer import Tokenizer

    kept = directory / TOKENIZER_FILE
    if not kept.is_file():
        return
    try:
        old = Tokenizer.load(kept)
    except (FrawdError, OSError, ValueError):  # not one we can read: not ours to judge
        return
    if old.vocab_size > vocab_size:
        raise FrawdError(f"cannot save {directory}: its {TOKENIZER_FILE} (from an earlier save) has "
                         f"{old.vocab_size} ids but this model only {vocab_size}; pass the model's "
                         "tokenizer (tokenizer=...) or save to another folder")


def plain_state(model: torch.nn.Module, failing: str) -> dict[str, torch.Tensor]:
    """`model`'s state_dict as a plain model of its config has it: LoRA adapters merged into
    their layers (`align/lora.py`). Refused, after `failing` ("cannot save DIR"): int8 layers
    (`quantize_int8` is for inference; they hold no float weights), and weights that a
    model of `model.config` would not have (a config changed after construction)."""
    from .align.lora import plain
    from .infer.quantize import is_int8

    if is_int8(model):
        raise FrawdError(f"{failing}: its linear layers are int8 (quantize_int8, for inference only); "
                         "use the model from before quantizing")
    state = plain(model).state_dict()
    cfg = model.config
    held = sum(t.numel() for k, t in state.items() if not (cfg.tie_embeddings and k == TIED_KEY))
    if held != cfg.num_parameters:
        raise FrawdError(f"{failing}: the model holds {held:,} weights but its config describes "
                         f"{cfg.num_parameters:,} (was model.config changed after construction?)")
    return state


def _as_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer to be saved as a `Tokenizer` (a path loaded, a `tokenizers` object
    wrapped); None for another kind of object, which is saved unchecked."""
    from tokenizers import Tokenizer as _HFTokenizer

    from .tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        return Tokenizer.load(tokenizer)
    return Tokenizer(tokenizer) if isinstance(tokenizer, _HFTokenizer) else None


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Save a tokenizer object (anything with `.save(path)`) or copy a tokenizer.json path
    (or the one in a folder, as `Tokenizer.load` reads it)."""
    with atomic_path(path) as tmp:
        if isinstance(tokenizer, (str, Path)):
            source = Path(tokenizer)
            shutil.copyfile(source / TOKENIZER_FILE if source.is_dir() else source, tmp)
        else:
            tokenizer.save(str(tmp))


def model_file(directory: str | Path, name: str, required: bool = True) -> Path | None:
    """`directory/name`, refused if it is a link leading outside `directory`; None when
    it is absent and not `required`."""
    directory = Path(directory)
    path = directory / name
    if not path.exists():
        if path.is_symlink():
            raise FrawdError(f"{path}: a broken symbolic link")
        if required:
            raise FrawdError(f"{path}: missing; a model directory holds {CONFIG_FILE}, {WEIGHTS_FILE} "
                             f"and, for text, {TOKENIZER_FILE}")
        return None
    if not path.resolve().is_relative_to(directory.resolve()):
        raise FrawdError(f"{path}: a symbolic link to {path.resolve()}, outside the model directory; "
                         "copy the file into the folder instead")
    if not path.is_file():
        raise FrawdError(f"{path}: not a regular file")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise FrawdError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise FrawdError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # (thousands of nested [ or {: the command's own handler could not name the file)
        raise FrawdError(f"{path}: nests too deeply to read") from None
    except OSError as exc:
        raise FrawdError(f"{path}: cannot read ({exc.strerror})") from None


def _gguf_advice(path: Path) -> str:
    """How to use `path` as a model when it is a GGUF file ("" when it is not)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return ""
    return f"; convert it first: frawd import --from-gguf {path} --out NEW_DIR" if magic == b"GGUF" else ""


def load_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if directory.is_file():
        raise FrawdError(f"{directory} is a file, not a model directory" + _gguf_advice(directory))
    if not directory.is_dir():
        raise FrawdError(f"model directory not found: {directory}")
    inner = directory / "model"
    if not (directory / CONFIG_FILE).exists() and (inner / CONFIG_FILE).is_file():  # `frawd pretrain`'s --out
        raise FrawdError(f"{directory}: no {CONFIG_FILE}; a training run keeps its model in model/: give {inner}")
    ggufs = [] if (directory / CONFIG_FILE).exists() else sorted(directory.glob("*.gguf"))
    if ggufs:  # (`frawd export --format gguf`'s folder, a download)
        raise FrawdError(f"{directory}: no {CONFIG_FILE}, and it holds a GGUF file" + _gguf_advice(ggufs[0]))
    path = model_file(directory, CONFIG_FILE)
    data = _read_json(path)
    if not isinstance(data, dict):
        raise FrawdError(f"{path}: expected a JSON object")
    version = data.pop("format_version", None)
    if version is None and ("model_type" in data or "architectures" in data):
        hf_type = data.get("model_type")
        advice = (f"convert it first: frawd import --from-hf {directory} --out NEW_DIR" if hf_type in IMPORTABLE
                  else f"frawd import reads model_type {' and '.join(IMPORTABLE)} only")
        raise FrawdError(f"{path}: a transformers config (model_type {hf_type!r}), not a FrawdLLM model directory; "
                         f"{advice}")
    if version is None:
        raise FrawdError(f"{path}: no format_version; not a FrawdLLM model directory")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FrawdError(f"{path}: format_version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise FrawdError(
            f"{path}: format_version {version} is newer than this FrawdLLM reads ({FORMAT_VERSION}); "
            "upgrade frawdllm"
        )
    kind = data.get("model_type", "decoder")
    if kind not in ("decoder", Seq2SeqConfig.model_type):
        raise FrawdError(f"{path}: unknown model_type {kind!r}; this FrawdLLM reads decoder and seq2seq models")
    try:
        if kind == Seq2SeqConfig.model_type:
            return Seq2SeqConfig.from_dict(data)
        data.pop("model_type", None)
        return ModelConfig.from_dict(data)
    except ConfigError as exc:
        raise FrawdError(f"{path}: invalid config: {exc}") from None


def load_generation_config(directory: str | Path, overridden: Collection[str] = ()) -> dict[str, Any]:
    """The sampling defaults in generation_config.json ({} without one), checked as
    `SamplingParams` so every value has the right type and range; those of `overridden`
    (replaced by the caller, a flag given) are returned unchecked."""
    path = model_file(directory, GENERATION_CONFIG_FILE, required=False)
    if path is None:
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise FrawdError(f"{path}: expected a JSON object of sampling parameters")
    if _HF_MARKERS.intersection(data):  # transformers' file (copied in): read as `frawd import` reads it
        from .export.hf_dir import sampling_from_hf

        config = load_config(directory)
        data = sampling_from_hf(data, config.eos_token_id, config.context_length, path)
    checked_sampling({key: value for key, value in data.items() if key not in overridden}, path)
    return data


# Keys only transformers' generation_config.json has (its settings mean other things: a
# temperature without do_sample is greedy there).
_HF_MARKERS = frozenset({"transformers_version", "do_sample", "_from_model_config"})


def checked_sampling(data: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """`data` once it reads as `SamplingParams` (a FrawdError naming `where` otherwise)."""
    from .infer.sampling import SamplingParams

    try:
        SamplingParams.from_dict(data)
    except ConfigError as exc:
        raise FrawdError(f"{where}: {exc}") from None
    return data


def weight_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, read from its header
    alone (the file is mapped, no tensor is loaded)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                    for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise FrawdError(f"{path}: not a readable safetensors file ({exc})") from None


def expected_shapes(cfg: ModelConfig, model: torch.nn.Module | None = None) -> dict[str, tuple[int, ...]]:
    """The stored tensors' shapes `cfg` implies (a tied head is stored once, as the
    embedding), from `model` (built from `cfg`) or else a model built on the meta device: no
    memory is allocated."""
    if model is None:
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop(TIED_KEY)
    return shapes


def tables_too_large(cfg: ModelConfig, weight_bytes: int, field: str = "context_length") -> str | None:
    """Why loaders refuse to build `cfg` over weights of `weight_bytes` bytes, or None: its
    position tables would be larger than the weights and than TABLE_ALLOWANCE (a config.json
    must not make a loader allocate far more than its weights). `field`: the context's name
    in the config file read."""
    tables = position_table_bytes(cfg)
    if tables <= max(weight_bytes, TABLE_ALLOWANCE):
        return None
    return (f"{field} {cfg.context_length:,} needs position tables of {tables / 2**20:,.0f} MiB as built, "
            f"more than the weights ({weight_bytes / 2**20:,.1f} MiB) and {TABLE_ALLOWANCE // 2**20} MiB")


def _some(names: list[str], shown: int = 5) -> str:
    """The first `shown` names, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (", ".join(names[:shown]) or "-") + more


def check_weights(cfg: ModelConfig, path: Path,
                  build: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module | None:
    """FrawdError unless the safetensors file at `path` holds exactly the tensors `cfg`
    implies; decided from the header before any tensor or model is allocated.

    `build` (a loader's constructor of the model `cfg` describes) is called once the header
    bounds the model by the file's size, and its model, returned, gives the shapes instead of
    one on the meta device: meta tensors' kernels import all of `torch._dynamo` (~2 s of every
    command that loads a model)."""
    stored = weight_shapes(path)
    if cfg.tie_embeddings and TIED_KEY in stored:
        stored.pop(TIED_KEY)  # some writers store the tied head twice; load_model checks it equals the embedding
    held = sum(math.prod(shape) for _, shape in stored.values())
    # Python integers: no overflow whatever config.json says. Close counts go on to the
    # shape comparison below (a better message), which builds the model on the meta device.
    if held != cfg.num_parameters and (cfg.n_layer > len(stored) or cfg.num_parameters > 2 * held + 2**20):
        raise FrawdError(f"{path}: holds {held:,} weights but config.json describes a model of "
                         f"{cfg.num_parameters:,} parameters")
    problem = tables_too_large(cfg, path.stat().st_size)
    if problem:
        raise FrawdError(f"{path.parent / CONFIG_FILE}: {problem}; refusing to build them")
    bad_dtype = sorted(name for name, (dtype, _) in stored.items() if dtype not in WEIGHT_DTYPES)
    if bad_dtype:
        raise FrawdError(f"{path}: tensor {bad_dtype[0]} is {stored[bad_dtype[0]][0]}; weights must be "
                         f"{', '.join(WEIGHT_DTYPES)}")
    model = build() if build is not None else None
    expected = expected_shapes(cfg, model)  # cheap: the layers and sizes are bounded by the file's
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise FrawdError(
            f"{path}: weights do not match config.json "
            f"(missing: {_some(missing)}; unexpected: {_some(unexpected)})"
        )
    for key, (_, shape) in stored.items():
        if shape != expected[key]:
            raise FrawdError(f"{path}: tensor {key} has shape {shape} but config.json implies {expected[key]}")
    assert held == cfg.num_parameters  # the same names and shapes hold the same count
    return model


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    """The model a config describes: `Seq2SeqTransformer` or `FrawdLLM`."""
    from .model import FrawdLLM, Seq2SeqTransformer

    return Seq2SeqTransformer if isinstance(cfg, Seq2SeqConfig) else FrawdLLM


KIND_HINT = {"decoder": "a decoder-only language model (frawd pretrain)",
             "seq2seq": "an encoder-decoder translation model (frawd translate)"}


def require_kind(directory: str | Path, cfg: ModelConfig, kind: str) -> None:
    """Refuse, in one line, a directory whose config is not of `kind` ("decoder" or "seq2seq")."""
    held = "seq2seq" if isinstance(cfg, Seq2SeqConfig) else "decoder"
    if held != kind:
        raise FrawdError(f"{directory}: holds {KIND_HINT[held]}; this command needs {KIND_HINT[kind]}")


def checked_weights(directory: str | Path, cfg: ModelConfig) -> Path:
    """The weights file of `directory`, its header checked against `cfg` (no tensor read)."""
    path = _weights_path(directory)
    check_weights(cfg, path)
    return path


def _weights_path(directory: str | Path) -> Path:
    path = Path(directory) / WEIGHTS_FILE
    if not path.exists() and not path.is_symlink():
        raise FrawdError(f"{path}: missing weights file")
    return readable(model_file(directory, WEIGHTS_FILE))


def readable(path: Path) -> Path:
    """`path`, once opened for reading: safetensors calls a file it may not read "No such file
    or directory"."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise FrawdError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return path


def first_non_finite(model: torch.nn.Module) -> str | None:
    """The name of the first parameter holding nan or inf values, None when all are finite
    (a run that diverged published such weights: they generate nothing but token 0)."""
    return next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)


def load_model(directory: str | Path, device: str | torch.device = "cpu", config: ModelConfig | None = None,
               kind: str | None = None):
    """The model in `directory`, in eval mode (as transformers returns one; the training
    loop sets train mode itself); `config` builds it instead of config.json's (the weights'
    shapes must fit it, e.g. the same model with another dropout). `kind` ("decoder" or
    "seq2seq"): refuse, in one line, a directory holding the other kind."""
    if kind is not None and kind not in KIND_HINT:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KIND_HINT))} or None, got {kind!r}")
    directory = Path(directory)
    cfg = load_config(directory) if config is None else config
    if kind is not None:
        require_kind(directory, cfg, kind)
    path = _weights_path(directory)
    model = check_weights(cfg, path, build=lambda: model_class(cfg)(cfg))
    try:
        # (safetensors reads "cpu" and "cuda:N" but refuses torch's "cpu:0")
        state = load_file(str(path), device="cpu" if torch.device(device).type == "cpu" else str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise FrawdError(f"{path}: not a readable safetensors file ({exc})") from None
    if cfg.tie_embeddings:
        if TIED_KEY in state and not torch.equal(state[TIED_KEY], state["embed.tok.weight"]):
            raise FrawdError(f"{path}: holds an {TIED_KEY} that differs from embed.tok.weight, but config.json "
                             "ties them (tie_embeddings: true): set it to false to load the stored head")
        state[TIED_KEY] = state["embed.tok.weight"]
    model.load_state_dict(state)
    return model.to(device).eval()
