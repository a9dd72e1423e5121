"""SkyPilot's own loader (`sky.Task.from_yaml_config`) accepts every exported task, offline.

SkyPilot pins click<8.2, which Coral's CLI tests outgrew, so it lives in its own virtual
environment (`make venv` builds `.venv-sky`; $CORAL_SKYPILOT_PYTHON points elsewhere). SkyPilot
checks instance types against its AWS catalog; offline, the test hands it one written from the
public price table Coral's catalog was built from (the same SkyPilot catalog commit).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import run
from .test_locked_export import check_locked

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, sys, yaml
import sky
from sky import catalog
out = []
for path in sys.argv[1:]:
    task = sky.Task.from_yaml_config(yaml.safe_load(open(path)))
    task.expand_and_validate_file_mounts()  # every mounted secret exists, from the folder `sky launch` runs in
    (res,) = task.resources
    acc = catalog.get_accelerators_from_instance_type(res.instance_type, clouds="aws") if res.instance_type else None
    out.append({"file": path, "num_nodes": task.num_nodes, "cloud": str(res.cloud).lower(), "region": res.region,
                "accelerators": res.accelerators, "instance_type": res.instance_type, "catalog_accelerators": acc,
                "run": task.run, "envs": task.envs, "ports": sorted(res.ports or []), "file_mounts": task.file_mounts,
                "ports_expanded": sorted({p for spec in (res.ports or []) for p in
                                          (range(int(spec.split("-")[0]), int(spec.split("-")[-1]) + 1)
                                           if isinstance(spec, str) else [int(spec)])})})
print(json.dumps(out))
"""


def _sky_python() -> str:
    exe = os.environ.get("CORAL_SKYPILOT_PYTHON") or str(REPO / ".venv-sky" / "bin" / "python")
    if not Path(exe).exists():
        pytest.skip(f"no SkyPilot interpreter at {exe}: `make venv` builds .venv-sky")
    return exe


def _sky_home(home: Path, data_dir: Path) -> None:
    """An AWS catalog in SkyPilot's v8 format, from coral/data/prices/gpu_nodes.csv."""
    folder = home / ".sky" / "catalogs" / "v8" / "aws"
    folder.mkdir(parents=True)
    names = {"A100-40GB": "A100", "V100-16GB": "V100"}
    with open(data_dir / "prices" / "gpu_nodes.csv") as f, open(folder / "vms.csv", "w", newline="") as g:
        w = csv.writer(g)
        w.writerow(["InstanceType", "AcceleratorName", "AcceleratorCount", "vCPUs", "MemoryGiB", "GpuInfo", "Price",
                    "SpotPrice", "Region", "AvailabilityZone"])
        for r in csv.DictReader(f):
            if r["cloud"] == "aws":
                w.writerow([r["instance_type"], names.get(r["gpu"], r["gpu"]), r["gpu_count"], r["vcpus"],
                            r["memory_gib"], "", r["price_per_hour"], r["spot_price_per_hour"], r["region"],
                            r["region"] + "a"])


def check_with_skypilot(plan, data, tmp_path, data_dir, *extra):
    exe = _sky_python()
    r = run("export", "--plan", str(plan), "--format", "skypilot", "--out", str(tmp_path / "sky"), *extra)
    assert r.exit_code == 0, r.output
    files = sorted(str(p) for p in (tmp_path / "sky").glob("[!.]*.yaml"))  # .sky.yaml: the project config
    home = tmp_path / "home"
    _sky_home(home, data_dir)
    env = {**os.environ, "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    # from the export folder, as docs/howto/deploy.md launches it: SkyPilot reads its .sky.yaml, finds its secrets/
    proc = subprocess.run([exe, "-c", CHECK, *files], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path / "sky")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tasks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(files) == len(tasks)
    check_locked(tmp_path / "sky")
    for t in tasks:  # what SkyPilot makes of it: only the front end's port published, the mounts resolved to secrets/
        assert set(t["ports_expanded"]) <= {8000}
        assert all(src.startswith(str(tmp_path / "sky" / "secrets")) for src in t["file_mounts"].values())
    total: dict[tuple[str, str], int] = {}
    (control,) = [t for t in tasks if t["accelerators"] is None]  # one CPU task: the control plane
    assert control["file"].endswith("00-control-plane.yaml") and 1 == control["num_nodes"]
    assert "--provisioner remote" in control["run"] and [8000] == control["ports_expanded"]
    for t in tasks:
        assert t["cloud"] == "aws"
        if t is control:
            continue
        # every engine task dials the control plane, and knows its node's address and scheduler port
        assert "CORAL_CONTROL_HOST" in t["envs"] and "SKYPILOT_NODE_IPS" in t["run"]
        assert int(t["envs"]["CORAL_SCHEDULER_PORT"]) >= 47000  # reached over the private network, not published
        # the instance type SkyPilot's catalog knows carries exactly the accelerators the task asks for
        assert t["catalog_accelerators"] == t["accelerators"]
        ((gpu, count),) = t["accelerators"].items()
        shape = f"{int(count)}x{gpu}"
        # an instance type other than the shape's default is its own configuration, asked for by name
        typed = [n["config"] for n in data["nodes"] if n["config"].startswith(shape + "@")
                 and n.get("instance_type") == t["instance_type"]]
        key = (f"aws:{t['region']}", typed[0] if typed else shape)
        total[key] = total.get(key, 0) + t["num_nodes"]
    assert {(n["region"], n["config"]): n["count"] for n in data["nodes"] if n["count"]} == total


def test_skypilot_accepts_every_exported_task(two_model_plan, tmp_path, data_dir):
    scenario, plan, data = two_model_plan
    check_with_skypilot(plan, data, tmp_path, data_dir, "--scenario", str(scenario))


@pytest.mark.slow
def test_core_plan_exports_to_skypilot(tmp_path, data_dir):
    """The issue's target: a core plan's tasks are accepted and add up to its nodes per (region, shape)."""
    plan = tmp_path / "core.json"
    r = run("plan", "--scenario", "core", "--out", str(plan))
    assert r.exit_code == 0, r.output
    data = json.loads(plan.read_text())
    assert not any(n.get("derived") for n in data["nodes"])  # the built-in offers only sold shapes
    check_with_skypilot(plan, data, tmp_path, data_dir)


def test_skypilot_rejects_a_broken_task(tmp_path, data_dir):
    """The check above can fail: SkyPilot refuses a field it does not know."""
    exe = _sky_python()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nresources: {cloud: aws, region: us-east-2, accelerators: 'L4:4', gpus_per_node: 4}\n")
    home = tmp_path / "home"
    _sky_home(home, data_dir)
    proc = subprocess.run([exe, "-c", CHECK, str(bad)], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(home)}, timeout=240)
    assert proc.returncode != 0
    assert "gpus_per_node" in proc.stderr
