"""Small scenarios and their plan files for the deployment tests (each plan solves in about a second)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from coral.cli import main

TWO_MODELS = {
    "name": "deploytest", "description": "two models, two regions, a small library",
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

# Only 2xL40S, which AWS does not sell: every instance uses a derived shape.
DERIVED = {
    "name": "derivedtest", "description": "phi-4 on a derived shape only",
    "models": [{"name": "phi-4", "ttft_ms": 3000, "tpot_ms": 400,
                "workload": {"rate_per_s": 4, "dataset": "synthetic", "prompt_tokens_mean": 600,
                             "output_tokens_mean": 60}}],
    "configs": ["2xL40S"],
    "regions": [{"name": "aws:us-east-2"}],
    "derive_missing_prices": True,
    "planner": {"n_max": 2, "batch_grid": [1, 4, 16, 64], "history_s": 900, "epoch_s": 120},
}


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def flat(result) -> str:
    """The output with rich's line wrapping undone (errors are one line to the user's terminal)."""
    return " ".join(result.output.split())


def write_plan(folder: Path, scenario: dict, name: str = "plan.json", *extra: str) -> tuple[Path, Path]:
    """Write `scenario` as YAML and `coral plan --out` of it; return (scenario path, plan path)."""
    s = folder / f"{scenario['name']}.yaml"
    s.write_text(yaml.safe_dump(scenario))
    p = folder / name
    r = run("plan", "--scenario", str(s), "--mode", "disagg", "--out", str(p), *extra)
    assert r.exit_code == 0, r.output
    return s, p


@pytest.fixture(scope="session")
def two_model_plan(tmp_path_factory) -> tuple[Path, Path, dict]:
    folder = tmp_path_factory.mktemp("plan")
    s, p = write_plan(folder, TWO_MODELS)
    return s, p, json.loads(p.read_text())


def with_first_token(data: dict, mode: str | None) -> dict:
    """The plan's JSON with every model's `first_token` set to `mode` (None: the field removed, as plan files
    before it): what a plan sized for that mode says (vLLM's P/D proxy runs only "decode")."""
    d = json.loads(json.dumps(data))
    d.pop("models", None)
    if mode is not None:
        d["models"] = [{"model": m, "first_token": mode} for m in sorted({i["model"] for i in d["instances"]})]
    return d


@pytest.fixture(scope="session")
def decode_plan(two_model_plan, tmp_path_factory) -> tuple[Path, Path, dict]:
    """`two_model_plan` with every model's first token emitted by the decode instance (what vLLM runs)."""
    s, _, data = two_model_plan
    d = with_first_token(data, "decode")
    p = tmp_path_factory.mktemp("decode") / "plan.json"
    p.write_text(json.dumps(d))
    return s, p, d
