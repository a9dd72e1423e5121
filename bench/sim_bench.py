"""Simulator throughput: simulated requests/s, events/s and peak memory on synthetic clusters."""
from __future__ import annotations

import resource
import sys
import time
from typing import Any

from coral.perf.model import Phase
from coral.scenario import load_scenario
from coral.sim import simulate
from coral.sim.synthetic import first_template, sized_cluster
from coral.workload import WorkloadSpec, build_workload

_SHAPES = [["1xL40S"], ["1xL40S", "1xL40S"], ["4xL40S"], ["8xL40S"], ["8xL40S", "8xL40S"],
           ["8xA100-40GB"], ["8xH100"], ["8xH100", "8xH100"]]


def _case(name: str, duration_s: float, epochs: int) -> dict[str, Any]:
    sc = load_scenario(name)
    shapes = [s for s in _SHAPES if all(n in {c.name for c in sc.configs} for n in s)]
    templates = []
    for m in sc.models:
        templates.append(first_template(sc, m.name, Phase.PREFILL, batches=[1, 2, 4], shapes=shapes))
        templates.append(first_template(sc, m.name, Phase.DECODE, batches=[8, 16, 32], shapes=shapes))
    region = sc.regions[0]
    specs = {m.name: WorkloadSpec(rate_per_s=m.rate_per_s, dataset="synthetic", arrival="poisson",
                                  prompt_tokens_mean=m.prompt_tokens_mean, output_tokens_mean=m.output_tokens_mean)
             for m in sc.models}
    traces = build_workload(specs, duration_s=duration_s, seed=1)
    initial = sized_cluster(sc, templates, region)

    def replan(now: float, demand: dict[tuple[str, Phase], float], running: list, window: dict) -> list:
        return sized_cluster(sc, templates, region, demand=demand)

    t0 = time.perf_counter()
    r = simulate(sc, traces, initial, replan, duration_s=duration_s, epoch_s=duration_s / epochs,
                 init_s=sc.planner.init_s, seed=1)
    wall = time.perf_counter() - t0
    s = r.summary()
    return {"case": f"{name}-{int(duration_s)}s", "requests": s["requests"]["arrived"], "events": r.events,
            "wall_s": round(wall, 2), "sim_requests_per_s": round(s["requests"]["arrived"] / wall),
            "events_per_s": round(r.events / wall), "instances": len(r.instances),
            "slo_attainment": s["slo_attainment"],
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run(quick: bool) -> list[dict[str, Any]]:
    """Benchmark rows: `core` (3 x 10 req/s) and `extended` (6 x 25 req/s), 5 epochs each.

    Args:
        quick: 5 simulated minutes instead of 30.

    Returns:
        One dict per case: requests, events, wall_s, sim_requests_per_s, events_per_s, peak_rss_mib
        (peak resident memory of the process so far).
    """
    duration = 300.0 if quick else 1800.0
    return [_case("core", duration, 5), _case("extended", duration, 5)]


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print(row)
