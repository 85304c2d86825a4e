"""Flags shared by the commands that generate text (`generate`, `chat`).

`sampling_flags` adds the sampling flags (`--temperature` ... `--stop`, `--no-stop`; `generate`
adds `--num-samples` and `--ignore-eos/--no-ignore-eos`); `params_from_flags` builds the
parameters: the model's generation_config.json first, then the flags actually typed (each
defaults to None, "not given", so a flag can also undo the file: `--seed none`, `--no-stop`).
`engine_flags` and `load_engine` load a model directory into an `Engine` (device, dtype,
int8 quantization, the native C forward or torch.compile, overflow policy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import FrawdError, check_unicode, counted


class SeedType(click.ParamType):
    """--seed: an integer, or `none` (fresh entropy, overriding generation_config.json's seed)."""

    name = "integer|none"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, str) and value.lower() == "none":
            return "none"
        return click.INT.convert(value, param, ctx)


def _default(value: str) -> str:
    return f"  [default: the file's, else {value}]"  # (generation_config.json's, where the model has one)


_SAMPLING = [
    ("--max-new-tokens", "max_new_tokens", int, "Most tokens to generate per completion." + _default("128")),
    ("--temperature", "temperature", float, "Sampling temperature; 0 = greedy." + _default("1.0")),
    ("--top-k", "top_k", int, "Keep the k most likely tokens (0 = off)." + _default("0")),
    ("--top-p", "top_p", float, "Nucleus sampling: keep the most likely tokens up to this mass." + _default("1.0")),
    ("--min-p", "min_p", float, "Drop tokens below min_p x the top probability." + _default("0")),
    ("--repetition-penalty", "repetition_penalty", float, "Penalise tokens already present (>1)." + _default("1.0")),
    ("--seed", "seed", SeedType(), "Random seed: a prompt's samples get the same text with the same seed and "
                                   "settings, alone, beside other prompts or served; 'none' = fresh entropy "
                                   "(overrides the model's generation_config.json).  [default: the file's, else "
                                   "random]"),
]


def sampling_flags(command):
    """Decorator: the sampling flags (each defaults to None = 'not given')."""
    command = click.option("--no-stop", "no_stop", is_flag=True,
                           help="No stop strings, not even those of the model's generation_config.json.")(command)
    command = click.option("--stop", "stop", multiple=True, metavar="TEXT",
                           help="Stop before this text (repeatable; replaces the model's generation_config.json "
                                "stop strings); it is never printed.")(command)
    for flag, name, kind, help_text in reversed(_SAMPLING):
        command = click.option(flag, name, type=kind, default=None, help=help_text)(command)
    return command


def params_from_flags(model_dir: str | Path, flags: dict[str, Any], **extra: Any):
    """SamplingParams from generation_config.json (if any), then the flags given, then `extra`."""
    from ..infer import SamplingParams
    from ..modeldir import load_config, load_generation_config

    load_config(model_dir)  # a missing or broken directory is named before its sampling defaults
    typed = [name for _, name, _, _ in _SAMPLING if flags.get(name) is not None]
    stops = ["stop"] if flags.get("stop") or flags.get("no_stop") else []
    # (a value of the file that a flag replaces is not checked: `--temperature 0.7` overrides a bad one)
    values: dict[str, Any] = dict(load_generation_config(model_dir, overridden=[*typed, *stops, *extra]))
    for name in typed:
        values[name] = flags[name]
    if flags.get("seed") == "none":  # --seed none: fresh entropy, whatever the file says
        values["seed"] = None
    if flags.get("no_stop"):
        if flags.get("stop"):
            raise FrawdError("--stop and --no-stop contradict each other: give one")
        values["stop"] = []
    if flags.get("stop"):
        for stop in flags["stop"]:  # (invalid UTF-8 on the command line: a stop that could never match)
            check_unicode(stop, "--stop")
        values["stop"] = list(flags["stop"])
    values.update(extra)
    return SamplingParams.from_dict(values)


def check_stop_ids(engine: Any, params: Any, model_dir: str | Path) -> None:
    """The stop token ids in the model's vocabulary, before any work, else one line naming
    generation_config.json: only that file gives them (flags do not; the other values were
    checked as the file and flags were read)."""
    from ..modeldir import GENERATION_CONFIG_FILE

    try:
        engine.checked_params(params)
    except FrawdError as error:
        raise FrawdError(f"{Path(model_dir) / GENERATION_CONFIG_FILE}: {error}") from None


def warn_unmatchable_stops(engine: Any, params: Any) -> None:
    """A warning on stderr for each stop string the model can never write: one with characters
    a char tokenizer lacks (it decodes them as nothing it can generate, so the stop never matches)."""
    never = [(stop, sorted(engine.tokenizer.unknown_characters(stop))) for stop in params.stop]
    never = [(stop, missing) for stop, missing in never if missing]
    for stop, missing in never[:3]:  # (a file's list may be long: the first few, then a count)
        click.echo(f"warning: stop string {stop!r} can never match: the tokenizer has no {''.join(missing)!r}",
                   err=True)
    if len(never) > 3:
        click.echo(f"warning: {counted(len(never) - 3, 'more stop string')} can never match", err=True)


