"""Continuous batching: requests join a running batch at any step and leave the moment they finish.

    scheduler = Scheduler(engine, max_batch=32)
    handle = scheduler.submit(prompt_ids, SamplingParams(max_new_tokens=50))
    for chunk in handle:            # StreamChunk: index = sample, text, token, finish_reason
        print(chunk.text, end="")
    scheduler.close()

`Engine.generate` runs a batch that starts together and ends when its last row does; a
server's requests arrive at any time. Here one thread runs a loop of steps:

1. rows of cancelled requests leave (a client that went away frees its row);
2. waiting requests join while rows are free: each prompt is prefilled alone, exactly as
   `Engine.generate` prefills one prompt (its first token comes from that), and its
   keys and values are written straight into a free row of the batch cache (`RowKVCache`,
   one length per row; n samples share one prefill, copied to their rows). Prompts are
   prefilled until a step's `prefill_tokens` are spent (the prompt that crosses it
   included: a prompt longer than the budget still gets its turn), so a burst of long
   prompts does not stall the decoding rows;
3. one decode step for every row: each row feeds its newest token at its own position,
   and gets its next token from `sampling.sample_next` with its own parameters, random
   generator and repetition history. A finished row leaves at once (the last row moves
   into its place, keeping the batch dense).

A row's arithmetic barely depends on which other rows share the step: `native.c` sums
each row of a product in the same order whatever the row count (but on AMX tiles, which a
batch of enough rows takes: another order, the last bits of the logits differ), and a row
attends only its own slots. So greedy output equals `Engine.generate`'s token for token
(when both run the native forward; PyTorch's batched products may round differently).

`submit` raises `QueueFull` when `max_queue` requests already wait for a row, `Closed` once
`close()` was called; `close(drain=True)` finishes what was accepted first, `drain=False`
ends every open request with an error (one being prefilled too). A cancelled request's
reader gets `Cancelled` (a listener hears nothing more); a listener that raises fails its
own request alone; a request's chunks are read once. The thread holds the scheduler only
while there is work, so a scheduler dropped without `close()` is collected once idle and
its thread ends.
The HTTP server (`frawdllm.serve`) is a thin layer over this.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from ..config import is_integer
from ..errors import ConfigError, FrawdError
from .cache import RowKVCache
from .engine import Engine, StreamChunk
from .sampling import SamplingParams, greedy_choice, make_generator, sample_next, sample_seed, token_logprobs
from .textstream import TextStream

# The longest an idle scheduler thread sleeps before it looks again whether its scheduler was
# dropped (the scheduler's finalizer wakes it at once; see `_run` for when it cannot).
_IDLE_RECHECK_S = 1.0
_EXIT_JOIN_S = 10.0  # how long exit waits for a scheduler thread to leave its step


class QueueFull(FrawdError):
    """More requests are waiting than the scheduler accepts."""


class Closed(FrawdError):
    """The scheduler was closed: it takes no more requests."""


class Cancelled(FrawdError):
    """The request was cancelled before it finished (raised to a reader iterating it)."""


class Request:
    """One submitted prompt: its chunks arrive through `listener` (or iterate the handle)."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams,
                 listener: Callable[[StreamChunk | BaseException], None] | None) -> None:
        self.id = next(Request._ids)
        self.prompt, self.params = prompt, params
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_samples = 0
        self._listener_failed = False
        self._read = False  # iterated to the end once
        self._queue: queue.SimpleQueue | None = None
        if listener is not None and not callable(listener):
            raise FrawdError(f"listener must be callable (it gets each chunk), got {type(listener).__name__}")
        if listener is None:
            self._queue = queue.SimpleQueue()
            listener = self._queue.put
        self.listener = listener

    def cancel(self) -> None:
        """Stop generating for this request (its rows leave at the next step). A reader
        iterating it gets the chunks already delivered, then `Cancelled`; a listener gets
        nothing more."""
        self.cancelled = True
        if self._queue is not None:  # the scheduler drops the rows silently: wake the reader
            self._queue.put(Cancelled(f"request {self.id} was cancelled"))

    def _deliver(self, item: StreamChunk | BaseException) -> None:
        """Hand `item` to the listener. A listener that raises fails this request alone: it is
        cancelled, gets its error, and hears nothing more; the other requests go on."""
        if self._listener_failed:
            return
        try:
            self.listener(item)
        except Exception as error:
            self._listener_failed = True
            self.cancelled = True
            with contextlib.suppress(Exception):  # (failing on its own error: no one is left to tell)
                self.listener(error)

    @property
    def done(self) -> bool:
        return self.finished_samples >= self.params.num_samples

    def __iter__(self) -> Iterator[StreamChunk]:
        """The chunks of every sample until all are finished (only without a listener)."""
        if self._queue is None:
            raise TypeError("this request delivers to its listener")
        if self._read:  # (its chunks are gone: waiting for more would never end)
            raise FrawdError(f"request {self.id} was read to its end already; its chunks come once")
        finished = 0
        while finished < self.params.num_samples:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            finished += item.finish_reason is not None
            yield item
        self._read = True


