"""What determines one (model, phase) template library, and its cache key (DESIGN §3)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.perf.model import PerfModel, Phase

LIBRARY_FORMAT = "coral-templates/7"  # 7: colocated templates; 6: TP-group layouts, per-entry KV caps, KV per NIC


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateSpec:
    """Everything that determines one (model, phase) library: the cache key is its hash."""

    model: ModelSpec
    phase: Phase
    slo_ms: float  # the phase's SLO as the scenario states it
    budget_ms: float  # the latency the placements are held to (coral.templates.budget)
    prompt_tokens: float  # the prompt length the latency is checked at (prefill: the quantile prompt)
    output_tokens: float
    configs: tuple[NodeConfig, ...]
    n_max: int
    rho: float
    batches: tuple[int, ...]
    work_prompt_tokens: float | None = None  # prefill: E[P²]/E[P], where Θ is measured (None: prompt_tokens)
    lengths: tuple[tuple[str, float], ...] = ()  # the length summary the spec came from (cache key)
    # The KV transfer (coral.templates.budget.KvModel): bytes per prompt token, the prompt tokens
    # of KV the latency check moves over the template's NIC, and those per work token its NICs move.
    kv_bytes_per_token: float = 0.0
    kv_latency_tokens: float = 0.0
    kv_allowance_ms: float = float("inf")  # the quantile transfer over the template's NIC must fit it
    kv_rate_tokens: float = 0.0
    layouts: bool = True  # split nodes into TP groups (data-parallel engines or in-node pipeline stages)
    max_entries: int = 8  # most stage entries (whole nodes or TP groups) one layout may expand to
    # Colocated only (coral.templates.colocated): the TTFT budget, the prompt it is checked at,
    # and E[P] / E[D], the ratio a replica serves prompt and output tokens in.
    ttft_budget_ms: float = 0.0
    ttft_prompt_tokens: float = 0.0
    prompt_per_output: float = 0.0

    def cache_key(self, perf: PerfModel) -> str:
        payload = {
            "format": LIBRARY_FORMAT, "model": asdict(self.model), "phase": self.phase.value, "slo_ms": self.slo_ms,
            "budget_ms": self.budget_ms, "work_prompt_tokens": self.work_prompt_tokens, "lengths": list(self.lengths),
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "configs": [asdict(c) for c in self.configs], "n_max": self.n_max, "rho": self.rho,
            "batches": list(self.batches), "perf": perf_fingerprint(perf, {c.gpu.name for c in self.configs}),
            "kv": [self.kv_bytes_per_token, self.kv_latency_tokens, self.kv_allowance_ms, self.kv_rate_tokens],
            "layouts": [self.layouts, self.max_entries],
            "colocated": [self.ttft_budget_ms, self.ttft_prompt_tokens, self.prompt_per_output],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def perf_fingerprint(perf: PerfModel, gpus: set[str] | None = None) -> dict[str, Any]:
    """The performance model's version and parameters (system constants, and the efficiencies
    of `gpus` — the GPUs a library uses — so a change elsewhere keeps its cache valid)."""
    out: dict[str, Any] = {"version": perf.version, "system": asdict(perf.system)}
    eff_of = getattr(perf, "eff", None)
    if eff_of is not None and gpus is not None:
        out["efficiency"] = {g: asdict(perf.efficiency.get(g, perf.default)) for g in sorted(gpus)}  # type: ignore[attr-defined]
    fallback = getattr(perf, "fallback", None)
    if fallback is not None:
        out["fallback"] = perf_fingerprint(fallback, gpus)
    return out
