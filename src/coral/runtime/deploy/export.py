"""`coral export`: a plan file as SkyPilot task YAMLs or `vllm serve` commands.

SkyPilot: a control-plane task (one CPU node: the coordinator, the HTTP front end and every
instance's scheduler on a fixed port, `coral serve --provisioner remote` over the plan's instances)
and one engine task per (instance line, node configuration) of the plan: a task's nodes share
one `resources` entry, so a heterogeneous template spans several tasks. `num_nodes` is the
instance count times the template's nodes of that configuration, so the engine tasks' nodes add
up to the plan's per (region, configuration). Each node's `run` picks its replica and which of the
template's machines it is from `SKYPILOT_NODE_RANK`, its own address from `SKYPILOT_NODE_IPS`, and
starts one Coral engine node per stage entry the layout puts on that machine (a whole node, or each
of its TP groups on its own GPUs), each dialling its scheduler at `$CORAL_CONTROL_HOST`
(docs/howto/deploy.md has the launch order).

vLLM: the `vllm serve` processes of each instance line whose layout vLLM can express
(:mod:`coral.runtime.deploy.vllm`), with the tensor, pipeline and data-parallel sizes, the uneven
layer partition and the prefill/decode KV connector; the others are listed with the reason. Only a
plan whose disaggregated models emit their first token from the decode instance (vLLM's P/D proxy) is
exported. A colocated instance (both phases in one server) has no KV connector: it runs chunked
prefill (`--enable-chunked-prefill`) with a step budget `--max-num-batched-tokens` of its template's
chunk plus its decode batch. In the SkyPilot export it is one more engine task, and the control plane
serves it as a `mixed` instance with its `chunk_tokens`.

Locked by default: every export carries the deployment's API key and CurveZMQ keypair
(:mod:`coral.runtime.deploy.secrets`) under `secrets/` (0600), and the task files refer to them by
path, never by value: SkyPilot mounts them (`file_mounts`), the control plane's front end requires the
key and every ZeroMQ socket of the cluster encrypts with the keypair; only the HTTP port is published
(the schedulers' ports stay on the cluster's private network). A `vllm serve` script reads the key into
`VLLM_API_KEY`.

Spot lines (a version-4 plan's `spot` instances, issue 30): their engine tasks rent spot and name SkyPilot's
managed-job recovery strategy (:data:`SPOT_RESOURCES`), their headers and `vllm serve` scripts say so, and the
control plane's cluster file marks them `spot: true`; on-demand lines are exported as before.

Derived shapes (a configuration the region does not sell) cannot be rented as such: they are
refused unless `allow_derived`, and flagged in every file that uses one.
No torch here: exports run without the runtime extra.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from coral.atomic import building_dir
from coral.catalog.hardware import split_config_name
from coral.catalog.models import builtin_hf_id, builtin_model_names
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.runtime.deploy.grafana import dashboard_json
from coral.runtime.deploy.layout import coral_engine_tp
from coral.runtime.deploy.mapping import node_weights, scheduler_port
from coral.runtime.deploy.plan_file import PlanFile, PlannedInstance
from coral.runtime.deploy.secrets import (
    API_KEY_FILE,
    CURVE_DIR,
    SECRETS_DIR,
    DeploymentSecrets,
    make_secrets,
    write_secrets,
)
from coral.runtime.deploy.vllm import VllmServer, vllm_layout

FORMATS = ("skypilot", "vllm", "grafana")

# Coral GPU names -> SkyPilot accelerator names (SkyPilot calls the 40 GB A100 "A100").
SKYPILOT_ACCELERATOR = {"A100-40GB": "A100", "V100-16GB": "V100"}
# Clouds SkyPilot names as Coral's region prefixes do.
SKYPILOT_CLOUDS = ("aws", "gcp", "azure", "lambda", "runpod", "oci", "nebius", "kubernetes")

HTTP_PORT = 8000  # the control plane's OpenAI-compatible front end
TP_RENDEZVOUS_PORT = 29500  # a multi-GPU engine node's tensor-parallel ranks meet here (on the node itself)
NIXL_SIDE_CHANNEL_PORT = 5600
CONTROL_PLANE = "00-control-plane"  # the SkyPilot task of the coordinator, HTTP front end and schedulers
# Where SkyPilot's file_mounts put the deployment's secrets on every node (from the export's secrets/)
REMOTE_SECRETS = "~/.coral/secrets"
REMOTE_API_KEY = f"{REMOTE_SECRETS}/{API_KEY_FILE}"
REMOTE_CURVE = f"{REMOTE_SECRETS}/{CURVE_DIR}"
# A spot line's engine tasks (SkyPilot's task YAML, `resources`): `use_spot: true` rents spot instances, and
# `job_recovery` (SkyPilot's recovery strategy for managed jobs, `sky jobs launch`; `sky launch` ignores it)
# relaunches the task after a preemption. `FAILOVER` waits in the same region and fails over after a timeout;
# `EAGER_NEXT_REGION` (SkyPilot's default) moves to the next region at once, but skips no region when the task
# names one, as every engine task does (the plan placed it there): FAILOVER says what happens.
SPOT_RESOURCES: Mapping[str, object] = {"use_spot": True, "job_recovery": {"strategy": "FAILOVER"}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    """Files to write (relative name -> text), instances that could not be expressed, and warnings."""

    format: str
    files: Mapping[str, str]
    skipped: tuple[tuple[str, str], ...] = ()  # (instance name, reason)
    warnings: tuple[str, ...] = ()
    secrets: DeploymentSecrets | None = None  # written under secrets/ (0600); the files refer to them by path


def _cloud_region(region: str) -> tuple[str, str]:
    cloud, _, name = region.partition(":")
    if not name or cloud not in SKYPILOT_CLOUDS:
        raise CoralError(f"region {region!r}: SkyPilot needs '<cloud>:<region>' with a cloud it knows "
                         f"({', '.join(SKYPILOT_CLOUDS)})")
    return cloud, name


def _accelerators(config: str) -> str:
    count, gpu = split_config_name(config)
    return f"{SKYPILOT_ACCELERATOR.get(gpu, gpu)}:{count}"


def _check_derived(plan: PlanFile, allow_derived: bool) -> list[str]:
    notes = []
    for i in plan.instances:
        for c in i.derived:
            note = (f"{i.name}: {c} is a derived shape in {i.region} (the region does not sell it; "
                    "its price was derived from the nearest shape sold)")
            if not allow_derived:
                raise CoralError(f"{note}; a cloud cannot rent it: re-plan without derive_missing_prices, "
                                 "or pass --allow-derived to export it anyway (flagged)")
            notes.append(note)
    return notes


def _hf_id(model_spec_name: str) -> str:
    return builtin_hf_id(model_spec_name) if model_spec_name in builtin_model_names() else model_spec_name


def _machine_table(plan: PlanFile, inst: PlannedInstance, config: str) -> list[dict[str, object]]:
    """The machines of `config` in every replica of `inst`, in rank order: replica, machine, and the engines
    it runs (stage, node index, layers, Coral engine TP, its GPUs): one per stage entry `hosts` puts there."""
    spec = next(m.spec for m in plan.scenario.models if m.name == inst.model)
    engines = inst.engines()
    out: list[dict[str, object]] = []
    for r in range(inst.count):
        for h, node in enumerate(inst.nodes):
            if node != config:
                continue
            mine = [{"stage": e.stage, "node": e.index, "layer_start": inst.stages[e.stage].layer_start,
                     "layer_end": inst.stages[e.stage].layer_end, "tp": coral_engine_tp(e.tp, spec),
                     "gpus": ",".join(map(str, e.gpus))} for e in engines if e.host == h]
            out.append({"replica": r, "machine": h, "engines": mine})
    return out


# The engine node's launcher, run by each node of an engine task: the spec of `python -m
# coral.runtime.engine.worker engine` with this node's layers, its address, and its scheduler's.
_ENGINE_PY = """\
import json, os, signal, subprocess, sys
e = os.environ
procs = []
# one engine per stage entry this machine hosts (several where the layout splits the node into TP groups),
# each on its own GPUs (CUDA_VISIBLE_DEVICES): its rank r uses cuda:r of them
for k, eng in enumerate(json.loads(e['ENGINES'])):
    tp = int(eng['tp'])
    spec = {
        'instance_id': f"{e['CORAL_INSTANCE_PREFIX']}-r{e['REPLICA']}", 'stage': int(eng['stage']),
        'node_index': int(eng['node']), 'host': e['CORAL_NODE_HOST'], 'threads': int(e['CORAL_TORCH_THREADS']),
        'parent_pid': os.getpid(),
        'scheduler': f"tcp://{e['CORAL_CONTROL_HOST']}:{int(e['CORAL_SCHEDULER_PORT']) + int(e['REPLICA'])}",
        'device_index': 0, 'curve_keys_dir': os.path.expanduser(e['CORAL_KEYS_DIR']),
        'shard': {'config': json.load(open(os.path.join(e['CORAL_WEIGHTS'], 'config.json'))),
                  'layer_start': int(eng['layer_start']), 'layer_end': int(eng['layer_end']),
                  'weights_path': e['CORAL_WEIGHTS'], 'device': e['CORAL_DEVICE'], 'dtype': e['CORAL_DTYPE']},
    }
    # rank 0 is the node its scheduler talks to; ranks 1..tp-1 follow it, meeting at this engine's own port
    port = int(e['CORAL_TP_PORT']) + k
    ranks = [dict(spec, tp={'rank': r, 'world': tp, 'init_method': f"tcp://127.0.0.1:{port}"})
             for r in range(tp)] if tp > 1 else [spec]
    env = dict(e, CUDA_VISIBLE_DEVICES=eng['gpus'])
    procs += [subprocess.Popen([sys.executable, '-m', 'coral.runtime.engine.worker', 'engine', json.dumps(s)],
                               start_new_session=True, env=env) for s in ranks]


