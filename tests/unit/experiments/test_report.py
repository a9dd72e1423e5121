"""The experiment report: tables that keep their columns, and an opening that says what the numbers mean."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from coral.experiments import report
from coral.experiments.report import how_to_read, table, table_problems


def test_table_escapes_pipes_so_rows_keep_their_columns():
    # a stage list "a:29 | b:6" is one cell; unescaped it became two (issue: 11-12 cells under 9)
    text = table(["model", "stages (layers)", "tok/s"], [["m", "1xL40S:29 | 1xL4:6", "1,000"]])
    assert "1xL40S:29 \\| 1xL4:6" in text
    assert [] == table_problems(text)
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table(["a", "b", "c"], [["x", "y"]])


def test_table_problems_finds_a_broken_row():
    broken = "intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n| 1 | 2 | 3 |\n\n| c |\n|---|\n| x \\| y |\n"
    problems = table_problems(broken)
    assert 1 == len(problems)
    assert problems[0].startswith("line 6: 3 cells under a 2-column header")


def _methods(attainments: dict[str, float]) -> dict:
    return {m: {"slo_attainment": a, "per_model": {"big": {"slo_attainment": a / 10, "ttft_p50_s": 103.4},
                                                   "small": {"slo_attainment": a, "ttft_p50_s": 0.2}}}
            for m, a in attainments.items()}


def test_opening_explains_low_attainment_and_links_results(tmp_path: Path):
    out = tmp_path / "runs" / "demo"
    out.mkdir(parents=True)
    result = {"cases": {"abundant": _methods({"coral": 0.267, "homo": 0.217})}}
    text = how_to_read("cost", result, out)
    assert "SLO attainment here: cost / abundant: coral 26.7%, homo 21.7%." in text
    assert "**Coral's plans fall short of the 95% goal**" in text
    assert "big in cost / abundant, 2.7% of its requests within them (TTFT p50 103.4 s)" in text
    assert "A cost ratio `X / coral` above 1× means X costs more than Coral." in text
    if report.RESULTS_DOC.exists():  # a source checkout: the link resolves from the report's folder
        link = text.split("[`docs/results.md`](", 1)[1].split(")", 1)[0]
        assert (out / link).resolve() == report.RESULTS_DOC
        assert os.path.exists(out / link)


def test_opening_does_not_warn_when_coral_meets_the_goal(tmp_path: Path):
    text = how_to_read("cost", {"cases": {"abundant": _methods({"coral": 0.97, "homo": 0.5})}}, tmp_path)
    assert "fall short" not in text
    assert "coral 97.0%, homo 50.0%" in text


def test_cost_lines_say_who_was_cheaper_instead_of_false():
    comp = {"cost_ratio": {"homo": 0.99}, "plan_cost_ratio": {"homo": 1.15},
            "cheapest_per_epoch": ["coral", "homo", "coral", "homo", "coral"],
            "cheapest_plan_per_epoch": ["coral"] * 5}
    text = report._cost_ratio_lines(comp, {"homo": 1.62})
    assert "- homo / coral: simulated cost 0.99×, plan cost 1.15× (paper: 1.62×)" in text
    assert "- simulated bill: Coral is cheapest in 3 of 5 epochs (homo in epoch 2, homo in epoch 4)" in text
    assert "- plan: Coral is cheapest in every epoch" in text
    assert "False" not in text and "below 1× it is cheaper than Coral" in text


def test_opening_of_a_study_without_simulation(tmp_path: Path):
    text = how_to_read("sensitivity", {"rows": []}, tmp_path)
    assert "no traffic is simulated, so there is no SLO attainment here" in text
