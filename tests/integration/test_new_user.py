"""What trips a new user in the first hour (issue 19): each bad input is one line with the
documented exit code, no traceback, and nothing written; outputs say what their numbers mean."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from coral.allocator.demand import capacity_targets
from coral.cli import main
from coral.experiments.pipeline import prepare
from coral.perf import Phase
from coral.scenario import load_scenario
from coral.scenario.starter import STARTER_YAML

REPO = Path(__file__).resolve().parents[2]

TINY = {
    "name": "tiny",
    "models": [{"name": "phi-4", "ttft_ms": 3000, "tpot_ms": 150,
                "workload": {"rate_per_s": 2, "dataset": "synthetic", "prompt_tokens_mean": 500,
                             "output_tokens_mean": 100}}],
    "configs": ["1xL40S", "2xL40S"],
    "regions": [{"name": "aws:us-east-2"}],
    "derive_missing_prices": True,
    "planner": {"n_max": 1},
}


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(main, list(args))


def clean_error(r, code: int = 2, *messages: str) -> None:
    assert code == r.exit_code, r.output
    assert "Traceback" not in r.output
    for m in messages:
        assert m in r.output, r.output


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CORAL_CACHE_DIR", str(folder))
    return folder


def tiny(tmp_path: Path, **changes) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump({**TINY, **changes}))
    return p


# -- 5, 6: folders and files in the wrong place ----------------------------------------------------

def test_scenario_folder_is_one_line(tmp_path: Path):
    for args in (["scenario", "show", str(tmp_path)], ["plan", "--scenario", f"{tmp_path}/"]):
        r = run(*args)
        clean_error(r, 2, "is a folder; give a scenario YAML file in it")
    assert [] == listing(tmp_path)


@pytest.mark.parametrize("args", [
    ["plan", "--scenario", "SCEN", "--out", "afile/b.json"],
    ["simulate", "--scenario", "SCEN", "--duration-s", "10", "--out", "afile/b"],
    ["experiment", "cost", "--quick", "--out", "afile/x"],
    ["templates", "figure", "--n-max", "1", "--out", "afile/x"],
    ["scenario", "init", "afile/new.yaml"],
])
def test_out_under_a_file_is_refused_before_any_work(tmp_path: Path, cache: Path, args: list[str]):
    (tmp_path / "afile").write_text("keep me")
    scen = tiny(tmp_path)
    before = listing(tmp_path)
    args = [str(scen) if a == "SCEN" else str(tmp_path / a) if a.startswith("afile") else a for a in args]
    r = run(*args)
    clean_error(r, 2, "afile is a file, not a folder")
    assert before == listing(tmp_path)
    assert "keep me" == (tmp_path / "afile").read_text()
    assert not cache.exists()  # refused before the library was built


def test_out_that_is_a_folder_for_a_plan_file(tmp_path: Path, cache: Path):
    (tmp_path / "plan").mkdir()
    r = run("plan", "--scenario", str(tiny(tmp_path)), "--out", str(tmp_path / "plan"))
    clean_error(r, 2, "is a directory")  # click's own check (dir_okay=False), still one line and exit 2


def test_os_errors_with_a_path_are_one_line(tmp_path: Path):
    # the safety net: an OSError naming a path that reaches a group is one line, exit 2
    import click

    from coral.cli_support import CoralGroup

    @click.group(cls=CoralGroup)
    def g() -> None:
        pass

    @g.command()
    @click.argument("path")
    def write(path: str) -> None:
        Path(path, "x").write_text("")  # NotADirectoryError / FileNotFoundError

    (tmp_path / "f").write_text("")
    r = CliRunner().invoke(g, ["write", str(tmp_path / "f")])
    clean_error(r, 2, f"error: cannot use {tmp_path / 'f' / 'x'}: a part of the path is a file, not a folder")
    r = CliRunner().invoke(g, ["write", str(tmp_path / "nope")])
    clean_error(r, 2, "no such file or folder")


# -- 7: a plan that serves nothing ----------------------------------------------------------------

@pytest.mark.parametrize("as_json", [False, True])
def test_plan_that_serves_nothing_is_infeasible(tmp_path: Path, cache: Path, as_json: bool):
    scen = tiny(tmp_path, default_availability=0)
    out = tmp_path / "plan.json"
    r = run("plan", "--scenario", str(scen), "--out", str(out), *(["--json"] if as_json else []))
    clean_error(r, 4, "infeasible: the coral plan serves none of the demand (alpha 0)", "nothing written")
    assert "status optimal" not in r.output
    assert not out.exists()
    if as_json:
        assert json.loads(r.stdout)["feasible"] is False


# -- 13: demand and capacity target apart ----------------------------------------------------------

def test_plan_shows_raw_demand_and_capacity_target(tmp_path: Path, cache: Path):
    scen_path = tiny(tmp_path)
    r = run("plan", "--scenario", str(scen_path), "--json")
    assert 0 == r.exit_code, r.output
    data = json.loads(r.stdout)
    offered = {(d["model"], d["phase"]): d["tok_per_s"] for d in data["offered_tok_per_s"]}
    # the traffic: 2 req/s x 500 prompt tokens, 2 req/s x 100 output tokens
    assert pytest.approx(1000.0) == offered[("phi-4", "prefill")]
    assert pytest.approx(200.0) == offered[("phi-4", "decode")]
    s = load_scenario(str(scen_path))
    # the plan sizes prefill in instances of its library's best template (the cache the CLI used)
    targets = capacity_targets(s, library=prepare(s, cache_dir=cache).library)
    for line in data["demand"]:
        # the capacity target is the allocator's own demand figure (the queueing model's), not re-derived here
        target = targets[("phi-4", Phase(line["phase"]))].capacity_tok_per_s
        assert pytest.approx(target) == line["demand_tok_per_s"]
        assert line["demand_tok_per_s"] >= offered[("phi-4", line["phase"])]
    r = run("plan", "--scenario", str(scen_path))
    assert 0 == r.exit_code, r.output
    for col in ("demand tok/s", "capacity target tok/s", "planned capacity tok/s", "load"):
        assert col in r.output
    assert "1,000" in r.output and "200" in r.output


def test_scenario_show_separates_demand_and_capacity_target():
    r = run("scenario", "show", "core", "--json")
    data = json.loads(r.output)
    s = load_scenario("core")
    for entry in data["models"]:
        m = s.model(entry["name"])
        assert pytest.approx(m.rate_per_s * m.prompt_tokens_mean) == entry["demand_prefill_tok_per_s"]
        assert pytest.approx(m.rate_per_s * m.output_tokens_mean) == entry["demand_decode_tok_per_s"]
        assert pytest.approx(capacity_targets(s)[(m.name, Phase.PREFILL)].capacity_tok_per_s) == \
            entry["capacity_target_prefill_tok_per_s"]
    text = run("scenario", "show", "core").output
    assert "demand prefill / decode tok/s" in text and "capacity target prefill / decode tok/s" in text


# -- 14: --availability in --help -----------------------------------------------------------------

def test_availability_help_is_plain_and_says_what_tight_does():
    for cmd in ("plan", "simulate"):
        text = " ".join(run(cmd, "--help").output.split())
        assert "%%" not in text
        assert "only the (region, config) pairs Coral's own abundant plan rents" in text
        assert "+ 25 % (75 % for extended)" in text
        assert "Coral's plan at the same demand always fits it, so `coral plan` is unchanged" in text


def test_exit_codes_are_documented():
    text = " ".join(run("--help").output.split())
    assert "Exit codes: 0 done; 2 bad input" in text and "4 `coral plan` found no plan" in text


# -- 8, 11: the runtime's commands ----------------------------------------------------------------

def _needs_runtime() -> None:
    if main.get_command(click.Context(main), "serve") is None:
        pytest.skip("the runtime extra (pyzmq, torch) is not installed")


def test_serve_with_a_missing_config_exits_2(tmp_path: Path):
    _needs_runtime()
    r = run("serve", "--config", str(tmp_path / "missing.yaml"))
    clean_error(r, 2, "not found")
    assert [] == listing(tmp_path)


def test_serve_refuses_a_ready_file_it_cannot_write_before_starting(tmp_path: Path):
    _needs_runtime()
    (tmp_path / "afile").write_text("")
    cfg = REPO / "examples" / "cluster-tiny.yaml"
    r = run("serve", "--config", str(cfg), "--ready-file", str(tmp_path / "afile" / "url"))
    clean_error(r, 2, "--ready-file", "afile is a file, not a folder")
    assert "coral serve:" not in r.output  # nothing was started


def test_keys_default_outside_the_checkout(tmp_path: Path):
    _needs_runtime()
    home = tmp_path / "config"
    r = run("keys", env={"XDG_CONFIG_HOME": str(home)})
    assert 0 == r.exit_code, r.output
    assert ["coral", "coral/keys", "coral/keys/cluster.key", "coral/keys/cluster.key_secret"] == listing(home)
    assert "warning" not in r.output
    r = run("keys", env={"XDG_CONFIG_HOME": str(home)})  # never overwritten: one line, exit 2
    clean_error(r, 2, "already holds a Curve keypair")
    (tmp_path / "f").write_text("")
    clean_error(run("keys", "--dir", str(tmp_path / "f")), 2, "is a file")


def test_keys_inside_a_checkout_warn(tmp_path: Path):
    _needs_runtime()
    (tmp_path / ".git").mkdir()
    r = run("keys", "--dir", str(tmp_path / "keys"))
    assert 0 == r.exit_code, r.output
    assert f"is inside the git checkout {tmp_path}" in r.output


def test_keys_folder_is_git_ignored():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("keys/cluster.key_secret", "examples/keys/cluster.key"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False)
        assert 0 == r.returncode, path


# -- 10: YAML errors --------------------------------------------------------------------------------

def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmodels:\n  - name: [a\n")
    r = run("scenario", "show", str(p))
    clean_error(r, 2, f"scenario {p} is not valid YAML: line 4, column 1:")
    assert "<unicode string>" not in r.output
    assert 1 == len(r.output.strip().splitlines())


@pytest.mark.parametrize(("path", "key", "value", "suggestion"), [
    (("models", 0), "tpot", 100, "models.0.tpot: unknown field; did you mean 'tpot_ms'?"),
    (("models", 0, "workload"), "rate", 2, "models.0.workload.rate: unknown field; did you mean 'rate_per_s'?"),
    (("planner",), "nmax", 2, "planner.nmax: unknown field; did you mean 'n_max'?"),
    (("regions", 0), "price", {}, "regions.0.price: unknown field; did you mean 'prices'?"),
    ((), "default_availabilty", 3, "default_availabilty: unknown field; did you mean 'default_availability'?"),
])
def test_misspelled_field_suggests_the_right_one(tmp_path: Path, path, key, value, suggestion):
    data = json.loads(json.dumps(TINY))
    node = data
    for part in path:
        node = node[part]
    if key == "tpot":
        del node["tpot_ms"]
    node[key] = value
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    r = run("scenario", "show", str(p))
    clean_error(r, 2, suggestion)


def test_misspelled_field_inside_a_shift_kind(tmp_path: Path):
    data = json.loads(json.dumps(TINY))
    data["models"][0]["workload"]["shift"] = {"kind": "step", "at_s": 10, "factr": 2}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    clean_error(run("scenario", "show", str(p)), 2, "unknown field; did you mean 'factor'?")


# -- 17: a starter scenario -------------------------------------------------------------------------

def test_scenario_init_writes_a_valid_starter_and_never_overwrites(tmp_path: Path):
    p = tmp_path / "my.yaml"
    r = run("scenario", "init", str(p))
    assert 0 == r.exit_code, r.output
    assert STARTER_YAML == p.read_text()
    s = load_scenario(str(p))
    assert ["qwen3-32b"] == [m.name for m in s.models]
    r = run("scenario", "show", str(p), "--json")
    assert 0 == r.exit_code and "my-scenario" == json.loads(r.output)["name"]
    p.write_text("mine")
    clean_error(run("scenario", "init", str(p)), 2, "already exists")
    assert "mine" == p.read_text()


def test_the_starter_plans_as_written(tmp_path: Path, cache: Path):
    # issue 26, item 4: what `coral scenario init` writes is solved by `coral plan` without an edit
    p = tmp_path / "my.yaml"
    assert 0 == run("scenario", "init", str(p)).exit_code
    r = run("plan", str(p), "--json")
    assert 0 == r.exit_code, r.output
    data = json.loads(r.stdout)
    assert "my-scenario" == data["scenario"]
    assert 1.0 == pytest.approx(data["alpha"])
    assert data["cost_usd_per_h"] > 0


# -- 4: results in a pipe ---------------------------------------------------------------------------

def test_pipe_output_keeps_lines_and_names_whole(tmp_path: Path, cache: Path):
    r = run("plan", "--scenario", str(tiny(tmp_path)))
    assert 0 == r.exit_code, r.output
    assert "…" not in r.stdout  # rich cuts cells with an ellipsis at 80 columns
    r = run("scenario", "show", "extended")
    assert "…" not in r.stdout and "qwen3-235b-a22b" in r.stdout


# -- 15, 16: the README -----------------------------------------------------------------------------

def test_readme_names_both_demos_and_calls_tables_tables():
    text = (REPO / "README.md").read_text()
    assert "coral demo" in text and "make demo" in text
    assert "a one-minute tour" in text
    assert "diagram" not in text
    assert "coral keys --dir keys/" not in text


def test_runtime_commands_exit_2_outside_the_coral_group_too(tmp_path: Path):
    # `python -m coral.runtime.deploy.serve_cli` and tests invoke these commands without the `coral` group
    _needs_runtime()
    from coral.runtime.deploy.serve_cli import keys, serve

    r = CliRunner().invoke(serve, ["--config", str(tmp_path / "missing.yaml")])
    clean_error(r, 2, "not found")
    assert CliRunner().invoke(keys, ["--dir", str(tmp_path / "k")]).exit_code == 0
    r = CliRunner().invoke(keys, ["--dir", str(tmp_path / "k")])
    clean_error(r, 2, "already holds a Curve keypair")
    assert 1 == len(r.output.strip().splitlines())


# -- issue 26, item 3: one way to name a scenario ----------------------------------------------------

def test_scenario_is_a_positional_argument_with_scenario_as_alias(tmp_path: Path, cache: Path):
    scen = str(tiny(tmp_path))
    by_arg = run("plan", scen, "--json")
    by_flag = run("plan", "--scenario", scen, "--json")
    assert 0 == by_arg.exit_code, by_arg.output
    assert json.loads(by_flag.stdout)["cost_usd_per_h"] == json.loads(by_arg.stdout)["cost_usd_per_h"]
    assert json.loads(run("scenario", "show", "--scenario", scen, "--json").output) == \
        json.loads(run("scenario", "show", scen, "--json").output)
    r = run("simulate", scen, "--duration-s", "20", "--json")
    assert 0 == r.exit_code, r.output
    assert ["phi-4"] == list(json.loads(r.stdout)["per_model"])
    r = run("templates", "show", scen, "--top", "1")
    assert 0 == r.exit_code and "phi-4" in r.output
    for cmd in ("plan", "simulate", "scenario show", "experiment cost"):
        usage = run(*cmd.split(), "--help").output.splitlines()[0]
        assert usage.endswith("SCENARIO") or usage.endswith("[SETUP]"), usage


@pytest.mark.parametrize(("args", "message"), [
    (["plan"], "missing SCENARIO: a built-in name (e.g. core) or a YAML file, as the first argument or --scenario"),
    (["simulate", "core", "--scenario", "extended"], "SCENARIO given twice ('core' and --scenario 'extended')"),
    (["scenario", "show"], "missing SCENARIO"),
    (["experiment", "cost", "extended", "--setup", "core"], "SETUP given twice ('extended' and --setup 'core')"),
    (["experiment", "cost", "huge"], "'huge' is not one of 'core', 'extended'"),
])
def test_scenario_named_wrongly_is_one_line(args: list[str], message: str):
    r = run(*args)
    clean_error(r, 2, message)


# -- issue 26, item 5: --verify says what it checked -------------------------------------------------

def _verdicts(decode: float, joint: float):
    from coral.experiments import verify as verify_mod

    # decode below its phase target (97.5 %) while the model's joint target (95 %) holds or not
    return [verify_mod.Verdict(model="phi-4", phase=Phase.PREFILL, attainment=0.99, phase_target=0.975,
                               model_attainment=joint, model_target=0.95, requests=400),
            verify_mod.Verdict(model="phi-4", phase=Phase.DECODE, attainment=decode, phase_target=0.975,
                               model_attainment=joint, model_target=0.95, requests=400)]


def test_verify_marks_a_phase_below_its_target_and_says_whether_the_model_holds(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    from coral.experiments import verify as verify_mod

    scen = str(tiny(tmp_path))
    monkeypatch.setattr(verify_mod, "verify_plan", lambda setup, plan, **kw: _verdicts(0.96, 0.955))
    r = run("plan", scen, "--verify")
    assert 0 == r.exit_code, r.output
    text = " ".join(r.stdout.split())
    assert "│ phi-4 │ decode │ TPOT │ 96.0% │ 97.5% │ below │" in text
    assert "│ phi-4 │ prefill │ TTFT │ 99.0% │ 97.5% │ ok │" in text
    assert "phi-4: 95.5% of 400 requests meet both SLOs; target 95% holds" in text
    assert "below: the phase misses the share it was sized for" in text
    data = json.loads(run("plan", scen, "--verify", "--json").stdout)
    pairs = {p["phase"]: p for p in data["verification"][0]["pairs"]}
    assert (False, True) == (pairs["decode"]["phase_ok"], pairs["decode"]["model_ok"])
    assert (True, True) == (pairs["prefill"]["phase_ok"], pairs["prefill"]["model_ok"])
    monkeypatch.setattr(verify_mod, "verify_plan", lambda setup, plan, **kw: _verdicts(0.90, 0.89))
    r = run("plan", scen, "--verify")
    assert 3 == r.exit_code
    assert "phi-4: 89.0% of 400 requests meet both SLOs; target 95% MISSED" in " ".join(r.stdout.split())


def test_attainment_plot_marks_an_unreachable_point():
    import matplotlib.pyplot as plt

    from coral.experiments.verify import attainment_figure

    fig = attainment_figure([(0.5, 12.0), (0.9, 21.0), (0.99, None)], "t")
    ax = fig.axes[0]
    assert ["$12", "$21", "99.0%: unreachable "] == [t.get_text() for t in ax.texts]
    assert [99.0, 99.0] == list(ax.lines[-2].get_xdata())  # the dotted line at 99 %
    assert [50.0, 90.0] == list(ax.lines[0].get_xdata())  # the reachable points, joined
    plt.close(fig)


# -- issue 26, item 7: the wrong kind of file ---------------------------------------------------------

def test_a_cluster_file_or_a_plan_given_as_scenario_is_named(tmp_path: Path, cache: Path):
    cluster = REPO / "examples" / "cluster-tiny.yaml"
    for args in (["plan", str(cluster)], ["scenario", "show", str(cluster)]):
        r = run(*args)
        clean_error(r, 2, f"{cluster} is a cluster file (for `coral serve --config`", "not a scenario file")
        assert 1 == len(r.output.strip().splitlines())
    out = tmp_path / "plan.json"
    assert 0 == run("plan", str(tiny(tmp_path)), "--out", str(out)).exit_code
    clean_error(run("plan", str(out)), 2, f"{out} is a plan file (written by `coral plan --out`", "not a scenario file")
    from coral.file_kinds import MARKERS

    assert MARKERS["plan"] <= set(json.loads(out.read_text()))  # the markers are a plan file's keys


def test_a_scenario_given_as_cluster_file_is_named(tmp_path: Path):
    _needs_runtime()
    scen = tiny(tmp_path)
    r = run("serve", "--config", str(scen))
    clean_error(r, 2, f"{scen} is a scenario file (for `coral plan`, `simulate` and `scenario show`), "
                      "not a cluster file")
    assert 1 == len(r.output.strip().splitlines())
    assert "Extra inputs are not permitted" not in r.output


def test_file_kind_markers_are_fields_of_their_own_kind_only():
    from coral.file_kinds import MARKERS, file_kind
    from coral.runtime.deploy.cluster_config import ClusterFile
    from coral.scenario.schema import ScenarioFile

    fields = {"scenario": set(ScenarioFile.model_fields), "cluster": set(ClusterFile.model_fields)}
    for kind, keys in fields.items():
        assert MARKERS[kind] <= keys, kind
    for kind, markers in MARKERS.items():  # (the plan's markers are checked on a written plan above)
        for other, keys in fields.items():
            assert other == kind or not markers & keys, (kind, other)
    assert file_kind(yaml.safe_load((REPO / "examples" / "cluster-tiny.yaml").read_text())) == "cluster"
    assert file_kind({"models": []}) is None  # both kinds have models: not enough to say
