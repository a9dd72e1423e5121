"""The `coral` command's output on a recorded set of cases, byte for byte: every command's `--help`,
the catalog / scenario / perf / plan / export / advisory outputs on a small scenario, and the
one-line errors of bad input. A refactoring keeps them; a change that means to alter an output
re-records it (and the diff shows what changed):

    .venv/bin/python tests/integration/test_cli_recorded.py      # rewrites tests/integration/cli_recorded/

Each case's file holds the exit code, stdout and stderr, with the temporary folder shown as `<tmp>`
and the solver's wall time as `<s>` (the only figures that differ from run to run).
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from coral.cli import main

RECORDED = Path(__file__).with_name("cli_recorded")

# A scenario whose library and plan take about a second (as tests/deploy uses).
SCENARIO = {
    "name": "recorded", "description": "two models, two regions, a small library",
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

# name -> argv; `{tmp}` is the case folder (the scenario is `{tmp}/recorded.yaml`, the plan `{tmp}/plan.json`).
# In order: later cases read what earlier ones wrote.
OUTPUT_CASES: dict[str, list[str]] = {
    "catalog-configs": ["catalog", "configs"],
    "catalog-gpus": ["catalog", "gpus"],
    "catalog-models-json": ["catalog", "models", "--json"],
    "scenario-show-core": ["scenario", "show", "core"],
    "perf-prefill": ["perf", "--model", "llama-2-70b", "--node", "1xA100-40GB", "--phase", "prefill", "--batch", "1",
                     "--prompt-tokens", "1000"],
    # the exports below read a disaggregated plan; plan-auto shows what the default mode picks
    "plan-json": ["plan", "--scenario", "{tmp}/recorded.yaml", "--mode", "disagg", "--json", "--out", "{tmp}/plan.json"],
    "plan-auto": ["plan", "--scenario", "{tmp}/recorded.yaml", "--out", "{tmp}/plan-auto.json"],
    "plan-running": ["plan", "--scenario", "{tmp}/recorded.yaml", "--running", "{tmp}/plan.json"],
    "export-skypilot": ["export", "--plan", "{tmp}/plan.json", "--format", "skypilot", "--out", "{tmp}/sky"],
    "export-vllm": ["export", "--plan", "{tmp}/plan.json", "--format", "vllm", "--out", "{tmp}/vllm"],
    # bad input: one line, exit 2
    "error-scenario-unknown": ["scenario", "show", "no-such-scenario"],
    "error-serve-missing-config": ["serve", "--config", "{tmp}/missing.yaml"],
    "error-serve-bad-ready-file": ["serve", "--config", "{tmp}/recorded.yaml", "--ready-file", "{tmp}"],
    "error-export-missing-plan": ["export", "--plan", "{tmp}/missing.json", "--format", "vllm", "--out", "{tmp}/x"],
    "error-bench-bad-rate": ["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--rate", "-1"],
    "error-experiment-unknown": ["experiment", "no-such-study"],
    "error-plan-bad-mode": ["plan", "--scenario", "{tmp}/recorded.yaml", "--mode", "both"],
}


def _help_cases() -> dict[str, list[str]]:
    """`--help` of `coral` and of every command and subcommand it lists."""
    cases: dict[str, list[str]] = {}

    def walk(cmd: click.Command, path: list[str]) -> None:
        cases["help-" + ("-".join(path) or "coral")] = [*path, "--help"]
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None:
                    walk(sub, [*path, name])

    walk(main, [])
    return cases


def _folder_text(folder: Path, tmp: Path) -> str:
    """Every file an export wrote, in name order, as `== path ==` and its content (a secret: its mode only,
    the deployment's keys are new each time)."""
    if not folder.is_dir():
        return ""
    parts = [f"== {p.relative_to(tmp)} ==\n" + (f"<secret, mode {p.stat().st_mode & 0o777:o}>\n" if "secrets" in p.parts else p.read_text())
             for p in sorted(folder.rglob("*")) if p.is_file()]  # fmt: skip
    return "".join(parts)


# wall times, and the security group named after a deployment's key, which differ from run to run
_TIMINGS = [(re.compile(r'("solve_s": )[-+0-9.e]+'), r"\1<s>"), (re.compile(r"(│ solve time s +│).*│"), r"\1 <s> │"),
            (re.compile(r"security_group_name: coral-[0-9a-f]+"), "security_group_name: coral-<key>")]


def _normalized(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<tmp>")
    for pattern, repl in _TIMINGS:
        text = pattern.sub(repl, text)
    return text


def _run_cases(tmp: Path, data_dir: Path) -> Iterator[tuple[str, str]]:
    """(case name, recorded text) for every case, run in `tmp` on the public data in `data_dir`."""
    (tmp / "recorded.yaml").write_text(yaml.safe_dump(SCENARIO))
    runner = CliRunner(env={"CORAL_DATA_DIR": str(data_dir)})
    for name, argv in {**_help_cases(), **OUTPUT_CASES}.items():
        args = [a.replace("{tmp}", str(tmp)) for a in argv]
        res = runner.invoke(main, args, prog_name="coral")
        text = f"exit: {res.exit_code}\n-- stdout --\n{res.stdout}-- stderr --\n{res.stderr}"
        if name.startswith("export-") and res.exit_code == 0:
            text += "-- files --\n" + _folder_text(Path(args[args.index("--out") + 1]), tmp)
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            text += f"-- exception --\n{type(res.exception).__name__}: {res.exception}\n"
        yield name, _normalized(text, tmp)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, str]:
    return dict(_run_cases(tmp_path_factory.mktemp("cli"), data_dir))


def test_every_case_is_recorded(outputs: dict[str, str]) -> None:
    recorded = sorted(p.stem for p in RECORDED.glob("*.txt"))
    assert sorted(outputs) == recorded


@pytest.mark.parametrize("name", sorted({**_help_cases(), **OUTPUT_CASES}))
def test_output_is_the_recorded_one(outputs: dict[str, str], name: str) -> None:
    path = RECORDED / f"{name}.txt"
    assert path.is_file(), f"{name} is not recorded; run `python tests/integration/test_cli_recorded.py`"
    assert path.read_text() == outputs[name]


def record(folder: Path = RECORDED) -> None:
    """Run every case and write its output under `folder` (old files removed)."""
    import tempfile

    from coral.workload.datasets import builtin_data_dir

    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.txt"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in _run_cases(Path(tmp), builtin_data_dir()):
            (folder / f"{name}.txt").write_text(text)


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDED)
