"""`frawd info`: what a config costs before you train it."""

from __future__ import annotations

import click

from ..errors import FrawdError
from .options import model_config_from, preset_option, set_option


def _human(n: int | float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024:
            return f"{n:.1f} {prefix}{unit}"
        n /= 1024
    return f"{n:.1f} Pi{unit}"


def _per_rank_memory(n: int, ranks: int) -> None:
    """Each rank's weights, gradients and AdamW moments: whole copies under DDP, 1/N under FSDP
    (plus, while a block runs, its gathered weights: shown as the largest block)."""
    click.echo(f"memory per rank with {ranks} ranks (fp32 weights, gradients, AdamW m and v; + activations):")
    click.echo(f"  {'':<6} {'weights':>11} {'gradients':>11} {'AdamW':>11} {'total':>11}")
    for name, share in (("ddp", 1), ("fsdp", ranks)):
        w = 4 * n / share
        click.echo(f"  {name:<6} {_human(w):>11} {_human(w):>11} {_human(2 * w):>11} {_human(4 * w):>11}")
    click.echo("  fsdp gathers one block's weights at a time (bf16: half the bytes of fp32) and shards the rest.")


@click.command()
@preset_option()
@set_option()
@click.option("--seq-len", type=int, default=None, help="Sequence length for FLOPs (default: context_length).")
@click.option("--ranks", type=click.IntRange(min=1), default=None,
              help="Also show each rank's share of the training memory with N ranks "
                   "(frawd pretrain --parallel ddp and fsdp).")
def info(preset: str, overrides: tuple[str, ...], seq_len: int | None, ranks: int | None) -> None:
    """Print a config, its exact parameter count, training FLOPs per token and memory,
    and this machine: device, CPU features, the dtype and compile `auto` picks and why,
    and the matmul peaks (measured once, cached in ~/.cache/frawdllm or $FRAWD_CACHE_DIR).

    The parameter count is computed from the config and equals the number of unique
    parameters of the built model (tied embeddings counted once).
    """
    if seq_len is not None and seq_len < 1:
        raise FrawdError(f"--seq-len must be a positive integer, got {seq_len}")
    cfg = model_config_from(preset, overrides)
    if seq_len is not None and seq_len > cfg.context_length:
        raise FrawdError(f"--seq-len {seq_len} exceeds the model's context_length {cfg.context_length}")
    click.echo(f"preset: {preset}")
    # (settings: the MLP width as built, where the config leaves it to be derived)
    for key, value in (cfg.settings() if hasattr(cfg, "settings") else cfg.to_dict()).items():
        click.echo(f"  {key:<18} {value}")
    n = cfg.num_parameters
    click.echo(f"parameters:               {n:,}")
    click.echo(f"  embedding:              {cfg.num_embedding_parameters:,}")
    click.echo(f"  non-embedding:          {cfg.num_non_embedding_parameters:,}")
    seq = seq_len or cfg.context_length
    flops = cfg.flops_per_token(seq)
    click.echo(f"training FLOPs/token:     {flops:,} (seq_len {seq}; 6N + attention)")
    click.echo("memory (fp32 training):")
    click.echo(f"  weights:                {_human(4 * n)}")
    click.echo(f"  gradients:              {_human(4 * n)}")
    click.echo(f"  AdamW state (m, v):     {_human(8 * n)}")
    click.echo(f"  total:                  {_human(16 * n)}  (+ activations)")
    click.echo(f"weights in bf16:          {_human(2 * n)}")
    if ranks is not None:
        _per_rank_memory(n, ranks)
    from ..train.device import hardware_report

    click.echo("this machine (for training):")
    for line in hardware_report(say=lambda message: click.echo(message, err=True)):
        click.echo(f"  {line}")
