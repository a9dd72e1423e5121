"""The allocator's output: a `Plan` (nodes to rent per region, serving instances, demand vs capacity)."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coral.allocator.spot import spot_region
from coral.perf.model import Phase
from coral.solver import Status
from coral.templates.template import Template

# A plan's status is the solver's (`coral.solver.Status`): OPTIMAL (proved within the MIP gap),
# FEASIBLE (a valid plan without proof: the greedy baselines, or a solver stop), TIME_LIMIT (the
# best plan found in time), INFEASIBLE (no plan; `notes` says why), ERROR (the solver failed;
# the plan is a fallback, see `notes`).
PlanStatus = Status

# The plan file's format version (`coral.runtime.deploy.plan_file` refuses others). 2: instances
# carry micro_batch, slo_ms, budget_ms and per-stage node_index / throughput_tok_per_s. 3: colocated
# instances (phase "colocated", chunk_tokens, decode_tok_per_s) and each model's mode. 4: spot
# instances and nodes (`spot`, and each instance's `capacity_share`, the share of its capacity the
# plan counted).
PLAN_JSON_VERSION = 4
#: A model's serving mode in a plan: disaggregated pools only, colocated instances only, or both.
MODEL_MODES = ("disagg", "colocated", "mix")


@dataclass(frozen=True, slots=True, kw_only=True)
class Instance:
    """`count` serving instances of one template in one region, on-demand or spot.

    A spot instance (`spot`) pays the spot price and counts `capacity_share` of its throughput:
    the chance that all its nodes survive an epoch and a replacement's start-up
    (`coral.allocator.spot`); an on-demand one counts all of it."""

    region: str
    template: Template
    count: int
    price_usd_per_h: float  # one instance: `p_r(τ)` (the spot price for a spot instance)
    spot: bool = False
    capacity_share: float = 1.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Instance.count must be >= 1, got {self.count}")
        if not (math.isfinite(self.price_usd_per_h) and self.price_usd_per_h >= 0):
            raise ValueError(f"Instance.price_usd_per_h must be finite and >= 0, got {self.price_usd_per_h}")
        if not 0 < self.capacity_share <= 1:
            raise ValueError(f"Instance.capacity_share must be in (0, 1], got {self.capacity_share}")

    @property
    def market(self) -> str:
        """The allocator's market of this instance: its region, or the region's spot market."""
        return spot_region(self.region) if self.spot else self.region

    @property
    def model(self) -> str:
        return self.template.model

    @property
    def phase(self) -> Phase:
        return self.template.phase

    @property
    def throughput_tok_per_s(self) -> float:
        """One instance's throughput `Θ(τ)`."""
        return self.template.throughput_tok_per_s

    @property
    def capacity_tok_per_s(self) -> float:
        """What the plan counts these instances for: `count · capacity_share · Θ(τ)`."""
        return self.count * self.capacity_share * self.template.throughput_tok_per_s

    @property
    def cost_usd_per_h(self) -> float:
        return self.count * self.price_usd_per_h


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeUse:
    """Nodes of one configuration rented in one region (on-demand or spot), and how many were available."""

    region: str
    config: str
    count: int
    available: int | None  # None: unbounded
    spot: bool = False

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"NodeUse.count must be >= 0, got {self.count}")

    @property
    def binding(self) -> bool:
        """Every available node is used (the resource limits the plan)."""
        return self.available is not None and self.available > 0 and self.count >= self.available


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandLine:
    """Demand and planned capacity of one (model, phase)."""

    model: str
    phase: Phase
    demand_tok_per_s: float
    capacity_tok_per_s: float

    @property
    def served_fraction(self) -> float:
        """Capacity / demand, capped at 1 (1 where there is no demand)."""
        if self.demand_tok_per_s <= 0:
            return 1.0
        return min(1.0, self.capacity_tok_per_s / self.demand_tok_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A resource plan: per region the nodes to rent, grouped into serving instances.

    `cost_usd_per_h` is the rental cost `Σ p_r(τ)·ν_{r,τ}`; `init_penalty_usd_per_h` the
    amortized start-up penalty of newly started instances the ILP charged on top (0 for the
    baselines); `objective` what the solver minimized (their sum, for `coral`). `alpha` is the
    uniform fraction of every (model, phase) demand the plan serves (1 unless goodput mode or a
    baseline ran out of nodes). `gap` is the proven relative MIP gap (None for the heuristics).
    """

    method: str
    status: PlanStatus
    instances: tuple[Instance, ...]
    nodes: tuple[NodeUse, ...]
    demand: tuple[DemandLine, ...]
    cost_usd_per_h: float
    alpha: float
    solve_s: float
    gap: float | None = None
    objective: float | None = None
    init_penalty_usd_per_h: float = 0.0
    goodput_mode: bool = False
    notes: tuple[str, ...] = ()
    # per model, which instance emits its first token ("prefill" / "decode", coral.templates.budget)
    first_token: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0 + 1e-9:
            raise ValueError(f"Plan.alpha must be in [0, 1], got {self.alpha}")
        if not (math.isfinite(self.cost_usd_per_h) and self.cost_usd_per_h >= 0):
            raise ValueError(f"Plan.cost_usd_per_h must be finite and >= 0, got {self.cost_usd_per_h}")
        if self.solve_s < 0:
            raise ValueError(f"Plan.solve_s must be >= 0, got {self.solve_s}")
        if self.gap is not None and not self.gap >= 0:
            raise ValueError(f"Plan.gap must be >= 0 or None, got {self.gap}")

    # -- views -------------------------------------------------------------------------------
    @property
    def binding(self) -> tuple[tuple[str, str], ...]:
        """(region, config) pairs used up to their availability."""
        return tuple((n.region, n.config) for n in self.nodes if n.binding)

    def counts(self) -> dict[tuple[str, str], int]:
        """`ν_{r,τ}` keyed by (market, template key): what the next epoch passes as `prev` (the
        market is the region, or `spot_region(region)` for spot instances)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for i in self.instances:
            out[(i.market, i.template.key)] += i.count
        return dict(out)

    def model_modes(self) -> dict[str, str]:
        """Per model with instances, how the plan serves it (one of `MODEL_MODES`)."""
        kinds: dict[str, set[str]] = defaultdict(set)
        for i in self.instances:
            kinds[i.model].add("colocated" if i.phase is Phase.COLOCATED else "disagg")
        return {m: "mix" if len(k) > 1 else next(iter(k)) for m, k in kinds.items()}

    def cost_by_model_phase(self) -> dict[tuple[str, Phase], float]:
        out: dict[tuple[str, Phase], float] = defaultdict(float)
        for i in self.instances:
            out[(i.model, i.phase)] += i.cost_usd_per_h
        return dict(out)

    def nodes_by_region(self) -> dict[str, dict[str, int]]:
        """Nodes per region and config, on-demand and spot together."""
        out: dict[str, dict[str, int]] = {}
        for n in self.nodes:
            if n.count:
                per = out.setdefault(n.region, {})
                per[n.config] = per.get(n.config, 0) + n.count
        return out

    @property
    def spot_cost_usd_per_h(self) -> float:
        """What the plan's spot instances cost."""
        return sum(i.cost_usd_per_h for i in self.instances if i.spot)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (plain str / int / float / list / dict / None)."""
        return {
            "plan_version": PLAN_JSON_VERSION,
            "method": self.method,
            "status": self.status.value,
            "cost_usd_per_h": self.cost_usd_per_h,
            "init_penalty_usd_per_h": self.init_penalty_usd_per_h,
            "objective": self.objective,
            "alpha": self.alpha,
            "goodput_mode": self.goodput_mode,
            "solve_s": self.solve_s,
            "gap": self.gap,
            "binding": [{"region": r, "config": c} for r, c in self.binding],
            "notes": list(self.notes),
            "models": self._models_json(),
            "instances": [
                {
                    "model": i.model,
                    "phase": i.phase.value,
                    "region": i.region,
                    "nodes": list(i.template.nodes),
                    "count": i.count,
                    "spot": i.spot,
                    "capacity_share": i.capacity_share,
                    "throughput_tok_per_s": i.throughput_tok_per_s,
                    "price_usd_per_h": i.price_usd_per_h,
                    "micro_batch": i.template.placement.micro_batch,
                    "slo_ms": i.template.slo_ms,
                    "budget_ms": i.template.budget_ms,
                    **({"chunk_tokens": i.template.chunk_tokens, "decode_tok_per_s": i.template.decode_tok_per_s}
                       if i.phase is Phase.COLOCATED else {}),
                    "stages": [{"nodes": list(s.nodes), "layers": s.layers, "node_index": list(s.node_index),
                                "throughput_tok_per_s": s.throughput_tok_per_s}
                               for s in i.template.placement.stages],
                    # per stage entry, the index into `nodes` of the machine it runs on (Template.hosts)
                    "hosts": [list(h) for h in i.template.hosts()],
                }
                for i in self.instances
            ],
            "demand": [
                {"model": d.model, "phase": d.phase.value, "demand_tok_per_s": d.demand_tok_per_s,
                 "capacity_tok_per_s": d.capacity_tok_per_s}
                for d in self.demand
            ],
            "nodes": [{"region": n.region, "config": n.config, "count": n.count, "available": n.available,
                       "spot": n.spot} for n in self.nodes],
        }

    def _models_json(self) -> list[dict[str, Any]]:
        """Per model: the instance that emits its first token (disaggregated) and its mode; a model
        without instances (no demand) has mode None."""
        modes = self.model_modes()
        names = list(dict.fromkeys([*self.first_token, *modes]))
        return [{"model": m, "first_token": self.first_token.get(m), "mode": modes.get(m)} for m in names]
