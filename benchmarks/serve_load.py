"""Load on `frawd serve` through HTTP: aggregate tokens/s and time to first token for 1, 8
and 32 concurrent streaming clients.

Workload (issue 13): the `tiny` preset (random weights, a BPE tokenizer of its 8192 ids
trained on tiny shakespeare when ../shared has it, else on a generated text), served by
`frawd serve` in a subprocess on a free local port. Each client sends streaming
completions (prompts as token ids) one after another: prompts of mixed lengths (8-120 tokens), 128 new tokens
each, greedy (the model's special tokens are never the greedy choice, so every request
generates its 128). `--preset small` (or another preset with the same vocabulary) serves
a larger model the same way: its weights no longer fit in the CPU's cache, so the forward,
not the HTTP layer, is most of a token's cost. Levels run interleaved (1, 8, 32, 1, 8, 32, ...) so load from other
processes hits each alike; each figure is the median over rounds.

Figures per level N (1, 8, 32):
  tokens_per_s_N   generated tokens of all clients / wall time of the level
  p50_ttft_ms_N, p95_ttft_ms_N   request sent -> first text chunk received
  server_cpu_us_per_token_N, client_cpu_us_per_token_N   CPU time (all threads) of the
                 server and of the client process per generated token: where the cores went
  failed_requests  requests that did not end with 128 tokens and [DONE] (all levels)
Without HTTP, measured first (as many rounds, before the server starts), what the engine alone gives:
  engine_tokens_per_s_N  the same clients and prompts submitted straight to a `Scheduler`
                 in this process (no HTTP, no client process): what the server's layer costs
  forward_tokens_per_s_N  bare decode steps of N rows (the native forward at the faster of 1
                 thread and all, every row with 128 cached tokens, about the workload's
                 middle), no scheduling, no sampling
  engine_scaling_32_vs_1, forward_scaling_32_vs_1  the same ratio as the headline: a
                 32-row step computes 32 tokens, but on a CPU it is compute-bound where a
                 1-row step is bound by reading the weights, so the forward's own ratio
                 bounds what batching can give (the HTTP figures exceed it only where the
                 single client loses more to overheads than the 32 do)
The peer: llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, the
`llamacpp` extra) on the same model's GGUF export in fp16 (our default engine reads fp16
weights too), same threads, the same prompts as text (its tokenizer gives our ids), at 1
and 8 clients, one round (it serves one request at a time; more clients only wait longer):
`peer_tokens_per_s_N`, `peer_p95_ttft_ms_N`, `peer_failed_requests` and
`tokens_per_s_8_vs_peer` (preceded by a `peer_note=` saying the peer's figure is unreliable
when some of its requests failed). Where it is not installed, peer=skipped is printed.

    .venv/bin/python benchmarks/serve_load.py [--rounds 2] [--requests-per-client 2] [--threads N] [--preset tiny]

The last line is the headline: scaling_32_vs_1=<tokens/s at 32 clients / at 1 client>.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench_common import ArgumentParser, cpu_features_line, positive_int, require, run_main
from frawdllm import FrawdLLM, get_config
from frawdllm.cli.sampling_flags import load_engine
from frawdllm.infer.scheduler import Scheduler
from frawdllm.tokenizer import SPECIAL_TOKENS, train_tokenizer

if TYPE_CHECKING:
    import aiohttp  # (imported where used: main() first checks that it is installed)

NEW_TOKENS = 128
LEVELS = (1, 8, 32)
PEER_LEVELS = (1, 8)  # one request at a time: 32 clients only queue longer
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"


def corpus() -> str:
    if SHARED.exists():
        return SHARED.read_text()[:400_000]
    words = ["the", "king", "queen", "of", "and", "to", "a", "my", "lord", "thou", "art", "in", "love", "with"]
    return " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(60_000))


def make_model(directory: Path, preset: str = "tiny"):
    text = corpus()
    tok = train_tokenizer([text[i:i + 2000] for i in range(0, len(text), 2000)], kind="bpe", vocab_size=8192)
    torch.manual_seed(0)
    model = FrawdLLM(get_config(preset))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # (untied below: the special rows change alone)
    if model.lm_head.weight is model.embed.tok.weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_embeddings = False
    with torch.no_grad():
        model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0  # logit 0: never the greedy choice
    model.save_pretrained(directory, tokenizer=tok)
    return tok, text


def prompts(tok, text: str, count: int) -> list[list[int]]:
    """Prompts of mixed lengths, 8 to 120 tokens (as ids: exact lengths, and prompt +
    128 new tokens always fits the context of 256)."""
    out = []
    for i in range(count):
        length = 8 + (i * 37) % 113
        start = (i * 7919) % (len(text) - 5000)
        out.append(tok.encode(text[start:start + 5000])[:length])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      prompt: list[int] | str) -> tuple[float, int, bool]:
    """(time to first text chunk, tokens generated, ok) of one streaming completion. Tokens
    are the usage count where the server sends one (ours does), else NEW_TOKENS when it
    ends for "length" (max_tokens reached; llama-cpp-python sends no usage, and a text
    event may carry several tokens or none), else the text events."""
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, done, events, reason = None, 0, False, 0, None
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return float("nan"), 0, False
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event["choices"] and event["choices"][0].get("finish_reason"):
                    reason = event["choices"][0]["finish_reason"]
                if event["choices"] and event["choices"][0]["text"]:
                    events += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return float("nan"), 0, False
    tokens = tokens or (NEW_TOKENS if reason == "length" else events)
    return (ttft if ttft is not None else float("nan")), tokens, done and tokens == NEW_TOKENS


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of process `pid` (Linux /proc)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def level(url: str, model: str, clients: int, per_client: int, texts: list[list[int]] | list[str],
                server_pid: int) -> dict:
    # One client process, asyncio and aiohttp (its C parser): the load generator shares the
    # cores with the server, so it must cost little per event.
    import aiohttp

    connector = aiohttp.TCPConnector(limit=clients + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        results = []

        async def worker(c: int) -> None:
            for r in range(per_client):
                results.append(await one_request(session, url, model, texts[(c * per_client + r) % len(texts)]))

        cpu = (cpu_seconds(), cpu_seconds(server_pid))
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - start
        client_cpu, server_cpu = cpu_seconds() - cpu[0], cpu_seconds(server_pid) - cpu[1]
    ttfts = sorted(t for t, _, ok in results if ok)
    generated = sum(n for _, n, _ in results)
    return {"tokens_per_s": generated / wall,
            "p50_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "p95_ttft_ms": 1000 * percentile(ttfts, 0.95) if ttfts else float("nan"),
            "server_cpu_us_per_token": 1e6 * server_cpu / max(generated, 1),
            "client_cpu_us_per_token": 1e6 * client_cpu / max(generated, 1),
            "failed": sum(not ok for _, _, ok in results)}


def engine_level(scheduler, clients: int, per_client: int, texts: list[list[int]]) -> float:
    """Tokens/s of `level`'s load (each client's requests one after another) submitted straight
    to `scheduler`: a finished request's listener submits its client's next one."""
    from frawdllm.infer import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    done, lock = threading.Event(), threading.Lock()
    left, tokens, failed = [clients * per_client], [0], []

    def send(c: int, r: int) -> None:
        def listener(chunk) -> None:
            if isinstance(chunk, BaseException):
                failed.append(chunk)
                done.set()
                return
            with lock:
                tokens[0] += chunk.token is not None
            if chunk.finish_reason is None:
                return
            if r + 1 < per_client:
                send(c, r + 1)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        scheduler.submit(texts[(c * per_client + r) % len(texts)], params, listener)

    start = time.perf_counter()
    for c in range(clients):
        send(c, 0)
    done.wait()
    if failed:
        raise SystemExit(f"the scheduler failed: {failed[0]}")
    return tokens[0] / (time.perf_counter() - start)


def forward_steps(engine, rows: int, steps: int = 20, cached: int = NEW_TOKENS) -> float:
    """Tokens/s of bare decode steps of `rows` rows, each with `cached` tokens in its cache, on
    the native forward at the faster of 1 thread and all (the engine re-decides its count as
    it runs; a figure from one or the other would depend on what ran before)."""
    from frawdllm.infer.cache import RowKVCache

    if not engine.native:
        raise SystemExit("the forward figures need the native forward (a C compiler)")
    cfg = engine.config
    cache = RowKVCache(cfg, rows, cached + 1, dtype=engine.kv_dtype)
    cache.rows = rows
    tokens = torch.full((rows, 1), 100, dtype=torch.long)
    positions = torch.full((rows, 1), cached, dtype=torch.long)
    decoder = engine.native_decoder()
    best = float("inf")
    for threads in sorted({1, torch.get_num_threads()}):
        times = []
        for _ in range(steps + 2):
            cache.lengths[:rows] = cached  # (every step writes the same slot)
            cache.begin(1)
            start = time.perf_counter()
            decoder.forward(tokens, positions, cache, threads)
            times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times[2:]))
    return rows / best


def without_http(model_dir: Path, texts: list[list[int]], args) -> dict[str, list[float]]:
    """The engine_* and forward_* figures of each round, measured in this process before the
    server starts (nothing else running: an idle server's threads still cost a 1-row step)."""
    engine = load_engine(str(model_dir), threads=args.threads)  # as `frawd serve` loads it
    alone: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # first: nothing else alive (an idle scheduler thread once cost a 1-row step ~13-20%)
        for n in (1, 32):
            alone.setdefault(f"forward_tokens_per_s_{n}", []).append(forward_steps(engine, n, 60 if n == 1 else 20))
    scheduler = Scheduler(engine, max_batch=32)
    try:
        engine_level(scheduler, 4, 1, texts)  # warm-up
        for _ in range(args.rounds):
            for n in (1, 32):
                per_client = args.requests_per_client * (2 if n == 1 else 1)
                alone.setdefault(f"engine_tokens_per_s_{n}", []).append(engine_level(scheduler, n, per_client, texts))
    finally:
        scheduler.close()
    return alone


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    index = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 1)) - 1))
    return sorted_values[index]