@dataclass
class _Row:
    request: Request
    sample: int
    tokens: list[int]  # prompt + generated
    stream: TextStream
    generator: torch.Generator | None
    seen: Tensor | None  # (V,) bool: tokens in the sequence (repetition penalty)
    generated: int = 0
    last: int = 0  # newest token, fed at the next step


class Scheduler:
    """Continuous batching over one `Engine`, on a thread of its own."""

    def __init__(self, engine: Engine, *, max_batch: int = 32, max_queue: int = 256,
                 prefill_tokens: int = 512) -> None:
        if not isinstance(engine, Engine):
            raise FrawdError(f"Scheduler batches the requests of an Engine; got {type(engine).__name__}")
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_tokens", prefill_tokens)):
            if not is_integer(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if engine.overflow != "stop":
            raise FrawdError("continuous batching needs an engine with overflow='stop'")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.prefill_tokens = prefill_tokens
        self._decoder = None  # the engine's native decoder, as of the latest admitted request
        cfg = engine.config
        self.cache = RowKVCache(cfg, max_batch, cfg.context_length, dtype=engine.kv_dtype, device=engine.device)
        self.rows: list[_Row] = []  # batch position -> row
        self.waiting: deque[Request] = deque()
        self.generated_tokens = 0  # since start, all requests
        self._cond = threading.Condition()
        self._closing = False
        self._admitting: Request | None = None  # popped from `waiting`, being prefilled
        self._pin = _Pin()  # the thread reaches the scheduler only through this (see _Pin)
        weakref.finalize(self, _dropped, self._pin, self._cond)
        self._thread = threading.Thread(target=_run, args=(self._pin, self._cond), name="frawd-scheduler",
                                        daemon=True)
        self._thread.start()
        _open.add(self)

    # ---- the outside ---------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               listener: Callable[[StreamChunk | BaseException], None] | None = None) -> Request:
        """Queue a prompt (text or ids). Chunks go to `listener(chunk)` from the scheduler's
        thread (it must not block), or, without one, iterate the returned request."""
        params = self.engine.checked_params(params)
        ids = self.engine.encode(prompt)
        if params.num_samples > self.max_batch:
            raise FrawdError(f"n = {params.num_samples} samples do not fit a batch of {self.max_batch}")
        request = Request(ids, params, listener)
        with self._cond:
            if self._closing:
                raise Closed("the scheduler is closed (shutting down): it takes no more requests")
            left = self._left_waiting(request)
            if left > self.max_queue:
                raise QueueFull(f"{left - 1} requests are already waiting for a row (the queue's limit)")
            self.waiting.append(request)
            self._pin.scheduler = self
            self._cond.notify()
        return request

    def _left_waiting(self, new: Request) -> int:
        """How many of the queued requests and `new` the next step finds no free row for: the
        queue `max_queue` limits (counting every queued request turned a burst away from an
        idle server with free rows: 2 requests at --max-queue 1 got a 429)."""
        free, left = self.max_batch - len(self.rows), 0
        for request in (*self.waiting, new):
            free -= request.params.num_samples
            left += free < 0
        return left

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.rows)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the loop: after every accepted request finished (drain), or at the next
        step (open requests are cancelled and told so with a FrawdError)."""
        with self._cond:
            self._closing = True
            if not drain:
                admitting = [self._admitting] if self._admitting is not None else []  # (in no list while prefilled)
                for request in [*self.waiting, *admitting, *{id(r.request): r.request for r in self.rows}.values()]:
                    request.cancelled = True  # (not cancel(): the reader learns why from this error)
                    request._deliver(FrawdError("the scheduler was closed"))
            self._pin.scheduler = self
            self._cond.notify()
        self._thread.join(timeout)
        _open.discard(self)

    # ---- the loop (run by `_run` on the scheduler's thread) -------------------------------------
    def _step(self) -> None:
        try:
            with torch.inference_mode():  # (entered once a step, not around each forward)
                self._drop_cancelled()
                self._admit()
                if self.rows:
                    self._decode()
        except Exception as error:  # never leave a client waiting forever
            self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            requests = {id(r.request): r.request for r in self.rows} | {id(r): r for r in self.waiting}
            self.waiting.clear()
        self.rows.clear()
        self.cache.rows = 0
        for request in requests.values():
            request._deliver(error)

    def _drop_cancelled(self) -> None:
        for i in reversed(range(len(self.rows))):
            if self.rows[i].request.cancelled:
                self._remove(i)
        with self._cond:
            kept = [r for r in self.waiting if not r.cancelled]
            if len(kept) != len(self.waiting):
                self.waiting = deque(kept)

    def _remove(self, i: int) -> None:
        """Row i leaves; the last row takes its place."""
        last = len(self.rows) - 1
        if i != last:
            self.cache.move(i, last)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.rows = len(self.rows)

    def _admit(self) -> None:
        budget = self.prefill_tokens
        while budget > 0:
            with self._cond:
                if not self.waiting or self.waiting[0].params.num_samples > self.max_batch - len(self.rows):
                    return
                request = self._admitting = self.waiting.popleft()
            budget -= len(request.prompt)
            try:
                self._prefill(request)
            except Exception as error:  # popped, so in no queue _fail_all sees: it alone fails
                for i in reversed(range(len(self.rows))):
                    if self.rows[i].request is request:
                        self._remove(i)
                request._deliver(error)
            finally:
                with self._cond:
                    self._admitting = None

    def _prefill(self, request: Request) -> None:
        engine, ids, params = self.engine, request.prompt, request.params
        first = len(self.rows)
        cache = self.cache.row_view(first)  # the prefill writes the new row in place
        cache.begin(len(ids))
        tokens = torch.tensor([ids], dtype=torch.long, device=engine.device)
        positions = torch.arange(len(ids), device=engine.device)[None, :]
        # The native decoder, checked against the model once per request here (not per step).
        self._decoder = engine.native_decoder() if engine.native else None
        logits = engine.forward(tokens, positions, cache, self._decoder)  # (1, V)
        self.cache.set_length(first, len(ids))
        for sample in range(params.num_samples):
            seed = sample_seed(params.seed, sample)
            seen = None
            if params.repetition_penalty != 1.0:
                seen = torch.zeros(engine.config.vocab_size, dtype=torch.bool, device=engine.device)
                seen[ids] = True
            row = _Row(request, sample, list(ids), TextStream(engine.tokenizer, params.stop, ids),
                       None if params.greedy else make_generator(seed, engine.device), seen)
            if sample:
                self.cache.move(len(self.rows), first)  # n samples: copies of the prompt's row
            self.rows.append(row)
        self.cache.rows = len(self.rows)
        self._emit(list(range(first, len(self.rows))), logits.expand(params.num_samples, -1))

    def _decode(self) -> None:
        batch = len(self.rows)
        tokens = torch.tensor([[r.last] for r in self.rows], dtype=torch.long, device=self.engine.device)
        positions = self.cache.lengths[:batch, None].clone()  # (B, 1): no padding, position = slot
        self.cache.begin(1)
        logits = self.engine.forward(tokens, positions.to(self.engine.device), self.cache, self._decoder)
        self._emit(list(range(batch)), logits)

    def _emit(self, batch_rows: list[int], logits: Float[Tensor, "B V"]) -> None:
        """Sample each row's next token, hand out its text, and remove finished rows."""
        engine = self.engine
        chosen = self._sample([self.rows[i] for i in batch_rows], logits)
        finished, chunks = [], []
        now = time.perf_counter()
        for j, (i, token) in enumerate(zip(batch_rows, chosen)):
            row = self.rows[i]
            request, params = row.request, row.request.params
            row.tokens.append(token)
            row.generated += 1
            row.last = token
            if row.seen is not None:
                row.seen[token] = True
            self.generated_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = now
            reason = engine.finish_reason(token, params, row.generated, len(row.tokens))
            text, reason = engine.push_text(row.stream, token, reason, params)
            if reason is not None:
                finished.append(i)
                request.finished_samples += 1
            logprob = None if params.logprobs is None else \
                engine.reported_logprob(token_logprobs(logits[j:j + 1], [token], params.logprobs)[0], reason, params)
            chunks.append((request, StreamChunk(row.sample, text, token, reason, logprob)))
        # finished rows leave before their last chunks are handed out: a caller told a request
        # ended found its row still taken (a burst it then sent got a 429 at --max-queue 1)
        for i in sorted(finished, reverse=True):
            self._remove(i)
        for request, chunk in chunks:
            if not request.cancelled:  # (cancelled since the step began: it hears nothing more)
                request._deliver(chunk)

    def _sample(self, rows: list[_Row], logits: Float[Tensor, "B V"]) -> list[int]:
        """The one sampler, per row (each has its own parameters and generator); plain
        greedy rows share one argmax."""
        out: list[int | None] = [None] * len(rows)
        plain = [i for i, r in enumerate(rows) if r.request.params.greedy and r.seen is None]
        if plain:
            picked = logits if len(plain) == len(rows) else logits[plain]  # (no copy when all are plain)
            for i, token in zip(plain, greedy_choice(picked).tolist()):
                out[i] = token
        for i, row in enumerate(rows):
            if out[i] is None:
                seen = row.seen[None, :] if row.seen is not None else None
                out[i] = int(sample_next(logits[i:i + 1], row.request.params, row.generator, seen)[0])
        return out  # type: ignore[return-value]


