"""Every Markdown report Coral writes keeps its tables whole: each row has as many cells as its
header (a raw `|` in a stage list once pushed rows to 11-12 cells under 9 columns)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from coral.experiments.cli import experiment
from coral.experiments.report import table_problems, templates_table

REPO = Path(__file__).resolve().parents[2]
# §6.6 helix is left out: its quick mode (templates of at most 2 nodes) has no Llama-2-70B
# prefill template that meets the SLO, so it cannot run in a test's time
STUDIES = ("cost", "goodput", "skew", "ablation", "sensitivity")
# One 120-s epoch instead of --quick's three: the reports have the same sections and tables, with
# fewer rows (the tables' shape is what is tested here; test_experiments.py runs the three epochs).
DURATION_S = "120"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reports")
    out = {}
    for name in STUDIES:
        folder = root / name
        r = CliRunner().invoke(experiment, [name, "--setup", "core", "--quick", "--duration-s", DURATION_S, "--jobs", "1",
                                            "--out", str(folder), "--cache-dir", str(root / "cache")])
        assert 0 == r.exit_code, r.output
        # the result line is one line, not broken inside its parentheses
        assert any(line.startswith(f"report: {folder / 'report.md'}  (summary:") and line.endswith(" s")
                   for line in r.stdout.splitlines()), r.stdout
        out[name] = folder
    return out


@pytest.mark.parametrize("name", STUDIES)
def test_every_table_row_has_its_header_cell_count(reports: dict[str, Path], name: str):
    text = (reports[name] / "report.md").read_text()
    assert "|---" in text
    assert [] == table_problems(text)


@pytest.mark.parametrize("name", STUDIES)
def test_report_opens_with_how_to_read_it(reports: dict[str, Path], name: str):
    text = (reports[name] / "report.md").read_text()
    first = text.split("\n## ", 1)[0]
    assert "**How to read this report.**" in first and "docs/results.md" in first
    summary = json.loads((reports[name] / "summary.json").read_text())
    for case, methods in summary.get("cases", {}).items():
        for method, rec in methods.items():
            # a method that served nothing (a rate factor of ~0 under tight availability) has no attainment
            shown = "–" if rec["slo_attainment"] is None else f"{rec['slo_attainment']:.1%}"
            assert f"{method} {shown}" in first, (case, method)


def test_cost_report_shows_the_templates_coral_picked(reports: dict[str, Path]):
    text = (reports["cost"] / "report.md").read_text()
    summary = json.loads((reports["cost"] / "summary.json").read_text())
    assert templates_table(summary["coral_hetero_templates"]) in text.split("Heterogeneous templates Coral picked", 1)[1]


def test_a_multi_stage_template_keeps_its_table_whole():
    # a stage list joins stages with `|`: escaped, so the row keeps its columns
    hetero = [{"model": "m", "phase": "prefill", "region": "r", "nodes": ["1xL4", "1xL40S"],
               "stages": [{"nodes": ["1xL4"], "layers": 20}, {"nodes": ["1xL40S"], "layers": 20}],
               "throughput_tok_per_s": 1000.0, "price_usd_per_h": 2.5, "max_count": 1, "epochs": [0]}]
    text = templates_table(hetero)
    assert "1xL4:20 \\| 1xL40S:20" in text
    assert [] == table_problems(text)


@pytest.mark.parametrize("doc", sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")) + ["README.md"])
def test_docs_tables_are_whole(doc: str):
    path = REPO / doc
    assert [] == table_problems(path.read_text()), doc
