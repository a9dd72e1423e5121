"""Colocated templates (DESIGN §4a): one replica serves both phases of a model with chunked
prefill, as vLLM and Sarathi-Serve schedule it.

Every step of a colocated instance carries its running decodes (the micro-batch `b`) plus up to
`chunk_tokens` prompt tokens. The placement search is the decode search (`coral.templates.library`:
the same multisets, TP layouts and pipelines, the same exact solver) on the mixed step's time
function (`PerfModel.mixed_node_time_s`):

- **Operating point.** A replica must serve prompt and output tokens in its model's traffic
  ratio `r = E[P] / E[D]`, so in steady state a step carries `r·b` prompt tokens on average:
  throughput (`Θ_D = b` per step, `Θ_P = r·Θ_D`) is timed at that chunk. This is the point of
  the (Θ_P, Θ_D) frontier that the model's own traffic sits on.
- **TPOT.** The largest step, `b` decodes plus the whole chunk `c`, must make one token per
  sequence within the step budget (`tpot_headroom` × TPOT; no KV transfer to allow for): the
  decode cadence cap (`problem.decode_caps`) applied with that step's time.
- **TTFT.** A prompt of `P` tokens takes `⌈P / c⌉` steps. Each step takes at most the step
  budget, so the attainment-quantile prompt `P_q` meets `ttft_headroom` × TTFT when
  `⌈P_q / c⌉ ≤ ⌊TTFT budget / step budget⌋`: the chunk is `c = max(⌈r·b⌉, ⌈P_q / steps⌉)`,
  the smallest that serves the ratio and the quantile prompt. The queue ahead of a prompt is the
  capacity model's (`coral.allocator.demand`, per phase, as for disaggregated instances).
- **Memory.** KV of `S·b` sequences at full context `P + D` (the prompts being chunked become
  these decodes), as a decode node holds.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from coral.catalog.hardware import NodeConfig
from coral.perf.model import PerfModel, Phase, Shape
from coral.templates.problem import FIRST, LAST, ONLY, Placement
from coral.templates.spec import TemplateSpec

POSITIONS = (FIRST, 1, LAST, ONLY)  # as problem.py numbers them: first, middle, last, only


def ttft_steps(ttft_budget_ms: float, step_budget_ms: float) -> int:
    """The most steps a prompt's chunks may take: whole step budgets within the TTFT budget (at
    least one: a prompt then goes in one chunk)."""
    return max(1, math.floor(ttft_budget_ms / step_budget_ms + 1e-9))


def chunk_tokens(spec: TemplateSpec, batch: int) -> int:
    """`c = max(⌈r·b⌉, ⌈P_q / steps⌉)`: the step's chunk at decode batch `batch` (module docstring)."""
    steps = ttft_steps(spec.ttft_budget_ms, spec.budget_ms)
    return max(1, math.ceil(spec.prompt_per_output * batch - 1e-9), math.ceil(spec.ttft_prompt_tokens / steps - 1e-9))


def mean_chunk(spec: TemplateSpec, batch: int) -> int:
    """The prompt tokens a step carries on average at the traffic's ratio, `⌈r·b⌉` (≥ 1)."""
    return max(1, math.ceil(spec.prompt_per_output * batch - 1e-9))


def chunk_context(spec: TemplateSpec) -> float:
    """Mean context a chunk's tokens attend to: half the work-weighted prompt, `E[P²] / (2·E[P])`."""
    return (spec.work_prompt_tokens or spec.prompt_tokens) / 2


def decode_context(spec: TemplateSpec) -> float:
    """Mean context of a running decode, `E[P] + E[D]/2`."""
    return spec.prompt_tokens + spec.output_tokens / 2


