"""Hand-made scenarios and templates for the allocator tests (no library build needed)."""
from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import lru_cache

from coral.perf.model import Phase
from coral.scenario import Scenario, load_scenario
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template, TemplateLibrary

P, D = Phase.PREFILL, Phase.DECODE


@lru_cache(maxsize=1)
def _core() -> Scenario:
    return load_scenario("core")


def make_template(model: str, phase: Phase, nodes: Iterable[str], throughput: float, layers: int = 32) -> Template:
    """A one-stage template on `nodes` with the given throughput."""
    ns = tuple(sorted(nodes))
    share = throughput / len(ns)
    stage = Stage(nodes=ns, node_index=tuple(range(len(ns))), layers=layers, time_s=0.01,
                  throughput_tok_per_s=throughput)
    assert share > 0
    placement = Placement(stages=(stage,), micro_batch=1, throughput_tok_per_s=throughput, latency_s=0.01,
                          comm_s=0.0)
    return Template(model=model, phase=phase, slo_ms=100.0, budget_ms=100.0, nodes=ns, placement=placement)


def make_library(templates: Iterable[Template]) -> TemplateLibrary:
    return TemplateLibrary(templates=tuple(templates))


def make_scenario(models: Iterable[str | tuple[str, tuple[str, ...] | None]],
                  prices: Mapping[tuple[str, str], float], availability: Mapping[tuple[str, str], int], *,
                  init_s: float = 120.0, name: str = "core") -> Scenario:
    """A scenario with the given models (name, or (name, allowed regions)), prices and availability.
    Model specs / workloads are borrowed from the core scenario; tests pass demand explicitly."""
    core = _core()
    served = []
    for m in models:
        mname, regions = (m, None) if isinstance(m, str) else m
        served.append(replace(core.models[0], name=mname, regions=regions))
    regions = tuple(dict.fromkeys(r for r, _ in prices))
    planner = core.planner.model_copy(update={"init_s": init_s})
    return replace(core, name=name, models=tuple(served), configs=(), regions=regions, prices=dict(prices),
                   availability=dict(availability), planner=planner)


def demand_of(values: Mapping[tuple[str, Phase], float], models: Iterable[str]) -> dict[tuple[str, Phase], float]:
    """Explicit demand for every (model, phase): the given values, 0 elsewhere."""
    out = {(m, ph): 0.0 for m in models for ph in (P, D)}
    out.update(values)
    return out


def random_instance(seed: int, *, tries: int, demand: tuple[float, float],
                    avail: int | None = None, avail_range: tuple[int, int] | None = None
                    ) -> tuple[Scenario, TemplateLibrary, dict[tuple[str, Phase], float]]:
    """A seeded two-model, two-region, three-configuration instance: prices, up to `tries` distinct
    one-stage templates per (model, phase), availability `avail` everywhere or drawn from
    `avail_range`, and demand drawn from `demand` (tok/s), in that order of draws."""
    rng = random.Random(seed)
    regions, configs = ["r1", "r2"], ["A", "B", "C"]
    prices = {(r, c): round(rng.uniform(0.5, 4.0), 2) for r in regions for c in configs}
    templates = []
    for m in ("m1", "m2"):
        for ph in (P, D):
            seen = set()
            for _ in range(tries):
                nodes = tuple(sorted(rng.choice(configs) for _ in range(rng.randint(1, 3))))
                if nodes not in seen:  # one template per multiset, as in a library
                    seen.add(nodes)
                    templates.append(make_template(m, ph, nodes, round(rng.uniform(20, 200), 1)))
    if avail_range is not None:
        availability = {k: rng.randint(*avail_range) for k in prices}
    else:
        assert avail is not None
        availability = {k: avail for k in prices}
    scenario = make_scenario(["m1", "m2"], prices, availability)
    want = demand_of({(m, ph): round(rng.uniform(*demand), 1) for m in ("m1", "m2") for ph in (P, D)}, ["m1", "m2"])
    return scenario, make_library(templates), want
