"""What a solved placement serves on the model's length distribution (`Θ`, DESIGN §4a): the
rate the library records for disaggregated templates."""
from __future__ import annotations

from collections.abc import Callable

from coral.catalog.hardware import NodeConfig
from coral.perf.model import PerfModel, Phase, Shape
from coral.templates.problem import Placement
from coral.templates.spec import TemplateSpec


def realized_throughput(perf: PerfModel, spec: TemplateSpec,
                        configs: dict[str, NodeConfig]) -> Callable[[tuple[str, ...], Placement], float]:
    """Θ of a solved placement as it is realized on the length distribution.

    - Prefill stages are re-timed at the prompt length `E[P²]/E[P]`: the per-token work of linear
      layers plus causal attention equals the distribution's there.
    - A pipeline only reaches its bottleneck stage's rate with enough micro-batches in flight. The
      memory model allows `2·S·min_s d_s` (prefill) or `S·min_s d_s` (decode), so by Little's law
      Θ ≤ lanes · u / latency; an unbalanced placement (a wide stage next to a narrow one) gets
      that lower figure, which is what the simulator and an engine deliver.
    """
    work = spec.work_prompt_tokens if spec.phase is Phase.PREFILL and spec.work_prompt_tokens else spec.prompt_tokens
    memo: dict[tuple[str, int, int, int, int], float] = {}

    def node_s(name: str, batch: int, layers: int, stage: int, stages: int) -> float:
        key = (name, batch, layers, stage, stages)
        v = memo.get(key)
        if v is None:
            shape = Shape(phase=spec.phase, batch=batch, prompt_tokens=work, output_tokens=spec.output_tokens)
            v = memo[key] = perf.node_time_s(configs[name], spec.model, shape, layers, first=stage == 0,
                                             last=stage == stages - 1)
        return v

    def theta(nodes: tuple[str, ...], placement: Placement) -> float:
        b, stages = placement.micro_batch, len(placement.stages)
        u = Shape(phase=spec.phase, batch=b, prompt_tokens=work, output_tokens=spec.output_tokens).work_tokens
        times = [[node_s(n, b, st.layers, s, stages) for n in st.nodes] for s, st in enumerate(placement.stages)]
        rate = min(sum(u / t for t in ts) for ts in times)
        width = min(len(st.nodes) for st in placement.stages)
        lanes = (2 if spec.phase is Phase.PREFILL else 1) * stages * width
        latency = sum(max(ts) for ts in times) + (stages - 1) * placement.comm_s
        return min(rate, lanes * u / latency)

    return theta
