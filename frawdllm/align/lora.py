"""LoRA: fine-tune a few low-rank matrices instead of every weight.

A frozen linear layer W (out x in) gets a trainable update B A, with A (r x in) and
B (out x r), r small:  y = x W^T + (alpha / r) x A^T B^T.  B starts at zero, so training
starts from the base model exactly. The adapters go on every attention and MLP projection
(qkv, proj, up, down; an encoder-decoder's cross-attention q and kv too); embeddings,
norms and the LM head stay frozen.

On save the update is merged, W' = W + (alpha / r) B A, into a plain model directory:
every other command (chat, generate, export) reads it without knowing LoRA was used.
"""

from __future__ import annotations

import copy
import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..config import is_integer

TARGETS = ("qkv", "q", "kv", "proj", "up", "down")


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update, scale * B @ A with scale = alpha / rank;
    B starts at zero, so the wrapped model first computes what it did. `merged()` folds it in."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear initialises its weight

    def forward(self, x: Float[Tensor, "*B I"]) -> Float[Tensor, "*B O"]:
        return self.base(x) + (x @ self.lora_a.T.to(x.dtype)) @ self.lora_b.T.to(x.dtype) * self.scale

    def merged(self) -> nn.Linear:
        linear = copy.deepcopy(self.base)
        with torch.no_grad():
            linear.weight += (self.lora_b.float() @ self.lora_a.float()).to(linear.weight.dtype) * self.scale
        return linear


def add_lora(model: nn.Module, rank: int, alpha: float | int | None = None) -> nn.Module:
    """Freeze `model` and wrap its projections with adapters (in place); returns it."""
    if not is_integer(rank) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0 < alpha < math.inf):  # (inf: 0 x inf, every output NaN)
        raise ValueError(f"LoRA alpha must be a finite positive number, got {alpha!r}")
    if has_lora(model):  # (else: "no linear layer named ...", the projections being LoRA layers now)
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    targets = [(module, name, child) for module in model.modules() for name, child in module.named_children()
               if name in TARGETS and isinstance(child, nn.Linear)]
    if not targets:  # (else every weight frozen and nothing to train, silently)
        raise ValueError(f"no linear layer named {', '.join(TARGETS)} to put LoRA adapters on in "
                         f"{type(model).__name__}")
    model.requires_grad_(False)
    for module, name, child in targets:
        setattr(module, name, LoRALinear(child, rank, alpha if alpha is not None else 2.0 * rank))
    return model


def has_lora(model: nn.Module) -> bool:
    """Whether `add_lora` wrapped any of the model's linears."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token of `model` (its config's `flops_per_token`): with adapters the
    frozen base computes no weight gradients (4N, not 6N), and each adapter weight costs 6."""
    if not has_lora(model):
        return model.config.flops_per_token(seq_len)
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    return model.config.flops_per_token(seq_len, frozen=True) + 6 * adapters


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain copy of `model` with every adapter merged into its layer, trainable as a
    plain model is (add_lora froze the base)."""
    plain = copy.deepcopy(model)
    for module in list(plain.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    return plain.requires_grad_(True)


def plain(model: nn.Module) -> nn.Module:
    """`model` itself, or, with adapters, its merged copy: what saving and inference take."""
    return merged_copy(model) if has_lora(model) else model


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters alone (every lora_a, lora_b), as a checkpoint saves them."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if "lora_" in name}


def load_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Put `adapter_state`'s tensors back; refused unless they are exactly this model's adapters."""
    params = dict(model.named_parameters())
    if (set(state) != {name for name in params if "lora_" in name}
            or any(value.shape != params[name].shape for name, value in state.items())):
        raise ValueError("the saved adapters do not fit this model (another --lora-rank?)")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
