"""Scheduler chunks into OpenAI's reply bodies: text as it becomes whole characters,
stop strings, `finish_reason`, `usage`, logprobs in chat's and completions' forms, and the
server-sent events of a stream (`_Reply`)."""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..infer.engine import StreamChunk
from ..infer.sampling import TokenLogprob
from ..infer.scheduler import Request as Job
from ..infer.textstream import open_character_tail
from .errors import ApiError, _ClientGone, _disconnect


def _piece(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """A token's text (its bytes decoded, U+FFFD for part of a character) and bytes."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


class _TextOffsets:
    """Where each token of a stream starts in its decoded text, in characters (what
    `text_offset` counts): its bytes run through one incremental UTF-8 decoder, so a token
    that ends or starts inside a character ("é" as two byte-level tokens) does not count
    a U+FFFD of its own. A special token is no text (a reply's decoding skips it), or, with
    `specials_shown` (an echoed prompt's decoding), its name, which ends a character cut
    short. `context`: the prompt's ids; where they end inside a character, the reply's text
    (`TextStream`) starts after it, and so do the offsets."""

    def __init__(self, tokenizer: Any, start: int = 0, context: Sequence[int] = (),
                 specials_shown: bool = False) -> None:
        self.tokenizer, self.chars, self.specials_shown = tokenizer, start, specials_shown
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tail = open_character_tail(tokenizer, context)
        self._decoder.decode(b"".join(tokenizer.token_bytes(t) for t in tail if t not in tokenizer.special_ids))
        self._prompt_char = bool(self._decoder.getstate()[0])  # the next character decoded is the prompt's

    def span(self, token: int) -> tuple[int, int]:
        """(where the token's text starts, where the text decoded so far ends) after it."""
        start = self.chars  # (inside a character: where that character starts)
        if token not in self.tokenizer.special_ids:
            text = self._decoder.decode(self.tokenizer.token_bytes(token))
            if self._prompt_char and text:
                text, self._prompt_char = text[1:], False
            self.chars += len(text)
        elif self.specials_shown:
            self.chars += len(self._decoder.decode(b"", final=True))  # a character cut short: U+FFFD
            self._decoder.reset()
            start = self.chars
            self.chars += len(self.tokenizer.token_bytes(token).decode("utf-8", errors="replace"))
        return start, self.chars


def _prompt_scored(tokenizer: Any, ids: list[int], logprobs: list[TokenLogprob | None], hidden: int = 0
                   ) -> list[tuple[int, TokenLogprob | None, int]]:
    """An echoed prompt's (token, logprob, where its text starts) triples. The echo of
    token ids is their decoding, special tokens' names included, so a special token counts
    its name's characters here; `hidden`: the leading ids the echo does not show (the BOS a
    text prompt's template adds), each at 0."""
    offsets = _TextOffsets(tokenizer, specials_shown=True)
    return [(token, entry, 0 if i < hidden else offsets.span(token)[0])
            for i, (token, entry) in enumerate(zip(ids, logprobs))]


def _completion_token(tokenizer: Any, token: int) -> str:
    """A token's name in the completions API: its text, or, for bytes that are not whole
    UTF-8 (part of a character), "bytes:\\xe6\\x97" as OpenAI's completions write them, so
    that each key of a position's top_logprobs names one token (as U+FFFD, every partial
    token had the same key: later ones overwrote the earlier, the chosen one's too)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _completion_logprobs(tokenizer: Any, scored: list[tuple[int, TokenLogprob | None, int]]) -> dict:
    """The completions API's logprobs object (tokens, token_logprobs, top_logprobs,
    text_offset) for (token, logprob or None, where its text starts) triples."""
    tokens = [_completion_token(tokenizer, token) for token, _, _ in scored]
    tops = []
    for (token, entry, _), name in zip(scored, tokens):
        if entry is None:
            tops.append(None)
            continue
        # the k likeliest, and the sampled token's own where it is not among them (up to k + 1,
        # as OpenAI's and vLLM's completions give them); two tokens of one name (an added
        # token spelling a vocabulary token's bytes) keep the likelier's value, or the chosen one's
        top = {}
        for t, lp in entry.top:
            top.setdefault(_completion_token(tokenizer, t), lp)
        top[name] = entry.logprob
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for _, e, _ in scored],
            "top_logprobs": tops, "text_offset": [start for _, _, start in scored]}


def _json_by_choice(body: dict) -> Response:
    """A reply with logprobs, built on a worker thread: with echo it can take megabytes (11 MB
    for 32 prompts of 250 tokens, n=8, logprobs=5), and built and serialised on the event loop
    it stalled every stream and /health for ~0.7 s. Its choices are serialised one at a time:
    json.dumps holds the GIL, and so the event loop, for the whole of one call (~0.3 s there)."""
    dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    head = dumps({key: value for key, value in body.items() if key != "choices"})
    text = head[:-1] + ',"choices":[' + ",".join(map(dumps, body["choices"])) + "]}"
    return Response(text.encode(), media_type="application/json")


class _Reply:
    """One request's answer being put together from the chunks of its jobs (one per prompt)."""

    def __init__(self, body: Any, jobs: list[Job], chunks: asyncio.Queue, chat: bool, prompt_tokens: int,
                 created: int, echoes: list[str], tokenizer: Any = None,
                 prompt_logprobs: list[tuple[list[int], list[TokenLogprob | None], int]] | None = None) -> None:
        self.body, self.jobs, self.chunks, self.chat = body, jobs, chunks, chat
        self.prompt_tokens, self.created = prompt_tokens, created
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.n = jobs[0].params.num_samples  # completions per prompt
        total = self.n * len(jobs)
        self.echoes = [echoes[i // self.n] for i in range(total)]  # completions: the prompt, with echo
        self.texts, self.reasons, self.counts = [""] * total, [None] * total, [0] * total
        self.tokenizer = tokenizer
        self.wants_logprobs = jobs[0].params.logprobs is not None
        # Each choice's logprob entries not yet in an event, with where their text starts and
        # ends (in the choice's text, echo included). An entry goes out with the event whose
        # text reaches its start; one whose text never comes (a stop string cut it) is dropped.
        self._unsent: list[list[tuple[TokenLogprob, int, int]]] = [[] for _ in range(total)]
        self._offsets = [_TextOffsets(tokenizer, len(echo), jobs[i // self.n].prompt)
                         for i, echo in enumerate(self.echoes)] if self.wants_logprobs else []
        # echo with logprobs: each prompt's (ids, logprobs), reported before its choices' tokens
        self.prompt_logprobs = prompt_logprobs
        self._prompt_sent = [prompt_logprobs is None] * total
        self.log: dict = {}
        self._head: str | None = None
        self._no_usage = ""

    @property
    def submitted(self) -> float:
        return self.jobs[0].submitted

    @property
    def first_token_at(self) -> float | None:
        firsts = [job.first_token_at for job in self.jobs if job.first_token_at is not None]
        return min(firsts) if firsts else None

    @property
    def completion_tokens(self) -> int:
        return sum(self.counts)

    @property
    def finish_reasons(self) -> list:
        return list(self.reasons)

    @property
    def ttft_ms(self) -> float | None:
        first = self.first_token_at
        return None if first is None else round(1000 * (first - self.submitted), 1)

    def _take(self, item: StreamChunk | BaseException) -> StreamChunk:
        if isinstance(item, _ClientGone):
            raise item
        if isinstance(item, BaseException):
            raise ApiError(503, f"generation failed: {item}")
        self.counts[item.index] += item.token is not None
        self.texts[item.index] += item.text
        if item.logprob is not None:
            self._unsent[item.index].append((item.logprob, *self._offsets[item.index].span(item.logprob.token)))
        if item.finish_reason is not None:
            self.reasons[item.index] = item.finish_reason
        return item

    async def _next(self) -> StreamChunk:
        return self._take(await self.chunks.get())

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def whole(self) -> JSONResponse:
        while None in self.reasons:  # (every sample's last chunk taken)
            await self._next()
        if self.wants_logprobs:  # (megabytes with echo: see _json_by_choice)
            return await asyncio.to_thread(lambda: _json_by_choice(self._whole()))
        return JSONResponse(self._whole())

    def _whole(self) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": self._new_logprobs(i), "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(self.texts, self.reasons))]
        else:
            choices = [{"index": i, "text": echo + text, "logprobs": self._new_logprobs(i), "finish_reason": reason}
                       for i, (echo, text, reason) in enumerate(zip(self.echoes, self.texts, self.reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "system_fingerprint": None,
                "choices": choices, "usage": self._usage()}

    def _new_logprobs(self, index: int) -> dict | None:
        """choices[index].logprobs for the tokens not yet sent whose text has begun in the
        choice's text so far (all of them, unstreamed), in OpenAI's form: chat's `content`
        list (token, logprob, bytes, top_logprobs) or the completions' parallel lists (tokens,
        token_logprobs, top_logprobs, text_offset). A token's text: in chat its bytes decoded
        (U+FFFD for part of a character); in completions `_completion_token`'s name
        (`bytes:\\xNN` for part of a character). Once the choice has finished, the tokens whose text
        never came (a stop string's: it is cut from the text) are dropped."""
        if not self.wants_logprobs:
            return None
        shown = len(self.echoes[index]) + len(self.texts[index])  # characters of the choice's text so far
        unsent = self._unsent[index]
        ready = 0
        while ready < len(unsent) and (unsent[ready][1] < shown or unsent[ready][2] <= shown):
            ready += 1  # (a token of no text counts as shown where the text reaches it)
        entries = [entry for entry, _, _ in unsent[:ready]]
        starts = [start for _, start, _ in unsent[:ready]]
        self._unsent[index] = [] if self.reasons[index] is not None else unsent[ready:]

        if self.chat:
            content = []
            for entry in entries:
                text, raw = _piece(self.tokenizer, entry.token)
                top = [{"token": t, "logprob": lp, "bytes": b} for (t, b), lp in
                       ((_piece(self.tokenizer, token), lp) for token, lp in entry.top)]
                content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        scored = [(entry.token, entry, start) for entry, start in zip(entries, starts)]
        if not self._prompt_sent[index]:  # echo: the prompt's tokens first (the first has no logprob)
            self._prompt_sent[index] = True
            ids, prompt, hidden = self.prompt_logprobs[index // self.n]
            scored = _prompt_scored(self.tokenizer, ids, prompt, hidden) + scored
        return _completion_logprobs(self.tokenizer, scored)

    def _token_choices(self, index: int, text: str) -> str:
        """json.dumps of a token event's choices, [{"index", "delta": {"content"} or "text",
        "logprobs": null, "finish_reason": null}], written without building the dicts: it
        runs once per token per client (tested equal to json.dumps)."""
        text = json.dumps(text, ensure_ascii=False)
        field = f'"delta": {{"content": {text}}}' if self.chat else f'"text": {text}'
        return f'[{{"index": {index}, {field}, "logprobs": null, "finish_reason": null}}]'

    def _event(self, choices: list[dict] | str, usage: dict | None = None) -> str:
        """One SSE event: {"id", "object", "created", "model", "system_fingerprint", "choices"
        (, "usage")}, its constant head serialised once per reply (an event per token);
        `choices` as dicts or already serialised."""
        if self._head is None:
            head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.body.model, "system_fingerprint": None}
            self._head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": '
            options = self.body.stream_options  # with include_usage every chunk has the field, null until the last
            self._no_usage = ', "usage": null' if options is not None and options.include_usage else ""
        tail = self._no_usage if usage is None else ', "usage": ' + json.dumps(usage, ensure_ascii=False)
        if not isinstance(choices, str):
            choices = json.dumps(choices, ensure_ascii=False)
        return self._head + choices + tail + "}\n\n"

    async def events(self, request: Request, finish: Any) -> AsyncIterator[str]:
        # A client that goes away: Starlette cancels this stream where the server speaks ASGI
        # spec 2.3 (uvicorn), but not under 2.4, where only a failed write would tell, and a
        # request still queued writes nothing. This watcher (one task a request, not a timer
        # per chunk) covers both. And a write to a client that left returns without an error:
        # a reply generated whole was "sent" to its end and logged 200 (Starlette cancels only
        # a stream that waits, and this one never waited again). A disconnect wakes the
        # watcher before the write it unblocks, so the check after each write sees it.
        gone = asyncio.ensure_future(_disconnect(request))
        gone.add_done_callback(lambda task: task.cancelled() or self.chunks.put_nowait(_ClientGone()))
        try:
            async for event in self._events():
                yield event
                if gone.done():
                    raise _ClientGone()
        except ApiError as error:  # generation failed after the 200 went out: said in the stream, as OpenAI does
            self.log["error"] = error.message
            yield "data: " + json.dumps(error.body(), ensure_ascii=False) + "\n\n"
            yield "data: [DONE]\n\n"
        except (_ClientGone, asyncio.CancelledError) as error:  # (Starlette cancels a stream that waits)
            # the client left, maybe after its reply was generated whole: nobody reads the rest
            self.log["cancelled"] = True  # (and finish() cancels the jobs)
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            gone.cancel()
            finish(self)

    async def _events(self) -> AsyncIterator[str]:
        """The SSE events of the reply, until its [DONE] (`_ClientGone` ends them early)."""
        if self.chat:
            yield self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(self.n)])
        elif any(self.echoes):
            def echoed() -> str:  # (megabytes with logprobs: built as _json_by_choice builds a reply)
                choices = [json.dumps({"index": i, "text": echo, "logprobs": self._new_logprobs(i),
                                       "finish_reason": None}, ensure_ascii=False)
                           for i, echo in enumerate(self.echoes)]
                return self._event("[" + ", ".join(choices) + "]")
            yield await asyncio.to_thread(echoed) if self.prompt_logprobs else echoed()
        while None in self.reasons:  # (every sample's last chunk taken)
            chunks = [await self.chunks.get()]
            while not self.chunks.empty():  # a client that fell behind gets what is ready in one write
                chunks.append(self.chunks.get_nowait())
            events = []
            for chunk in chunks:
                try:
                    chunk = self._take(chunk)  # (taken as its event is made: its logprobs go with it)
                except ApiError:  # generation failed: what came before it still goes out first
                    if events:
                        yield "".join(events)
                    raise
                if chunk.finish_reason is None:
                    if chunk.text and self.wants_logprobs:  # (a token's logprobs go with the next text)
                        field = {"delta": {"content": chunk.text}} if self.chat else {"text": chunk.text}
                        events.append(self._event([{"index": chunk.index, **field,
                                                    "logprobs": self._new_logprobs(chunk.index),
                                                    "finish_reason": None}]))
                    elif chunk.text:  # (else a token that is not printable yet)
                        events.append(self._event(self._token_choices(chunk.index, chunk.text)))
                    continue
                if self.chat:
                    delta = {"content": chunk.text} if chunk.text else {}
                    choice = {"index": chunk.index, "delta": delta, "logprobs": self._new_logprobs(chunk.index),
                              "finish_reason": chunk.finish_reason}
                else:
                    choice = {"index": chunk.index, "text": chunk.text, "logprobs": self._new_logprobs(chunk.index),
                              "finish_reason": chunk.finish_reason}
                events.append(self._event([choice]))
            if events:
                yield "".join(events)
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield self._event([], usage=self._usage())
        yield "data: [DONE]\n\n"

