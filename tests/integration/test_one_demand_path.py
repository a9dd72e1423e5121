"""One demand path: the simulator's epochs and the live planner of `coral serve --plan` plan on the same
epoch demand when they see the same requests (`coral.policy.demand.epoch_demand` on the requests
that arrived in the epoch: the simulator's own, the coordinator's `RequestWindow`)."""
from __future__ import annotations

from pathlib import Path

import yaml

from coral.experiments.pipeline import prepare, run_simulation
from coral.policy.demand import epoch_forecaster
from coral.runtime.deploy.planner import PlanPlanner
from coral.runtime.serving.window import EpochObservation, RequestWindow
from coral.scenario import load_scenario
from coral.workload import build_workload

SCENARIO = {
    "name": "onedemand", "description": "two models, two regions, a small library",
    "models": [
        {"name": "phi-4", "ttft_ms": 2000, "tpot_ms": 80,
         "workload": {"rate_per_s": 4, "dataset": "synthetic", "prompt_tokens_mean": 600, "output_tokens_mean": 60}},
        {"name": "qwen3-32b", "ttft_ms": 6000, "tpot_ms": 120,
         "workload": {"rate_per_s": 2, "dataset": "synthetic", "prompt_tokens_mean": 800, "output_tokens_mean": 60}},
    ],
    "configs": ["1xL40S", "4xL40S", "1xL4", "4xL4", "1xA10G"],
    "regions": [{"name": "aws:us-east-2"}, {"name": "aws:ap-northeast-2"}],
    "planner": {"n_max": 3, "batch_grid": [1, 4, 16, 64], "history_s": 900, "epoch_s": 120},
}


def test_the_simulator_and_the_live_planner_plan_each_epoch_on_the_same_demand(tmp_path: Path) -> None:
    path = tmp_path / "onedemand.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    setup = prepare(load_scenario(str(path)))
    scenario, epoch = setup.scenario, float(setup.scenario.planner.epoch_s)
    duration = 3 * epoch + 1.0
    run = run_simulation(setup, duration_s=duration, epoch_s=epoch, seed=0)
    assert 3 == len(run.demands)  # one re-plan per boundary: 120, 240 and 360 s
    # The same requests, as the coordinator records them while they arrive (absolute times of the
    # run's traffic), taken at each boundary; and the live planner over the same scenario and library.
    traces = build_workload({m.name: m.workload for m in scenario.models}, duration_s=duration, seed=0,
                            base_dir=scenario.base_dir)
    recorder = RequestWindow([m.name for m in scenario.models], t0=0.0)
    live = PlanPlanner(scenario=scenario, library=setup.library, sizing_library=setup.library,
                       availability=dict(setup.availability), models={}, forecast=epoch_forecaster(scenario))
    for k, sim_demand in enumerate(run.demands):
        lo, hi = k * epoch, (k + 1) * epoch
        arrivals = sorted((float(t), m, int(p), int(o)) for m, tr in traces.items()
                          for t, p, o in zip(tr.arrival_s, tr.prompt_tokens, tr.output_tokens, strict=True) if lo <= t < hi)
        assert arrivals  # the epoch saw traffic
        for t, m, p, o in arrivals:
            recorder.record(m, t, p, [0] * o)  # finished: every token generated
        seen = EpochObservation(demand_tok_per_s={}, window=recorder.take(hi), epoch_s=epoch)
        assert sorted(m.name for m in scenario.models) == sorted(seen.window)
        assert sum(len(w) for w in seen.window.values()) == len(arrivals)
        assert sim_demand == live.epoch_demand(seen), f"epoch {k}"
