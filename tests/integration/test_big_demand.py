"""Big demands behave (issue 26, item 6): the traffic sample the planner replays stays bounded, the
solve's time limit is the solve's alone, a plan that hit it says so on stderr (exit 0), and the
long steps print progress."""
from __future__ import annotations

import dataclasses
import importlib
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_new_user import TINY  # a sibling module: pytest puts this folder on the path

from coral.cli import main
from coral.scenario import load_scenario, with_demand_scale
from coral.scenario import traffic as traffic_mod
from coral.solver import SolveOptions, Status


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CORAL_CACHE_DIR", str(folder))
    return folder


def _tiny(tmp_path: Path, **workload: object) -> Path:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["models"][0]["workload"].update(workload)
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_the_sample_is_cut_to_a_bounded_number_of_requests_at_the_same_rate(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(traffic_mod, "MAX_SAMPLE_REQUESTS", 5_000)
    s = load_scenario(str(_tiny(tmp_path, rate_per_s=100)))  # an hour at 100 req/s: 360,000 requests
    sample = traffic_mod.traffic_sample(s, "phi-4")
    assert pytest.approx(50.0) == sample.window_s  # 5,000 requests / 100 req/s
    assert 100 == pytest.approx(len(sample) / sample.window_s, rel=0.05)
    # below the bound, and with a demand shift (its time matters), the whole history
    assert 3600.0 == traffic_mod.traffic_sample(load_scenario(str(_tiny(tmp_path, rate_per_s=1))), "phi-4").window_s
    shifted = load_scenario(str(_tiny(tmp_path, rate_per_s=100, shift={"kind": "step", "at_s": 1800, "factor": 2})))
    assert 3600.0 == traffic_mod.traffic_sample(shifted, "phi-4").window_s


def test_core_at_1000x_is_sized_on_a_bounded_sample():
    # an hour of core at 1000x is 36 M requests per model: the replays held 8 GB and took minutes
    s = with_demand_scale(load_scenario("core"), 1000)
    for m in s.models:
        sample = traffic_mod.traffic_sample(s, m.name)
        assert len(sample) <= traffic_mod.MAX_SAMPLE_REQUESTS * 1.05
        assert m.rate_per_s == pytest.approx(len(sample) / sample.window_s, rel=0.05)
    assert traffic_mod.MAX_SAMPLE_REQUESTS <= 400_000


def test_every_builtin_history_is_whole():
    # the bound changes no built-in scenario's sample at its own demand
    for name in ("core", "extended", "helix"):
        s = load_scenario(name)
        for m in s.models:
            assert s.planner.history_s == traffic_mod.traffic_sample(s, m.name).window_s, (name, m.name)


def test_the_time_limit_is_the_solves_alone(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    from coral.experiments.pipeline import prepare

    allocate_mod = importlib.import_module("coral.allocator.allocate")  # the package exports the function

    setup = prepare(load_scenario(str(_tiny(tmp_path))), cache_dir=cache)
    real_inputs, real_solve = allocate_mod.build_inputs, allocate_mod.allocate_inputs
    given: list[float] = []

    def slow_inputs(*args, **kwargs):  # building the inputs (capacity targets) takes a while
        time.sleep(0.3)
        return real_inputs(*args, **kwargs)

    def solve(inputs, **kwargs):
        given.append(kwargs["options"].time_limit_s)
        return real_solve(inputs, **kwargs)

    monkeypatch.setattr(allocate_mod, "build_inputs", slow_inputs)
    monkeypatch.setattr(allocate_mod, "allocate_inputs", solve)
    allocate_mod.allocate(setup.scenario, setup.library, options=SolveOptions(backend="highs", time_limit_s=0.5))
    assert [0.5] == given


def test_a_plan_that_hit_the_time_limit_says_so_and_exits_0(tmp_path: Path, cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    from coral.experiments import pipeline

    real = pipeline.plan
    monkeypatch.setattr(pipeline, "plan", lambda *a, **kw: dataclasses.replace(
        real(*a, **kw), status=Status.TIME_LIMIT, gap=0.0123))
    r = CliRunner().invoke(main, ["plan", str(_tiny(tmp_path)), "--time-limit-s", "30"])
    assert 0 == r.exit_code, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("time limit:")]
    assert ["time limit: the solve stopped after --time-limit-s 30 with a gap of 1.23% (asked: 0.01%); the plan "
            "stands (exit 0), but a cheaper one may exist: give it more time, e.g. --time-limit-s 120"] == lines
    r = CliRunner().invoke(main, ["plan", str(_tiny(tmp_path)), "--json"])
    assert 0 == r.exit_code and '"status": "time_limit"' in r.stdout and "time limit: the solve" in r.stderr


def test_capacity_targets_report_each_model(monkeypatch: pytest.MonkeyPatch):
    from coral.allocator import demand

    monkeypatch.setattr(demand, "_MEMO", {})  # sized afresh, not from this process's memo
    seen: list[tuple[int, int]] = []
    demand.capacity_targets(load_scenario("core"), progress=lambda done, total: seen.append((done, total)), store=False)
    assert [(0, 3), (1, 3), (2, 3), (3, 3)] == seen


def test_long_steps_print_progress_in_a_pipe(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    from coral.allocator import demand
    from coral.experiments import pipeline

    real_targets, real_plan = demand.capacity_targets, pipeline.plan

    def slow_targets(*args, progress=None, **kwargs):
        if progress is not None:  # the CLI's call: a replay that takes a while
            progress(0, 1)
            time.sleep(1.2)
        return real_targets(*args, progress=progress, **kwargs)

    def slow_plan(*args, **kwargs):
        time.sleep(5.5)  # the pipe's progress prints a line every 5 s
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(demand, "capacity_targets", slow_targets)
    monkeypatch.setattr(pipeline, "plan", slow_plan)
    r = CliRunner().invoke(main, ["plan", str(_tiny(tmp_path))])
    assert 0 == r.exit_code, r.output
    assert "capacity targets (replaying each model's traffic): 1/1 done" in r.stderr
    assert "solving the allocation (time limit 60 s, seconds): " in r.stderr
