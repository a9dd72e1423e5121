"""The allocator as the runtime's live planner: observed demand -> the cheapest set of instances that serves it.

Two modes (both `planner: allocator` in the cluster file):

- :class:`PlanPlanner` (`coral serve --plan plan.json`): the real one. It re-plans over the plan's
  own scenario: its template library (SLO budgets, node configurations), its prices and
  availability per region, and the simulator's epoch demand on the requests the coordinator
  recorded (:func:`coral.policy.demand.epoch_demand`: the queueing model on the last epoch's
  requests and on the scenario's traffic sample, scaled to the forecast rate), and maps the new
  plan back to runtime instances through :mod:`coral.runtime.deploy.mapping`, as `serve --plan` does.
  A spot instance's preemption notice (issue 30) marks its (region, configuration) spot pools down
  for the fitted recovery time (:meth:`PlanPlanner.after_notice`), and every re-plan until then
  starts no spot instance in those (`allocate(..., spot_down=...)`; the spot instances still running
  there stay): the replacement is on-demand or spot from a pool not lost (another configuration or
  region).
- :class:`AllocatorPlanner` (a cluster file alone): the file's own instance shapes, each engine
  process one node of one local configuration, on the observed tokens/s over a target utilization.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from coral.allocator import Plan, allocate, allocate_inputs, tight_availability
from coral.allocator.allocate import METHODS
from coral.allocator.demand import Forecaster
from coral.allocator.inputs import AllocationInputs
from coral.allocator.spot import spot_region
from coral.cache import default_cache_dir
from coral.errors import CoralError
from coral.perf.model import DEMAND_PHASES, Phase
from coral.policy.demand import epoch_demand, epoch_forecaster
from coral.runtime.deploy.cluster_config import MIXED, InstanceSpec, ServedModel
from coral.runtime.deploy.lifecycle import shape_key
from coral.runtime.deploy.mapping import plan_instance_specs
from coral.runtime.deploy.plan_file import parse_plan
from coral.runtime.deploy.vllm import nodes_of, vllm_templates
from coral.runtime.serving.window import EpochObservation
from coral.scenario import Scenario, with_demand_scale, with_spot
from coral.solver import SolveOptions
from coral.templates.library import build_library
from coral.templates.planning import plan_inputs
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template, TemplateLibrary
from coral.workload import Trace, cut, scale_to_rate

log = logging.getLogger(__name__)

LOCAL_NODE = "1xLOCAL"  # the configuration name the local provisioner's nodes are counted under


def _template(spec: InstanceSpec) -> Template:
    """One shape as a template: its declared throughput, one node per engine process."""
    nodes = sum(len(st.node_throughputs) for st in spec.stages)
    stages = tuple(Stage(nodes=(LOCAL_NODE,) * len(st.node_throughputs), node_index=tuple(range(len(st.node_throughputs))),
                         layers=st.layer_end - st.layer_start, time_s=0.0, throughput_tok_per_s=spec.throughput_tok_per_s)
                   for st in spec.stages)
    placement = Placement(stages=stages, micro_batch=1, throughput_tok_per_s=spec.throughput_tok_per_s, latency_s=0.0,
                          comm_s=0.0)
    # A cluster-file shape has no SLO: its latency is not planned, only its throughput.
    return Template(model=spec.model, phase=Phase(spec.phase), slo_ms=math.inf, budget_ms=math.inf,
                    nodes=(LOCAL_NODE,) * nodes, placement=placement)


@dataclasses.dataclass(slots=True)
class AllocatorPlanner:
    """`planner(observed_demand, running) -> desired` for `Controller`, backed by the allocation ILP.

    The candidate instances are the distinct shapes of the cluster file (prefill and decode;
    `mixed` instances are kept as they are). Each engine process is one node of price
    `node_usd_per_h`; at most `max_nodes` run per region. Demand is the observed tokens/s over
    `target_utilization` with a floor of `min_instances` instance per (model, phase) that has one.
    """

    shapes: Sequence[InstanceSpec]
    node_usd_per_h: float = 1.0
    max_nodes: int = 64
    target_utilization: float = 0.8
    init_s: float = 10.0
    min_instances: int = 1
    options: SolveOptions = dataclasses.field(default_factory=lambda: SolveOptions(time_limit_s=10.0))

    def __call__(self, seen: EpochObservation, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        demand = seen.demand_tok_per_s
        # Shapes with the same model, phase and node count are the same template to the
        # allocator: keep the one that serves most.
        best: dict[str, tuple[Template, InstanceSpec]] = {}
        for s in self.shapes:
            if s.phase == MIXED:
                continue
            t = _template(s)
            if t.key not in best or t.throughput_tok_per_s > best[t.key][0].throughput_tok_per_s:
                best[t.key] = (t, s)
        groups: dict[tuple[str, Phase], list[Template]] = {}
        for t, _ in best.values():
            groups.setdefault((t.model, t.phase), []).append(t)
        regions = sorted({s.region for _, s in best.values()})
        want = {}
        for (model, phase), ts in groups.items():
            observed = float(demand.get(model, {}).get(phase.value, 0.0)) / self.target_utilization
            want[(model, phase)] = max(observed, self.min_instances * min(t.throughput_tok_per_s for t in ts))
        models = tuple(sorted({m for m, _ in groups}))
        for m in models:  # a phase without a shape has no demand to meet here
            for ph in DEMAND_PHASES:
                want.setdefault((m, ph), 0.0)
        inputs = AllocationInputs(
            models=models, regions=tuple(regions), configs=(LOCAL_NODE,),
            prices={(r, LOCAL_NODE): self.node_usd_per_h for r in regions},
            availability={(r, LOCAL_NODE): self.max_nodes for r in regions},
            demand=want, allowed_regions={m: tuple(regions) for m in models},
            slo_ms={g: 0.0 for g in want}, templates={g: tuple(ts) for g, ts in groups.items()}, init_s=self.init_s)
        key_of = {shape_key(s): t.key for t, s in best.values()}
        prev = Counter((s.region, key_of[shape_key(s)]) for s in running if shape_key(s) in key_of)
        plan = allocate_inputs(inputs, prev=dict(prev), options=self.options)
        desired: list[InstanceSpec] = [s for s in running if s.phase == MIXED]
        for inst in plan.instances:
            spec = best[inst.template.key][1]
            desired.extend(dataclasses.replace(spec, region=inst.region) for _ in range(inst.count))
        if not desired and running:
            return list(running)  # never plan the cluster away entirely
        return desired


FLOOR_TOK_PER_S = 1.0  # the demand of a (model, phase) seen idle: one instance stays to take the next request


def template_key(spec: InstanceSpec) -> str | None:
    """The template key (`model/phase/node+node...`, as `Template.key`) of an instance a plan placed (a mixed
    one is a plan's colocated instance); None for one without node configurations (a cluster file's own shape)."""
    if not all(st.configs for st in spec.stages):
        return None
    phase = Phase.COLOCATED.value if spec.phase == MIXED else spec.phase
    # the stages name entries (whole nodes or TP groups of them); the key names the rented nodes
    return f"{spec.model}/{phase}/" + "+".join(nodes_of([st.configs for st in spec.stages]))


@dataclasses.dataclass(slots=True)
class PlanPlanner:
    """`planner(observation, running) -> desired` over the scenario of the plan being served.

    Each call: the requests the coordinator recorded over the epoch -> the simulator's epoch demand
    (:func:`coral.policy.demand.epoch_demand`: the queueing model on them and on the scenario's
    traffic sample, scaled to the forecast rate, EWMA + quantile with hysteresis) -> at least
    :data:`FLOOR_TOK_PER_S` per (model, phase) -> the allocation ILP over the library with the
    running plan as `prev` (starting an instance costs its `init_s`) -> runtime instances, named and
    weighted as `serve --plan` names them.

    Build it with :meth:`from_plan`; `last_plan` holds the last allocation (for logs and tests).
    """

    scenario: Scenario
    library: TemplateLibrary  # what the allocator chooses from (restricted for an `--engine vllm` plan)
    sizing_library: TemplateLibrary  # what prefill capacity is sized in (the full library, as `coral plan`)
    availability: Mapping[tuple[str, str], int]
    models: Mapping[str, ServedModel]
    method: str = "coral"
    forecast: Forecaster = dataclasses.field(default_factory=Forecaster)
    options: SolveOptions = dataclasses.field(default_factory=lambda: SolveOptions(time_limit_s=30.0))
    last_plan: Plan | None = None
    last_demand: dict[tuple[str, Phase], float] = dataclasses.field(default_factory=dict)
    # (region, config) -> when its spot pool is back (`clock` seconds): lost to a notice, not rented until then
    spot_down: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def from_plan(cls, plan: Any, models: Mapping[str, ServedModel], *, cache_dir: Any = None,
                  options: SolveOptions | None = None) -> PlanPlanner:
        """The planner of a served plan file: its scenario (at its `--demand-scale`, with spot on where the
        plan rents spot), library (restricted as its `--engine`), availability mode and method.

        Args:
            plan: a `coral.runtime.deploy.plan_file.PlanFile`.
            models: the cluster file's models by name (weights, layer counts).
            cache_dir: the template cache (default: Coral's).
            options: the solver's options (default HiGHS, 30 s).

        Raises:
            CoralError: a method the live planner cannot run, or a library build error.
        """
        if plan.method not in METHODS:
            raise CoralError(f"{plan.path}: method {plan.method!r} cannot re-plan live; valid: {', '.join(METHODS)}")
        scenario = with_demand_scale(plan.scenario, plan.demand_scale)
        if any(i.spot for i in plan.instances) and not scenario.spot:
            scenario = with_spot(scenario)  # a plan made with `coral plan --spot` re-plans with spot on too
        full = build_library(scenario, cache_dir=cache_dir or default_cache_dir())
        library = full
        if plan.engine == "vllm":
            library = TemplateLibrary(templates=vllm_templates(full.templates, {m.name: m.spec for m in scenario.models}),
                                      stats=full.stats)
        availability = dict(scenario.availability)
        if plan.availability == "tight":
            availability = dict(tight_availability(scenario, full))
        return cls(scenario=scenario, library=library, sizing_library=full, availability=availability,
                   models=dict(models), method=plan.method, forecast=epoch_forecaster(scenario),
                   options=options or SolveOptions(time_limit_s=30.0))

    def epoch_demand(self, seen: EpochObservation) -> dict[tuple[str, Phase], float]:
        """The simulator's epoch demand on the epoch's requests (tok/s per (model, phase)); updates the forecast."""
        return epoch_demand(self.scenario, seen.window, self.forecast, self.sizing_library)

    def capacity(self, seen: EpochObservation) -> dict[tuple[str, Phase], float]:
        """The capacity to plan for, per (model, phase), tok/s: :meth:`epoch_demand`, at least
        :data:`FLOOR_TOK_PER_S` (a model seen idle keeps one instance to take its next request)."""
        return {g: max(FLOOR_TOK_PER_S, v) for g, v in self.epoch_demand(seen).items()}

    def __call__(self, seen: EpochObservation, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        return self._plan(self.capacity(seen), running)

    def pools_down(self) -> frozenset[tuple[str, str]]:
        """The (region, config) spot pools lost to a notice and not back yet (those back are forgotten)."""
        now = self.clock()
        for pool in [p for p, back in self.spot_down.items() if back <= now]:
            del self.spot_down[pool]
            log.info("live planner: spot pool %s / %s is back", *pool)
        return frozenset(self.spot_down)

    def spot_lost(self, region: str, configs: Sequence[str]) -> None:
        """Mark `region`'s spot pools of `configs` down: for the scenario's fitted recovery time (its spot
        process's `recovery_s`), at least one epoch (the next re-plan still sees it lost)."""
        now = self.clock()
        for c in configs:
            offer = self.scenario.spot.get((region, c))
            hold_s = max(offer.process.recovery_s if offer is not None else 0.0, float(self.scenario.planner.epoch_s))
            self.spot_down[(region, c)] = max(self.spot_down.get((region, c), 0.0), now + hold_s)

    def spot_back(self, region: str | None = None, config: str | None = None) -> None:
        """Forget lost spot pools now (all, or those of `region` and / or `config`): told the capacity is back."""
        for r, c in list(self.spot_down):
            if region in (None, r) and config in (None, c):
                del self.spot_down[(r, c)]

    def after_notice(self, lost: InstanceSpec, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec] | None:
        """A spot instance's preemption notice (`Controller.preempt`): its spot pools are down
        (:meth:`spot_lost`), and the plan without them on the last epoch's demand (before the first epoch:
        the scenario's own traffic), `running` (the instances left) as `prev`. None for an instance that is
        not spot or that the plan did not place (no node configurations).
        """
        key = template_key(lost)
        if not lost.spot or key is None:
            return None
        self.spot_lost(lost.region, sorted(set(key.split("/", 2)[2].split("+"))))
        want = self.last_demand or self._scenario_demand()
        log.warning("live planner: spot notice for %s: re-planning without the spot pools %s", lost.name,
                    ", ".join(f"{r} / {c}" for r, c in sorted(self.pools_down())))
        return self._plan(want, running)

    def _scenario_demand(self) -> dict[tuple[str, Phase], float]:
        """The capacity an epoch of the scenario's own traffic asks for (a forecaster of its own: the live one
        is not moved)."""
        seen = traffic_observation(self.scenario)
        demand = epoch_demand(self.scenario, seen.window, epoch_forecaster(self.scenario), self.sizing_library)
        return {g: max(FLOOR_TOK_PER_S, v) for g, v in demand.items()}

    def _plan(self, want: dict[tuple[str, Phase], float], running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        rows: dict[tuple[str, Phase | str], float] = {g: v for g, v in want.items()}
        # a running spot instance is counted in its region's spot market (`Plan.counts()` keys it so)
        prev = Counter((spot_region(s.region) if s.spot else s.region, k) for s in running
                       if (k := template_key(s)) is not None)
        plan = allocate(self.scenario, self.library, method=self.method, demand=rows, availability=self.availability,
                        prev=dict(prev), options=self.options, spot_down=self.pools_down())
        self.last_plan, self.last_demand = plan, want
        if not plan.instances:
            log.warning("live planner: the re-plan has no instance (%s); keeping the running plan", "; ".join(plan.notes))
            return list(running)
        pf = parse_plan({"scenario": self.scenario.name, **plan.to_json()}, self.scenario, "the live re-plan")
        log.info("live planner: %d instance(s), %.2f $/h (%s)", sum(i.count for i in pf.instances), plan.cost_usd_per_h,
                 plan.status.value)
        # a hand-written mixed instance (no node configurations) is kept; a plan's colocated one is re-planned
        return [*plan_instance_specs(pf, dict(self.models)), *(s for s in running if s.phase == MIXED and template_key(s) is None)]


def traffic_observation(scenario: Scenario, factor: float = 1.0, *, epoch_s: float | None = None) -> EpochObservation:
    """What the coordinator would record over one epoch of `factor` times the scenario's own traffic:
    each model's traffic sample sped up by `factor`, its first `epoch_s` (default `planner.epoch_s`).
    For benches, tests and dry runs of the live planner.

    Args:
        scenario: the resolved scenario.
        factor: the traffic's rate over the scenario's (0 = nothing arrived).
        epoch_s: the epoch's length.

    Returns:
        The observation (tokens/s and the requests' window), every model present.

    Raises:
        ValueError: a negative factor or a non-positive epoch.
    """
    span = float(scenario.planner.epoch_s if epoch_s is None else epoch_s)
    if factor < 0 or not span > 0:
        raise ValueError(f"factor must be >= 0 and epoch_s > 0, got {factor} and {span}")
    window: dict[str, Trace] = {}
    for m in plan_inputs(scenario):
        sample = m.history
        if factor > 0 and sample.rate_per_s > 0:
            window[m.model] = cut(scale_to_rate(sample, factor * sample.rate_per_s), 0.0, span)
        else:
            window[m.model] = Trace(name=m.model, arrival_s=np.zeros(0), prompt_tokens=np.zeros(0, dtype=np.int64),
                                   output_tokens=np.zeros(0, dtype=np.int64), window_s=span)
    demand = {m: {"prefill": float(t.prompt_tokens.sum()) / span, "decode": float(t.output_tokens.sum()) / span}
              for m, t in window.items()}
    return EpochObservation(demand_tok_per_s=demand, window=window, epoch_s=span)


__all__ = ["FLOOR_TOK_PER_S", "LOCAL_NODE", "AllocatorPlanner", "PlanPlanner", "template_key", "traffic_observation"]
