"""The one place a template's latency budget is derived from a model's SLO (DESIGN §4a).

- **Prefill** templates must bring the attainment-quantile prompt `P_q` to its first token within
  `ttft_headroom · TTFT`; the rest of the TTFT is left for queueing, which the capacity model sizes.
- **Decode** templates must make one step within `tpot_headroom · TPOT` less the KV transfer each
  output token pays for: the quantile request's prompt KV (`kv_per_token_q` prompt tokens per
  output token) over the model's KV link, the slowest NIC its templates may use. That floor is the
  smallest NIC among the scenario's configurations that keeps the transfer within `kv_share` of
  TPOT and gives the lowest estimated cost (single-node templates' $ per token in both phases at
  their budgets: a faster floor rules nodes out but leaves more of the TPOT to the step); slower nodes are left out of the model's templates in both phases, so every
  prefill -> decode pair is at least that fast and the plan and the simulator see the same figure.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.perf.model import Phase
from coral.slo import Slo
from coral.workload.summary import LengthSummary


@dataclass(frozen=True, slots=True, kw_only=True)
class KvLink:
    """The KV transfer a model's plan assumes: the NIC floor of its nodes and what it costs TPOT."""

    floor_gbps: float
    bytes_per_token: float  # KV bytes of one prompt token, all layers
    per_output_token_ms: float  # the quantile request's KV transfer per output token at the floor

    @property
    def s_per_prompt_token(self) -> float:
        return self.bytes_per_token / (self.floor_gbps * 1e9 / 8)


def kv_link(model: ModelSpec, lengths: LengthSummary, slo: Slo, configs: Sequence[NodeConfig],
            kv_share: float, cost: Callable[[float, float], float] | None = None) -> KvLink:
    """The model's KV link: among the NIC speeds (Gbps) that keep the quantile request's KV transfer
    within `kv_share` of TPOT, the one with the lowest `cost(floor_gbps, transfer_ms)` (an estimate
    of the model's $/h with only nodes at least that fast; a faster floor rules out nodes but leaves
    more of the TPOT to the step), the slowest on a tie or without `cost`. The fastest NIC offered
    when none keeps the transfer within `kv_share` (then the decode budget shrinks, or vanishes)."""
    per_token = model.num_layers * model.kv_bytes_per_token_layer
    speeds = sorted({c.network_gbps for c in configs})
    if not speeds:  # nothing to place it on: no transfer to budget for
        return KvLink(floor_gbps=math.inf, bytes_per_token=per_token, per_output_token_ms=0.0)

    def cost_ms(gbps: float) -> float:
        return lengths.kv_per_token_q * per_token / (gbps * 1e9 / 8) * 1e3

    ok = [g for g in speeds if cost_ms(g) <= kv_share * slo.tpot_ms]
    if not ok:
        floor = speeds[-1]
    elif cost is None:
        floor = ok[0]
    else:
        floor = min(ok, key=lambda g: (cost(g, cost_ms(g)), g))
    return KvLink(floor_gbps=floor, bytes_per_token=per_token, per_output_token_ms=cost_ms(floor))


def latency_budget_ms(slo: Slo, phase: Phase, *, ttft_headroom: float, tpot_headroom: float,
                      kv: KvLink | None = None) -> float:
    """A template's latency budget (ms) for `phase`: see the module docstring. Can be <= 0 when the
    KV transfer alone takes the TPOT (then no decode template exists)."""
    if phase is Phase.PREFILL:
        return slo.ttft_ms * ttft_headroom
    return slo.tpot_ms * tpot_headroom - (kv.per_output_token_ms if kv is not None else 0.0)


def usable_configs(configs: Sequence[NodeConfig], kv: KvLink) -> tuple[NodeConfig, ...]:
    """The configurations fast enough for the model's KV link."""
    return tuple(c for c in configs if c.network_gbps >= kv.floor_gbps)
