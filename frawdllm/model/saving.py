"""What every model class shares: its size and its model directory (`modeldir.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ModelDirectoryMixin:
    """`num_parameters`, `save_pretrained` and `from_pretrained` for an `nn.Module` model."""

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]

    def save_pretrained(self, directory: str | Path, tokenizer: Any = None) -> Path:
        """Write config.json (it names the kind of model), model.safetensors (and
        tokenizer.json if given) atomically. Other files already in `directory` stay, as
        with transformers' save_pretrained: saving a fine-tuned model back where it was
        loaded from keeps its tokenizer.json; a new folder starts clean."""
        from ..modeldir import save_model_dir

        return save_model_dir(self, directory, tokenizer=tokenizer)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu"):
        """The model a directory holds, in eval mode (`.train()` to train it), its parameters
        float32 whatever dtype the file stores (bf16/fp16 values convert exactly; `.to(dtype)`
        for another); an error if it holds another kind of model."""
        from ..errors import FrawdError
        from ..modeldir import load_model
        from ..train.device import pick_device

        model = load_model(directory, device=pick_device(str(device)))  # (a bad device: one line, first)
        if not isinstance(model, cls):
            raise FrawdError(f"{directory}: holds a {type(model).__name__} model, not a {cls.__name__}")
        return model
