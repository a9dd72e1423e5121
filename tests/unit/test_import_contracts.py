"""The layering is a test: the import-linter contracts of pyproject.toml hold (no package imports a
layer above it, the runtime's parts meet only in protocol and transport, no import cycles, no sockets
below the runtime), and every package of coral is placed in a layer, so a new one cannot go round it."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "coral"


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert 0 == out.returncode, out.stdout + out.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in out.stdout


def test_every_package_is_in_a_layer() -> None:
    layered = {name.strip() for layer in _contracts()["layers"]["layers"] for name in layer.split("|")}
    packages = {f"coral.{p.stem}" for p in SRC.glob("*.py") if p.stem != "__init__"}
    packages |= {f"coral.{p.parent.name}" for p in SRC.glob("*/__init__.py")}
    assert sorted(packages) == sorted(layered)


def test_every_runtime_module_is_in_a_subpackage_or_shared() -> None:
    runtime = SRC / "runtime"
    layered = {name.strip() for layer in _contracts()["runtime"]["layers"] for name in layer.split("|")}
    top = {p.stem for p in runtime.glob("*.py") if p.stem != "__init__"} | {p.parent.name for p in runtime.glob("*/__init__.py")}
    assert sorted(layered) == sorted(top)
    assert ["protocol", "transport"] == sorted(p.stem for p in runtime.glob("*.py") if p.stem != "__init__")


def test_ignored_imports_are_the_planner_issue_ones() -> None:
    # Only the cycles inside the packages the planner rewrite (#25) owns are tolerated, each named.
    ignored = {imp for c in _contracts().values() for imp in c.get("ignore_imports", [])}
    planner = ("coral.scenario.", "coral.templates.", "coral.allocator.", "coral.sim.")
    assert [] == sorted(i for i in ignored if not i.startswith(planner))