def step_times(perf: PerfModel, spec: TemplateSpec, config: NodeConfig, batch: int,
               chunk: int) -> tuple[float, tuple[float, float, float, float]]:
    """(one layer's time, the first/middle/last/only stage extras) of a step of `batch` decodes and
    `chunk` prompt tokens on `config`."""
    d_ctx, c_ctx = decode_context(spec), chunk_context(spec)
    t = perf.mixed_layer_time_s(config, spec.model, decode_batch=batch, decode_context=d_ctx, chunk_tokens=chunk,
                                chunk_context=c_ctx)
    extras = tuple(perf.mixed_node_time_s(config, spec.model, layers=0, decode_batch=batch, decode_context=d_ctx,
                                          chunk_tokens=chunk, chunk_context=c_ctx, first=p in (FIRST, ONLY),
                                          last=p in (LAST, ONLY)) for p in POSITIONS)
    return t, extras  # type: ignore[return-value]


def memory_shape(spec: TemplateSpec, batch: int) -> Shape:
    """The decode shape whose KV a colocated node holds (`S·b` sequences at `P + D`)."""
    return Shape(phase=Phase.DECODE, batch=batch, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens)


def hop_shape(spec: TemplateSpec, batch: int) -> Shape:
    """A shape with the step's tokens (`b + c`), for the activations between stages."""
    return Shape(phase=Phase.DECODE, batch=batch + chunk_tokens(spec, batch), prompt_tokens=1.0, output_tokens=0.0)


def realized_decode_rate(perf: PerfModel, spec: TemplateSpec,
                         configs: dict[str, NodeConfig]) -> Callable[[tuple[str, ...], Placement], float]:
    """`Θ_D` of a solved colocated placement: generated tokens/s at the mean chunk, capped by
    Little's law with `S·width` micro-batches in flight, as a decode placement's (the library's
    `coral.templates.throughput.realized_throughput`)."""
    memo: dict[tuple[str, int, int, int, int], float] = {}

    def node_s(name: str, batch: int, layers: int, stage: int, stages: int) -> float:
        key = (name, batch, layers, stage, stages)
        v = memo.get(key)
        if v is None:
            v = memo[key] = perf.mixed_node_time_s(
                configs[name], spec.model, layers=layers, decode_batch=batch, decode_context=decode_context(spec),
                chunk_tokens=mean_chunk(spec, batch), chunk_context=chunk_context(spec), first=stage == 0,
                last=stage == stages - 1)
        return v

    def theta(nodes: tuple[str, ...], placement: Placement) -> float:
        b, stages = placement.micro_batch, len(placement.stages)
        times = [[node_s(n, b, st.layers, s, stages) for n in st.nodes] for s, st in enumerate(placement.stages)]
        rate = min(sum(b / t for t in ts) for ts in times)
        lanes = stages * min(len(st.nodes) for st in placement.stages)
        latency = sum(max(ts) for ts in times) + (stages - 1) * placement.comm_s
        return min(rate, lanes * b / latency)

    return theta


def not_colocatable(perf: PerfModel, spec: TemplateSpec) -> tuple[str, ...]:
    """One line per configuration whose memory holds the model but whose fastest step (one decode
    plus a one-token chunk, all layers, the whole node as one TP group) misses the step budget:
    the model is not colocatable on that node, with the step time that is too slow."""
    out = []
    L = spec.model.num_layers
    for c in spec.configs:
        if c.is_group or c.memory_bytes * perf.system.memory_utilization < spec.model.weights_bytes:
            continue
        step = perf.mixed_node_time_s(c, spec.model, layers=L, decode_batch=1, decode_context=decode_context(spec),
                                      chunk_tokens=1, chunk_context=chunk_context(spec), first=True, last=True)
        if step * 1e3 > spec.budget_ms:
            out.append(f"{spec.model.name} is not colocatable on {c.name}: a step of one decode and a one-token "
                       f"chunk takes {step * 1e3:.1f} ms, over the {spec.budget_ms:g} ms step budget "
                       f"(TPOT {spec.slo_ms:g} ms x headroom)")
    return tuple(out)