def stop(*_):
    for p in procs:  # rank 0 first: it stops its followers itself
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
sys.exit(max(p.wait() for p in procs))
"""


# The control plane's cluster file, completed on its node: its address, the API key (read from the file
# SkyPilot mounted) and the CurveZMQ keypair's folder; written 0600, since it now holds the key.
_CONTROL_PY = """\
import os, sys, yaml
e, home = os.environ, os.path.expanduser
path = home('~/coral/cluster.yaml')
cluster = yaml.safe_load(open(path))
c = cluster['coordinator']
c['host'] = e['CORAL_NODE_HOST']
try:
    c['api_key'] = open(home(e['CORAL_API_KEY_FILE'])).read().strip()
except OSError as err:
    sys.exit(f"no API key at {e['CORAL_API_KEY_FILE']} ({err}): launch this task from the export folder, "
             "so that its file_mounts find secrets/")
if not c['api_key']:
    sys.exit(f"the API key file {e['CORAL_API_KEY_FILE']} is empty")
c['curve_keys_dir'] = home(e['CORAL_KEYS_DIR'])
fd = os.open(path + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, 'w') as f:
    yaml.safe_dump(cluster, f, sort_keys=False)
os.replace(path + '.tmp', path)
"""


def _skypilot_task(plan: PlanFile, inst: PlannedInstance, config: str, replica: int | None = None) -> dict[str, object]:
    """The engine task of `inst`'s machines of `config` (only those of `replica` where given: a spot line's
    task per replica, so that a managed job's recovery relaunches no healthy replica's machines)."""
    cloud, region = _cloud_region(inst.region)
    table = [m for m in _machine_table(plan, inst, config) if replica is None or m["replica"] == replica]
    served = next(m for m in plan.scenario.models if m.name == inst.model)
    offer = plan.scenario.catalog.offers.get((inst.region, config))
    resources: dict[str, object] = {"cloud": cloud, "region": region, "accelerators": _accelerators(config)}
    if offer is not None and config not in inst.derived:
        resources["instance_type"] = offer.instance_type
    if inst.spot:
        resources.update(copy.deepcopy(dict(SPOT_RESOURCES)))  # a fresh dict per task: no YAML anchors
    cases = "\n".join(
        f"  {n}) REPLICA={m['replica']} MACHINE={m['machine']} "
        f"ENGINES={shlex.quote(json.dumps(m['engines'], separators=(',', ':')))} ;;" for n, m in enumerate(table))
    run = (
        "set -euo pipefail\n"
        ': "${CORAL_CONTROL_HOST:?launch the control plane first, then pass --env CORAL_CONTROL_HOST=<its IP>}"\n'
        "# This machine's place in the plan: its replica, which of the template's nodes it is, and the engines it\n"
        "# runs (one per stage entry there: stage, node index, layers, tensor-parallel degree, GPUs).\n"
        'case "$SKYPILOT_NODE_RANK" in\n'
        f"{cases}\n"
        '  *) echo "node rank $SKYPILOT_NODE_RANK is not in the plan" >&2; exit 1 ;;\n'
        "esac\n"
        "# The address the scheduler and the other stages reach this node at: its line of SKYPILOT_NODE_IPS\n"
        "# (the cloud network's), or what $CORAL_HOST_CMD prints (e.g. `tailscale ip -4` for a mesh across regions).\n"
        'if [ -n "${CORAL_HOST_CMD:-}" ]; then CORAL_NODE_HOST=$(eval "$CORAL_HOST_CMD"); '
        'else CORAL_NODE_HOST=$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p"); fi\n'
        "export REPLICA MACHINE ENGINES CORAL_NODE_HOST\n"
        'echo "coral engines: ${CORAL_INSTANCE_PREFIX}-r${REPLICA} machine ${MACHINE} at ${CORAL_NODE_HOST}: ${ENGINES}"\n'
        "python - <<'PY'\n" + _ENGINE_PY + "PY\n"
    )
    task: dict[str, object] = {
        "name": f"coral-{inst.name}{'' if replica is None else f'-r{replica}'}-{config}".lower(),
        "num_nodes": len(table),
        "resources": resources,
        "envs": {
            "CORAL_INSTANCE_PREFIX": inst.name,
            "CORAL_CONTROL_HOST": "",  # the control plane's address (`sky status --ip coral-control`), set with --env
            "CORAL_SCHEDULER_PORT": str(scheduler_port(inst.index, 0)),
            "CORAL_TP_PORT": str(TP_RENDEZVOUS_PORT),  # engine k of a machine: its TP ranks meet at this + k
            "CORAL_HOST_CMD": "",
            "CORAL_WEIGHTS": f"/models/{served.spec.name}",
            "CORAL_DEVICE": "cuda",  # rank r of an engine uses cuda:r of its GPUs (CUDA_VISIBLE_DEVICES)
            "CORAL_DTYPE": "bfloat16",
            "CORAL_TORCH_THREADS": "8",
            "CORAL_INSTALL": "coral[runtime]",
            "CORAL_KEYS_DIR": REMOTE_CURVE,  # the cluster's CurveZMQ keypair (file_mounts below)
            "HF_MODEL": _hf_id(served.spec.name),
        },
        # an engine needs the keypair only (every ZeroMQ socket of the cluster encrypts with it), not the API key
        "file_mounts": {REMOTE_CURVE: f"{SECRETS_DIR}/{CURVE_DIR}"},
        "setup": (
            "set -euo pipefail\n"
            'pip install "$CORAL_INSTALL"\n'
            'sudo mkdir -p "$(dirname "$CORAL_WEIGHTS")" && sudo chown "$(id -u)" "$(dirname "$CORAL_WEIGHTS")"\n'
            'if [ ! -f "$CORAL_WEIGHTS/config.json" ]; then huggingface-cli download "$HF_MODEL" --local-dir "$CORAL_WEIGHTS"; fi\n'
        ),
        "run": run,
    }
    return task


def control_cluster(plan: PlanFile) -> dict[str, object]:
    """The cluster file the control plane serves (`coral serve --provisioner remote`): every planned
    instance with its stages, per-node routing weights, stage entries (`configs`), each engine's TP
    degree and machine (`tp`, `hosts`) and fixed scheduler port, and each model's config, tokenizer
    (read from `/models/<model>`, where its setup puts them) and first-token mode."""
    specs = {m.name: m.spec for m in plan.scenario.models}
    models = sorted({i.model for i in plan.instances})
    instances = []
    for inst in plan.instances:
        weights = node_weights(plan, inst)
        spec = specs[inst.model]
        engines = inst.engines()
        for r in range(inst.count):
            instances.append({
                # a colocated instance is the runtime's "mixed" one (coral.runtime.deploy.cluster_config.MIXED)
                "name": f"{inst.name}-r{r}", "model": inst.model, "phase": "mixed" if inst.colocated else inst.phase.value,
                "region": inst.region, "throughput_tok_per_s": inst.throughput_tok_per_s,
                "scheduler_port": scheduler_port(inst.index, r), **({"spot": True} if inst.spot else {}),
                **({"chunk_tokens": inst.chunk_tokens} if inst.colocated else {}),
                "stages": [{"layers": [st.layer_start, st.layer_end], "nodes": list(w), "configs": list(st.nodes),
                            "tp": [coral_engine_tp(e.tp, spec) for e in engines if e.stage == s],
                            "hosts": [e.host for e in engines if e.stage == s]}
                           for s, (st, w) in enumerate(zip(inst.stages, weights, strict=True))]})
    return {
        # its run script sets the node's own address, the API key and the CurveZMQ keypair's folder
        "coordinator": {"host": "0.0.0.0", "port": HTTP_PORT},
        "device": "cpu",  # the control plane runs no layer
        "models": [{"name": m, "weights": {"path": f"/models/{specs[m].name}"}, "tokenizer": f"/models/{specs[m].name}",
                    "first_token": plan.first_token_of(m)} for m in models],
        "instances": instances,
    }


def _control_region(plan: PlanFile) -> str:
    """The region with the most planned nodes (ties: the first in the scenario): most engines are near."""
    count: dict[str, int] = {}
    for (region, _), n in plan.nodes_of_instances().items():
        count[region] = count.get(region, 0) + n
    return max(plan.scenario.regions, key=lambda r: (count.get(r, 0), -plan.scenario.regions.index(r)))


def _control_task(plan: PlanFile) -> dict[str, object]:
    cloud, region = _cloud_region(_control_region(plan))
    cluster_yaml = yaml.safe_dump(control_cluster(plan), sort_keys=False, width=200)
    downloads = "".join(
        f'huggingface-cli download {shlex.quote(_hf_id(m.spec.name))} --include "*.json" '
        f"--local-dir /models/{m.spec.name}\n"
        for m in plan.scenario.models if any(i.model == m.name for i in plan.instances))
    return {
        "name": "coral-control",
        "num_nodes": 1,
        # only the HTTP front end is published: the engines reach the schedulers' ports over the private network
        "resources": {"cloud": cloud, "region": region, "cpus": "8+", "memory": "32+", "ports": [HTTP_PORT]},
        "envs": {"CORAL_INSTALL": "coral[runtime]", "CORAL_STARTUP_TIMEOUT_S": "3600", "CORAL_HOST_CMD": "",
                 "CORAL_API_KEY_FILE": REMOTE_API_KEY, "CORAL_KEYS_DIR": REMOTE_CURVE},
        "file_mounts": {REMOTE_API_KEY: f"{SECRETS_DIR}/{API_KEY_FILE}", REMOTE_CURVE: f"{SECRETS_DIR}/{CURVE_DIR}"},
        "setup": (
            "set -euo pipefail\n"
            'pip install "$CORAL_INSTALL"\n'
            "sudo mkdir -p /models && sudo chown \"$(id -u)\" /models\n"
            "# each model's config and tokenizer (no weights: the control plane runs no layer)\n"
            + downloads
        ),
        "run": (
            "set -euo pipefail\n"
            "mkdir -p ~/coral\n"
            "cat > ~/coral/cluster.yaml <<'CORAL_CLUSTER'\n" + cluster_yaml + "CORAL_CLUSTER\n"
            "# Every process here binds and advertises this node's address on the nodes' network (the engines'\n"
            "# replies come back to it): its SKYPILOT_NODE_IPS line, or what $CORAL_HOST_CMD prints.\n"
            'if [ -n "${CORAL_HOST_CMD:-}" ]; then CORAL_NODE_HOST=$(eval "$CORAL_HOST_CMD"); '
            'else CORAL_NODE_HOST=$(echo "$SKYPILOT_NODE_IPS" | head -n 1); fi\n'
            "export CORAL_NODE_HOST\n"
            'echo "coral control plane: engines dial ${CORAL_NODE_HOST} (pass --env CORAL_CONTROL_HOST=${CORAL_NODE_HOST})"\n'
            "python - <<'PY'\n" + _CONTROL_PY + "PY\n"
            "# the coordinator, the HTTP front end and every instance's scheduler; the engine tasks dial in\n"
            'exec coral serve --config ~/coral/cluster.yaml --provisioner remote '
            '--startup-timeout "$CORAL_STARTUP_TIMEOUT_S" --log-level INFO\n'
        ),
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, as SkyPilot's own examples write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _header(plan: PlanFile, inst: PlannedInstance, extra: list[str]) -> str:
    lines = [f"# Coral plan {plan.path} (scenario {plan.scenario.name}, {plan.method}): {inst.count} x "
             f"{inst.model} {inst.phase.value} in {inst.region} on {' + '.join(inst.nodes)}"
             + (f" (spot, {inst.price_usd_per_h:.2f} $/h each)" if inst.spot else ""),
             "# stages: " + " | ".join(f"{'+'.join(s.nodes)}: layers {s.layer_start}-{s.layer_end - 1}"
                                       for s in inst.stages)]
    if inst.colocated:
        lines.append(f"# colocated: prefill and decode in one instance, chunked prefill of at most {inst.chunk_tokens} "
                     f"prompt tokens per step beside a decode batch of {inst.micro_batch}; no KV transfer")
    if inst.spot:
        lines.append(f"# SPOT: rent every machine here as a spot instance (the plan counted {inst.capacity_share:.0%} of "
                     "its capacity); the cloud may take one with a notice (AWS: 2 minutes)")
    if inst.derived:
        lines.append(f"# WARNING: derived shape(s) {', '.join(inst.derived)}: {inst.region} does not sell them; "
                     "SkyPilot picks the nearest instance with these accelerators")
    return "\n".join(lines + extra) + "\n"


def export_skypilot(plan: PlanFile, *, allow_derived: bool = False, secrets: DeploymentSecrets | None = None) -> Export:
    """The control-plane task and one engine task YAML per (instance line, node configuration), and for a
    spot line per (instance line, replica, node configuration).

    Args:
        plan: the plan file.
        allow_derived: export derived shapes (flagged) instead of refusing them.
        secrets: the deployment's API key and CurveZMQ keypair (None: new ones).

    Raises:
        CoralError: a derived shape without `allow_derived`, a region SkyPilot cannot name, or an
            instance line with more replicas than the scheduler ports number.
    """
    warnings = _check_derived(plan, allow_derived)
    files: dict[str, str] = {}
    files[f"{CONTROL_PLANE}.yaml"] = (
        f"# Coral plan {plan.path} (scenario {plan.scenario.name}, {plan.method}): the control plane, launch it first\n"
        f"# (`sky launch -c coral-control {CONTROL_PLANE}.yaml`): coordinator, HTTP front end on port {HTTP_PORT}, "
        f"and the schedulers of {sum(i.count for i in plan.instances)} instance(s)\n"
        + yaml.dump(_control_task(plan), Dumper=_Dumper, sort_keys=False, width=200))
    for inst in plan.instances:
        spec = next(m.spec for m in plan.scenario.models if m.name == inst.model)
        # a spot line: a task per replica (a managed job's recovery relaunches the whole task)
        for config, replica in [(c, r) for c in sorted(set(inst.nodes)) for r in (range(inst.count) if inst.spot else [None])]:
            task = _skypilot_task(plan, inst, config, replica)
            gpus = split_config_name(config)[0]
            extra = []
            for e in inst.engines():
                tp = coral_engine_tp(e.tp, spec)
                if e.node == config and tp < e.tp:
                    extra.append(f"# NOTE: stage {e.stage} entry {e.entry} runs tensor-parallel {tp} on Coral's engine "
                                 f"({spec.name}'s heads, KV heads or experts do not split {e.tp} ways): {e.tp - tp} of "
                                 "its GPU(s) idle")
            per = sorted({sum(1 for e in inst.engines() if e.host == h) for h, n in enumerate(inst.nodes) if n == config})
            if per != [1]:
                extra.append(f"# each {config} machine ({gpus} GPUs) runs {' or '.join(map(str, per))} engines, one per TP "
                             "group, each on its own GPUs")
            if inst.spot:
                extra.append(f"# replica {replica} of {inst.count}; launch it with `sky jobs launch` (a managed job): "
                             "resources.job_recovery relaunches its machines after a preemption (`sky launch` rents "
                             "spot machines but does not relaunch them)")
            part = "" if replica is None else f"-r{replica}"
            files[f"{inst.name}{part}-{config}.yaml"] = (_header(plan, inst, extra)
                                                   + yaml.dump(task, Dumper=_Dumper, sort_keys=False, width=200))
    secrets = secrets or make_secrets()
    files[SKY_PROJECT_CONFIG] = _sky_project_config(secrets)
    return Export(format="skypilot", files=files, warnings=tuple(warnings), secrets=secrets)


SKY_PROJECT_CONFIG = ".sky.yaml"  # SkyPilot reads it from the folder `sky launch` runs in


def _sky_project_config(secrets: DeploymentSecrets) -> str:
    """SkyPilot's project config for the export folder: every cluster of the deployment in one AWS security
    group, which SkyPilot creates admitting its own members (and SSH): the engines reach the schedulers'
    ports over the private network without publishing them. SkyPilot opens no port in a group it was
    given, so the front end's port is opened once by hand, to the clients only (docs/howto/deploy.md)."""
    group = "coral-" + hashlib.sha256(secrets.curve_public.encode()).hexdigest()[:10]
    return ("# SkyPilot project config (read from the folder `sky launch` runs in): every cluster of this deployment\n"
            f"# in one security group; open the HTTP port {HTTP_PORT} of it to your clients once (docs/howto/deploy.md).\n"
            + yaml.safe_dump({"aws": {"security_group_name": group}}, sort_keys=False))