def start_server(model_dir: Path, threads: int | None, name: str = "tiny") -> tuple[subprocess.Popen, str]:
    port = free_port()
    frawd = str(Path(sys.executable).parent / "frawd")
    command = [frawd, "serve", "--model", f"{name}={model_dir}", "--port", str(port), "--log-level", "warning",
               "--max-tokens", str(NEW_TOKENS)]
    if threads:
        command += ["--threads", str(threads)]
    return wait_for(subprocess.Popen(command, stderr=subprocess.PIPE, text=True), port, "/health", "frawd serve")


def start_peer(gguf: Path, threads: int, name: str = "tiny") -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's server on `gguf`: one request at a time (no batching), the others queue.
    Its log (an access line per request) goes to a file beside the model, not to a pipe nobody reads."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", name,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256", "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--verbose", "False",
               "--interrupt_requests", "False"]  # (its default: a new request cancels the running one)
    log = open(gguf.with_suffix(".log"), "w+")
    return wait_for(subprocess.Popen(command, stderr=log, stdout=log, text=True), port, "/v1/models",
                    "llama_cpp.server", log)


def wait_for(proc: subprocess.Popen, port: int, path: str, name: str, log=None) -> tuple[subprocess.Popen, str]:
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            if log is not None:
                log.seek(0)
            raise SystemExit(f"{name} exited: {(log or proc.stderr).read()[-2000:]}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not start within 300 s")


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="rounds of the levels 1, 8, 32, interleaved; figures are medians [default: 2]")
    parser.add_argument("--requests-per-client", type=positive_int, default=2,
                        help="requests each client sends, one after another (twice as many at 1 client) "
                             "[default: 2]")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="the server's CPU threads [default: torch's]")
    parser.add_argument("--preset", default="tiny", help="the model served (random weights) [default: tiny]")
    args = parser.parse_args()
    name = args.preset
    if get_config(name).vocab_size != 8192 or get_config(name).context_length < 256:
        parser.error(f"--preset {name}: the workload needs a vocabulary of 8192 and a context of 256 or more")
    for module in ("aiohttp", "httpx"):  # the load generator and the health check (in the `test` extra)
        require(module, module)
    print(f"preset={name}")
    print(f"cpu_count={os.cpu_count()}")
    print(cpu_features_line())
    print(f"torch_threads={args.threads or torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / name
        print(f"building the {name} model and its tokenizer...", file=sys.stderr, flush=True)
        tok, text = make_model(model_dir, name)
        texts = prompts(tok, text, 64)
        alone = without_http(model_dir, texts, args)
        proc, url = start_server(model_dir, args.threads, name)
        try:
            asyncio.run(level(url, name, 4, 1, texts, proc.pid))  # warm-up
            figures: dict[int, list[dict]] = {n: [] for n in LEVELS}
            for r in range(args.rounds):
                for n in LEVELS:
                    per_client = args.requests_per_client * (2 if n == 1 else 1)  # (1 client: a few more samples)
                    figures[n].append(asyncio.run(level(url, name, n, per_client, texts, proc.pid)))
                    print(f"round {r + 1} clients {n}: {figures[n][-1]}", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
        peer: dict[int, dict] = {}
        if importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("sse_starlette") is not None:
            from frawdllm.export.gguf import export_gguf

            gguf = export_gguf(model_dir, Path(tmp) / f"{name}.gguf", dtype="float16")
            proc, url = start_peer(gguf, args.threads or torch.get_num_threads(), name)
            try:
                as_text = [tok.decode(ids) for ids in texts]
                asyncio.run(level(url, name, 2, 1, as_text, proc.pid))  # warm-up
                for n in PEER_LEVELS:
                    peer[n] = asyncio.run(level(url, name, n, args.requests_per_client * (2 if n == 1 else 1),
                                                as_text, proc.pid))
                    print(f"peer clients {n}: {peer[n]}", file=sys.stderr, flush=True)
            finally:
                proc.kill()  # (it may not stop on SIGTERM while requests wait)
                proc.wait(60)
    failed = 0
    for n in LEVELS:
        runs = figures[n]
        for key in ("tokens_per_s", "p50_ttft_ms", "p95_ttft_ms", "server_cpu_us_per_token",
                    "client_cpu_us_per_token"):
            print(f"{key}_{n}={statistics.median(r[key] for r in runs):.1f}")
        failed += sum(r["failed"] for r in runs)
    print(f"failed_requests={failed}")
    median = {key: statistics.median(values) for key, values in alone.items()}
    for what in ("engine", "forward"):
        for n in (1, 32):
            print(f"{what}_tokens_per_s_{n}={median[f'{what}_tokens_per_s_{n}']:.1f}")
        print(f"{what}_scaling_32_vs_1={median[f'{what}_tokens_per_s_32'] / median[f'{what}_tokens_per_s_1']:.2f}")
    ours_32 = statistics.median(r["tokens_per_s"] for r in figures[32])
    if not peer:
        print("peer=skipped (llama-cpp-python's server is not installed; pip install 'frawdllm[llamacpp]' builds it)")
    else:
        print("peer=llama_cpp.server (llama-cpp-python, fp16 GGUF)")
        for n, r in peer.items():
            print(f"peer_tokens_per_s_{n}={r['tokens_per_s']:.1f}")
            print(f"peer_p95_ttft_ms_{n}={r['p95_ttft_ms']:.1f}")
        peer_failed = sum(r["failed"] for r in peer.values())
        print(f"peer_failed_requests={peer_failed}")
        if peer_failed:
            print(f"peer_note=the peer's figures are unreliable: {peer_failed} of its requests failed "
                  f"(its tokens/s counts only what they generated), and so is tokens_per_s_8_vs_peer")
        ours_8 = statistics.median(r["tokens_per_s"] for r in figures[8])
        print(f"tokens_per_s_8_vs_peer={ours_8 / peer[8]['tokens_per_s']:.2f}")
    scaling = ours_32 / statistics.median(r["tokens_per_s"] for r in figures[1])
    print(f"scaling_32_vs_1={scaling:.2f}")


if __name__ == "__main__":
    run_main(main)
