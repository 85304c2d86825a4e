"""The generation engine: prompts in, completions out, one token per step from a KV cache.

    engine = Engine(model, tokenizer)
    engine.generate(["Once upon", "The king"], SamplingParams(temperature=0, max_new_tokens=50))
    for chunk in engine.stream("Once upon", SamplingParams(max_new_tokens=50)):
        print(chunk.text, end="")

How a batch runs:

1. prefill: prompts are left-padded to a common length and run through the model once;
   each row's positions start at 0 at its first real token, and padding is masked out of
   attention (see `cache.py`). Only the last position goes through the LM head.
2. decode: each step feeds every row's newest token at its own position, samples the
   next one (`sampling.sample_next`, the one sampler of the project; plain greedy rows its
   argmax rule, `greedy_choice`) and checks the stop
   rules. A row that finishes stops producing tokens; once half the batch has finished,
   finished rows are dropped from the cache so they cost nothing.
3. past the model's context: `overflow="stop"` ends the row (finish_reason "length");
   `overflow="slide"` keeps the last 3/4 of the context (after the BOS a prompt starts with,
   as llama.cpp's context shift keeps it) and prefills it again, so every
   position stays inside the range the model was trained on (for RoPE, learned and
   sinusoidal positions alike) and the cache stays coherent. Each row slides when it
   reaches the context itself (the others are prefilled again with their own windows),
   so a row's text does not depend on the rows beside it.

Who computes the forward: on CPU, by default, each phase (`paths.PHASES`: prefill of a
short and of a long prompt, batch-1 decode, decode of 2-7 rows and of 8 or more) runs
whichever of the native C forward (`native.py`: one call per step, on its own fp16
copies of the weights unless weights="fp32") and PyTorch eager measured fastest on this
machine (`paths.py`, measured once and cached); where that is the C
forward in every phase with fp16 (or int8) weights, the KV cache is fp16 too
(`Engine.kv_dtype`). `native=True` forces the C forward everywhere, `native=False`
PyTorch; `compile=True` runs decode steps under
`torch.compile` (the cache is then static, fixed shapes with the slot to write as a
tensor, so one graph serves every step). The model given is never changed: each PyTorch
forward runs it in eval mode (no dropout) and leaves it in the mode it was in.

Prompts: text (`str`: no special tokens parsed; only the BOS that the tokenizer's own
template adds, `Tokenizer.encode_prompt`, leads it) or token ids: a list or tuple of
integers (numpy integers too), or a 1-D integer tensor or numpy array. A list whose first
item is a number is one prompt of ids; otherwise a list holds prompts (a 2-D tensor or
array: a prompt per row). `bytes` is refused: decode it to `str` first. (Annotated `Any`:
checked here, so that a wrong type is one clear line.)

fp16 KV cache: keys and values past fp16's range (65504) would be stored as inf and turn
later logits into NaN. The C forward notices as it stores them (prefill and decode alike)
and the call fails with an error that names the fp32 cache (weights="fp32").

One engine may be shared by several threads (a server's requests): each call has its own
cache and run state, and the native forward serves one call at a time.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from numbers import Number
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..config import Seq2SeqConfig, is_integer
from ..errors import FrawdError
from ..model.gpt import eval_mode, is_id_tensor
from ..tokenizer import Tokenizer
from ..train.compile import quiet_inductor, use_persistent_cache
from . import native as native_forward
from . import paths
from .cache import KVCache, RowKVCache
from .quantize import fp32_activations, is_int8
from .sampling import (MAX_LOGPROBS, SamplingParams, TokenLogprob, checked_params, greedy_index, make_generator,
                       sample_next, sample_seed, token_logprobs)
from .textstream import TextStream, text_after

OVERFLOW_MODES = ("stop", "slide")
WEIGHT_MODES = ("auto", *native_forward.WEIGHT_DTYPES)
DEFAULT_NATIVE_WEIGHTS = "fp16"  # what weights="auto" reads in native decoding (fp32 if the CPU cannot)
# compile=True: inductor's own CPU matrix kernels (max_autotune picks them over MKL when
# faster: for one-row products they read the weights about twice as fast) on weights
# frozen into the graph as constants (freezing, set around the first call).
COMPILE_OPTIONS = {
    "max_autotune": True,
    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,  # no timing tables on stderr
}
SLIDE_KEEP = 0.75  # fraction of the context kept when sliding


@dataclass
class Completion:
    """One finished completion. `tokens` are the generated ids (a final stop token included)."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop": end-of-sequence, stop token or stop string; "length": token or context limit
    prompt_tokens: int
    prompt_index: int = 0
    sample_index: int = 0


