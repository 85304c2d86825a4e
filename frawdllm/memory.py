"""How much memory a new allocation may take: what refuses work that would not fit (a KV
cache, a beam search, a training batch) before any of it is allocated, instead of the
kernel's OOM killer ending the process without a word."""

from __future__ import annotations

from pathlib import Path

import torch


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation may take on `device`: a GPU's free memory plus what PyTorch
    holds unused; on the CPU the memory the system has available (and this process's cgroup
    allows); None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a container's limit (cgroup v2), below the machine's
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def position_table_bytes(cfg) -> int:
    """Bytes of the position tables a model builds at construction (computed in float64)."""
    width = {"rope": cfg.head_dim, "sinusoidal": cfg.n_embd}.get(cfg.pos_encoding, 0)
    return cfg.context_length * width * 8


def check_model_fits(cfg, model: str) -> None:
    """Refuse, in one line (a ConfigError), to build a `model` whose fp32 weights and position
    tables cannot fit in the memory the default device has available: a context_length of
    2e9 asked the allocator for 16 GB, and where the system overcommits, the kernel's OOM
    killer ended the process as the weights were initialised. (Meta tensors allocate nothing.)"""
    from .errors import ConfigError

    device = torch.get_default_device()
    if device.type == "meta":
        return
    free = free_memory(device)
    need = 4 * cfg.num_parameters + position_table_bytes(cfg)
    if free is not None and need > free:
        raise ConfigError(f"{model}: this config needs {need / 2**30:,.1f} GiB for its weights and position tables "
                          f"(context_length {cfg.context_length:,}), more than the {free / 2**30:,.1f} GiB of memory "
                          "available")


def training_floor_bytes(model_cfg, rows: int, tokens_per_row: int, activation_bytes: int,
                         frozen: bool = False) -> int:
    """A lower bound on the memory of a training micro-batch of `rows` x `tokens_per_row`
    tokens: fp32 weights, gradients and AdamW's two moments (16 bytes a parameter; 4, the
    weights alone, when they are `frozen` under LoRA adapters), and, for every token of every
    layer, the two MLP activations of `ffn_dim` values its backward keeps (the nonlinearity's
    input and the down projection's). The real need is larger (attention, norms, logits), so
    a run this refuses could never have fit."""
    return _state_bytes(model_cfg, frozen) + rows * tokens_per_row * model_cfg.n_layer * 2 * model_cfg.ffn_dim \
        * activation_bytes


def _state_bytes(model_cfg, frozen: bool) -> int:
    return (4 if frozen else 16) * model_cfg.num_parameters


def check_training_fits(model_cfg, batch_size: int, tokens_per_row: int, dtype: str, device: torch.device,
                        rows_per_example: int = 1, frozen: bool = False) -> None:
    """Refuse, in one line, a CPU training run whose micro-batch cannot fit in the memory the
    system has available (the kernel's OOM killer ended `sft --batch-size 100000` without a
    word). bf16 activations are assumed unless `dtype` is fp32 (`auto` may pick bf16): a lower
    bound. On a GPU an allocation that fails raises an error the run reports itself."""
    from .errors import FrawdError

    if device.type != "cpu":
        return
    rows = batch_size * rows_per_example
    need = training_floor_bytes(model_cfg, rows, tokens_per_row, 4 if dtype == "fp32" else 2, frozen)
    free, state = free_memory(device), _state_bytes(model_cfg, frozen)
    if free is not None and state > free:  # (no batch size fits)
        what = "the frozen weights, in fp32" if frozen else "weights, gradients and AdamW's two moments, in fp32"
        raise FrawdError(f"the model's {model_cfg.num_parameters:,} parameters need {state / 2**30:.1f} GiB to "
                         f"train ({what}) before any activation, more than the {max(free, 0) / 2**30:.1f} GiB "
                         "available: a smaller model")
    if free is not None and need > free:
        shape = f"{rows:,} rows" if rows_per_example > 1 else "rows"
        weights = "the frozen weights" if frozen else "weights, gradients, AdamW"
        raise FrawdError(f"--batch-size {batch_size} ({shape} of {tokens_per_row} tokens) needs at least "
                         f"{need / 2**30:.1f} GiB to train ({weights} and the MLP activations "
                         f"backward keeps), more than the {max(free, 0) / 2**30:.1f} GiB available: lower "
                         "--batch-size (--grad-accum N keeps the tokens per step)")


__all__ = ["free_memory", "training_floor_bytes", "check_training_fits"]