def context_stop_note(engine: Any, params: Any, ends: list[tuple[str | None, int]], what: str) -> str | None:
    """What to say when a completion (`what`: "the reply", ...) ended at the model's context short
    of max_new_tokens (`ends`: each one's finish reason and token count), or None."""
    short = [n for reason, n in ends if reason == "length" and n < params.max_new_tokens]
    if not short:
        return None
    return (f"{what} stopped at the model's context of {engine.config.context_length} tokens after "
            f"{counted(min(short), 'new token')}, short of --max-new-tokens {params.max_new_tokens}; "
            "--overflow slide keeps going")


# (the modes of infer/quantize.py, named here so that --help does not import torch)
quantize_option = click.option("--quantize", type=click.Choice(["none", "int8"]), default="none", show_default=True,
                               help="int8: linear weights in int8 with per-row scales (4x smaller, faster decode).")


def engine_flags(command):
    """Decorator: --model and the flags that choose how the model runs."""
    options = [
        click.option("--model", "model_dir", required=True, metavar="DIR",
                     help="A model directory (config.json, model.safetensors, tokenizer.json)."),
        quantize_option,
        click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
                     help="Precision of PyTorch's forward (weights and KV cache; bf16 runs PyTorch only). The "
                          "native C forward reads fp32 weights as --native says; with fp16 or int8 weights in every "
                          "phase its KV cache is fp16 (frawd generate --stats shows what ran)."),
        click.option("--overflow", type=click.Choice(["stop", "slide"]), default="stop", show_default=True,
                     help="Past the model's context: stop, or slide (keep the last 3/4, prefill again)."),
        click.option("--native", "native", type=click.Choice(["auto", "fp16", "fp32", "off"]), default="auto",
                     show_default=True,
                     help="The C forward on CPU (frawdllm/infer/native.c): fp16 reads fp16 copies of the "
                          "weights (half the memory traffic, logits within ~1e-3) and, where every phase runs "
                          "in C, keeps the KV cache in fp16; fp32 the weights as they are and an fp32 cache "
                          "(exact); off = PyTorch; auto = fp16 where the CPU can read it. With --quantize "
                          "int8 the weights are read as int8 and the cache is fp16 whatever this says. Models it "
                          "cannot run (bf16, GPU) use PyTorch."),
        click.option("--compile/--no-compile", "compile_model", default=False, show_default=True,
                     help="torch.compile the decode step instead of --native (slow to start)."),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)."),
        click.option("--threads", type=int, default=None, help="CPU threads, torch's and the native forward's, at most 8 per CPU [default: torch's choice]."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


MAX_THREADS_PER_CPU = 8


def load_engine(model_dir: str, quantize: str = "none", dtype: str = "fp32", overflow: str = "stop",
                compile_model: bool = False, device: str = "cpu", threads: int | None = None,
                native: str = "auto"):
    """A ready Engine for a model directory; every problem is a one-line FrawdError."""
    import torch

    from ..cbuild import usable_cpus
    from ..infer import Engine
    from ..infer.quantize import quantize_int8
    from ..modeldir import TOKENIZER_FILE, first_non_finite, load_model, model_file
    from ..tokenizer import Tokenizer
    from ..train.device import pick_device

    if threads is not None:
        cpus = usable_cpus()  # (`taskset -c 0` leaves one of the machine's CPUs to this process)
        if threads < 1:
            raise FrawdError(f"--threads must be at least 1, got {threads}")
        if threads > MAX_THREADS_PER_CPU * cpus:  # (100000 crashed OpenMP: a segfault, no message)
            raise FrawdError(f"--threads {threads} is more than {MAX_THREADS_PER_CPU}x the {cpus} CPUs this process "
                             f"may use (at most {MAX_THREADS_PER_CPU * cpus}; more threads than CPUs only wait for "
                             f"each other)")
        torch.set_num_threads(threads)
    if compile_model and native in ("fp16", "fp32"):
        raise FrawdError(f"--compile runs the decode step through torch.compile, not the native forward that "
                         f"--native {native} asks for: give one of them")
    model = load_model(model_dir, device=pick_device(device), kind="decoder")
    bad = first_non_finite(model)
    if bad is not None:  # (sampling raised inside torch.multinomial; greedy wrote token 0 over and over)
        raise FrawdError(f"{model_dir}: the model's weights hold nan or inf values (the first: {bad}): a run that "
                         "diverged? Use a checkpoint from before it")
    tokenizer = Tokenizer.load(model_file(model_dir, TOKENIZER_FILE)).check_fits(model.config.vocab_size, model_dir)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if quantize == "int8":
        quantize_int8(model)
    use_native = False if native == "off" or compile_model else None  # None: wherever it can run
    return Engine(model, tokenizer, compile=compile_model, overflow=overflow, native=use_native,
                  weights="auto" if native == "off" else native)


__all__ = ["sampling_flags", "params_from_flags", "engine_flags", "load_engine", "warn_unmatchable_stops",
           "context_stop_note"]
