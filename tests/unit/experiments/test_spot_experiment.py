"""`coral experiment spot`'s verdicts on the issue's targets and its report section, on hand-made
run records (the end-to-end run is `coral experiment spot core`; docs/results.md)."""
from __future__ import annotations

from pathlib import Path

from coral.experiments.report import section, table_problems
from coral.experiments.runner import spot_targets


def _rec(cost: float, attainments: list[float], worst_epoch: list[float], spot_usd: float | None = None) -> dict:
    per_model = {f"m{k}": {"slo_attainment": a, "worst_epoch_attainment": w, "attainment_target": 0.95}
                 for k, (a, w) in enumerate(zip(attainments, worst_epoch, strict=True))}
    rec = {"cost_usd_per_h": cost, "per_model": per_model,
           "per_epoch": [{"slo_attainment_by_model": {}}]}
    if spot_usd is not None:
        rec["spot"] = {"cost_usd": {"spot": spot_usd, "on_demand": 0.0}, "notices": 2, "instances_lost": 1,
                       "nodes_lost": 1, "requests_requeued": 5, "requests_failed": 0}
    return rec


def _cases(fitted: dict, x4: dict) -> dict:
    return {"on-demand": {"coral": _rec(100.0, [0.99, 0.98], [0.97, 0.96])},
            "spot x1": {"coral": fitted}, "spot x4": {"coral": x4}}


def test_targets_met():
    got = spot_targets(_cases(_rec(30.0, [0.99, 0.96], [0.93, 0.91], 30.0), _rec(40.0, [0.95, 0.91], [0.5, 0.8], 40.0)))
    assert {"cost_share_of_on_demand": 0.3, "cost_ok": True, "every_model_at_target": True,
            "every_epoch_at_90": True} == got["fitted"]
    assert {"every_model_at_90": True, "fell_back_to_on_demand": False} == got["x4"]


def test_targets_missed_each_way():
    got = spot_targets(_cases(_rec(61.0, [0.99, 0.94], [0.93, 0.89], 61.0), _rec(90.0, [0.99, 0.89], [0.9, 0.9], 0.0)))
    assert {"cost_share_of_on_demand": 0.61, "cost_ok": False, "every_model_at_target": False,
            "every_epoch_at_90": False} == got["fitted"]
    assert {"every_model_at_90": False, "fell_back_to_on_demand": True} == got["x4"]


def test_section_renders_every_case(tmp_path: Path):
    cases = {"on-demand": {"coral": _rec(100.0, [0.99, 0.98], [0.97, 0.96]), "homo": _rec(120.0, [0.99, 0.98], [0.97, 0.96])},
             "spot x1": {"coral": _rec(30.0, [0.99, 0.96], [0.93, 0.91], 30.0),
                         "homo": _rec(35.0, [0.99, 0.96], [0.93, 0.91], 35.0)}}
    result = {"cases": cases, "targets": spot_targets(cases), "processes": {
        "aws:us-east-2": {"preemption_per_node_h": 0.25, "co_loss_share": 0.75, "recovery_s": 7090.0, "source": "fit"}}}
    md = section("spot", result, "core", tmp_path / "figures")
    assert [] == table_problems(md)
    assert "| spot x1 | coral | 30.00 | 0.30× | 100.0% | 96.0% | 91.0% | 2 | 1 / 1 | 5 / 0 |" in md
    assert "sim $/h 30.0% of on-demand (target ≤ 60 %: met)" in md
    assert (tmp_path / "figures" / "spot.png").exists()
