"""A clone works on its own (issue 26, item 2): the tracked files, copied into an empty folder with
an empty home and no data or cache variables, run the commands that read the public data."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [n for n in out.decode().split("\0") if n and (REPO / n).is_file()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The tracked files (what `git clone` gives) in `<tmp>/empty/coral`, and an environment with
    an empty HOME, this interpreter's packages but Coral from the copy, and no CORAL_* variable."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    root = tmp_path_factory.mktemp("empty")
    copy = root / "coral"
    for name in _tracked():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    (root / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORAL_")}
    env.update(HOME=str(root / "home"), PYTHONPATH=str(copy / "src"), XDG_CACHE_HOME=str(root / "home" / ".cache"))
    return copy, env


def _coral(clone: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    copy, env = clone
    return subprocess.run([sys.executable, "-m", "coral.cli", *args], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_the_copy_runs_its_own_sources(clone: tuple[Path, dict[str, str]]):
    copy, env = clone
    r = subprocess.run([sys.executable, "-c", "import coral.workload.datasets as d; print(d.builtin_data_dir())"],
                       cwd=copy, env=env, capture_output=True, text=True, check=True)
    assert copy / "src" / "coral" / "data" == Path(r.stdout.strip())


def test_the_copy_reads_its_traces_and_profiles(clone: tuple[Path, dict[str, str]]):
    r = _coral(clone, "scenario", "show", "core", "--json")  # replays azure-code, azure-conv and burstgpt
    assert 0 == r.returncode, r.stderr
    assert ["burstgpt", "azure-code", "azure-conv"] == [m["dataset"] for m in json.loads(r.stdout)["models"]]
    r = _coral(clone, "calibrate", "--json")  # the Helix and Vidur profiles
    assert 0 == r.returncode, r.stderr
    assert json.loads(r.stdout)["summary"]["counted_points"] > 0


def test_make_and_ci_name_nothing_outside_the_copy(clone: tuple[Path, dict[str, str]]):
    copy, _ = clone
    for name in ("Makefile", ".ci/run"):
        text = (copy / name).read_text()
        assert "../" not in text and "/work/" not in text, name
    assert os.access(copy / ".ci" / "run", os.X_OK)


def test_the_readme_names_the_demo_the_makefile_runs():
    demo = next(line.split("coral ", 1)[1].split(" --out")[0]
                for line in (REPO / "Makefile").read_text().splitlines() if "coral experiment" in line)
    assert "experiment cost core --duration-s 720" == demo
    text = " ".join((REPO / "README.md").read_text().split())
    assert f"`coral {demo}`" in text and "from a fresh clone with an empty home" in text
