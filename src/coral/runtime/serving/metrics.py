"""Prometheus metrics of the front end, under vLLM's names (``vllm:*``, label ``model_name``), and Coral's own (``coral:*``).

Dashboards and autoscalers written for vLLM read them unchanged. Request-level histograms
are observed by the front end as the client sees the stream; the gauges (running, waiting,
KV-cache usage), the schedulers' counters (preemptions, tokens per step, KV transfers) and the
fleet's state (instances per state, lost nodes, plan cost, re-plans, repairs, each model's
health) are read from a :class:`FleetStats` snapshot when Prometheus scrapes. Each
:class:`ServingMetrics` has its own registry, so several servers in one process (tests)
never share counters.

Names, labels and buckets follow vLLM's ``vllm/v1/metrics/loggers.py`` (its label ``engine`` is
left out: Coral aggregates a model's instances, and names an instance where it matters, as
``instance``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from coral.runtime.protocol import ITERATION_TOKEN_BUCKETS, KV_TRANSFER_SECONDS_BUCKETS

__all__ = [
    "CONTENT_TYPE",
    "HEALTH_STATES",
    "INSTANCE_STATES",
    "ITERATION_TOKEN_BUCKETS",
    "CacheInfo",
    "FleetStats",
    "ModelCounters",
    "ServingMetrics",
    "build_1_2_5_buckets",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N = (1, 2, 5, 10, 20)
# vLLM's ``vllm:iteration_tokens_total`` buckets (tokens in one engine step; here one micro-batch), and
# the KV hand-off's seconds (Coral's own: vLLM has no PD transfer metric): the schedulers count into them
_KV_SECONDS = KV_TRANSFER_SECONDS_BUCKETS

#: An instance's states in ``coral:instances``: what ``/admin/instances`` shows.
INSTANCE_STATES = ("starting", "active", "degraded", "draining", "repairing")
#: A model's states in ``/health`` and ``coral:model_health``.
HEALTH_STATES = ("ok", "degraded", "unavailable", "starting")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets of token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCounters:
    """A model's cumulative scheduler-side counters, summed over its instances (the retired ones too)."""

    preemptions: int = 0
    iteration_token_counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)  # per bucket, +Inf last; not cumulative
    iteration_tokens_sum: int = 0
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds_counts: tuple[int, ...] = (0,) * (len(_KV_SECONDS) + 1)
    kv_transfer_seconds_sum: float = 0.0

    def __post_init__(self) -> None:
        if len(self.iteration_token_counts) != len(ITERATION_TOKEN_BUCKETS) + 1:
            raise ValueError(f"iteration_token_counts needs {len(ITERATION_TOKEN_BUCKETS) + 1} buckets")
        if len(self.kv_transfer_seconds_counts) != len(_KV_SECONDS) + 1:
            raise ValueError(f"kv_transfer_seconds_counts needs {len(_KV_SECONDS) + 1} buckets")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheInfo:
    """One instance's KV cache, as vLLM's ``vllm:cache_config_info`` labels describe it."""

    model: str
    instance: str
    block_size: int
    num_gpu_blocks: int  # blocks of the instance's smallest node pool
    cache_dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetStats:
    """What the scrape-time collector reads: the schedulers' gauges and counters and the fleet's state."""

    #: model -> (requests running, requests waiting, KV-cache usage 0-1)
    load: Mapping[str, tuple[int, int, float]] = field(default_factory=dict)
    counters: Mapping[str, ModelCounters] = field(default_factory=dict)
    caches: tuple[CacheInfo, ...] = ()
    #: (model, state) -> instances; states from INSTANCE_STATES
    instances: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: (model, instance, node "stage/index") of every node a live instance has lost
    lost_nodes: tuple[tuple[str, str, str], ...] = ()
    health: Mapping[str, str] = field(default_factory=dict)  # model -> one of HEALTH_STATES
    plan_cost_usd_per_h: float | None = None  # None: the running plan has no prices (a hand-written cluster file)
    replans: int = 0  # plan changes carried out (epochs that changed something, /admin/plan)
    #: (model, reason) -> repairs started; reason "failed" (an instance lost), "degraded" (a node lost) or
    #: "preempted" (a spot preemption notice)
    repairs: Mapping[tuple[str, str], int] = field(default_factory=dict)


