"""Prometheus metrics of the front end, under vLLM's names (``vllm:*``, label ``model_name``).

Dashboards and autoscalers written for vLLM read them unchanged. Request-level histograms
are observed by the front end as the client sees the stream; the gauges (running, waiting,
KV-cache usage) are read from the instances' heartbeats when Prometheus scrapes. Each
:class:`ServingMetrics` has its own registry, so several servers in one process (tests)
never share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServingMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

#: A callable returning ``{model: (running, waiting, kv_cache_usage)}`` at scrape time.
LoadSource = Callable[[], dict[str, tuple[int, int, float]]]


class _LoadCollector(Collector):
    def __init__(self, source: LoadSource) -> None:
        self.source = source

    def collect(self) -> Iterable[Any]:
        load = self.source()
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=["model_name"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"])
        for m, (r, w, u) in sorted(load.items()):
            running.add_metric([m], r)
            waiting.add_metric([m], w)
            kv.add_metric([m], u)
        return [running, waiting, kv]


class ServingMetrics:
    """The front end's metric objects (one registry per server)."""

    def __init__(self, load: LoadSource) -> None:
        """Args:
        load: model -> (requests running, requests waiting, KV-cache usage 0-1), read at scrape time.
        """
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", label, buckets=_TTFT, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", label, buckets=_ITL, registry=r)
        self.tpot_iter = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (the inter-token gaps; vLLM's older name).", label, buckets=_ITL, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", label, buckets=_ITL, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", label, buckets=_LATENCY, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", label, buckets=_LATENCY, registry=r)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", label, buckets=_TOKENS, registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", label, buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", label, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.", [*label, "finished_reason"], registry=r)
        self.http_errors = Counter("coral:http_request_errors", "HTTP responses with an error status, by code.", [*label, "code"], registry=r)
        r.register(_LoadCollector(load))
        self._children: dict[str, tuple[Any, ...]] = {}

    def _of(self, model: str) -> tuple[Any, ...]:
        """The model's labelled children, looked up once (``labels()`` takes a lock each call)."""
        c = self._children.get(model)
        if c is None:
            c = self._children[model] = tuple(
                m.labels(model) for m in (self.prompt_tokens, self.generation_tokens, self.req_prompt, self.req_gen,
                                          self.e2e, self.ttft, self.tpot, self.queue, self.itl, self.tpot_iter)
            )  # fmt: skip
        return c

    def render(self) -> bytes:
        """The text exposition (Prometheus format 0.0.4)."""
        return generate_latest(self.registry)

    def observe_request(
        self, model: str, *, prompt_tokens: int, output_tokens: int, finished_reason: str, e2e_s: float,
        ttft_s: float | None, queue_s: float | None,
    ) -> None:  # fmt: skip
        """Account one ended request (every choice of it).

        Args:
            model: the served model's name.
            prompt_tokens, output_tokens: its token counts.
            finished_reason: ``stop``, ``length`` or ``abort`` (vLLM's values).
            e2e_s: arrival to last token.
            ttft_s: arrival to first token (None if none came).
            queue_s: time it waited in the scheduler (None if unknown).
        """
        prompt, gen, req_prompt, req_gen, e2e, ttft, tpot, queue, _itl, _tpot_iter = self._of(model)
        prompt.inc(prompt_tokens)
        gen.inc(output_tokens)
        req_prompt.observe(prompt_tokens)
        req_gen.observe(output_tokens)
        self.success.labels(model, finished_reason).inc()
        e2e.observe(e2e_s)
        if ttft_s is not None:
            ttft.observe(ttft_s)
            if output_tokens > 1:
                tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))
        if queue_s is not None:
            queue.observe(queue_s)

    def observe_gap(self, model: str, gap_s: float) -> None:
        """One inter-token gap of a stream."""
        c = self._of(model)
        c[8].observe(gap_s)
        c[9].observe(gap_s)

    def error(self, model: str, code: int) -> None:
        """One error response."""
        self.http_errors.labels(model, str(code)).inc()