def _vllm_servers(plan: PlanFile, inst: PlannedInstance) -> tuple[VllmServer, ...] | str:
    spec = next(m.spec for m in plan.scenario.models if m.name == inst.model)
    return vllm_layout([s.nodes for s in inst.stages], nodes=inst.nodes, hosts=inst.hosts or None, spec=spec)


def _serve_command(inst: PlannedInstance, model_id: str, sv: VllmServer, *, port: int, k: int) -> str:
    """One `vllm serve` line: server `k` of a machine, with its environment (GPUs, layer partition, NIXL port)."""
    args = [  # the API key comes from $VLLM_API_KEY (vLLM's own variable), never from the command line
        "vllm", "serve", model_id, "--host", "0.0.0.0", "--port", str(port),
        "--tensor-parallel-size", str(sv.tp), "--pipeline-parallel-size", str(sv.pp),
    ]
    if sv.dp > 1:
        args += ["--data-parallel-size", str(sv.dp)]
    if inst.colocated:  # vLLM's step budget counts every running decode's token beside the prompt chunk
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(int(inst.chunk_tokens or 0) + inst.micro_batch)]
    else:
        args += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))]
    if len(sv.hosts) > 1:
        args += ["--distributed-executor-backend", "ray"]
    env = [] if inst.colocated else [f"VLLM_NIXL_SIDE_CHANNEL_PORT={NIXL_SIDE_CHANNEL_PORT + 100 * k}"]
    if sv.pp > 1:
        env.insert(0, "VLLM_PP_LAYER_PARTITION=" + ",".join(str(s.layers) for s in inst.stages))
    if len(sv.hosts) == 1:  # its own GPUs of the machine (a whole node: all of them)
        env.insert(0, "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, sv.gpus)))
    return " ".join([*env, *(shlex.quote(a) for a in args)])


def vllm_command(plan: PlanFile, inst: PlannedInstance, *, port: int = 8000) -> str:
    """The shell lines that start one replica of `inst` under vLLM: one `vllm serve` per server of its layout
    (:func:`coral.runtime.deploy.vllm.vllm_layout`), on the machine it names; Ray across a pipeline's machines.

    A layout of one server is one command. A layout of several (the replicas of a one-stage template: a
    server per machine with `--data-parallel-size` for its TP groups, or one per group where their
    degrees differ) is a `case` on the script's first argument, the machine (`0 .. n-1`) it runs on;
    servers sharing a machine get their own GPUs (`CUDA_VISIBLE_DEVICES`), ports (`port + 100·k`) and
    NIXL side-channel ports.

    Raises:
        CoralError: the template is not one vLLM can run.
    """
    servers = _vllm_servers(plan, inst)
    if isinstance(servers, str):
        raise CoralError(f"{inst.name}: {servers}")
    served = next(m for m in plan.scenario.models if m.name == inst.model)
    partition = ",".join(str(s.layers) for s in inst.stages)
    # NixlConnector takes kv_both on both sides; the P/D proxy in front sends each prompt to a
    # prefill instance first, then to a decode one that pulls the KV and emits the first token
    # (vLLM's NixlConnector guide)
    role = {Phase.PREFILL: "prefill: the P/D proxy sends prompts here, decode instances pull the KV",
            Phase.DECODE: "decode: pulls the KV of prompts prefilled elsewhere and emits every token, the first included",
            Phase.COLOCATED: "colocated: runs each request's prefill and decode, prompt chunks mixed into decode steps, no KV connector",
            }[inst.phase]

    def command(sv: VllmServer, k: int) -> str:
        return _serve_command(inst, _hf_id(served.spec.name), sv, port=port + 100 * k, k=k)

    layout = "; ".join(f"machine {sv.host}: GPUs {','.join(map(str, sv.gpus))} TP {sv.tp} x PP {sv.pp} x DP {sv.dp}"
                       for sv in servers)
    lines = [
        f"# run once per replica ({inst.count}); {role}",
        f"# layout: {layout} (stages: " + " | ".join("+".join(s.nodes) for s in inst.stages) + ")",
    ]
    if servers[0].pp > 1:
        lines.append(f"# layers per stage {partition} (sum {sum(s.layers for s in inst.stages)} = {served.spec.name}'s "
                     f"{served.spec.num_layers})")
    if len(servers) == 1:
        sv = servers[0]
        if len(sv.hosts) > 1:
            lines.append("# on every machine: ray start (the head on stage 0's machine, `ray start --address HEAD:6379` on "
                         "the others); vLLM places pipeline ranks on Ray nodes itself, so with mixed GPU types check "
                         "that rank s lands on stage s's node type")
        if len(set(inst.nodes)) > 1:
            lines.append("# heterogeneous pipeline: " + ", ".join(f"stage {k} {s.nodes[0]}" for k, s in enumerate(inst.stages)))
        lines.append(command(sv, 0))
        return "\n".join(lines) + "\n"
    machines = sorted({sv.host for sv in servers})
    front = "a load balancer takes every server as one more replica" if inst.colocated else \
        "the P/D proxy takes every server as one more " + inst.phase.value + " instance"
    lines.append(f"# {len(servers)} vLLM servers on {len(machines)} machine(s): run this script on each machine of the "
                 "replica with its number; " + front)
    lines.append(f'MACHINE="${{1:?usage: $0 MACHINE, the machine of the replica this is (0..{machines[-1]})}}"')
    lines.append('case "$MACHINE" in')
    for h in machines:
        mine = [sv for sv in servers if sv.host == h]
        if len(mine) == 1:
            lines.append(f"  {h}) exec {command(mine[0], 0)} ;;")
        else:
            body = " & ".join(command(sv, k) for k, sv in enumerate(mine))
            lines.append(f"  {h}) {body} & wait ;;")
    lines.append('  *) echo "machine $MACHINE is not in this layout" >&2; exit 1 ;;')
    lines.append("esac")
    return "\n".join(lines) + "\n"


def check_first_token_vllm(plan: PlanFile) -> None:
    """Refuse a plan whose disaggregated models emit their first token at the prefill instance: vLLM's P/D proxy
    emits it from the decode instance, once the KV has arrived (the transfer counts in TTFT, not TPOT). A model
    served colocated only has no hand-off: its first token comes from its one instance either way.

    Raises:
        CoralError: naming the first such model and the fixes.
    """
    for m in sorted({i.model for i in plan.instances if not i.colocated}):
        mode = plan.first_token_of(m)
        if mode != "decode":
            given = "" if m in plan.first_token else " by default"
            raise CoralError(f"{plan.path}: {m} emits its first token from prefill (first_token {mode}{given}); vLLM's "
                             "P/D proxy emits it from decode: re-plan for first_token decode, or export --format skypilot")


# A `vllm serve` script's first lines: the deployment's API key, from the file beside it, into vLLM's variable.
_VLLM_KEY = (
    'VLLM_API_KEY="$(cat "$(dirname "$0")/secrets/api_key")" || { echo "no secrets/api_key beside $0: copy the whole '
    'export folder" >&2; exit 1; }\nexport VLLM_API_KEY  # clients send Authorization: Bearer <that key>\n'
)


def export_vllm(plan: PlanFile, *, allow_derived: bool = False, base_port: int = 8000,
                secrets: DeploymentSecrets | None = None) -> Export:  # fmt: skip
    """A `vllm serve` script per instance line vLLM can run; the others listed in `skipped`.

    Every script reads the deployment's API key (`secrets/api_key` beside it) into `VLLM_API_KEY`. (The
    CurveZMQ keypair is made too, for a Coral control plane beside it; vLLM's own processes do not speak
    Coral's ZeroMQ.)

    Raises:
        CoralError: a model whose first token the plan emits at the prefill instance
            (:func:`check_first_token_vllm`), a derived shape without `allow_derived`, or no instance vLLM can run.
    """
    check_first_token_vllm(plan)
    warnings = _check_derived(plan, allow_derived)
    files: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for inst in plan.instances:
        servers = _vllm_servers(plan, inst)
        if isinstance(servers, str):
            skipped.append((inst.name, servers))
            continue
        port = base_port + inst.index
        files[f"{inst.name}.sh"] = ("#!/usr/bin/env bash\nset -euo pipefail\n" + _header(plan, inst, []) + _VLLM_KEY
                                    + vllm_command(plan, inst, port=port))
    if not files:
        raise CoralError(f"{plan.path}: vLLM can run none of the plan's {len(plan.instances)} instance lines "
                         f"(first: {skipped[0][0]}: {skipped[0][1]}); re-plan with `coral plan --engine vllm`")
    if skipped:
        files["SKIPPED.txt"] = "".join(f"{name}: {why}\n" for name, why in skipped)
    return Export(format="vllm", files=files, skipped=tuple(skipped), warnings=tuple(warnings), secrets=secrets or make_secrets())


def export_grafana() -> Export:
    """The Grafana dashboard of a deployment's metrics (:mod:`coral.runtime.deploy.grafana`; no plan needed)."""
    return Export(format="grafana", files={"coral-dashboard.json": dashboard_json()})


def export_plan(plan: PlanFile | None, fmt: str, *, allow_derived: bool = False, secrets: DeploymentSecrets | None = None) -> Export:
    """Dispatch on `fmt` (one of :data:`FORMATS`).

    Raises:
        CoralError: an unknown format, a plan missing for skypilot or vllm, or the format's own refusals.
    """
    if fmt == "grafana":
        return export_grafana()
    if plan is None:
        raise CoralError(f"--format {fmt} exports a plan: pass --plan plan.json (from `coral plan --out`)")
    if fmt == "skypilot":
        return export_skypilot(plan, allow_derived=allow_derived, secrets=secrets)
    if fmt == "vllm":
        return export_vllm(plan, allow_derived=allow_derived, secrets=secrets)
    raise CoralError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")


MARKER = ".coral-export"  # names a folder `coral export` wrote, so a re-export may replace it


def check_out_folder(out: str | Path) -> Path:
    """Refuse an `--out` that is not ours to replace: an existing file, or a non-empty folder
    that no `coral export` wrote (replacing it would delete the user's files).

    Raises:
        CoralError: naming the path and the fix.
    """
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise CoralError(f"--out {p}: is a file; give a folder (it is created, or replaced whole)")
    if p.is_dir() and any(p.iterdir()) and not (p / MARKER).exists():
        raise CoralError(f"--out {p}: is a folder with other files, which an export would replace; "
                         "give a new or empty folder")
    return p


def write_export(export: Export, out: str | Path) -> list[Path]:
    """Write every file of `export` into folder `out`, whole or not at all (a previous export there is replaced).

    Raises:
        CoralError: as :func:`check_out_folder`.
    """
    check_out_folder(out)
    with building_dir(out) as tmp:
        (tmp / MARKER).write_text(f"written by coral export ({export.format})\n")
        for name, text in export.files.items():
            (tmp / name).write_text(text)
            if name.endswith(".sh"):
                (tmp / name).chmod(0o755)
        if export.secrets is not None:
            write_secrets(export.secrets, tmp)
    return [Path(out) / n for n in export.files]


__all__ = ["CONTROL_PLANE", "FORMATS", "REMOTE_API_KEY", "REMOTE_CURVE", "MARKER", "SPOT_RESOURCES", "Export", "check_first_token_vllm", "control_cluster", "check_out_folder", "export_grafana", "export_plan", "export_skypilot", "export_vllm", "vllm_command", "write_export"]