#: A callable returning the fleet's state at scrape time.
StatsSource = Callable[[], FleetStats]


def _histogram(fam: HistogramMetricFamily, labels: list[str], bounds: Iterable[float], counts: tuple[int, ...], total: float) -> None:
    cumulative, acc = [], 0
    for le, c in zip([*map(floatToGoString, bounds), "+Inf"], counts, strict=True):
        acc += c
        cumulative.append((le, acc))
    fam.add_metric(labels, cumulative, sum_value=total)


class _FleetCollector(Collector):
    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterable[Any]:
        s = self.source()
        m = ["model_name"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=m)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=m)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=m)
        for name, (r, w, u) in sorted(s.load.items()):
            running.add_metric([name], r)
            waiting.add_metric([name], w)
            kv.add_metric([name], u)
        preempt = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=m)
        iters = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=m)
        kv_n = CounterMetricFamily("coral:kv_transfers", "KV-cache hand-offs from prefill to decode instances completed.", labels=m)
        kv_b = CounterMetricFamily("coral:kv_transfer_bytes", "Bytes of KV cache moved from prefill to decode nodes.", labels=m)
        kv_s = HistogramMetricFamily("coral:kv_transfer_seconds", "Time from a decode instance's KV request to its last layer loaded.", labels=m)
        for name, c in sorted(s.counters.items()):
            preempt.add_metric([name], c.preemptions)
            _histogram(iters, [name], ITERATION_TOKEN_BUCKETS, c.iteration_token_counts, c.iteration_tokens_sum)
            kv_n.add_metric([name], c.kv_transfers)
            kv_b.add_metric([name], c.kv_transfer_bytes)
            _histogram(kv_s, [name], _KV_SECONDS, c.kv_transfer_seconds_counts, c.kv_transfer_seconds_sum)
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=["model_name", "engine", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"])  # fmt: skip
        for ci in sorted(s.caches, key=lambda c: (c.model, c.instance)):
            cache.add_metric([ci.model, ci.instance, str(ci.block_size), str(ci.num_gpu_blocks), ci.cache_dtype, "False"], 1)
        inst = GaugeMetricFamily("coral:instances", "Serving instances per state (starting, active, degraded, draining, repairing).",
                                 labels=["model_name", "state"])  # fmt: skip
        for name in sorted({k[0] for k in s.instances} | set(s.health)):
            for state in INSTANCE_STATES:
                inst.add_metric([name, state], s.instances.get((name, state), 0))
        lost = GaugeMetricFamily("coral:engine_node_lost", "1 for each engine node a live instance has lost (its data-parallel stage runs on the rest).",
                                 labels=["model_name", "instance", "node"])  # fmt: skip
        for model, instance, node in sorted(s.lost_nodes):
            lost.add_metric([model, instance, node], 1)
        health = GaugeMetricFamily("coral:model_health", "1 for the model's state (ok, degraded, unavailable, starting), 0 for the others.",
                                   labels=["model_name", "status"])  # fmt: skip
        for name, status in sorted(s.health.items()):
            for h in HEALTH_STATES:
                health.add_metric([name, h], 1 if h == status else 0)
        out = [running, waiting, kv, preempt, iters, kv_n, kv_b, kv_s, cache, inst, lost, health]
        replans = CounterMetricFamily("coral:replans", "Plan changes carried out (an epoch that changed the plan, POST /admin/plan).")
        replans.add_metric([], s.replans)
        repairs = CounterMetricFamily("coral:repairs", "Replacement instances started by self-repair, by what was lost (failed: an instance, degraded: a node).",
                                      labels=["model_name", "reason"])  # fmt: skip
        for (name, reason), n in sorted(s.repairs.items()):
            repairs.add_metric([name, reason], n)
        out += [replans, repairs]
        if s.plan_cost_usd_per_h is not None:
            cost = GaugeMetricFamily("coral:plan_cost_usd_per_hour", "The running plan's price: its instances' nodes at the scenario's prices ($/h).")
            cost.add_metric([], s.plan_cost_usd_per_h)
            out.append(cost)
        return out


class ServingMetrics:
    """The front end's metric objects (one registry per server)."""

    def __init__(self, stats: StatsSource, *, max_model_len: int = 50_000) -> None:
        """Args:
        stats: the fleet's state, read at scrape time (:class:`FleetStats`).
        max_model_len: the longest context of the served models (vLLM sizes its token buckets by it).
        """
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        label = ["model_name"]
        tokens = build_1_2_5_buckets(max(1, max_model_len))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", label, buckets=_TTFT, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", label, buckets=_ITL, registry=r)
        self.tpot_iter = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (the inter-token gaps; vLLM's older name).", label, buckets=_ITL, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", label, buckets=_ITL, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", label, buckets=_LATENCY, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", label, buckets=_LATENCY, registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", label, buckets=_LATENCY, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", label, buckets=_LATENCY, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", label, buckets=_LATENCY, registry=r)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", label, buckets=tokens, registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", label, buckets=tokens, registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", label, buckets=_N, registry=r)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", label, buckets=tokens, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", label, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.", [*label, "finished_reason"], registry=r)
        self.http_errors = Counter("coral:http_request_errors", "HTTP responses with an error status, by code.", [*label, "code"], registry=r)
        r.register(_FleetCollector(stats))
        self._children: dict[str, tuple[Any, ...]] = {}

    def _of(self, model: str) -> tuple[Any, ...]:
        """The model's labelled children, looked up once (``labels()`` takes a lock each call)."""
        c = self._children.get(model)
        if c is None:
            c = self._children[model] = tuple(
                m.labels(model) for m in (self.prompt_tokens, self.generation_tokens, self.req_prompt, self.req_gen,
                                          self.e2e, self.ttft, self.tpot, self.queue, self.itl, self.tpot_iter,
                                          self.prefill, self.decode, self.inference, self.params_n, self.params_max_tokens)
            )  # fmt: skip
        return c

    def render(self) -> bytes:
        """The text exposition (Prometheus format 0.0.4)."""
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every sample name this server exposes (``_bucket``, ``_total`` ... included), from one render."""
        return {line.split("{", 1)[0].split(" ", 1)[0] for line in self.render().decode().splitlines() if line and not line.startswith("#")}

    def observe_params(self, model: str, *, n: int, max_tokens: int) -> None:
        """The sampling parameters of one accepted request (vLLM's ``request_params_*``)."""
        c = self._of(model)
        c[13].observe(n)
        c[14].observe(max_tokens)

    def observe_request(
        self, model: str, *, prompt_tokens: int, output_tokens: int, finished_reason: str, e2e_s: float,
        ttft_s: float | None, queue_s: float | None,
    ) -> None:  # fmt: skip
        """Account one ended request (every choice of it).

        The phases follow vLLM's: prefill from the first scheduling (arrival + queue time) to the
        first token, decode from the first token to the last, inference = prefill + decode.

        Args:
            model: the served model's name.
            prompt_tokens, output_tokens: its token counts.
            finished_reason: ``stop``, ``length`` or ``abort`` (vLLM's values).
            e2e_s: arrival to last token.
            ttft_s: arrival to first token (None if none came).
            queue_s: time it waited in the scheduler (None if unknown).
        """
        prompt, gen, req_prompt, req_gen, e2e, ttft, tpot, queue, _itl, _tpot_iter, prefill, decode, inference, _n, _mt = self._of(model)
        prompt.inc(prompt_tokens)
        gen.inc(output_tokens)
        req_prompt.observe(prompt_tokens)
        req_gen.observe(output_tokens)
        self.success.labels(model, finished_reason).inc()
        e2e.observe(e2e_s)
        if queue_s is not None:
            queue.observe(queue_s)
        if ttft_s is not None:
            ttft.observe(ttft_s)
            if output_tokens > 1:
                tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))
            pre = max(0.0, ttft_s - (queue_s or 0.0))
            dec = max(0.0, e2e_s - ttft_s)
            prefill.observe(pre)
            decode.observe(dec)
            inference.observe(pre + dec)

    def observe_gap(self, model: str, gap_s: float) -> None:
        """One inter-token gap of a stream."""
        c = self._of(model)
        c[8].observe(gap_s)
        c[9].observe(gap_s)

    def error(self, model: str, code: int) -> None:
        """One error response."""
        self.http_errors.labels(model, str(code)).inc()
