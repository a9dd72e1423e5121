"""The SkyPilot export run end to end on 127.0.0.1: the control plane's cluster file served with remote
engines (`coral serve --provisioner remote`), and every engine task's own `run` script started once
per node rank (with SkyPilot's SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS), dialling in. A tiny model
with phi-4's 40 layers, saved as safetensors, stands in for phi-4; its greedy tokens must equal
transformers' generate()."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from coral.cli import main
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.export import CONTROL_PLANE, control_cluster, export_skypilot
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.provisioner import LocalProvisioner
from coral.runtime.deploy.secrets import make_secrets, write_secrets
from coral.runtime.engine.model import BUILTIN_CONFIGS, seeded_state_dict

from .conftest import http
from .test_pipeline_inproc import reference
from .test_serve_plan import PHI

CONFIG = {**BUILTIN_CONFIGS["tiny-llama"], "num_hidden_layers": 40}


def _weights(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file({k: v.contiguous() for k, v in seeded_state_dict(CONFIG, 3).items()}, str(folder / "model.safetensors"))
    return folder


def _heredoc(run: str, tag: str) -> str:
    return run.split(f"<<'{tag}'\n", 1)[1].split(f"\n{tag}\n", 1)[0]


def test_exported_control_plane_and_engine_tasks_serve_on_loopback(tmp_path: Path) -> None:
    scen = tmp_path / "s.yaml"
    # 1-GPU nodes: one engine per machine (the next test covers machines running several engines);
    # on 4-GPU nodes the plan runs Phi-4 as four TP1 engines a machine, too many CPU processes here
    scen.write_text(yaml.safe_dump({**PHI, "configs": ["1xL40S", "1xL4"]}))
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)]).exit_code == 0
    _serve_export(tmp_path, load_plan_file(plan))


# Six engine processes (CPU torch) on one loopback host: past the 240 s start-up bound on a busy
# 2-core machine. make test serves an in-node pipeline with several engines per machine in
# tests/runtime/test_layouts_serve.py; this is the SkyPilot-script form of it.
@pytest.mark.long(reduced="tests/runtime/test_layouts_serve.py (several engines on one machine, served)")
def test_machines_running_several_tp_groups_serve_on_loopback(tmp_path: Path) -> None:
    """A hand-made plan: one 4xL40S as an in-node pipeline of four TP1 engines (one machine, four engines
    started by one run script, each on its own GPU), two 1xL4 machines for decode, first token from decode."""
    from deploy.layout_plans import (  # tests/deploy (pytest puts tests/ on sys.path)
        DECODE,
        PP4,
        write_layout_plan,
    )

    pf = load_plan_file(write_layout_plan(tmp_path, [PP4, DECODE], first_token="decode")[1])
    # ports of their own: the other test's schedulers bind the export's fixed ones in this same process
    _serve_export(tmp_path, pf, engines_per_task={f"{pf.instances[0].name}-4xL40S.yaml": 4}, port_offset=1000)


# One keypair for both tests: this process's ZeroMQ context keeps the ZAP authenticator of the first
# keypair it served with (coral.runtime.transport._authenticator), which would refuse a second one's peers.
_SECRETS = make_secrets()


def _serve_export(tmp_path: Path, pf, engines_per_task: dict[str, int] | None = None, port_offset: int = 0) -> None:
    ex = export_skypilot(pf, secrets=_SECRETS)
    control_task = yaml.safe_load(ex.files[f"{CONTROL_PLANE}.yaml"])
    # the control plane's run script up to `coral serve`, as its node runs it: it writes the cluster file
    prep, serve_line = control_task["run"].split("exec coral serve", 1)
    assert "--config ~/coral/cluster.yaml --provisioner remote" in serve_line
    home = tmp_path / "home"
    home.mkdir()
    # SkyPilot's file_mounts: the export's secrets/ where the tasks read them (~/.coral/secrets/...)
    assert ex.secrets is not None
    write_secrets(ex.secrets, tmp_path / "export")
    for remote, local in control_task["file_mounts"].items():
        src, dst = tmp_path / "export" / local, home / remote.removeprefix("~/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
    key = ex.secrets.api_key
    env = {**os.environ, **{k: str(v) for k, v in control_task["envs"].items()}, "HOME": str(home),
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
           "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1"}
    subprocess.run(["bash", "-c", prep], env=env, check=True, timeout=60)
    shipped_file = home / "coral" / "cluster.yaml"
    assert 0o600 == shipped_file.stat().st_mode & 0o777  # it holds the key now
    shipped = yaml.safe_load(shipped_file.read_text())
    assert ("127.0.0.1", key) == (shipped["coordinator"]["host"], shipped["coordinator"]["api_key"])
    assert str(home / ".coral" / "secrets" / "curve") == shipped["coordinator"]["curve_keys_dir"]  # CurveZMQ on
    assert control_cluster(pf)["instances"] == shipped["instances"]  # what it serves is the plan, as exported

    weights = _weights(tmp_path / "w")
    for m in shipped["models"]:  # on the cloud: /models/phi-4 (config + tokenizer); here the tiny stand-in
        m["weights"]["path"] = str(weights)
        m.pop("tokenizer")
    shipped["coordinator"]["port"] = 0
    for i in shipped["instances"]:
        i["scheduler_port"] += port_offset
    cluster = parse_cluster(shipped)
    assert all(i.scheduler_port for i in cluster.instances)
    dep = Deployment(cluster, LocalProvisioner(start_engines=False), http_port=0)
    started: list[BaseException | None] = []

    def start() -> None:
        try:
            dep.start(timeout_s=240)  # returns once every instance's engines have dialled in
            started.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            started.append(e)

    control = threading.Thread(target=start)
    control.start()
    engines: list[subprocess.Popen[bytes]] = []
    log = open(tmp_path / "engines.log", "wb")  # noqa: SIM115 - closed below
    try:
        bin_dir = str(Path(sys.executable).parent)
        for name, text in sorted(ex.files.items()):
            if name == f"{CONTROL_PLANE}.yaml" or name.startswith("."):  # .sky.yaml: SkyPilot's project config
                continue
            task = yaml.safe_load(text)
            n = task["num_nodes"]
            for rank in range(n):  # what SkyPilot does on each node of the task
                env = {**os.environ, **{k: str(v) for k, v in task["envs"].items()}, "HOME": str(home),
                       "PATH": bin_dir + os.pathsep + os.environ["PATH"], "SKYPILOT_NODE_RANK": str(rank),
                       "SKYPILOT_NODE_IPS": "\n".join(["127.0.0.1"] * n), "CORAL_CONTROL_HOST": "127.0.0.1",
                       "CORAL_WEIGHTS": str(weights), "CORAL_DEVICE": "cpu", "CORAL_DTYPE": "float32",
                       "CORAL_TORCH_THREADS": "1", "CORAL_TP_PORT": str(29400 + 10 * len(engines)),
                       "CORAL_SCHEDULER_PORT": str(int(task["envs"]["CORAL_SCHEDULER_PORT"]) + port_offset)}
                engines.append(subprocess.Popen(["bash", "-c", task["run"]], env=env, start_new_session=True,
                                                stdout=subprocess.DEVNULL, stderr=log))
        control.join(timeout=300)
        log.flush()
        # when the instances never dial in, the engine nodes' own stderr says why
        assert [None] == started, (started, (tmp_path / "engines.log").read_text()[-3000:],
                                   [(e.args[-1][-200:], e.poll()) for e in engines])
        assert {i.name for i in cluster.instances} == set(dep.coordinator.instances)  # type: ignore[union-attr]
        assert [] == [e.args for e in engines if e.poll() is not None]  # every engine node still runs
        for task, n in (engines_per_task or {}).items():  # one machine's run script started all its engines
            inst = yaml.safe_load(ex.files[task])["envs"]["CORAL_INSTANCE_PREFIX"]
            assert 1 == yaml.safe_load(ex.files[task])["num_nodes"]
            assert n == sum(len(st.node_throughputs) for i in cluster.instances if i.name.startswith(inst) for st in i.stages)
        prompts = [[1, 2, 3], [7] * 12, [40, 41]]
        got = []
        for p in prompts:
            s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": p, "max_tokens": 4,
                                                             "temperature": 0},
                        headers={"Authorization": f"Bearer {key}"})
            assert 200 == s, b
            got.append(b["choices"][0]["token_ids"])
        assert reference(CONFIG, 3, prompts, 4) == got
    finally:
        control.join(timeout=300)
        dep.stop()
        for e in engines:
            if e.poll() is None:
                os.killpg(e.pid, signal.SIGTERM)
        for e in engines:
            try:
                e.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(e.pid, signal.SIGKILL)
                e.wait(timeout=5)
        log.close()
    # the engine nodes stopped cleanly: no rank died under another (a TP group stops rank 0 first)
    assert "Traceback" not in (tmp_path / "engines.log").read_text(), (tmp_path / "engines.log").read_text()[-3000:]
