"""Helpers for the simulator tests: a constant-time performance model, hand templates, Poisson traces."""
from __future__ import annotations

import numpy as np

from coral.perf.model import PerfModel, Phase
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template
from coral.workload import Trace


class ConstPerf(PerfModel):
    """Every layer takes `layer_s`; no first/last extras; transfers take `xfer_s`."""

    version = "const"

    def __init__(self, layer_s: float, xfer_s: float = 0.0) -> None:
        super().__init__()
        self.layer_s = layer_s
        self.xfer_s = xfer_s

    def layer_time_s(self, config, model, shape):  # noqa: ANN001, ANN201
        return self.layer_s

    def stage_extra_s(self, config, model, shape, *, first, last):  # noqa: ANN001, ANN201
        return 0.0

    def extra_s(self, config, model, *, tokens, rows, first, last):  # noqa: ANN001, ANN201
        return 0.0

    def transfer_s(self, model, shape, src, dst):  # noqa: ANN001, ANN201
        return self.xfer_s

    def kv_transfer_s(self, model, prompt_tokens, src, dst, *, layers=None):  # noqa: ANN001, ANN201
        return self.xfer_s


def const_template(model: str, phase: Phase, *, stages: int = 1, layers: int = 10, layer_s: float = 0.01,
                   batch: int = 1, node: str = "1xL40S", tok: float = 100.0, chunk_tokens: int | None = None) -> Template:
    """A template whose numbers match `ConstPerf(layer_s)`: `stages` stages of one node each
    (colocated: `chunk_tokens` prompt tokens a step, Θ_D = `batch` tokens a step)."""
    per = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    st = tuple(Stage(nodes=(node,), node_index=(s,), layers=j, time_s=j * layer_s,
                     throughput_tok_per_s=tok * batch / (j * layer_s)) for s, j in enumerate(per))
    pl = Placement(stages=st, micro_batch=batch, throughput_tok_per_s=min(s.throughput_tok_per_s for s in st),
                   latency_s=sum(s.time_s for s in st), comm_s=0.0)
    colo = phase is Phase.COLOCATED
    return Template(model=model, phase=phase, slo_ms=1e6, budget_ms=1e6, nodes=(node,) * stages, placement=pl,
                    chunk_tokens=chunk_tokens if colo else None,
                    decode_tok_per_s=pl.throughput_tok_per_s / tok if colo else None)


def poisson_trace(name: str, rate: float, duration_s: float, seed: int, *, prompt: int = 100,
                  output: int | tuple[int, int] = 1) -> Trace:
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 1.2) + 50
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    arr = arr[arr < duration_s]
    if isinstance(output, tuple):
        out = rng.integers(output[0], output[1] + 1, arr.size)
    else:
        out = np.full(arr.size, output)
    return Trace(name=name, arrival_s=arr, prompt_tokens=np.full(arr.size, prompt), output_tokens=out)
