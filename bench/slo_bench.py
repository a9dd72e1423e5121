"""SLO targets of the planner (issue 13), measured the way `coral experiment cost` measures them:
each method's plans replayed in the simulator over 30 minutes, re-planned every 6.

Rows: per model, Coral's attainment over the run (target: the model's slo_attainment) and in its
worst epoch (>= 90 %); Coral's simulated bill against its plan's (<= 5 % above) and whether it is
the cheapest method's in every epoch; the router's effect at an equal plan (least-work vs WRR).
"""
from __future__ import annotations

from typing import Any


def _cost_run(setup: str, arrival: str | None) -> dict[str, Any]:
    from coral.experiments.runner import RunConfig, Session, run_experiment

    return run_experiment("cost", Session(config=RunConfig.make(setup, arrival=arrival)))


def run(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cases = [("core", None)] + ([] if quick else [("core", "poisson")])
    for setup, arrival in cases:
        label = f"{setup}/{arrival or 'trace'}"
        res = _cost_run(setup, arrival)
        methods = res["cases"]["abundant"]
        coral = methods["coral"]
        for model, pm in coral["per_model"].items():
            target = pm["attainment_target"]
            rows.append({"bench": f"{label} coral {model} attainment (run)", "value": pm["slo_attainment"],
                         "goal": f">= {target:g}"})
            rows.append({"bench": f"{label} coral {model} attainment (worst epoch)",
                         "value": pm["worst_epoch_attainment"], "goal": ">= 0.9"})
        rows.append({"bench": f"{label} coral sim $/h over plan $/h", "value":
                     coral["cost_usd_per_h"] / coral["plan_cost_usd_per_h"], "goal": "<= 1.05"})
        epochs = len(coral["per_epoch"])
        cheapest = sum(1 for k in range(epochs)
                       if min(methods, key=lambda m: methods[m]["per_epoch"][k]["cost_usd_per_h"]) == "coral")
        rows.append({"bench": f"{label} epochs where coral's sim $/h is cheapest", "value": float(cheapest),
                     "goal": f">= {epochs}"})
        for m in ("homo", "cauchy", "template-greedy"):
            rows.append({"bench": f"{label} {m} / coral sim $/h", "value":
                         methods[m]["cost_usd_per_h"] / coral["cost_usd_per_h"], "unit": "x (equal target)"})
    rows.extend(_router_rows())
    return rows


def _router_rows() -> list[dict[str, Any]]:
    """Coral's plans on core simulated with each router (same plans, same traffic)."""
    from coral.experiments.pipeline import prepare, run_simulation
    from coral.scenario import load_scenario

    out = []
    for router in ("least-work", "wrr"):
        scenario = load_scenario("core", {"planner": {"router": router}})
        run = run_simulation(prepare(scenario, jobs=2), "coral", duration_s=1800.0)
        s = run.result.summary(timing=False)
        worst = min(v["slo_attainment"] for v in s["per_model"].values())
        out.append({"bench": f"core coral, router {router}: worst model's attainment", "value": worst,
                    "unit": f"at {s['cost_usd_per_h']:.0f} $/h"})
    return out
