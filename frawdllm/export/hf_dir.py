"""Hugging Face model directories: export ours for stock `transformers`, import theirs.

Export writes, in a temporary folder that is renamed onto the target only when complete:

    config.json               GPT2Config or LlamaConfig (see `hf.py` for which)
    generation_config.json    special ids and our sampling defaults
    model.safetensors         the weights under transformers' names
    tokenizer.json            our tokenizer, unchanged
    tokenizer_config.json     special tokens and our chat template written as Jinja

so `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`
load it without `trust_remote_code`. An encoder-decoder (`Seq2SeqTransformer`) is written
as `MarianMTModel` (see `marian.py`; `AutoModelForSeq2SeqLM` loads it) with the same
tokenizer files.

Import reads a local GPT-2 or Llama checkpoint (config.json + safetensors, never a
pickle) into a FrawdLLM model directory, tokenizer.json included when there is one.
config.json is untrusted: whatever transformers raises reading it, and any size that
disagrees with the safetensors headers or would not fit in memory, is one FrawdError
naming the field, raised before a tensor is read or --out touched (a model is built only
once the headers bound its size: at most about twice the weights').
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import ModelConfig, Seq2SeqConfig
from ..errors import FrawdError
from ..infer.sampling import SamplingParams
from ..io import atomic_dir, read_json_object, write_json_atomic
from ..model import FrawdLLM
from ..modeldir import (GENERATION_CONFIG_FILE, TOKENIZER_FILE, _some, checked_sampling, expected_shapes,
                        load_config, load_generation_config, load_model, model_file, plain_state,
                        tables_too_large, weight_shapes)
from ..tokenizer import Tokenizer
from .hf import (HF_EMBEDDING, first_id, from_hf_config, from_hf_state_dict, head_differs, hf_architecture,
                 normalise_hf_names, tensor_layout, to_hf_config, to_hf_state_dict)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# `render_chat_text` of frawdllm.tokenizer, as the Jinja template transformers and llama.cpp run.
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# transformers' GenerationConfig settings that say how it generates (not which tokens are which).
_HF_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens",
                "max_length", "num_return_sequences", "stop_strings")
# Its settings that change what generate() returns but have no counterpart in ours, each at
# its "off" value (transformers' default): a file setting one otherwise is warned about.
_HF_UNMAPPED = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "length_penalty": 1.0, "early_stopping": False,
    "penalty_alpha": None, "dola_layers": None, "min_length": 0, "min_new_tokens": None, "max_time": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "force_words_ids": None, "constraints": None, "sequence_bias": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": 1.0,
    "token_healing": False, "watermarking_config": None,
}


# ---- export ------------------------------------------------------------------------------------
def load_for_export(model_dir: str | Path) -> tuple[torch.nn.Module, Tokenizer | None, dict[str, Any]]:
    """The model, its tokenizer (None when the directory has none) and its sampling defaults."""
    model_dir = Path(model_dir)
    model = load_model(model_dir).eval()
    tok_path = model_file(model_dir, TOKENIZER_FILE, required=False)
    tokenizer = Tokenizer.load(tok_path) if tok_path is not None else None
    if tokenizer is not None:
        tokenizer.check_fits(model.config.vocab_size, model_dir)
    return model, tokenizer, load_generation_config(model_dir)


def special_token(tokenizer: Tokenizer, token_id: int, what: str) -> str:
    token = tokenizer.id_to_token(token_id)
    if token is None:
        raise FrawdError(f"{what} {token_id} is not in the tokenizer's vocabulary")
    return token


def tokenizer_config(tokenizer: Tokenizer, cfg) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over our tokenizer.json."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special_token(tokenizer, cfg.bos_token_id, "bos_token_id"),
        "eos_token": special_token(tokenizer, cfg.eos_token_id, "eos_token_id"),
        "pad_token": special_token(tokenizer, cfg.pad_token_id, "pad_token_id"),
        "model_max_length": cfg.context_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.token_to_id("<|unk|>") is not None:
        config["unk_token"] = "<|unk|>"
    if tokenizer.has_frawd_specials():  # the chat template needs the role tokens
        config["chat_template"] = CHAT_TEMPLATE
    return config


def generation_config(cfg, sampling: dict[str, Any]) -> dict[str, Any]:
    """transformers' generation_config.json for the model's sampling defaults (`sampling`:
    its own generation_config.json, over `SamplingParams`' defaults): what `frawd generate`
    does is what `model.generate()` does. Sampling (temperature > 0, ours by default) is
    do_sample with top_k given even when 0 (off), since transformers' default is 50; settings
    at their "off" value are left out (transformers' defaults are off too). Our stop tokens
    join eos_token_id (a list), stop strings are stop_strings (transformers then needs
    `generate(..., tokenizer=)`, and keeps the string in the output, which we leave out) and
    num_samples is num_return_sequences. seed, ignore_eos and logprobs have no counterpart."""
    params = SamplingParams.from_dict(sampling)
    stops = [cfg.eos_token_id] + [i for i in dict.fromkeys(params.stop_token_ids) if i != cfg.eos_token_id]
    config: dict[str, Any] = {
        "bos_token_id": cfg.bos_token_id, "eos_token_id": stops if len(stops) > 1 else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if not params.greedy:
        config.update(do_sample=True, temperature=params.temperature, top_k=params.top_k)
        if params.top_p != 1:
            config["top_p"] = params.top_p
        if params.min_p != 0:
            config["min_p"] = params.min_p
    if params.repetition_penalty != 1:
        config["repetition_penalty"] = params.repetition_penalty
    config["max_new_tokens"] = params.max_new_tokens  # (transformers' own limit: 20 tokens in all)
    if params.num_samples > 1 and not params.greedy:  # (transformers refuses several greedy sequences)
        config["num_return_sequences"] = params.num_samples
    if params.stop:
        config["stop_strings"] = list(params.stop)
    return config


def _set_or(config: dict[str, Any], key: str, default: Any) -> Any:
    return config[key] if config.get(key) is not None else default


def sampling_from_hf(config: dict[str, Any], eos_token_id: int, context_length: int | None = None,
                     where: str | Path = GENERATION_CONFIG_FILE) -> dict[str, Any]:
    """Our generation_config.json from transformers' one (`eos_token_id`, `context_length`: the
    imported model's): its sampling settings, read with transformers' defaults (greedy without
    do_sample; top_k 50 with it), and its stop settings (`generation_config`'s mapping
    backwards). Only what the file sets: {} for a file of token ids alone (the importing side's
    defaults apply), but end ids past the model's own become stop_token_ids. max_length counts
    the prompt, so it maps only when it reaches the context (our generation ends there):
    max_new_tokens = context_length. One warning names each setting that is ignored
    (`_HF_UNMAPPED`, a smaller max_length)."""
    out: dict[str, Any] = {}
    ignored = {k: config[k] for k, off in _HF_UNMAPPED.items() if config.get(k) not in (None, off)}
    max_length = config.get("max_length")
    if max_length is not None and config.get("max_new_tokens") is None:  # (max_new_tokens wins in transformers)
        if context_length is not None and isinstance(max_length, int) and max_length >= context_length:
            out["max_new_tokens"] = context_length  # (a row ends when the context is full, before this)
        else:
            ignored["max_length"] = max_length
    if ignored:
        shown = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        why = " (max_length counts the prompt: only one reaching the context maps)" if "max_length" in ignored else ""
        warnings.warn(f"{where}: ignored, FrawdLLM's generation has no counterpart: {shown}{why}")
    if config.get("do_sample"):
        out.update(temperature=_set_or(config, "temperature", 1.0), top_k=_set_or(config, "top_k", 50))
        out.update({k: config[k] for k in ("top_p", "min_p") if config.get(k) is not None})
    elif ignored or any(config.get(k) is not None for k in _HF_SETTINGS):
        out["temperature"] = 0  # transformers' greedy default (a beam search becomes greedy too)
    for ours, theirs in (("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_new_tokens"),
                         ("num_samples", "num_return_sequences")):
        if config.get(theirs) is not None:
            out[ours] = config[theirs]
    stop_strings = config.get("stop_strings")
    if stop_strings:
        out["stop"] = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    ends = config.get("eos_token_id")
    ends = ends if isinstance(ends, list) else [ends]
    stop_ids = [i for i in ends if i is not None and i != eos_token_id]
    if stop_ids:
        out["stop_token_ids"] = stop_ids
    return out


def cast_within_range(name: str, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """`tensor` as `dtype`, or one line naming it where a finite value of it would become inf
    (float16 holds at most 65504: a larger weight was written as inf, and the model's logits NaN)."""
    cast = tensor.to(DTYPES[dtype])
    if cast.dtype != tensor.dtype and cast.is_floating_point() and bool((cast.isinf() & tensor.isfinite()).any()):
        largest = float(tensor[tensor.isfinite()].abs().max())
        raise FrawdError(f"{name} holds {largest:.6g}, beyond {dtype}'s range (at most "
                         f"{torch.finfo(cast.dtype).max:g}); it would be written as inf: export as bfloat16 or "
                         "float32")
    return cast


def write_hf_dir(model: FrawdLLM, tokenizer: Tokenizer | None, directory: Path, dtype: str = "float32",
                 sampling: dict[str, Any] | None = None) -> None:
    """Write the transformers files into `directory` (an empty folder; see `export_hf`)."""
    cfg = model.config
    hf_config = to_hf_config(cfg)
    hf_config.dtype = dtype
    plain = plain_state(model, f"cannot export to {directory}")  # (LoRA adapters merged)
    state = {k: cast_within_range(k, v, dtype) for k, v in to_hf_state_dict(plain, cfg).items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_json_atomic(directory / "config.json", hf_config.to_dict())
    write_json_atomic(directory / "generation_config.json", generation_config(cfg, sampling or {}))
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)
        write_json_atomic(directory / "tokenizer_config.json", tokenizer_config(tokenizer, cfg))


def export_hf(model_dir: str | Path, out: str | Path, dtype: str = "float32", overwrite: bool = False) -> str:
    """Export a FrawdLLM model directory to a transformers directory `out`; returns the
    architecture name. Nothing appears at `out` unless the whole export succeeds."""
    if dtype not in DTYPES:
        raise FrawdError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    cfg = load_config(model_dir)
    if isinstance(cfg, Seq2SeqConfig):
        return _export_marian(model_dir, out, cfg, dtype, overwrite)
    arch = hf_architecture(cfg)  # refuse before touching --out
    with atomic_dir(out, overwrite=overwrite, keep=(model_dir,)) as tmp:
        model, tokenizer, sampling = load_for_export(model_dir)
        write_hf_dir(model, tokenizer, tmp, dtype, sampling)
    return arch


def _export_marian(model_dir: str | Path, out: str | Path, cfg: Seq2SeqConfig, dtype: str, overwrite: bool) -> str:
    from .marian import MARIAN, to_marian_config, to_marian_model

    to_marian_config(cfg)  # refuse (naming what does not map) before touching --out
    with atomic_dir(out, overwrite=overwrite, keep=(model_dir,)) as tmp:
        model, tokenizer, _ = load_for_export(model_dir)
        marian = to_marian_model(model)
        for name, tensor in marian.state_dict().items():
            cast_within_range(name, tensor, dtype)
        with _no_progress_bars():  # transformers' "Writing model shards" bar stays off
            marian.to(DTYPES[dtype]).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
            config = tokenizer_config(tokenizer, cfg)
            config.pop("chat_template", None)
            write_json_atomic(tmp / "tokenizer_config.json", config)
    return MARIAN


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block, then as they were."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ---- import ------------------------------------------------------------------------------------
def _index_shards(index: Path) -> list[Path]:
    """The shard files a model.safetensors.index.json names (files beside it, nowhere else)."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FrawdError(f"{index}: not a safetensors index (a \"weight_map\" of tensor names to shard files)")
    names = sorted(set(weight_map.values()))
    for name in names:
        if (index.parent / name).resolve().parent != index.parent.resolve():
            raise FrawdError(f"{index}: shard {name!r} is not a file in {index.parent}")
    return [index.parent / name for name in names]


def _hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the checkpoint's weights (one, or an index's shards)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        return _index_shards(index)
    for path in (single, index):
        if path.exists():
            raise FrawdError(f"{path} is not a file")
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise FrawdError(
            f"{directory}: only pickle weights (*.bin); FrawdLLM never unpickles. Re-save them with "
            "model.save_pretrained(dir, safe_serialization=True)"
        )
    raise FrawdError(f"{directory}: no model.safetensors (or model.safetensors.index.json)")


def _read_hf_weights(directory: Path, files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    try:
        for path in files:
            state.update(load_file(str(path)))
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise FrawdError(f"{directory}: cannot read the safetensors weights ({exc})") from None
    return state


def _first_line(exc: BaseException) -> str:
    """What went wrong, in one line: huggingface_hub's strict-dataclass errors put the cause
    (the field and the problem) on a second line, so their cause speaks instead."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict dataclasses
        StrictDataclassError = ()  # noqa: N806
    while isinstance(exc, StrictDataclassError) and exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# config.json's sizes and counts (GPT-2's and Llama's names): each at least 1 where given.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads",
                "n_head", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner",
                "max_position_embeddings", "n_positions")


def _read_hf_config(directory: Path) -> tuple[str, ModelConfig]:
    """config.json's model_type and its ModelConfig. transformers parses and validates the
    file; whatever it raises on this untrusted input (a string for an int, heads that do not
    divide the hidden size, ...) is one line naming the file."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    path = directory / "config.json"
    try:  # (transformers said "Unrecognized model in DIR" of a list, and named the file twice)
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # (invalid JSON or UTF-8; a missing file is transformers' to name below)
        raise FrawdError(f"{path}: not a JSON file ({_first_line(exc)})") from None
    except OSError:
        raw = {}
    if not isinstance(raw, dict):
        raise FrawdError(f"{path}: not a JSON object (a {type(raw).__name__})")
    for field in _SIZE_FIELDS:  # (0 heads was transformers' "integer modulo by zero"; -4 blamed head_dim)
        value = raw.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise FrawdError(f"{path}: {field}={value} must be at least 1")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (its warnings about values are ours to name, in one line)
    try:
        hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read the file is bad input
        raise FrawdError(f"{path}: {_first_line(exc)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    taken = _fill_special_ids(hf_config, directory)
    try:
        cfg = from_hf_config(hf_config)
    except FrawdError as exc:  # what has no FrawdLLM equivalent, named by the file it is in
        raise FrawdError(f"{path}: {exc}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:  # a value transformers let through
        raise FrawdError(f"{path}: {_first_line(exc)}") from None
    if taken:  # (once the config is accepted: a refusal stays one line)
        warnings.warn(f"{path} has no {', '.join(taken)}: took " + "; ".join(taken.values()))
    return getattr(hf_config, "model_type", ""), cfg


def _fill_special_ids(hf_config: Any, directory: Path) -> dict[str, str]:
    """Set the special ids config.json leaves null from the checkpoint's other files:
    generation_config.json's (what transformers' generate() reads), else the tokens
    tokenizer_config.json names (eos_token, ...) looked up in tokenizer.json, else, for the
    eos, the tokenizer's end-of-text token (`Tokenizer.document_end_id`). Returns
    {field: where its id came from}."""
    fields = ("bos_token_id", "eos_token_id", "pad_token_id")
    missing = [field for field in fields if first_id(getattr(hf_config, field, None)) is None]
    if not missing:
        return {}
    generation = read_json_object(directory / GENERATION_CONFIG_FILE)
    named = read_json_object(directory / "tokenizer_config.json")
    tokenizer_file = directory / TOKENIZER_FILE
    tokenizer = Tokenizer.load(tokenizer_file) if tokenizer_file.is_file() else None
    taken: dict[str, str] = {}
    for field in missing:
        token = named.get(field.removesuffix("_id"))
        token = token.get("content") if isinstance(token, dict) else token  # (transformers' AddedToken form)
        found = first_id(generation.get(field))
        if found is not None:
            taken[field] = f"{field} {found} from {GENERATION_CONFIG_FILE}"
        elif tokenizer is not None and isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            found = tokenizer.token_to_id(token)
            taken[field] = f"{field} {found} ({token}) from tokenizer_config.json"
        elif tokenizer is not None and field == "eos_token_id" and tokenizer.document_end_id() is not None:
            found = tokenizer.document_end_id()
            taken[field] = f"{field} {found} ({tokenizer.id_to_token(found)}) from {TOKENIZER_FILE}"
        if found is not None:
            setattr(hf_config, field, found)
    return taken


# config.json's names of the fields the header checks name, per model_type.
_HF_FIELDS = {
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "n_embd", "context_length": "n_positions", "n_layer": "n_layer"},
    "llama": {"vocab_size": "vocab_size", "n_embd": "hidden_size", "context_length": "max_position_embeddings",
              "n_layer": "num_hidden_layers"},
}
_LAYERS = {"gpt2": "transformer.h.", "llama": "model.layers."}
# The config.json field that sizes a tensor the checks above do not cover.
_SIZED_BY = {
    "gpt2": (("mlp.c_fc", "n_inner"), ("mlp.c_proj", "n_inner")),
    "llama": (("q_proj", "num_attention_heads/head_dim"), ("o_proj", "num_attention_heads/head_dim"),
              ("k_proj", "num_key_value_heads"), ("v_proj", "num_key_value_heads"),
              ("gate_proj", "intermediate_size"), ("up_proj", "intermediate_size"),
              ("down_proj", "intermediate_size")),
}


@dataclass(frozen=True)
class _Checked:
    """A checkpoint whose config.json agrees with its safetensors headers."""

    directory: Path
    kind: str
    cfg: ModelConfig
    files: list[Path]
    stored: dict[str, tuple[Path, tuple[int, ...]]]  # transformers name -> (file, shape)


def _checked_hf_dir(hf_dir: str | Path) -> _Checked:
    """Read config.json and compare it with the safetensors headers (no tensor is read, no
    model built): the layer count, the embedding (vocab_size, hidden size), learned positions
    and RoPE tables, the tensor names and the parameter count. A FrawdError names the
    config.json field that disagrees."""
    directory = Path(hf_dir)
    if not directory.exists():
        hub_like = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(hf_dir)) and not str(hf_dir).startswith(".")
        raise FrawdError(f"{directory}: not found" + (
            "; --from-hf reads a local directory, it downloads nothing: fetch a Hub model first "
            f"(hf download {hf_dir} --local-dir DIR)" if hub_like else ""))
    if not directory.is_dir():
        gguf = " (import a GGUF file with --from-gguf)" \
            if directory.suffix.lower() == ".gguf" else ""
        raise FrawdError(f"{directory} is a file, not a transformers model directory{gguf}")
    if not (directory / "config.json").is_file():
        raise FrawdError(f"{directory}: no config.json; not a transformers model directory")
    if "format_version" in read_json_object(directory / "config.json"):
        raise FrawdError(f"{directory}: a FrawdLLM model directory already (its config.json has format_version); "
                         "every frawd command reads it as it is")
    kind, cfg = _read_hf_config(directory)
    files = _hf_weight_files(directory)
    stored = {name: (path, shape) for path in files for name, (_, shape) in weight_shapes(path).items()}
    stored = normalise_hf_names(stored, kind == "gpt2")  # as `from_hf_state_dict` will name them
    config, fields = directory / "config.json", _HF_FIELDS[kind]

    def refuse(field: str, value: int, held: str) -> NoReturn:
        raise FrawdError(f"{config}: {fields[field]} {value:,} does not match the weights, which {held}")

    layers = {name[len(_LAYERS[kind]):].split(".")[0] for name in stored if name.startswith(_LAYERS[kind])}
    if cfg.n_layer != len(layers):  # first: the layer count bounds the work below
        refuse("n_layer", cfg.n_layer, f"hold {len(layers):,} layer{'s' * (len(layers) != 1)}")
    sized = [(HF_EMBEDDING[kind], "vocab_size", 0, cfg.vocab_size), (HF_EMBEDDING[kind], "n_embd", 1, cfg.n_embd)]
    if cfg.pos_encoding == "learned":  # GPT-2's position table is a weight; RoPE's is built (below)
        sized.append(("transformer.wpe.weight", "context_length", 0, cfg.context_length))
    for name, field, dim, value in sized:
        shape = stored.get(name, (None, None))[1]
        if shape is not None and len(shape) == 2 and shape[dim] != value:
            refuse(field, value, f"have {name} of shape {shape}")
    size = sum(path.stat().st_size for path in files)
    problem = tables_too_large(cfg, size, fields["context_length"])
    if problem:
        raise FrawdError(f"{config}: {problem}; refusing to build them")
    expected = {name for m in tensor_layout(cfg) for name in m.theirs}
    extra = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing, unexpected = sorted(expected - set(stored)), sorted(set(stored) - expected - extra)
    if missing or unexpected:
        raise FrawdError(f"{directory}: the weights do not match config.json "
                         f"(missing: {_some(missing)}; unexpected: {_some(unexpected)})")
    return _Checked(directory, kind, cfg, files, stored)


def _expected_hf_shapes(checked: _Checked, model: FrawdLLM | None) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each transformers tensor, from `model`'s tensors
    (or, for a model too large to build, those of one on the meta device)."""
    cfg = checked.cfg
    ours = expected_shapes(cfg, model)
    out: dict[str, tuple[int, ...]] = {}
    for m in tensor_layout(cfg):
        shape = ours[m.ours]
        for name, rows in zip(m.theirs, m.sizes or (shape[0],)):
            part = (rows, *shape[1:])
            out[name] = part[::-1] if m.transpose else part
    if cfg.tie_embeddings:
        out["lm_head.weight"] = ours["embed.tok.weight"]
    return out


def _built(checked: _Checked) -> FrawdLLM:
    """The model config.json describes, built only once the headers bound it by the files'
    size; every stored tensor's shape is compared with it before any is read."""
    cfg, stored = checked.cfg, checked.stored
    held = sum(math.prod(shape) for name, (_, shape) in stored.items()
               if not (cfg.tie_embeddings and name == "lm_head.weight"))
    # Python integers: no overflow. Close counts build the model and compare shapes (no
    # tensor read yet); far ones find the shape that differs on the meta device.
    model = FrawdLLM(cfg) if held == cfg.num_parameters or cfg.num_parameters <= 2 * held + 2**20 else None
    for name, want in _expected_hf_shapes(checked, model).items():
        path, shape = stored.get(name, (None, want))
        if tuple(shape) != tuple(want):
            field = next((f for part, f in _SIZED_BY[checked.kind] if part in name), None)
            hint = f" (check its {field})" if field else ""
            raise FrawdError(f"{path}: tensor {name} has shape {tuple(shape)} but "
                             f"{checked.directory / 'config.json'} implies {tuple(want)}{hint}")
    if model is None:
        raise FrawdError(f"{checked.directory}: the weights hold {held:,} numbers but config.json describes "
                         f"a model of {cfg.num_parameters:,} parameters")  # unreachable: some shape differs
    return model


def _load_checked(checked: _Checked) -> FrawdLLM:
    model, cfg = _built(checked), checked.cfg
    weights = _read_hf_weights(checked.directory, checked.files)
    if head_differs(weights, cfg):  # as transformers loads it: untied
        warnings.warn(f"{checked.directory / 'config.json'} says tie_word_embeddings, but the weights hold "
                      "an lm_head.weight that differs from the embedding: imported untied, as transformers "
                      "loads it")
        cfg = cfg.replace(tie_embeddings=False)
        model = FrawdLLM(cfg)
    state = from_hf_state_dict(weights, cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise FrawdError(f"{checked.directory}: weights do not match config.json "
                         f"({str(exc).splitlines()[-1].strip()})") from None
    return model.eval()


def read_hf_dir(hf_dir: str | Path) -> FrawdLLM:
    """A FrawdLLM model computing what the transformers checkpoint in `hf_dir` computes.
    config.json is checked against the safetensors headers (`_checked_hf_dir`) before the
    model is built or a tensor read."""
    return _load_checked(_checked_hf_dir(hf_dir))


# Tokenizer files of transformers' slow tokenizers, which FrawdLLM does not read.
_OTHER_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model")


_IDS_ONLY = ("it runs on token ids from Python alone (FrawdLLM.from_pretrained: frawd generate, chat, serve and "
             "the Engine need a tokenizer) and exports")


def _note_no_tokenizer(directory: Path) -> None:
    """Warn that the checkpoint has no tokenizer.json (naming the files FrawdLLM does not read, if any)."""
    others = [name for name in _OTHER_TOKENIZER_FILES if (directory / name).is_file()]
    if not others:
        warnings.warn(f"{directory} has no {TOKENIZER_FILE} (nor any other tokenizer file): imported without a "
                      f"tokenizer, so {_IDS_ONLY}; copy the tokenizer.json of the model it came from into the import")
    else:
        warnings.warn(f"{directory} has no {TOKENIZER_FILE} (only {', '.join(others)}, which FrawdLLM does not "
                      f"read): imported without a tokenizer, so {_IDS_ONLY}; "
                      f"AutoTokenizer.from_pretrained({str(directory)!r}).save_pretrained({str(directory)!r}) "
                      "writes it, then import again")


def import_hf(hf_dir: str | Path, out: str | Path, overwrite: bool = False) -> FrawdLLM:
    """Convert a transformers checkpoint into a FrawdLLM model directory `out`."""
    directory = Path(hf_dir)
    checked = _checked_hf_dir(directory)  # before --out is touched: nothing is written on a refusal
    with atomic_dir(out, overwrite=overwrite, keep=(directory,)) as tmp:
        model = _load_checked(checked)
        tokenizer = directory / TOKENIZER_FILE
        if tokenizer.exists() and not tokenizer.is_file():
            raise FrawdError(f"{tokenizer} is not a file")
        if tokenizer.is_file():  # copied as is, once it has shown it loads and fits the model
            Tokenizer.load(tokenizer).check_fits(model.config.vocab_size, tokenizer)
        source = directory / GENERATION_CONFIG_FILE
        if not source.is_file():  # transformers' generate() then stops at each of config.json's end ids
            source = directory / "config.json"
            generation = {"eos_token_id": read_json_object(source).get("eos_token_id")}
        else:
            generation = read_json_object(source)
        sampling = sampling_from_hf(generation, model.config.eos_token_id, model.config.context_length, source)
        if sampling:
            checked_sampling(sampling, source)
            outside = [i for i in sampling.get("stop_token_ids", []) if i >= model.config.vocab_size]
            if outside:  # (the engine would refuse the directory's own defaults)
                raise FrawdError(f"{source}: end token id {outside[0]} (eos_token_id) is outside the vocabulary "
                                 f"(vocab_size {model.config.vocab_size})")
        if not tokenizer.is_file():  # (said once nothing is refused)
            _note_no_tokenizer(directory)
        model.save_pretrained(tmp, tokenizer=tokenizer if tokenizer.is_file() else None)
        if sampling:
            write_json_atomic(tmp / GENERATION_CONFIG_FILE, sampling)
    return model


__all__ = [
    "CHAT_TEMPLATE", "DTYPES", "export_hf", "import_hf", "read_hf_dir", "write_hf_dir",
    "tokenizer_config", "generation_config", "load_for_export", "special_token",
]
