"""Shared by the interop tests: small random models whose every tensor matters.

Our init leaves biases at zero and norm gains at one, so a mapping that dropped or
swapped them would still pass; `randomize_` gives every parameter random values.
"""

from __future__ import annotations

import torch

from frawdllm import FrawdLLM, get_config

# Small enough for seconds on a CPU, big enough for GQA (4 query heads) and full context.
SMALL = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, context_length=32)

# name -> (preset, overrides): the exportable variants the parity tests cover.
VARIANTS: dict[str, tuple[str, dict]] = {
    "gpt2-tied": ("tiny", {}),
    # (an eps far from the norms' own default 1e-5 and whose effect shows: a norm built
    # without it computed the same logits as the parity checks' other models)
    "gpt2-untied": ("tiny", {"tie_embeddings": False, "norm_eps": 1e-2}),
    "gpt2-nobias": ("tiny", {"bias": False}),
    "llama-mha": ("tiny-llama", {"n_kv_head": 4}),
    "llama-gqa": ("tiny-llama", {"n_kv_head": 2, "norm_eps": 1e-2}),
    "llama-mqa-untied": ("tiny-llama", {"n_kv_head": 1, "tie_embeddings": False}),
    "llama-bias-gqa": ("tiny-llama", {"n_kv_head": 2, "bias": True}),
}


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random: gains near 1 (norm weights), everything else N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            is_gain = p.ndim == 1 and name.endswith("weight")
            p.copy_(noise + 1.0 if is_gain else noise)
    return module


def small_model(variant: str, seed: int = 0, **changes) -> FrawdLLM:
    """A random model of `variant`; `changes` override SMALL and the variant's fields."""
    preset, overrides = VARIANTS[variant]
    return randomize_(FrawdLLM(get_config(preset, **{**SMALL, **overrides, **changes})), seed).eval()


def random_ids(vocab_size: int, batch: int = 2, length: int = SMALL["context_length"], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
