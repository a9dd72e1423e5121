"""The one place a template's latency budget and its KV transfer are derived from a model's SLO (DESIGN §4a).

- **Prefill** templates must bring the attainment-quantile prompt `P_q` to its first token within
  `ttft_headroom · TTFT`; the rest of the TTFT is left for queueing, which the capacity model sizes.
- **Decode** templates must make one step within `tpot_headroom · TPOT`.
- **The KV transfer** of a request goes from its prefill instance to its decode instance, over
  the slower NIC of the two. Where it counts depends on which instance emits the first token
  (`KvModel.first_token`):
  - `"prefill"` (the paper's runtime): the prefill instance emits it; the transfer delays the
    second token, so over a request it costs `P / (D − 1)` prompt tokens of KV per output token
    in TPOT. A decode template's budget loses the quantile request's share over its own NIC.
  - `"decode"` (vLLM's P/D proxy): the decode instance emits it once the KV has arrived, so the
    quantile prompt's whole KV counts in TTFT. A prefill template's budget loses that transfer
    over its own NIC.

  `auto` takes, per model, the mode where the quantile request's transfer over the scenario's
  median NIC is the smaller share of its SLO. Both phases are also capped in throughput by the KV
  their NICs can move (`KvModel.rate_tokens`): a prefill template sends one prompt token of KV
  per prompt token it serves, a decode template receives `E[P] / E[D]` per token it generates.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.perf.model import Phase
from coral.slo import Slo
from coral.workload.summary import LengthSummary

FIRST_TOKEN_MODES = ("auto", "prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class KvModel:
    """How a model's prefill -> decode KV transfer is charged (see the module docstring)."""

    first_token: str  # "prefill" or "decode": the instance that emits the first token
    bytes_per_token: float  # KV bytes of one prompt token, all layers
    prompt_q: float  # the quantile prompt (its KV counts in TTFT in "decode" mode)
    per_output_q: float  # the quantile of P / (D - 1) (prompt tokens per output token, "prefill" mode)
    prompt_per_output: float  # E[P] / E[D]: KV a decode instance receives per token it generates

    def __post_init__(self) -> None:
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"KvModel.first_token must be 'prefill' or 'decode', got {self.first_token!r}")

    def latency_tokens(self, phase: Phase) -> float:
        """Prompt tokens of KV a `phase` template's latency check moves over its NIC."""
        if phase is Phase.PREFILL:
            return self.prompt_q if self.first_token == "decode" else 0.0
        return self.per_output_q if self.first_token == "prefill" else 0.0

    def rate_tokens(self, phase: Phase) -> float:
        """Prompt tokens of KV per work token a `phase` template's NICs move (throughput cap)."""
        return 1.0 if phase is Phase.PREFILL else self.prompt_per_output


def kv_model(model: ModelSpec, lengths: LengthSummary, slo: Slo, configs: Sequence[NodeConfig],
             first_token: str = "auto") -> KvModel:
    """The model's KV model; `first_token` "auto" picks the mode as the module docstring says."""
    if first_token not in FIRST_TOKEN_MODES:
        raise ValueError(f"first_token must be one of {', '.join(FIRST_TOKEN_MODES)}, got {first_token!r}")
    per_token = model.num_layers * model.kv_bytes_per_token_layer
    mode = first_token
    if mode == "auto":
        nic = statistics.median(c.network_bytes_per_s for c in configs) if configs else 1.25e9
        ttft_share = lengths.prompt_q * per_token / nic * 1e3 / slo.ttft_ms
        tpot_share = lengths.kv_per_token_q * per_token / nic * 1e3 / slo.tpot_ms
        mode = "decode" if ttft_share < tpot_share else "prefill"
    return KvModel(first_token=mode, bytes_per_token=per_token, prompt_q=lengths.prompt_q,
                   per_output_q=lengths.kv_per_token_q,
                   prompt_per_output=lengths.prompt_mean / max(lengths.output_mean, 1.0))


def latency_budget_ms(slo: Slo, phase: Phase, *, ttft_headroom: float, tpot_headroom: float) -> float:
    """A template's latency budget (ms) for `phase` before its own KV transfer: see the module docstring."""
    if phase is Phase.PREFILL:
        return slo.ttft_ms * ttft_headroom
    return slo.tpot_ms * tpot_headroom
