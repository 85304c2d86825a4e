"""`/metrics`: the server's Prometheus counters, gauges and histograms (requests, tokens,
queue depth, time to first token), in a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..infer.scheduler import Scheduler


class _Metrics:
    """The server's Prometheus figures; `_Guard` counts requests, the routes tokens and latency."""

    def __init__(self, models: dict[str, Scheduler]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("frawd_requests", "HTTP requests answered", ["path", "status"], registry=r)
        self.prompt_tokens = Counter("frawd_prompt_tokens", "Prompt tokens of accepted requests", ["model"],
                                     registry=r)
        self.generated = Counter("frawd_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("frawd_time_to_first_token_seconds", "Submit to first token", ["model"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.latency = Histogram("frawd_request_seconds", "Request duration", ["model"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        queue = Gauge("frawd_queue_depth", "Requests waiting for a batch row", ["model"], registry=r)
        running = Gauge("frawd_running_rows", "Rows in the running batch", ["model"], registry=r)
        rate = Gauge("frawd_tokens_per_second", "Tokens generated per second since the previous scrape", ["model"],
                     registry=r)
        for name, scheduler in models.items():
            queue.labels(name).set_function(lambda s=scheduler: s.queue_depth)
            running.labels(name).set_function(lambda s=scheduler: s.running)
            rate.labels(name).set_function(_Rate(scheduler))


class _Rate:
    """Tokens/s of a scheduler between two reads."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.last = scheduler, (time.perf_counter(), scheduler.generated_tokens)

    def __call__(self) -> float:
        now, count = time.perf_counter(), self.scheduler.generated_tokens
        (then, before), self.last = self.last, (now, count)
        return (count - before) / max(now - then, 1e-9)

