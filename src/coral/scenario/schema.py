"""Scenario file schema (YAML), validated once at the edge with pydantic.

A scenario says which models to serve (with SLOs and workloads), which node configurations
in which regions may be rented (prices, availability), which performance model to use and
the planner's knobs. `coral scenario show NAME` prints one resolved.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coral.workload import WorkloadSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelEntry(_Strict):
    """A model to serve, its SLOs and workload."""

    name: str = Field(description="Name the model is served and reported under.")
    spec: str | None = Field(None, description=(
        "Built-in model name (e.g. 'qwen3-32b') or a path to a Hugging Face config.json; default: `name`."))
    ttft_ms: float = Field(gt=0, allow_inf_nan=False, description="Time-to-first-token SLO (prefill latency budget), ms.")
    tpot_ms: float = Field(gt=0, allow_inf_nan=False, description="Time-per-output-token SLO (decode step budget), ms.")
    workload: WorkloadSpec = Field(description="The model's traffic (see coral.workload.WorkloadSpec).")
    regions: list[str] | None = Field(None, description="Regions this model may run in (data residency); default: all.")
    slo_attainment: float | None = Field(None, gt=0, lt=1, description=(
        "Share of this model's requests that must meet both SLOs (overrides the scenario's slo_attainment)."))


class RegionEntry(_Strict):
    """A region and what can be rented there."""

    name: str = Field(description="Region as '<cloud>:<region>', e.g. 'aws:us-east-2'.")
    prices: dict[str, float] = Field(default_factory=dict, description=(
        "Price overrides in $/h per node configuration (e.g. {'1xL4': 0.80}); others come from the catalog."))
    availability: dict[str, int] = Field(default_factory=dict, description=(
        "Nodes available per configuration; configurations not listed get the scenario's default_availability."))

    spot: bool = Field(False, description=(
        "Offer each configuration's spot instance in this region beside its on-demand one: the catalog's spot "
        "price with the preemption process fitted from AWS spot traces (V100, the proxy for every GPU; "
        "docs/reference/allocator.md). Off: nothing about spot changes the scenario."))
    spot_preemption_per_h: float | None = Field(None, description=(
        "Your own spot preemption rate per node-hour (a Poisson process, >= 0) instead of the fitted one."))
    spot_co_loss_share: float | None = Field(None, description=(
        "Your own correlation of preemptions within the region, in [0, 1]: for a node that is lost, the share of "
        "the other held nodes lost with it (0: independent, 1: all together); default the fitted one."))
    spot_share_cap: float | dict[str, float] = Field(1.0, description=(
        "Largest share of each model's capacity in this region that may be spot, in (0, 1]: bounds what one "
        "correlated event can take. One number for every model, or {model: share} (models not listed: 1, no cap)."))

    @field_validator("spot_preemption_per_h")
    @classmethod
    def _rate_ok(cls, v: float | None) -> float | None:
        if v is not None and not (v >= 0 and v != float("inf")):
            raise ValueError(f"spot_preemption_per_h must be a finite number >= 0 (preemptions per node-hour), got {v}; "
                             "give e.g. 0.4, or leave it out for the fitted rate")
        return v

    @field_validator("spot_co_loss_share")
    @classmethod
    def _rho_ok(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"spot_co_loss_share must be in [0, 1], got {v}; give e.g. 0.5, or leave it out for "
                             "the fitted correlation")
        return v

    @field_validator("spot_share_cap")
    @classmethod
    def _cap_ok(cls, v: float | dict[str, float]) -> float | dict[str, float]:
        for model, cap in (v.items() if isinstance(v, dict) else [("", v)]):
            if not 0 < cap <= 1:
                where = f"spot_share_cap of {model}" if model else "spot_share_cap"
                raise ValueError(f"{where} must be in (0, 1], got {cap}; give the largest share of a model's "
                                 "capacity here that may be spot, e.g. 0.5 (1: no cap)")
        return v

    @field_validator("prices")
    @classmethod
    def _prices_ok(cls, v: dict[str, float]) -> dict[str, float]:
        for cfg, price in v.items():
            if not (price >= 0) or price == float("inf"):
                raise ValueError(f"price of {cfg} must be a finite number >= 0, got {price}")
        return v

    @field_validator("availability")
    @classmethod
    def _avail_ok(cls, v: dict[str, int]) -> dict[str, int]:
        for cfg, count in v.items():
            if count < 0:
                raise ValueError(f"availability of {cfg} must be >= 0, got {count}")
        return v


class PerfEntry(_Strict):
    """Which performance model times the templates."""

    backend: Literal["roofline", "profile", "helix"] = Field("roofline", description=(
        "'roofline' (analytical, calibrated), 'profile' (our CSV of measured per-layer latencies), "
        "'helix' (Helix's per-layer LLaMA-2-70B files)."))
    profile: str | None = Field(None, description="Profile CSV (backend 'profile') or Helix profile folder (backend 'helix').")
    memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of GPU memory usable for weights and KV cache.")
    network_latency_ms: float = Field(0.2, ge=0, allow_inf_nan=False, description="Latency of one inter-stage hop, ms.")

    @model_validator(mode="after")
    def _profile_needed(self) -> PerfEntry:
        if self.backend == "profile" and not self.profile:
            raise ValueError("backend 'profile' needs `profile`: a CSV path")
        return self


class PlannerEntry(_Strict):
    """Knobs of the template library and the allocator."""

    n_max: int = Field(6, ge=1, le=8, description="Most nodes in one template.")
    rho: float = Field(12.0, ge=1, allow_inf_nan=False, description="Templates may hold at most rho x the model's weight bytes of GPU memory.")
    ttft_headroom: float = Field(0.5, gt=0, le=1, description=(
        "Prefill templates must bring the attainment-quantile prompt to its first token within this share of "
        "the TTFT SLO; the rest is left for queueing, which the capacity model sizes."))
    tpot_headroom: float = Field(0.9, gt=0, le=1, description=(
        "Decode templates must make one step within this share of the TPOT SLO, less the KV transfer each "
        "output token pays for where it counts in TPOT (first_token: prefill); their steady-state cadence with "
        "all micro-batches in flight is checked."))
    kv_ttft_share: float = Field(0.25, gt=0, lt=1, description=(
        "Where the KV transfer counts in TTFT (first_token: decode), the attainment-quantile request's transfer may "
        "take this share of TTFT: a template of either phase is kept only where its node's NIC ships it within that, "
        "and the queueing is sized for the rest."))
    kv_tpot_share: float = Field(0.1, gt=0, lt=1, description=(
        "Where the KV transfer counts in TPOT (first_token: prefill), the attainment-quantile request's transfer per "
        "output token may take this share of TPOT: a template of either phase is kept only where its node's NIC "
        "ships it within that, and decode templates step within tpot_headroom x TPOT less it."))
    first_token: Literal["auto", "prefill", "decode"] = Field("auto", description=(
        "Which instance emits a request's first token. prefill (the paper's runtime): the prefill -> decode "
        "KV transfer counts in TPOT; decode (vLLM's P/D proxy): it counts in TTFT. auto: per model, where the "
        "attainment-quantile request's transfer over the scenario's median NIC is the smaller share of its KV allowance."))
    history_s: float = Field(3600.0, gt=0, allow_inf_nan=False, description=(
        "Length of the traffic sample (a separate draw of each model's workload) the first plan's capacity "
        "is sized on; later epochs size on the traffic observed."))
    forecast_quantile: float = Field(0.9, gt=0, lt=1, description=(
        "Each epoch's demand is this quantile of the forecast of the next epoch's rate (EWMA level and the "
        "spread of its past errors), not the raw last-epoch mean."))
    scale_down_margin: float = Field(0.15, ge=0, lt=1, description=(
        "Hysteresis: an epoch's capacity only falls when the new target is more than this share below the "
        "running one (fewer instances stopped and restarted)."))
    router: Literal["least-work", "wrr"] = Field("least-work", description=(
        "Request routing in the simulator: 'least-work' sends each prompt to the prefill instance that clears "
        "it soonest (outstanding prompt tokens / throughput) and each decode to the least occupied instance; "
        "'wrr' is the paper's weighted round-robin in proportion to template throughput."))
    init_s: float = Field(120.0, ge=0, allow_inf_nan=False, description="Startup time of a new instance (loading weights), s.")
    epoch_s: float = Field(360.0, gt=0, allow_inf_nan=False, description="Re-planning period, s.")
    batch_grid: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128], description=(
        "Micro-batch sizes tried per template (decode); prefill tries the sizes up to prefill_max_batch."))
    prefill_max_batch: int = Field(8, ge=1, description="Largest prefill micro-batch (prompts) tried.")

    @field_validator("batch_grid")
    @classmethod
    def _grid_ok(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("batch_grid must be a non-empty list of integers >= 1")
        return sorted(set(v))


class ScenarioFile(_Strict):
    """A whole scenario."""

    name: str = Field(description="Scenario name.")
    description: str = Field("", description="What the scenario is for.")
    models: list[ModelEntry] = Field(min_length=1, description="Models to serve.")
    configs: list[str] = Field(min_length=1, description="Node configurations that may be rented, e.g. ['1xL4', '2xL40S'].")
    regions: list[RegionEntry] = Field(min_length=1, description="Regions and their prices / availability.")
    slo_attainment: float = Field(0.95, gt=0, lt=1, description=(
        "Share of each model's requests that must meet both SLOs (TTFT <= ttft_ms and TPOT = (e2e - TTFT) / "
        "(output tokens - 1) <= tpot_ms); the plan's capacity is sized for it. Per-model override: "
        "models[].slo_attainment."))
    default_availability: int = Field(64, ge=0, description="Nodes available per (region, configuration) unless listed.")
    derive_missing_prices: bool = Field(False, description=(
        "Opt in to derived shapes: offer a configuration a region does not sell (e.g. AWS has no 2-GPU L40S), "
        "priced at the per-GPU price of the nearest larger shape of the same GPU sold there (none larger: not "
        "offered) and marked derived in every output. Off (default): a region offers only the shapes it sells."))
    prices_csv: str | None = Field(None, description="Replace the built-in prices with this CSV (our format or SkyPilot vms.csv).")
    perf: PerfEntry = Field(default_factory=lambda: PerfEntry(), description="Performance model.")
    planner: PlannerEntry = Field(default_factory=lambda: PlannerEntry(), description="Planner knobs.")

    @model_validator(mode="after")
    def _unique(self) -> ScenarioFile:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        regions = [r.name for r in self.regions]
        if len(set(regions)) != len(regions):
            raise ValueError(f"region names must be unique, got {regions}")
        return self
