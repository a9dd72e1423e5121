"""The `coral` CLI end to end (in process, through click's runner)."""
import json

import pytest
from click.testing import CliRunner

from coral.cli import main


def run(*args):
    result = CliRunner().invoke(main, list(args))
    return result


def test_help_everywhere():
    for cmd in ([], ["catalog"], ["catalog", "gpus"], ["perf"], ["scenario", "show"], ["templates", "solve"],
                ["templates", "build"], ["templates", "show"], ["calibrate"]):
        r = run(*cmd, "--help")
        assert r.exit_code == 0 and "Usage:" in r.output


def test_catalog_json():
    r = run("catalog", "configs", "--json")
    names = [row["config"] for row in json.loads(r.output)]
    assert "1xA100-40GB" in names and "8xH100" in names
    r = run("catalog", "models", "--json")
    assert {m["name"] for m in json.loads(r.output)} >= {"qwen3-32b", "gpt-oss-20b", "phi-4"}
    r = run("catalog", "prices", "--region", "aws:us-east-2", "--json")
    assert all(o["region"] == "aws:us-east-2" for o in json.loads(r.output))


def test_perf_issue_check():
    r = run("perf", "--model", "llama-2-70b", "--node", "1xA100-40GB", "--phase", "prefill", "--batch", "1",
            "--prompt-tokens", "1000", "--json")
    out = json.loads(r.output)
    assert out["layer_ms"] == pytest.approx(8.0, rel=0.20)  # Helix measured 8 ms
    assert out["throughput_tok_per_s"] == pytest.approx(1000 / (out["layer_ms"] / 1e3))
    assert out["max_layers"] >= 1
    r = run("perf", "--model", "llama-2-70b", "--node", "1xA100-40GB", "--phase", "decode", "--batch", "100",
            "--prompt-tokens", "1000", "--json")
    assert json.loads(r.output)["layer_ms"] == pytest.approx(2.5, rel=0.25)  # Helix measured 2.5 ms


def test_user_errors_are_clean():
    r = run("perf", "--model", "llama-2-70b", "--node", "1xB9000", "--phase", "prefill", "--batch", "1", "--prompt-tokens", "10")
    assert r.exit_code == 2 and "unknown configuration '1xB9000'; valid configurations:" in r.output
    assert "Traceback" not in r.output
    r = run("scenario", "show", "nope")
    assert r.exit_code == 2 and "valid scenarios: core, extended, helix" in r.output
    r = run("templates", "solve", "--model", "phi-4", "--phase", "decode", "--slo-ms", "50", "--nodes",
            ",".join(["1xL4"] * 7), "--n-max", "6")
    assert r.exit_code == 2 and "more than n_max=6" in r.output


def test_templates_solve_json_and_infeasible():
    r = run("templates", "solve", "--model", "qwen3-32b", "--phase", "decode", "--slo-ms", "120", "--nodes",
            "1xL40S,1xL40S,2xL40S", "--json")
    out = json.loads(r.output)
    # decode's budget is tpot_headroom (0.9) x the SLO, with no KV transfer for a lone template
    assert out["budget_ms"] == pytest.approx(108.0)
    assert out["feasible"] is True and out["latency_ms"] <= out["budget_ms"]
    assert sum(s["layers"] for s in out["stages"]) == 64
    assert out["throughput_tok_per_s"] == pytest.approx(min(s["throughput_tok_per_s"] for s in out["stages"]))
    r = run("templates", "solve", "--model", "qwen3-32b", "--phase", "decode", "--slo-ms", "100", "--nodes", "1xL4", "--json")
    out = json.loads(r.output)
    assert out["feasible"] is False and out["reason"].startswith("memory short by")
    r = run("templates", "solve", "--model", "phi-4", "--phase", "decode", "--slo-ms", "1", "--nodes", "1xL40S,1xL40S", "--json")
    out = json.loads(r.output)
    assert out["feasible"] is False and "below the minimum achievable latency" in out["reason"]


def test_scenario_show_json():
    out = json.loads(run("scenario", "show", "core", "--json").output)
    assert [m["name"] for m in out["models"]] == ["qwen3-32b", "gpt-oss-20b", "phi-4"]


def test_templates_figure(tmp_path):
    out = tmp_path / "fig"
    r = run("templates", "figure", "--n-max", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["templates"] == data["homogeneous"] + data["heterogeneous"] > 0
    assert (out / "fig1a_per_usd.png").stat().st_size > 0 and (out / "fig1b_spectrum.png").stat().st_size > 0
    note = (out / "figure.md").read_text()
    if data["best_heterogeneous"]:  # the paper's absolute figure is quoted with why ours differs
        assert "(paper: 526; see below why these differ)" in note
        assert "**Why the absolute numbers are not the paper's**" in note
    assert data["best"]["tok_per_s_per_usd"] >= max(
        [v["tok_per_s_per_usd"] for v in data["best_homogeneous_h100"].values()], default=0)


def test_plan_and_simulate_json(tmp_path, data_dir):  # simulate replays the Azure traces
    cache = str(tmp_path / "cache")
    r = run("plan", "--scenario", "core", "--n-max", "2", "--cache-dir", cache, "--json", "--out", str(tmp_path / "plan.json"))
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    for key in ("status", "cost_usd_per_h", "alpha", "solve_s", "gap", "instances", "demand", "nodes"):
        assert key in plan
    assert plan["status"] == "optimal" and plan["alpha"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "plan.json").read_text())["cost_usd_per_h"] == plan["cost_usd_per_h"]
    # capacity covers demand for every (model, phase); the cost is the instances' cost
    assert all(d["capacity_tok_per_s"] >= d["demand_tok_per_s"] * (1 - 1e-9) for d in plan["demand"])
    homo = json.loads(run("plan", "--scenario", "core", "--n-max", "2", "--cache-dir", cache, "--method", "homo",
                          "--json").output)
    assert homo["cost_usd_per_h"] >= plan["cost_usd_per_h"] * (1 - 1e-9)  # the ILP is optimal over a superset

    r = run("simulate", "--scenario", "core", "--n-max", "2", "--cache-dir", cache, "--duration-s", "120",
            "--epoch-s", "60", "--json", "--out", str(tmp_path / "sim"))
    assert r.exit_code == 0, r.output
    sim = json.loads(r.output)
    for key in ("cost_usd_per_h", "goodput_tok_per_s", "slo_attainment", "requests", "wall_s", "per_model"):
        assert key in sim
    req = sim["requests"]
    assert req["arrived"] == req["finished"] + req["failed"] + req["in_flight"] > 0
    assert (tmp_path / "sim" / "summary.json").exists()
    r = run("plan", "--scenario", "core", "--demand-scale", "-1")
    assert r.exit_code == 2 and "--demand-scale must be a finite number > 0" in r.output
