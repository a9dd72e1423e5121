"""Tests of the workload spec (edge schema), dataset resolution and the multi-model builder."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import coral.workload.spec as spec_module
from coral.errors import CoralError, UnknownNameError
from coral.workload import (
    CsvColumnsSpec,
    DiurnalShiftSpec,
    HeavySplitSpec,
    NoShiftSpec,
    StepShiftSpec,
    WorkloadSpec,
    build_workload,
    dataset_path,
    load_azure,
    load_dataset,
    parse_workload_spec,
)

SRC = Path(__file__).resolve().parents[3] / "src" / "coral" / "workload"


@pytest.mark.parametrize(
    "model", [WorkloadSpec, StepShiftSpec, DiurnalShiftSpec, NoShiftSpec, CsvColumnsSpec, HeavySplitSpec])
def test_every_field_is_documented(model):
    undocumented = [name for name, field in model.model_fields.items() if not field.description]
    assert [] == undocumented


def test_minimal_spec_defaults():
    spec = parse_workload_spec({"rate_per_s": 10, "dataset": "azure-code"})
    assert ("trace", NoShiftSpec()) == (spec.effective_arrival, spec.shift)
    assert "poisson" == parse_workload_spec({"rate_per_s": 1, "dataset": "synthetic-azure-conv"}).effective_arrival
    assert NoShiftSpec() == parse_workload_spec({"rate_per_s": 1, "dataset": "burstgpt", "shift": "none"}).shift


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"rate_per_s": 1, "dataset": "azure-code", "colour": "red"}, r"workload\.colour: Extra inputs"),
        ({"rate_per_s": float("nan"), "dataset": "azure-code"}, r"workload\.rate_per_s: .*finite"),
        ({"rate_per_s": -1, "dataset": "azure-code"}, r"workload\.rate_per_s: .*greater than or equal to 0"),
        ({"dataset": "azure-code"}, r"workload\.rate_per_s: Field required"),
        ({"rate_per_s": 1, "dataset": "azure_code"}, r"unknown dataset 'azure_code'; use one of azure-code"),
        ({"rate_per_s": 1, "dataset": "synthetic"}, "needs prompt_tokens_mean and output_tokens_mean"),
        ({"rate_per_s": 1, "dataset": "synthetic", "prompt_tokens_mean": 10, "output_tokens_mean": 5,
          "output_tokens_median": 9}, "output_tokens_median .* is above"),
        ({"rate_per_s": 1, "dataset": "azure-conv", "prompt_tokens_mean": 10}, "only apply to dataset `synthetic`"),
        ({"rate_per_s": 1, "dataset": "azure-conv", "arrival": "gamma"}, "needs `cv`"),
        ({"rate_per_s": 1, "dataset": "azure-conv", "cv": 2}, "`cv` only applies to arrival `gamma`"),
        ({"rate_per_s": 1, "dataset": "synthetic-azure-code", "arrival": "trace"}, "has no arrival times"),
        ({"rate_per_s": 1, "dataset": "azure-code", "lengths": "lognormal"}, "drop `lengths`"),
        ({"rate_per_s": 1, "dataset": "azure-code", "columns": {}}, "only applies when `dataset` is a path"),
        ({"rate_per_s": 1, "dataset": "azure-code", "arrival": "poisson", "trace_start_s": 5},
         "only applies to arrival `trace`"),
        ({"rate_per_s": 1, "dataset": "azure-code", "shift": {"kind": "step", "at_s": 5}},
         r"workload\.shift\.step\.factor: Field required"),
        ({"rate_per_s": 1, "dataset": "azure-code", "shift": {"kind": "ramp"}}, r"workload\.shift: .*'none', 'step', 'diurnal'"),
        ({"rate_per_s": 1, "dataset": "azure-code", "shift": {"kind": "diurnal", "period_s": 10, "amplitude": 2}},
         r"workload\.shift\.diurnal\.amplitude"),
    ],
)
def test_bad_specs_raise_coral_error_naming_the_field(data, match):
    with pytest.raises(CoralError, match=match):
        parse_workload_spec(data)


def test_to_trace_is_seeded(shared_data: Path):
    spec = WorkloadSpec(rate_per_s=8, dataset="azure-conv")
    first = spec.to_trace(120, 5, shared_data)
    assert first == spec.to_trace(120, 5, shared_data)
    assert first != spec.to_trace(120, 6, shared_data)
    assert (120.0, "azure-conv") == (first.duration_s, first.name)


def test_trace_replay_from_the_start_reproduces_the_file(shared_data: Path):
    source = load_azure(shared_data / "traces" / "azure_llm_2023_code.csv.gz").trace
    rate = 10.0
    spec = WorkloadSpec(rate_per_s=rate, dataset="azure-code", trace_start_s=0)
    trace = spec.to_trace(len(source) / rate, seed=0, data_dir=shared_data)
    assert source.prompt_tokens.tolist() == trace.prompt_tokens.tolist()
    assert np.allclose(source.arrival_s * source.rate_per_s / rate, trace.arrival_s)


def test_poisson_arrivals_with_lengths_from_a_trace(shared_data: Path):
    empirical = WorkloadSpec(rate_per_s=50, dataset="azure-code", arrival="poisson").to_trace(200, 1, shared_data)
    fitted = WorkloadSpec(rate_per_s=50, dataset="azure-code", arrival="gamma", cv=3,
                          lengths="lognormal").to_trace(200, 1, shared_data)
    # ~10,000 draws: prompt means within 5 % of the trace's 2047.8 (prompt CV ~ 0.6-1.0).
    assert 2047.8 == pytest.approx(empirical.mean_prompt_tok, rel=0.05)
    assert 2047.8 == pytest.approx(fitted.mean_prompt_tok, rel=0.05)
    source = load_azure(shared_data / "traces" / "azure_llm_2023_code.csv.gz").trace
    assert set(empirical.prompt_tokens.tolist()) <= set(source.prompt_tokens.tolist())


def test_synthetic_spec_lengths():
    spec = parse_workload_spec({"rate_per_s": 100, "dataset": "synthetic", "prompt_tokens_mean": 500,
                                "output_tokens_mean": 100, "output_tokens_median": 60})
    trace = spec.to_trace(100, seed=3)
    assert 500 == pytest.approx(trace.mean_prompt_tok, rel=0.05)
    assert 100 == pytest.approx(trace.mean_output_tok, rel=0.05)
    assert 60 == pytest.approx(np.median(trace.output_tokens), rel=0.05)
    assert 100 == pytest.approx(trace.rate_per_s, rel=0.05)


def test_missing_data_dir_says_how_to_fix(no_data_dir: Path):
    with pytest.raises(CoralError, match=r"--data-dir DIR or set CORAL_DATA_DIR=DIR.*'synthetic-azure-code'") as info:
        WorkloadSpec(rate_per_s=1, dataset="azure-code").to_trace(10, 0)
    assert str(no_data_dir) in str(info.value)


def test_synthetic_azure_fits_need_no_data(no_data_dir: Path):
    trace = WorkloadSpec(rate_per_s=200, dataset="synthetic-azure-code").to_trace(100, 0)
    assert 2047.8 == pytest.approx(trace.mean_prompt_tok, rel=0.03)
    assert 27.9 == pytest.approx(trace.mean_output_tok, rel=0.05)


def test_data_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shared_data: Path):
    mine = tmp_path / "mine" / "traces"
    mine.mkdir(parents=True)
    (mine / "burstgpt_1_first400.csv.gz").write_bytes((shared_data / "traces" / "burstgpt_1_first400.csv.gz").read_bytes())
    monkeypatch.setenv("CORAL_DATA_DIR", str(tmp_path / "mine"))
    assert mine / "burstgpt_1_first400.csv.gz" == dataset_path("burstgpt")  # the override comes first
    assert shared_data / "traces" / "azure_llm_2023_conv.csv.gz" == dataset_path("azure-conv")  # then the shipped copy


def test_shipped_copy_and_explicit_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shared_data: Path):
    monkeypatch.delenv("CORAL_DATA_DIR", raising=False)
    assert shared_data / "traces" / "azure_llm_2023_conv.csv.gz" == dataset_path("azure-conv")
    (tmp_path / "azure_llm_2023_conv.csv.gz").write_bytes(b"")  # a flat folder works too
    assert tmp_path / "azure_llm_2023_conv.csv.gz" == dataset_path("azure-conv", tmp_path)
    with pytest.raises(CoralError, match=r"looked in .*--data-dir"):
        dataset_path("azure-code", tmp_path)  # an explicit folder is not second-guessed


def test_csv_path_dataset_relative_to_base_dir(write_csv, tmp_path: Path):
    write_csv("mine.csv", """
        when,p,o
        0,10,1
        1,20,2
        2,30,3
        3,40,4
    """)
    spec = parse_workload_spec({"rate_per_s": 1, "dataset": "mine.csv", "trace_start_s": 0,
                                "columns": {"arrival_s": "when", "prompt_tokens": "p", "output_tokens": "o"}})
    trace = spec.to_trace(4, seed=0, base_dir=tmp_path)
    assert [10, 20, 30, 40] == trace.prompt_tokens.tolist()
    with pytest.raises(CoralError, match=r"unrecognised trace columns 'when', 'p', 'o'.*`columns:`"):
        parse_workload_spec({"rate_per_s": 1, "dataset": "mine.csv"}).to_trace(4, seed=0, base_dir=tmp_path)
    with pytest.raises(CoralError, match=r"trace file not found: .*other\.csv"):
        parse_workload_spec({"rate_per_s": 1, "dataset": "other.csv"}).to_trace(4, seed=0, base_dir=tmp_path)


def test_step_shift_in_spec():
    spec = parse_workload_spec({"rate_per_s": 20, "dataset": "synthetic-azure-conv",
                                "shift": {"kind": "step", "at_s": 300, "factor": 0.25}})
    trace = spec.to_trace(600, seed=4)
    before = int((trace.arrival_s < 300).sum())
    # 6000 expected before (sd 77), 1500 after (sd 39); 5 sd.
    assert abs(before - 6000) < 5 * 77
    assert abs(len(trace) - before - 1500) < 5 * 39


def _specs() -> dict[str, WorkloadSpec]:
    return {
        "big": WorkloadSpec(rate_per_s=10, dataset="synthetic-azure-code"),
        "mid": WorkloadSpec(rate_per_s=10, dataset="synthetic-azure-conv", arrival="gamma", cv=2),
        "small": WorkloadSpec(rate_per_s=10, dataset="synthetic-azure-conv"),
    }


def test_build_workload_is_seeded_per_model_name():
    workload = build_workload(_specs(), duration_s=60, seed=7)
    assert ["big", "mid", "small"] == list(workload)
    assert ["big", "mid", "small"] == [trace.name for trace in workload.values()]
    assert workload == build_workload(_specs(), duration_s=60, seed=7)
    assert workload["big"] != build_workload(_specs(), duration_s=60, seed=8)["big"]
    # Dropping a model leaves the others' traces unchanged.
    fewer = {k: v for k, v in _specs().items() if k != "mid"}
    assert workload["small"] == build_workload(fewer, duration_s=60, seed=7)["small"]
    # Two models on the same dataset and rate still get different arrivals.
    assert workload["small"].arrival_s.tolist() != workload["mid"].arrival_s.tolist()


def test_build_workload_large_heavy():
    # Total 30 req/s; "big" gets 80 % = 24, the two others 3 each (Poisson counts over 500 s: 12000 sd 110,
    # 1500 sd 39; 5 sd).
    workload = build_workload(_specs(), duration_s=500, seed=1, heavy=HeavySplitSpec(models=["big"]))
    assert abs(len(workload["big"]) - 12_000) < 5 * 110
    assert abs(len(workload["small"]) - 1500) < 5 * 39
    assert abs(len(workload["mid"]) - 1500) < 5 * 2 * 39  # cv 2 doubles the count's sd


def test_build_workload_heavy_split_from_a_time():
    workload = build_workload(_specs(), duration_s=400, seed=2, heavy=HeavySplitSpec(models=["big"], at_s=200))
    big = workload["big"].arrival_s
    # 10 req/s for 200 s (2000, sd 45), then 24 req/s (4800, sd 69).
    assert abs(int((big < 200).sum()) - 2000) < 5 * 45
    assert abs(int((big >= 200).sum()) - 4800) < 5 * 69


def test_build_workload_unknown_heavy_model():
    with pytest.raises(UnknownNameError, match=r"unknown model 'huge'; valid models: big, mid, small"):
        build_workload(_specs(), duration_s=10, seed=0, heavy=HeavySplitSpec(models=["huge"]))


def test_build_workload_reads_each_dataset_once(monkeypatch: pytest.MonkeyPatch, shared_data: Path):
    calls = []
    real = spec_module.load_dataset

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(spec_module, "load_dataset", counting)
    specs = {name: WorkloadSpec(rate_per_s=2, dataset="burstgpt") for name in ("a", "b", "c")}
    workload = build_workload(specs, duration_s=100, seed=0, data_dir=shared_data)
    assert ["burstgpt"] == calls
    assert 3 == len(workload)


@pytest.mark.parametrize("dataset", ["azure-code", "azure-conv", "burstgpt"])
def test_builtin_mean_lengths_match_the_files(shared_data: Path, dataset: str):
    spec = WorkloadSpec(rate_per_s=1, dataset=dataset)
    trace = load_dataset(dataset, shared_data).trace
    assert spec.mean_lengths_tok() == (round(trace.mean_prompt_tok, 1), round(trace.mean_output_tok, 1))


def test_mean_lengths_of_synthetic_and_csv(write_csv, tmp_path: Path):
    assert pytest.approx((2047.8, 27.9)) == WorkloadSpec(rate_per_s=1, dataset="synthetic-azure-code").mean_lengths_tok()
    synthetic = WorkloadSpec(rate_per_s=1, dataset="synthetic", prompt_tokens_mean=300, output_tokens_mean=40)
    assert pytest.approx((300.0, 40.0)) == synthetic.mean_lengths_tok()
    write_csv("m.csv", "arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,30,5")
    assert (20.0, 3.0) == WorkloadSpec(rate_per_s=1, dataset="m.csv").mean_lengths_tok(base_dir=tmp_path)


def test_bad_duration_is_a_coral_error():
    with pytest.raises(CoralError, match="duration_s must be a finite number > 0"):
        WorkloadSpec(rate_per_s=1, dataset="synthetic-azure-code").to_trace(0, seed=0)


def test_workload_imports_only_leaf_modules_from_the_rest_of_coral():
    imported = set()
    for path in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("coral"):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name.startswith("coral"))
    leaves = {"coral.errors", "coral.atomic", "coral.cache"}  # stdlib-only modules
    assert set() == {name for name in imported if not name.startswith("coral.workload") and name not in leaves}
