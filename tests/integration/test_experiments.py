"""`coral experiment`: end to end on the core setup in quick mode, and its input errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from coral.experiments.cli import experiment

METHODS = ("coral", "homo", "cauchy", "template-greedy")


@pytest.fixture()
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh template cache, so the test builds its (small, n_max 2) library itself."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CORAL_CACHE_DIR", str(cache))
    return cache


def test_cost_quick_writes_report_summary_and_figures(tmp_path: Path, isolated_cache: Path, data_dir: Path) -> None:
    out = tmp_path / "cost-run"
    result = CliRunner().invoke(experiment, ["cost", "--setup", "core", "--quick", "--jobs", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output.replace("\n", "")

    assert sorted(p.name for p in out.iterdir()) == ["figures", "report.md", "summary.json"]
    assert not list(tmp_path.glob(".cost-run.*"))  # the temporary folder is gone
    assert list((out / "figures").glob("*.png"))
    assert any(isolated_cache.glob("*.parquet"))  # built in the isolated cache, not ~/.cache

    summary = json.loads((out / "summary.json").read_text())
    assert "coral experiment cost core --out" in summary["command"]
    assert "--quick" in summary["command"]
    assert (summary["seed"], summary["scenario"], summary["duration_s"]) == (0, "core", 360.0)
    methods = summary["cases"]["abundant"]
    assert set(METHODS) == set(methods)
    for name, rec in methods.items():
        for key in ("cost_usd_per_h", "goodput_tok_per_s", "slo_attainment"):
            assert isinstance(rec[key], float), (name, key)
        assert len(rec["per_epoch"]) == 3  # 360 s in 120 s epochs
        for epoch in rec["per_epoch"]:
            assert {"cost_usd_per_h", "goodput_tok_per_s", "slo_attainment"} <= set(epoch)
        assert rec["cost_usd_per_h"] > 0
        assert rec["requests"]["arrived"] > 0
        assert set(rec["per_model"]) == {"qwen3-32b", "gpt-oss-20b", "phi-4"}
        # the mean over the run is the time-weighted mean of the (equal-length) epochs
        epochs = [e["cost_usd_per_h"] for e in rec["per_epoch"]]
        assert rec["cost_usd_per_h"] == pytest.approx(sum(epochs) / len(epochs), rel=1e-6)
    assert set(summary["comparison"]["abundant"]["cost_ratio"]) == set(METHODS) - {"coral"}

    report = (out / "report.md").read_text()
    assert summary["command"] in report
    assert "§6.3" in report
    for png in (out / "figures").glob("*.png"):
        assert f"figures/{png.name}" in report


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nonsense"], "No such command 'nonsense'"),
        (["cost", "--setup", "huge"], "'huge' is not one of 'core', 'extended'"),
        (["cost", "--duration-s", "-5"], "--duration-s"),
    ],
)
def test_bad_input_is_a_clean_error(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(experiment, [*args, "--out", str(tmp_path / "x")] if args[0] == "cost" else args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
