"""AdamW with weight decay on the matrices only.

Weight decay pulls weights towards zero. It helps the matrices of linear layers; on
biases and norm gains it only fights the model (a norm gain of 0 silences a channel),
so those get none. Embedding matrices are matrices too, but rows of rare tokens are
updated rarely and decay would erase them, so they get none unless asked
(`decay_embeddings`). With a tied LM head the head is the token embedding.

The fused AdamW kernel (one pass over all parameters) is used where PyTorch has it.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict]:
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # shared (tied) parameters come once
        if not param.requires_grad:
            continue
        is_matrix = param.dim() >= 2
        if is_matrix and (decay_embeddings or id(param) not in embedding_ids):
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=fused or None)
