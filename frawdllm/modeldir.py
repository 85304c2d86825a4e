"""The model directory: the one on-disk format of a FrawdLLM model.

    config.json              ModelConfig as JSON, plus "format_version"
    model.safetensors        weights (safetensors: never pickle)
    tokenizer.json           Hugging Face `tokenizers` format (optional)
    generation_config.json   sampling defaults (optional)

Each file is written to a temporary name and renamed, so a crash never leaves a torn
file. Loading checks everything and raises `FrawdError` with one clear line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .errors import ConfigError, FrawdError
from .io import atomic_path, write_json_atomic

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TIED_KEY = "lm_head.weight"


def save_model_dir(model: torch.nn.Module, directory: str | Path, tokenizer: Any = None,
                   generation_config: dict[str, Any] | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop(TIED_KEY)  # the same tensor as the token embedding; stored once
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", "frawdllm_format_version": str(FORMAT_VERSION)})
    write_json_atomic(directory / CONFIG_FILE, {"format_version": FORMAT_VERSION, **cfg.to_dict()})
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory / TOKENIZER_FILE)
    if generation_config is not None:
        write_json_atomic(directory / GENERATION_CONFIG_FILE, generation_config)
    return directory


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Save a tokenizer object (anything with `.save(path)`) or copy a tokenizer.json path."""
    with atomic_path(path) as tmp:
        if isinstance(tokenizer, (str, Path)):
            shutil.copyfile(tokenizer, tmp)
        else:
            tokenizer.save(str(tmp))


def load_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise FrawdError(f"model directory not found: {directory}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FrawdError(f"{path}: missing; a model directory needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FrawdError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FrawdError(f"{path}: expected a JSON object")
    version = data.pop("format_version", None)
    if version is None:
        raise FrawdError(f"{path}: no format_version; not a FrawdLLM model directory")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FrawdError(
            f"{path}: format_version {version} is newer than this FrawdLLM reads ({FORMAT_VERSION}); "
            "upgrade frawdllm"
        )
    try:
        return ModelConfig.from_dict(data)
    except (ConfigError, TypeError) as exc:
        raise FrawdError(f"{path}: invalid config: {exc}") from None


def load_model(directory: str | Path, device: str | torch.device = "cpu", config: ModelConfig | None = None):
    """The model in `directory`; `config` builds it instead of config.json's (the weights'
    shapes must fit it, e.g. the same model with another dropout)."""
    from .model import FrawdLLM

    directory = Path(directory)
    cfg = load_config(directory) if config is None else config
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise FrawdError(f"{path}: missing weights file")
    try:
        state = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise FrawdError(f"{path}: not a readable safetensors file ({exc})") from None
    model = FrawdLLM(cfg)
    if cfg.tie_embeddings and TIED_KEY not in state:
        state[TIED_KEY] = state["embed.tok.weight"] if "embed.tok.weight" in state else None
        if state[TIED_KEY] is None:
            state.pop(TIED_KEY)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise FrawdError(
            f"{path}: weights do not match config.json "
            f"(missing: {', '.join(missing[:5]) or '-'}; unexpected: {', '.join(unexpected[:5]) or '-'})"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise FrawdError(
                f"{path}: tensor {key} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[key].shape)}"
            )
    model.load_state_dict(state)
    return model.to(device)