@dataclass
class _Pin:
    """What the scheduler's thread holds: the scheduler, only while it may have work (set by
    `submit` and `close`, cleared by the thread once idle), so that accepted requests finish
    even when nobody else holds the scheduler, and an idle one nobody holds is collected."""
    scheduler: Scheduler | None = None
    dropped: bool = False  # set by the scheduler's finalizer


def _run(pin: _Pin, cond: threading.Condition) -> None:
    """The scheduler's thread: steps while there is work; ends on close() or once the
    scheduler was dropped and collected."""
    while True:
        with cond:
            while pin.scheduler is None:
                if pin.dropped:
                    return
                # (the timeout: a collection on this thread as it starts waiting would notify no one)
                cond.wait(_IDLE_RECHECK_S)
            scheduler = pin.scheduler
            if not scheduler.waiting and not scheduler.rows:
                pin.scheduler = None
                if scheduler._closing:
                    return
                del scheduler  # (when that was the last reference, `dropped` is set now)
                continue
        scheduler._step()


_open: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()  # schedulers not closed yet


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit, close the schedulers their users left open (cancelling what they
    still run): a scheduler's thread, left running while Python finalised, aborted the
    process ("terminate called without an active exception", exit status 134)."""
    for scheduler in list(_open):
        scheduler.close(drain=False, timeout=_EXIT_JOIN_S)


def _dropped(pin: _Pin, cond: threading.Condition) -> None:
    with cond:
        pin.dropped = True
        cond.notify()


__all__ = ["Scheduler", "Request", "QueueFull", "Closed", "Cancelled"]