@dataclass
class StreamChunk:
    """Text that became printable for completion `index` (= prompt_index * num_samples + sample_index)."""

    index: int
    text: str
    token: int | None
    finish_reason: str | None = None  # set on the last chunk of a completion
    logprob: TokenLogprob | None = None  # with params.logprobs: the token's (not for a final stop token)


@dataclass
class _TokenEvent:
    row: int
    token: int
    finish_reason: str | None
    logprob: TokenLogprob | None = None


class Engine:
    """Generation for one model and its tokenizer (a `Tokenizer`, or the path of its
    tokenizer.json or of a model folder holding one).

    Construction changes nothing in the model (forwards run it in eval mode). `native`
    (None: per phase, where it measures fastest; True: everywhere; False: never) uses the
    C forward, reading `weights` ("auto" = "fp16" copies where the CPU reads fp16 and every
    weight fits fp16, else "fp32"; or either by name; an int8 model is read
    as int8); `compile=True` runs PyTorch decode steps under torch.compile instead;
    `overflow` says what happens past the context ("stop" or "slide").
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        compile: bool = False,
        overflow: str = "stop",
        native: bool | None = None,
        weights: str = "auto",
    ) -> None:
        if overflow not in OVERFLOW_MODES:
            raise FrawdError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}; got {overflow!r}")
        if native not in (None, True, False):  # ("no" is truthy: it forced the native forward)
            raise FrawdError(f"native must be None (chosen per phase), True or False; got {native!r}")
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise FrawdError(f"Engine generates with a FrawdLLM model; got {type(model).__name__}")
        if isinstance(getattr(model, "config", None), Seq2SeqConfig):
            raise FrawdError("Engine generates with a decoder-only model (FrawdLLM); for an encoder-decoder "
                             "Seq2SeqTransformer use frawdllm.infer.translate "
                             "(translate_ids, greedy_decode, beam_search)")
        if isinstance(tokenizer, (str, os.PathLike)):  # a tokenizer.json (or a model folder holding one)
            tokenizer = Tokenizer.load(tokenizer)
        if not callable(getattr(tokenizer, "decode", None)):  # (encode only for text prompts)
            raise TypeError(f"Engine(model, tokenizer): the tokenizer is {type(tokenizer).__name__}, without "
                            "decode; give the model's (Tokenizer.load(PATH), or the path)")
        if hasattr(tokenizer, "check_fits"):  # (a duck-typed tokenizer without it is trusted)
            tokenizer.check_fits(model.config.vocab_size, "Engine(model, tokenizer)")
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.overflow = overflow
        self.compile = compile
        embed = model.embed.tok.weight
        self.device, self.dtype = embed.device, embed.dtype
        self.eos_id = self.config.eos_token_id
        self.native = self._use_native(native)
        self._force_native = bool(native)
        if weights not in WEIGHT_MODES:
            raise FrawdError(f"weights must be one of {', '.join(WEIGHT_MODES)}; got {weights!r}")
        if self.native and weights == "auto":  # (fp32 where a weight is past fp16's range: a diverged run's)
            fp16 = native_forward.has_fp16() and native_forward.fits_fp16(model)
            weights = DEFAULT_NATIVE_WEIGHTS if fp16 else "fp32"
        if self.native and is_int8(model):
            weights = "int8"  # every linear is int8: that is what the C forward reads
        self.weights = weights if self.native else None
        self._decoder: native_forward.NativeDecoder | None = None
        self._plan: dict[str, paths.Path] | None = None
        self._threads: dict[str, paths.ThreadChoice] = {}  # per phase on the CPU, re-decided as it runs
        self._lock = threading.Lock()  # guards the decoder, built on first use
        self._plan_lock = threading.Lock()
        if compile:
            quiet_inductor()
            use_persistent_cache()  # (training's: a later run reuses the kernels, $FRAWD_CACHE_DIR holds them)
        self._warmed_shapes: set[tuple[int, int]] = set()  # compiled decode steps' (rows, cache slots)
        # the compiled decode step (the "compiled" path, which only a compile=True engine plans)
        self._decode = (torch.compile(_own_decode_step(), fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
                        if compile else None)

    def _use_native(self, wanted: bool | None) -> bool:
        """Decode steps in C (`native.py`): by default whenever the model qualifies."""
        if wanted is False or (wanted is None and self.compile):
            return False
        if wanted and self.compile:
            raise FrawdError("choose compile or native decoding, not both")
        reason = native_forward.supports(self.model)
        if reason is None and not native_forward.available():
            reason = native_forward.unavailable_reason()
        if reason is not None and wanted:
            raise FrawdError(f"native decoding is not possible: {reason}")
        return reason is None

    def refresh(self) -> None:
        """Copy the model's weights again at the next call. Needed only after a write the
        engine cannot see: through `.data` (or another way round the version counter) to
        a few entries that its 16 probed values per tensor miss."""
        with self._lock:
            self._decoder = None

    def native_decoder(self) -> native_forward.NativeDecoder:
        """The C forward over the model as it is now (rebuilt if its weights changed)."""
        with self._lock:
            if self._decoder is None or not self._decoder.is_current(self.model):
                weights = "fp32" if self.weights == "int8" else self.weights  # (int8 linears read as int8)
                self._decoder = native_forward.NativeDecoder(self.model, weights)
            return self._decoder

    def plan(self) -> dict[str, paths.Path]:
        """The path of each phase (`paths.PHASES`): measured once per CPU and model when `native`
        was left to the engine."""
        with self._plan_lock:
            if self._plan is None:
                threads = torch.get_num_threads()
                if self.compile:
                    self._plan = {name: paths.Path("compiled") for name in paths.PHASES}
                    self._plan["prefill"] = self._plan["long"] = paths.Path("torch")  # (prefills run eager)
                elif not self.native:
                    self._plan = {name: paths.Path("torch") for name in paths.PHASES}
                elif self._force_native:
                    self._plan = {name: paths.Path("native", threads) for name in paths.PHASES}
                else:
                    self._plan = paths.choose(self.model, self.native_decoder(), self.weights)
                self._threads = {name: paths.ThreadChoice(p.threads or threads, threads)
                                 for name, p in self._plan.items()
                                 if p.kind == "native" or (p.kind == "torch" and self.device.type == "cpu")}
            return self._plan

    def native_forward(self, decoder: native_forward.NativeDecoder, tokens: Int[Tensor, "B T"],
                       positions: Int[Tensor, "B T"], cache: KVCache | RowKVCache, path: paths.Path) -> Float[Tensor, "B V"]:
        """The C forward for one phase, at the thread count that phase currently runs fastest with."""
        return self._at_best_threads(paths.phase(*tokens.shape), path.threads, tokens.numel(),
                                     lambda threads: decoder.forward(tokens, positions, cache, threads))

    def torch_forward(self, rows: int, new_tokens: int, run: Callable[[], Tensor]) -> Float[Tensor, "B V"]:
        """`run()`, a PyTorch eager forward of `rows` rows of `new_tokens` tokens, at the thread
        count its phase currently runs fastest with. Under load torch's team of threads waits at
        every operation for its member without a core: a 16-row decode step of `tiny` took
        118 ms on 2 threads and 33 ms on 1 while other processes kept the 2 cores busy."""
        return self._at_best_threads(paths.phase(rows, new_tokens), None, rows * new_tokens,
                                     lambda threads: _at_threads(threads, run))

    def row_step(self, step: native_forward.RowStep, token: int, position: int, slot: int) -> Float[Tensor, "1 V"]:
        """A batch-1 native decode step (`native.RowStep`), at the decode phase's thread count."""
        return self._at_best_threads("decode", self.plan()["decode"].threads or torch.get_num_threads(), 1,
                                     lambda threads: step(token, position, slot, threads))

    def _at_best_threads(self, phase: str, planned: int | None, tokens: int, run: Callable[[int | None], Tensor]
                         ) -> Float[Tensor, "B V"]:
        """`run(threads)` at the thread count `phase` currently runs fastest with, timed to
        keep that choice current (`paths.ThreadChoice`); the planned count where none is kept."""
        choice = self._threads.get(phase)
        if choice is None:
            return run(planned)
        threads = choice.pick()
        start = time.perf_counter()
        out = run(threads)
        choice.record(threads, time.perf_counter() - start, tokens)
        return out

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: fp16 where the C forward reads fp16 or int8 weights in every
        phase (half the cache's memory and of the bytes attention reads; keys and values are
        rounded once, like the weights), else the model's dtype. `weights="fp32"` stays exact."""
        plan = self.plan()
        if (self.weights in ("fp16", "int8") and native_forward.has_fp16()
                and all(p.kind == "native" for p in plan.values())):
            return torch.float16
        return self.dtype

    def path(self, rows: int, new_tokens: int) -> paths.Path:
        """How a forward of `rows` rows of `new_tokens` tokens runs."""
        return self.plan()[paths.phase(rows, new_tokens)]

    def describe(self) -> str:
        """What computes the forward: "native int8", or per phase when they differ, e.g.
        "native fp16 (decode, batch); PyTorch eager (prefill, wide)"."""
        groups: dict[str, list[str]] = {}
        for name, p in self.plan().items():
            label = f"native {self.weights}" if p.kind == "native" else str(p)
            groups.setdefault(label, []).append(name)
        if len(groups) == 1:
            return next(iter(groups))
        return "; ".join(f"{label} ({', '.join(names)})" for label, names in groups.items())

    # ---- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Any, whole: bool = False) -> list[int]:
        """One prompt as a list of Python ints: text encoded (after the BOS its tokenizer's template
        adds: an imported Llama's; none for ours), token ids (any form the module docstring's
        "Prompts" names, taken as they are) checked against the vocabulary;
        `whole`: it must fit the context, whatever `overflow` says (a prompt scored at once).

        An empty prompt becomes <|eos|>: in pretraining data a document starts after one.
        """
        prompt = _one_prompt(prompt)
        if isinstance(prompt, str):
            if not callable(getattr(self.tokenizer, "encode", None)):
                raise FrawdError(f"a text prompt needs a tokenizer with encode ({type(self.tokenizer).__name__} has "
                                 "none): give token ids")
            # the BOS the tokenizer's own template adds, as transformers' tokenizer does (a duck-typed one: encode)
            ids = getattr(self.tokenizer, "encode_prompt", self.tokenizer.encode)(prompt)
        else:
            ids = prompt
            bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
            if bad:
                raise FrawdError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        if not ids:
            ids = [self.eos_id]
        if len(ids) > self.config.context_length and (whole or self.overflow == "stop"):
            advice = "" if whole else " or use overflow='slide' (--overflow slide)"
            raise FrawdError(f"the prompt has {len(ids)} tokens but the model's context is "
                             f"{self.config.context_length}; shorten it{advice}")
        return ids

    def _prompt_list(self, prompts: Any) -> list[list[int]]:
        if _is_one_prompt(prompts):
            prompts = [prompts]
        elif isinstance(prompts, (Tensor, np.ndarray)):
            prompts = list(prompts)  # a prompt per row
        elif not isinstance(prompts, Sequence):
            raise FrawdError(f"prompts must be a prompt (str or token ids) or a list of prompts; "
                             f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise FrawdError("no prompts given")
        return [self.encode(p) for p in prompts]

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts: Any, params: SamplingParams | None = None) -> list[Completion]:
        """Completions for every prompt, `params.num_samples` each, in prompt order.

        `prompts`: one prompt or a list of them. A prompt is text (`str`) or token ids: a
        list/tuple of ints (numpy integers too) or a 1-D integer tensor or numpy array (a 2-D
        one is a prompt per row). A list starting with a number is one prompt; `bytes` is an
        error (decode it to str).
        """
        params = self.checked_params(params)
        encoded = self._prompt_list(prompts)
        self.check_rows_fit(encoded, params)
        n = params.num_samples
        tokens: list[list[int]] = [[] for _ in range(len(encoded) * n)]
        texts = [""] * len(tokens)
        reasons = ["length"] * len(tokens)
        for chunk in self._chunks(encoded, params, need_text=bool(params.stop)):
            if chunk.token is not None:
                tokens[chunk.index].append(chunk.token)
            texts[chunk.index] += chunk.text
            if chunk.finish_reason is not None:
                reasons[chunk.index] = chunk.finish_reason
        out = []
        for i, ids in enumerate(tokens):
            if not params.stop:  # no stop strings: decode once at the end (a stop token is not text)
                texts[i] = text_after(self.tokenizer, encoded[i // n], ids[:-1] if reasons[i] == "stop" else ids)
            out.append(Completion(texts[i], ids, reasons[i], len(encoded[i // n]), i // n, i % n))
        return out

    def stream(self, prompts: Any, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Text as it becomes printable: never half a character, never (part of) a stop
        string. `prompts` as in `generate`."""
        params = self.checked_params(params)
        encoded = self._prompt_list(prompts)
        self.check_rows_fit(encoded, params)
        yield from self._chunks(encoded, params, need_text=True)

    def check_rows_fit(self, encoded: list[list[int]], params: SamplingParams, samples: str = "num_samples") -> None:
        """FrawdError if the prompts' ids, `params.num_samples` rows each, would need a KV
        cache (and a row of logits each) larger than the memory available, before any of it
        is allocated (num_samples=10**9 was a MemoryError, or the OOM killer). The cache is
        sized as this engine sizes it (`cache_slots`), at its cache dtype. `samples`: what
        the message calls the number of samples (the CLI's --num-samples)."""
        from ..memory import free_memory

        cfg = self.config
        rows = len(encoded) * params.num_samples
        # (a prompt past the context slides to a shorter window with overflow="slide": near enough)
        widths = [min(len(ids), cfg.context_length) for ids in encoded]
        slots = cache_slots(widths, cfg.context_length, params.max_new_tokens, self.compile)
        item = torch.empty(0, dtype=self.kv_dtype).element_size()
        per_row = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * slots * item + 4 * cfg.vocab_size  # (fp32 logits)
        need, have = rows * per_row, free_memory(self.device)
        if have is not None and need > have:
            raise FrawdError(f"{rows:,} sequences at once (prompts x {samples}) need about {need / 2**30:.1f} GiB "
                             f"for their KV cache; {have / 2**30:.1f} GiB is available; ask for fewer")

    @torch.inference_mode()
    def prompt_logprobs(self, ids: Any, k: int) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it (None for the first:
        nothing predicts it) and the `k` likeliest there (0..MAX_LOGPROBS): one PyTorch forward
        of the prompt (the server's `echo` with `logprobs`, how evaluation harnesses score a
        text). `ids`: a prompt as `generate` takes it, checked by `encode` (an empty one is
        <|eos|>)."""
        if not is_integer(k) or not 0 <= k <= MAX_LOGPROBS:
            raise FrawdError(f"k (alternatives per token) must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        ids = self.encode(ids, whole=True)
        with eval_mode(self.model), self.torch_arithmetic():
            logits = self.model(torch.tensor([ids], device=self.device))[0][0]  # (T, V)
        return [None] + token_logprobs(logits[:-1], ids[1:], k) if len(ids) > 1 else [None]

    def checked_params(self, params: Any) -> SamplingParams:
        """`params` (None: the defaults), its stop token ids checked against this model's vocabulary."""
        params = checked_params(params)
        bad = [i for i in params.stop_token_ids if i >= self.config.vocab_size]
        if bad:
            raise FrawdError(f"stop token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        return params

    def _is_stop_token(self, token: int, params: SamplingParams) -> bool:
        return (token == self.eos_id and not params.ignore_eos) or token in params.stop_token_ids

    # ---- tokens -> text -----------------------------------------------------------------------
    def _chunks(self, encoded: list[list[int]], params: SamplingParams, need_text: bool) -> Iterator[StreamChunk]:
        run = _Run(self, encoded, params)
        streams = [TextStream(self.tokenizer, params.stop, encoded[row // params.num_samples])
                   for row in range(run.n_rows)] if need_text else None
        for event in run.events():
            text, reason = "", event.finish_reason
            if streams is not None:
                text, reason = self.push_text(streams[event.row], event.token, reason, params)
                if reason is not None and event.finish_reason is None:  # a stop string completed
                    run.finish(event.row)
            yield StreamChunk(event.row, text, event.token, reason,
                              self.reported_logprob(event.logprob, event.finish_reason, params))

    def reported_logprob(self, logprob: TokenLogprob | None, reason: str | None,
                         params: SamplingParams) -> TokenLogprob | None:
        """A token's logprob as reported: none for the stop token that ended a row (it is
        no text), as for its text."""
        if logprob is None or (reason == "stop" and self._is_stop_token(logprob.token, params)):
            return None
        return logprob

    def push_text(self, stream: TextStream, token: int, reason: str | None,
                  params: SamplingParams) -> tuple[str, str | None]:
        """(text now printable, finish reason) after `token`: a stop token is not text, a
        completed stop string ends the row ("stop"), a finished row flushes what was held."""
        text = ""
        if not (reason == "stop" and self._is_stop_token(token, params)):
            text = stream.push(token)
        if stream.stopped:
            reason = "stop"
        if reason is not None:
            text += stream.finish()
            if stream.stopped:  # (a stop string can end in the held-back tail finish() flushes)
                reason = "stop"
        return text, reason

    def finish_reason(self, token: int, params: SamplingParams, generated: int, length: int) -> str | None:
        """Why a row ends after sampling `token` (its `generated`-th; the sequence is now
        `length` long), or None: a stop token, max_new_tokens, or the context (overflow="stop")."""
        if self._is_stop_token(token, params):
            return "stop"
        if generated >= params.max_new_tokens:
            return "length"
        # The new token would sit at position length - 1: past the context it cannot be fed.
        if self.overflow == "stop" and length > self.config.context_length:
            return "length"
        return None

    @torch.inference_mode()
    def forward(self, tokens: Int[Tensor, "B T"], positions: Int[Tensor, "B T"], cache: Any,
                decoder: native_forward.NativeDecoder | None = None) -> Float[Tensor, "B V"]:
        """Each row's last-token logits by the path the plan gives this shape (native C or
        PyTorch eager; a compiled plan runs eager here); keys and values go into `cache`,
        whose `begin(T)` has been called. `decoder`: the native decoder to use, from a recent
        `native_decoder()` (checking that it is current walks every parameter, ~0.2 ms: a
        caller making many steps checks once per request, not per step)."""
        path = self.path(*tokens.shape)
        if path.kind == "native":
            return self.native_forward(decoder or self.native_decoder(), tokens, positions, cache, path)
        with self.torch_arithmetic():
            return self.torch_forward(*tokens.shape, lambda: paths.torch_logits(self.model, tokens, positions, cache))

    def torch_arithmetic(self) -> AbstractContextManager:
        """How PyTorch phases compute: for an int8 model the native forward reads, as it does
        (fp32 activations, `quantize.fp32_activations`), so no row depends on the path taken."""
        return fp32_activations() if self.weights == "int8" else nullcontext()


def _at_threads(threads: int | None, run: Callable[[], Tensor]) -> Tensor:
    """`run()` with torch's intra-op thread count set to `threads` (None: as it is). The count
    is the process's: torch work in another thread meanwhile runs with it too."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        return run()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def cache_slots(widths: list[int], context: int, max_new_tokens: int, compiled: bool) -> int:
    """The KV cache slots per row of a run whose rows start with windows of `widths` tokens."""
    longest = max(widths)
    needed = longest + max_new_tokens - 1  # the last sampled token is never fed back
    cap = context + longest - min(widths)  # every row can reach its context end
    slots = max(1, min(needed, cap))
    if compiled:  # a few fixed cache sizes, so a new prompt length rarely means a new graph
        slots = max(64, 1 << (slots - 1).bit_length())
    return slots


class _Run:
    """The token loop of one `generate`/`stream` call: prefill, then decode steps."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.model, cfg = engine.model, engine.config
        self.context = cfg.context_length
        self.seqs = [list(p) for p in prompts for _ in range(params.num_samples)]  # prompt + generated, per row
        self.n_rows = len(self.seqs)
        self.generated = [0] * self.n_rows
        self.done = [False] * self.n_rows
        self.slide_keep = max(1, int(self.context * SLIDE_KEEP))
        # A window keeps the prefix its tokenizer starts a prompt with (an imported Llama's BOS):
        # the model never saw a text without it.
        prefix = list(getattr(engine.tokenizer, "prompt_prefix", None) or [])
        self.kept = [len(prefix) if prefix and s[:len(prefix)] == prefix and len(prefix) < self.slide_keep else 0
                     for s in self.seqs]
        # where each row's window (what its cache holds) resumes in its sequence after the kept
        # prefix: a prompt longer than the context starts sliding at once
        self.starts = [0 if len(s) <= self.context else self._slid_start(row) for row, s in enumerate(self.seqs)]
        max_len = cache_slots([len(self._window(row)) for row in range(self.n_rows)], self.context,
                              params.max_new_tokens, engine.compile)
        self.cache = KVCache(cfg, self.n_rows, max_len, dtype=engine.kv_dtype, device=engine.device,
                             static=engine.compile)
        self.rows = list(range(self.n_rows))  # batch position -> row
        self.warm = False  # a decode step ran in this run (compiled mode: its guards passed)
        plan = engine.plan()
        self.native = engine.native_decoder() if any(p.kind == "native" for p in plan.values()) else None
        # One row decoding natively: steps through a RowStep, greedy picks straight from its logits.
        one_row = self.n_rows == 1 and plan["decode"].kind == "native" and engine.device.type == "cpu"
        self.row_step = native_forward.RowStep(self.native, self.cache) if one_row else None
        self.pick_greedy = self.row_step is not None and params.greedy and params.repetition_penalty == 1.0 \
            and params.logprobs is None
        # A generator per row (sample i of a prompt: seed + i * stride), as the server's
        # scheduler has: a seeded prompt gets the same text alone, in a batch or served.
        self.generators = None if params.greedy else [
            make_generator(sample_seed(params.seed, row % params.num_samples), engine.device)
            for row in range(self.n_rows)]
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(self.n_rows, cfg.vocab_size, dtype=torch.bool, device=engine.device)
            for row, seq in enumerate(self.seqs):
                self.seen[row, seq] = True

    def finish(self, row: int) -> None:
        """Stop a row from outside (a stop string was found in its text)."""
        self.done[row] = True

    def events(self) -> Iterator[_TokenEvent]:
        logits = self._prefill()
        while True:
            if self.pick_greedy:
                values = self.row_step.values if logits is self.row_step.logits else logits.numpy()
                sampled, next_tokens = None, [greedy_index(values)]
            else:
                sampled = self._sample(logits)  # (B,)
                next_tokens = sampled.tolist()
            logprobs = None if self.params.logprobs is None else \
                token_logprobs(logits, next_tokens, self.params.logprobs)  # (B, V) logits: not pick_greedy
            for i, row in enumerate(self.rows):
                if self.done[row]:
                    continue
                token = next_tokens[i]
                self.seqs[row].append(token)
                self.generated[row] += 1
                reason = self._finish_reason(row, token)
                if reason is not None:
                    self.done[row] = True
                yield _TokenEvent(row, token, reason, None if logprobs is None else logprobs[i])
            if all(self.done[row] for row in self.rows):
                return
            if self._needs_slide():
                self._slide()
                logits = self._prefill()
            elif self.row_step is not None:
                logits = self._step_one_row(next_tokens[0])
            else:
                kept = self._drop_finished_rows()
                # Feed the sampled tensor back as is (no per-step list -> tensor copy). A
                # finished row riding along gets a token it will never use; rows do not
                # attend to each other, so it changes nothing for the others.
                logits = self._step(sampled if kept is None else sampled[kept])

    def _finish_reason(self, row: int, token: int) -> str | None:
        return self.engine.finish_reason(token, self.params, self.generated[row], len(self.seqs[row]))

    def _sample(self, logits: Float[Tensor, "B V"]) -> Int[Tensor, "B"]:
        seen = self.seen[self.rows] if self.seen is not None else None
        if self.generators is None:  # greedy: one argmax for the batch
            tokens = sample_next(logits, self.params, None, seen)
        else:
            tokens = torch.cat([sample_next(logits[i:i + 1], self.params, self.generators[row],
                                            None if seen is None else seen[i:i + 1])
                                for i, row in enumerate(self.rows)])
        if self.seen is not None:
            self.seen[self.rows, tokens] = True
        return tokens

    # ---- model calls --------------------------------------------------------------------------
    def _window(self, row: int) -> list[int]:
        """What of a row's sequence goes into the cache: all of it, or after a slide its kept
        prefix and its last part."""
        seq, start = self.seqs[row], self.starts[row]
        return seq if start == 0 else seq[:self.kept[row]] + seq[start:]

    def _slid_start(self, row: int, keep: int | None = None) -> int:
        """Where a window of `keep` tokens (default `slide_keep`), kept prefix included, resumes."""
        return len(self.seqs[row]) - (self.slide_keep if keep is None else keep) + self.kept[row]

    def _over_context(self, row: int) -> bool:
        """The row's newest token has no position left in its window."""
        start = self.starts[row]
        return len(self.seqs[row]) - start + (self.kept[row] if start else 0) > self.context

    def _slide(self) -> None:
        """New windows for a prefill past the context: a row that reached it keeps its last
        `slide_keep` tokens (as it would alone), a finished row its last token, and every
        other row the window it has."""
        for row in self.rows:
            if self.done[row]:
                self.starts[row] = self._slid_start(row, keep=self.kept[row] + 1)
            elif self._over_context(row):
                self.starts[row] = self._slid_start(row)

    @torch.inference_mode()
    def _prefill(self) -> Float[Tensor, "B V"]:
        """Run every row's window into the emptied cache."""
        seqs = [self._window(row) for row in self.rows]
        lengths = torch.tensor([len(s) for s in seqs], device=self.engine.device)
        width = int(lengths.max())
        ids = torch.full((len(seqs), width), self.engine.config.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
        ids = ids.to(self.engine.device)
        pad = (width - lengths)[:, None]  # (B, 1)
        slots = torch.arange(width, device=self.engine.device)[None, :]  # (1, T)
        self.cache.reset()
        self.cache.begin(width, valid=slots >= pad)
        positions = (slots - pad).clamp(min=0)  # (B, T); padding sits at 0 and is masked anyway
        self.positions = lengths[:, None].clone()  # (B, 1): where each row's next token goes
        self.position_values = self.positions.numpy() if self.positions.device.type == "cpu" else None  # (a view)
        return self.engine.forward(ids, positions, self.cache, self.native)  # (B, V)

    @torch.inference_mode()
    def _step(self, last_tokens: Int[Tensor, " B"]) -> Float[Tensor, "B V"]:
        tokens = last_tokens[:, None]  # (B, 1)
        self.cache.begin(1)
        if len(self.rows) > 1:  # finished rows ride along until dropped: keep their positions in range
            self.positions.clamp_(max=self.context - 1)
        path = self.engine.path(len(self.rows), 1)
        if path.kind == "native":
            logits = self.engine.native_forward(self.native, tokens, self.positions, self.cache, path)
        elif path.kind == "torch":
            logits = self.engine.torch_forward(len(self.rows), 1,
                                               lambda: decode_logits(self.model, tokens, self.positions, self.cache))
        elif self.warm:
            # Same model, cache tensors and shapes as the previous step of this run: the
            # graph chosen then is still right, so skip re-checking its guards (~0.3 ms).
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True), eval_mode(self.model):
                logits = self.engine._decode(self.model, tokens, self.positions, self.cache)
        else:
            # Freezing is read while dynamo traces (weights become constants of the graph),
            # so it is set around the call rather than passed in torch.compile's options.
            shape = (len(self.rows), self.cache.max_len)
            if shape not in self.engine._warmed_shapes:  # (a new shape compiles: seconds to minutes, said)
                self.engine._warmed_shapes.add(shape)
                print(f"torch.compile warm-up of the decode step ({shape[0]} row{'s' * (shape[0] != 1)}, "
                      f"{shape[1]} cache slots)...", file=sys.stderr, flush=True)
            with torch._inductor.config.patch(freezing=True), eval_mode(self.model):
                logits = self.engine._decode(self.model, tokens, self.positions, self.cache)
            self.warm = True
        self.positions += 1
        return logits.float()

    def _step_one_row(self, token: int) -> Float[Tensor, "1 V"]:
        """`_step` for a batch of one on the native forward, with no tensor made or torch op run."""
        slot = self.cache.length
        self.cache.begin(1)
        position = int(self.position_values[0, 0])
        logits = self.engine.row_step(self.row_step, token, position, slot)
        self.position_values[0, 0] = position + 1
        return logits

    def _needs_slide(self) -> bool:
        if self.engine.overflow != "slide":
            return False
        return self.cache.free < 1 or any(self._over_context(row) for row in self.rows if not self.done[row])

    def _drop_finished_rows(self) -> Tensor | None:
        """Remove finished rows from the batch once they are half of it (eager mode only).

        Returns the batch positions kept, or None when the batch is unchanged.
        """
        if self.engine.compile or len(self.rows) == 1:
            return None
        keep = [i for i, row in enumerate(self.rows) if not self.done[row]]
        if len(keep) > len(self.rows) // 2:
            return None
        index = torch.tensor(keep, device=self.engine.device)
        self.cache.select_rows(index)
        self.positions = self.positions[index]
        self.rows = [self.rows[i] for i in keep]
        return index


def _is_token_id(value: Any) -> bool:
    """A Python or numpy integer, or a 0-d integer tensor (a bool is not a token id)."""
    if isinstance(value, Tensor):
        return value.ndim == 0 and _integer_dtype(value)
    return is_integer(value)


def _integer_dtype(array: Tensor | np.ndarray) -> bool:
    if isinstance(array, Tensor):
        return is_id_tensor(array)
    return np.issubdtype(array.dtype, np.integer)


def _is_one_prompt(prompts: Any) -> bool:
    """Whether `generate`'s argument is one prompt rather than a list of them."""
    if isinstance(prompts, (str, bytes, bytearray, memoryview)):
        return True
    if isinstance(prompts, (Tensor, np.ndarray)):
        return prompts.ndim <= 1
    first = prompts[0] if isinstance(prompts, Sequence) and len(prompts) > 0 else None
    return isinstance(first, (Number, np.bool_)) or (isinstance(first, Tensor) and first.ndim == 0)


def _one_prompt(prompt: Any) -> str | list[int]:
    """A prompt as text or as a list of Python ints; anything else is a one-line FrawdError."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise FrawdError("a prompt is text (str) or token ids, not bytes: decode it first, "
                         "e.g. prompt.decode('utf-8')")
    if isinstance(prompt, (Tensor, np.ndarray)):
        if prompt.ndim != 1 or not _integer_dtype(prompt):
            raise FrawdError(f"a prompt given as a tensor or array must hold 1-D integer token ids; "
                             f"got shape {tuple(prompt.shape)}, dtype {prompt.dtype}")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise FrawdError(f"a prompt is text (str) or a sequence of token ids; got {type(prompt).__name__}")
    for i in prompt:
        if not _is_token_id(i):
            raise FrawdError(f"prompt token ids must be integers; got {i!r}")
    return [int(i) for i in prompt]


def decode_logits(
    model: nn.Module, tokens: Int[Tensor, "B 1"], positions: Int[Tensor, "B 1"], cache: KVCache | RowKVCache
) -> Float[Tensor, "B V"]:
    """One decode step: each row's newest token in, next-token logits out (in eval mode)."""
    with eval_mode(model):
        return _decode_step(model, tokens, positions, cache)


def _decode_step(model, tokens, positions, cache):  # what torch.compile traces (no run-time type checks)
    hidden = model.hidden_states(tokens, positions, cache)  # (B, 1, D)
    return model.lm_head(hidden[:, -1])  # (B, V)


def _own_decode_step():
    """`_decode_step` with a code object of its own, for one Engine.

    Dynamo keeps compiled graphs per code object, and a frozen graph holds the weights it
    was traced with; with a shared code object, a new Engine over weights changed in place
    would pass the old graph's guards (same Parameter objects) and decode with stale weights.
    """
    return types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, "_decode_step")


__all__ = ["Engine", "Completion", "StreamChunk", "decode_logits", "cache_slots", "OVERFLOW_MODES"]
