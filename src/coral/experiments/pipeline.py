"""The end-to-end pipeline shared by the CLI and the experiments: library -> plan -> simulation."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coral.allocator import Plan, allocate, tight_availability
from coral.allocator.demand import Forecaster
from coral.allocator.spot import spot_region
from coral.cache import default_cache_dir
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.policy import InstanceSpec
from coral.policy.demand import epoch_demand, epoch_forecaster
from coral.scenario import Scenario, load_scenario, with_demand_scale
from coral.sim import SimResult, SpotMarket, simulate
from coral.solver import SolveOptions
from coral.templates.library import build_library
from coral.templates.template import TemplateLibrary
from coral.workload import Trace, build_workload

AVAILABILITY_MODES = ("abundant", "tight")


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """A scenario with its library and the availability a run uses."""

    scenario: Scenario
    library: TemplateLibrary
    availability: Mapping[tuple[str, str], int]
    availability_mode: str
    library_s: float


def scaled_scenario(name: str, demand_scale: float = 1.0, overrides: Mapping[str, Any] | None = None) -> Scenario:
    """Load a scenario with every model's rate multiplied by `demand_scale`."""
    if not demand_scale > 0 or demand_scale == float("inf"):
        raise CoralError(f"--demand-scale must be a finite number > 0, got {demand_scale}")
    return with_demand_scale(load_scenario(name, overrides), demand_scale)


def prepare(scenario: Scenario, *, availability: str = "abundant", jobs: int = 1, cache_dir: Path | None = None,
            use_cache: bool = True, n_max: int | None = None, rho: float | None = None,
            on_unit: Callable[[Any], None] | None = None,
            step: Callable[[Any, int, int], None] | None = None) -> Setup:
    """Build (or read) the scenario's library and work out the availability mode's node counts.

    Raises:
        CoralError: an unknown availability mode.
    """
    if availability not in AVAILABILITY_MODES:
        raise CoralError(f"unknown availability {availability!r}; valid: {', '.join(AVAILABILITY_MODES)}")
    t0 = time.perf_counter()
    library = build_library(scenario, jobs=jobs, cache_dir=(cache_dir or default_cache_dir()) if use_cache else None,
                            n_max=n_max, rho=rho, progress=on_unit, step=step)
    library_s = time.perf_counter() - t0
    avail = dict(scenario.availability)
    if availability == "tight":
        avail = dict(tight_availability(scenario, library))
    return Setup(scenario=scenario, library=library, availability=avail, availability_mode=availability,
                 library_s=library_s)


def plan(setup: Setup, method: str = "coral", *, demand: Mapping[tuple[str, Phase | str], float] | None = None,
         prev: Any = None, options: SolveOptions | None = None, mode: str = "auto",
         spot_down: Collection[tuple[str, str]] = ()) -> Plan:
    """Allocate with `method` under the setup's availability (`mode`: `coral.allocator.inputs.MODES`).

    `spot_down`: (region, configuration) spot pools where no new node can be had: no spot
    instance using one starts, the running ones (`prev`) stay until they are preempted (the
    allocator's `spot_down`)."""
    return allocate(setup.scenario, setup.library, method=method, demand=demand, availability=setup.availability,
                    prev=prev, options=options, mode=mode, spot_down=spot_down)


def plan_specs(p: Plan) -> list[InstanceSpec]:
    """A plan's instances, one InstanceSpec per running instance (spot ones marked)."""
    return [InstanceSpec(template=i.template, region=i.region, spot=i.spot) for i in p.instances for _ in range(i.count)]


def prev_counts(running: list[InstanceSpec]) -> dict[tuple[str, str], int]:
    """The running instances as the allocator's `prev`: (region, template key) -> count, a spot
    instance under its region's spot market (`coral.allocator.spot.spot_region`), as `Plan.counts` does."""
    return dict(Counter((spot_region(s.region) if s.spot else s.region, s.template.key) for s in running))


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRun:
    result: SimResult
    plans: tuple[Plan, ...]  # the initial plan and one per epoch boundary
    demands: tuple[dict[tuple[str, Phase | str], float], ...] = ()  # what each re-plan was solved on (one per boundary)
    notice_plans: tuple[Plan, ...] = ()  # the unscheduled re-plans at spot preemption notices, in time order


