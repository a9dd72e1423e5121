"""The public data ships inside the package: every file checksummed, the stand-ins reproducible
and labelled, and nothing in the repository pointing at a folder outside it (issue 26)."""
from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.util
import io
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from coral.workload.datasets import BUILTIN_DATASET_FILES, builtin_data_dir

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "src" / "coral" / "data"


def _sums() -> dict[str, str]:
    lines = (DATA / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines)}


def test_the_shipped_copy_is_the_package_folder():
    assert DATA.resolve() == builtin_data_dir().resolve()
    for relative in BUILTIN_DATASET_FILES.values():
        assert (builtin_data_dir() / relative).is_file()


def test_every_data_file_is_listed_with_its_checksum():
    shipped = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file()} - {"README.md", "SHA256SUMS"}
    sums = _sums()
    assert sorted(shipped) == sorted(sums)
    for name, digest in sums.items():
        assert digest == hashlib.sha256((DATA / name).read_bytes()).hexdigest(), name


def test_pyproject_ships_the_data_folder():
    text = (REPO / "pyproject.toml").read_text()
    assert '"data/**/*"' in text


def _tool():
    spec = importlib.util.spec_from_file_location("data_standins", REPO / "tools" / "data_standins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["data_standins"] = module
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict[str, str]]:
    with gzip.open(DATA / "availability" / name, "rt") as f:
        return list(csv.DictReader(f))


def test_standins_are_what_the_tool_writes_and_say_so():
    tool = _tool()
    for name, data in tool.standins().items():
        assert name.startswith("standin_")
        assert data == (DATA / "availability" / name).read_bytes(), name
    spot = _rows(tool.SPOT_FILE)
    assert all(r["series_id"].startswith("STANDIN/") for r in spot)
    assert 27 == len({r["series_id"] for r in spot})
    # each series covers its ticks without a gap, in runs of changing values within 0..nodes requested
    for sid, *_, ticks in tool.SPOT_SERIES:
        runs = [r for r in spot if r["series_id"] == f"STANDIN/{sid}"]
        assert (0, ticks) == (int(runs[0]["start_tick"]), int(runs[-1]["end_tick"]))
        for a, b in itertools.pairwise(runs):
            assert a["end_tick"] == b["start_tick"] and a["value"] != b["value"]
        assert all(0 <= int(r["value"]) <= int(r["nodes_requested"]) for r in runs)
    inventory = _rows(tool.INVENTORY_FILE)
    assert 4278 == len(inventory)
    assert all(r["node_name"].startswith("standin-") for r in inventory)
    assert 432 == sum(r["gpu_model"] == "A100-SXM4-80GB" for r in inventory)
    # the real files are not shipped
    assert not (DATA / "availability" / "spot_gpu_availability_aws_rle.csv.gz").exists()
    assert not (DATA / "availability" / "alibaba_gfs2026_node_inventory.csv.gz").exists()


def test_the_data_readme_names_every_licence_and_the_standins():
    text = (DATA / "README.md").read_text()
    for needle in ("Apache-2.0", "CC-BY 4.0", "MIT", "**stand-in**", "tools/data_standins.py", "SHA256SUMS",
                   "# Real public data for the Coral re-implementation"):  # the collection's own text is kept
        assert needle in text


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / n for n in out.decode().split("\0")
            if n and not n.endswith((".gz", ".png", ".parquet")) and (REPO / n).is_file()]


def test_nothing_names_a_folder_outside_the_repository():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    needles = ("shared" + "/data", "../" + "shared", "Copy of " + "shared")  # spelled apart so this file passes
    hits = [f"{p.relative_to(REPO)}: {n}" for p in _tracked_text_files()
            for n in needles if n in p.read_text(errors="replace")]
    assert [] == hits


def test_upstream_text_is_readable_csv():
    # a spot check that the files are the CSVs their README describes
    with gzip.open(DATA / "traces" / "azure_llm_2023_code.csv.gz", "rt") as f:
        header = next(csv.reader(io.StringIO(f.readline())))
    assert ["TIMESTAMP", "ContextTokens", "GeneratedTokens"] == header
