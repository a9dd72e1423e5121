"""Exports are locked by default: a deployment's API key and CurveZMQ keys are made for it, kept user-only
and referred to by path, never written into a task file; only the HTTP port is published."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml

from coral.runtime.deploy.secrets import load_secrets

from .conftest import run

SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def check_locked(folder: Path) -> dict[str, dict]:
    """The properties every exported deployment has; returns the parsed task files (SkyPilot) by name.

    - the secrets exist, are user-only (folders 0700, files 0600) and git-ignored;
    - no exported file but the secrets themselves holds the API key or the Curve secret key;
    - no env value that names a key, token, secret or password is empty;
    - a task publishes no port but the HTTP front end's (8000), and every file it mounts exists in the export.
    """
    s = load_secrets(folder)
    assert s is not None, f"no secrets in {folder}"
    secret_dir = folder / "secrets"
    modes = {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [secret_dir, *secret_dir.rglob("*")]}
    assert {m for p, m in modes.items() if (folder / p).is_dir()} == {0o700}, modes
    assert {m for p, m in modes.items() if (folder / p).is_file()} == {0o600}, modes
    assert "*" in (secret_dir / ".gitignore").read_text().split()
    secret_line = next(line for line in s.curve_secret.splitlines() if "secret-key" in line).split("=", 1)[1].strip()
    tasks = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and secret_dir not in p.parents):
        text = f.read_text()
        assert s.api_key not in text and secret_line not in text, f"{f.name} holds a secret"
        if f.suffix != ".yaml" or f.name.startswith("."):
            continue
        task = yaml.safe_load(text)
        tasks[f.name] = task
        for k, v in (task.get("envs") or {}).items():
            if any(w in k for w in SECRET_WORDS):
                assert v not in (None, ""), f"{f.name}: env {k} is empty"
        assert set((task.get("resources") or {}).get("ports") or []) <= {8000}, f"{f.name} publishes {task['resources']['ports']}"
        for remote, local in (task.get("file_mounts") or {}).items():
            src = folder / local
            assert src.exists() and (src.is_dir() or src.stat().st_size > 0), f"{f.name}: file_mounts {remote}: {local} missing"
            assert secret_dir in src.parents, f"{f.name} mounts {local}, outside secrets/"
    return tasks


def test_skypilot_export_is_locked(two_model_plan, tmp_path):
    scenario, plan, _ = two_model_plan
    out = tmp_path / "sky"
    r = run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "skypilot", "--out", str(out))
    assert r.exit_code == 0, r.output
    tasks = check_locked(out)
    control = tasks["00-control-plane.yaml"]
    assert [8000] == control["resources"]["ports"]  # the schedulers' ports are not published
    # the control plane gets the API key and the keypair, an engine only the keypair
    assert {"~/.coral/secrets/api_key": "secrets/api_key", "~/.coral/secrets/curve": "secrets/curve"} == control["file_mounts"]
    engines = [t for n, t in tasks.items() if n != "00-control-plane.yaml"]
    assert engines and all({"~/.coral/secrets/curve": "secrets/curve"} == t["file_mounts"] for t in engines)
    assert all("ports" not in t["resources"] for t in engines)
    assert "CORAL_API_KEY" not in control["envs"]
    # every cluster of the deployment in one security group (SkyPilot's project config in the launch folder)
    group = yaml.safe_load((out / ".sky.yaml").read_text())["aws"]["security_group_name"]
    assert group.startswith("coral-")
    assert "new API key" in r.output


def test_a_re_export_keeps_the_deployments_keys(two_model_plan, tmp_path):
    scenario, plan, _ = two_model_plan
    out, other = tmp_path / "sky", tmp_path / "other"
    got, said = [], []
    for folder in (out, out, other):
        r = run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "skypilot", "--out", str(folder))
        assert r.exit_code == 0, r.output
        got.append(load_secrets(folder))
        said.append("kept API key" in r.output)
    first, again, fresh = got
    assert first is not None and fresh is not None
    assert first == again  # the running deployment's processes hold these: a re-export keeps them
    assert first.api_key != fresh.api_key and first.curve_public != fresh.curve_public  # another deployment: its own
    assert [False, True, False] == said


def test_vllm_export_reads_its_key_from_the_file(decode_plan, tmp_path):
    scenario, plan, _ = decode_plan
    out = tmp_path / "vllm"
    r = run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "vllm", "--out", str(out))
    assert r.exit_code == 0, r.output
    check_locked(out)
    for script in out.glob("*.sh"):
        text = script.read_text()
        assert 'VLLM_API_KEY="$(cat "$(dirname "$0")/secrets/api_key")"' in text and "--api-key" not in text


def test_the_vllm_script_exports_the_key_vllm_reads(decode_plan, tmp_path):
    """Run a script's key lines with `vllm` replaced by a stub that prints the variable vLLM reads."""
    import subprocess

    scenario, plan, _ = decode_plan
    out = tmp_path / "vllm"
    assert run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "vllm", "--out", str(out)).exit_code == 0
    script = next(out.glob("*.sh"))
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "vllm").write_text('#!/usr/bin/env bash\necho "key=$VLLM_API_KEY"\n')
    (stub / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script), "0"], capture_output=True, text=True, env=env, timeout=30)
    secrets = load_secrets(out)
    assert secrets is not None and 0 == proc.returncode, proc.stderr
    assert f"key={secrets.api_key}" == proc.stdout.strip().splitlines()[-1]