@dataclass(slots=True)
class EpochReplanner:
    """The simulator's re-planner: every epoch, the demand of `coral.policy.demand.epoch_demand` on the
    requests that arrived in it (the live planner's too), solved with the running plan as `prev`.

    With a spot market, it plans around the spot pools that are down now (no new start there;
    what runs there stays), and the
    simulator also calls it at every preemption notice (`market.notice_at` set): that re-plan
    solves the last plan's demand again (the scenario's nominal one before the first boundary)
    for the running instances without the noticed ones, so the lost capacity is replaced at
    once; it goes to `notice_plans`, not `plans` (one per boundary)."""

    setup: Setup
    method: str
    options: SolveOptions | None
    forecast: Forecaster
    market: SpotMarket | None = None
    plans: list[Plan] = field(default_factory=list)
    demands: list[dict[tuple[str, Phase | str], float]] = field(default_factory=list)
    notice_plans: list[Plan] = field(default_factory=list)

    def __call__(self, now_s: float, observed: Mapping[tuple[str, Any], float], running: list[InstanceSpec],
                 window: Mapping[str, Trace]) -> list[InstanceSpec]:
        down = self.market.down_at(now_s) if self.market is not None else frozenset()
        if self.market is not None and self.market.notice_at is not None:
            last = self.demands[-1] if self.demands else None
            new = plan(self.setup, self.method, demand=last, prev=prev_counts(running), options=self.options,
                       spot_down=down)
            self.notice_plans.append(new)
            return plan_specs(new)
        demand: dict[tuple[str, Phase | str], float] = {
            g: v for g, v in epoch_demand(self.setup.scenario, window, self.forecast, self.setup.library).items()}
        new = plan(self.setup, self.method, demand=demand, prev=prev_counts(running), options=self.options,
                   spot_down=down)
        self.demands.append(demand)
        self.plans.append(new)
        return plan_specs(new)


def run_simulation(setup: Setup, method: str = "coral", *, duration_s: float = 1800.0, epoch_s: float | None = None,
                   seed: int = 0, data_dir: str | Path | None = None, options: SolveOptions | None = None,
                   progress: Callable[[float, float], None] | None = None) -> SimRun:
    """Simulate the scenario's traffic on `method`'s plans, re-planning every epoch from the
    demand observed in the last one (the first plan uses the scenario's nominal demand).

    Raises:
        CoralError: bad durations, missing trace data.
    """
    scenario = setup.scenario
    epoch = epoch_s if epoch_s is not None else scenario.planner.epoch_s
    if not duration_s > 0 or not epoch > 0:
        raise CoralError("--duration-s and --epoch-s must be > 0")
    traces = build_workload({m.name: m.workload for m in scenario.models}, duration_s=duration_s, seed=seed,
                            data_dir=data_dir, base_dir=scenario.base_dir)
    # Spot on somewhere: one market for the simulator (preemptions, spot prices) and the re-planner (pools down)
    market = SpotMarket(scenario.spot) if scenario.spot else None
    replan = EpochReplanner(setup=setup, method=method, options=options, forecast=epoch_forecaster(scenario),
                            market=market)
    replan.plans.append(plan(setup, method, options=options))
    result = simulate(scenario, traces, plan_specs(replan.plans[0]), replan, duration_s=duration_s, epoch_s=epoch,
                      init_s=scenario.planner.init_s, seed=seed, progress=progress, router=scenario.planner.router,
                      spot=market)
    return SimRun(result=result, plans=tuple(replan.plans), demands=tuple(replan.demands),
                  notice_plans=tuple(replan.notice_plans))
