"""``coral serve`` (start the coordinator, schedulers and engines of a cluster file) and ``coral keys`` (CurveZMQ keypair)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click

from coral.atomic import write_text
from coral.cli_support import UserError, check_output_path
from coral.errors import CoralError

__all__ = ["keys", "serve"]


@click.command("serve")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Cluster YAML file (see examples/cluster-tiny.yaml).")
@click.option("--port", type=int, default=None, help="HTTP port; overrides the cluster file (0 = any free port).")
@click.option("--startup-timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every instance to register.")
@click.option("--log-level", default="WARNING", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Logging level of every process.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None, help="Write the HTTP base URL here once serving (for scripts).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, help=(
    "Serve this plan file's instances (count, stages, layer ranges, per-node routing weights from each template) "
    "instead of the cluster file's; the cluster file still gives the models' weights and the runtime settings. "
    "With coordinator.planner 'allocator', each epoch re-plans over the plan's scenario (its templates, prices, "
    "availability) on the observed demand."))
@click.option("--scenario", "scenario_name", default=None, help="With --plan: the plan's scenario (default: the one it names).")
@click.option("--provisioner", "provisioner_name", type=click.Choice(["local", "ray", "remote"]), default="local", show_default=True, help=(
    "local: child processes on this machine; ray: Ray actors, one placement group per instance, placed by "
    "accelerator_type (with --plan, each node's GPU type; the plan is refused when the Ray cluster is short); "
    "remote: only the schedulers run here, each on its instance's scheduler_port, and the engine nodes are started "
    "elsewhere and dial in (the control plane of `coral export --format skypilot`, docs/howto/deploy.md)."))
@click.option("--ray-address", default=None, help="With --provisioner ray: the Ray cluster to join (default: a local one).")
@click.option("--dry-run", is_flag=True, help=(
    "Serve the first plan, then only log the actions later plan changes (epochs, /admin/plan) would take."))
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True, help=(
    "On SIGTERM / SIGINT: refuse new requests (503 with Retry-After) and let the ones in flight, streams "
    "included, finish for at most this many seconds before stopping (a second signal stops at once)."))
@click.option("--body-deadline", "body_deadline_s", type=click.FloatRange(min=0, min_open=True), default=None, help=(
    "Seconds a request body has to arrive whole (else 408); default the cluster file's coordinator.body_deadline_s (30)."))
@click.option("--insecure", is_flag=True, help=(
    "Serve on a non-loopback address without coordinator.api_key (anyone who reaches the port can use the API)."))
def serve(config_path: str, port: int | None, startup_timeout: float, log_level: str, ready_file: str | None,
          plan_path: str | None = None, scenario_name: str | None = None, provisioner_name: str = "local",
          ray_address: str | None = None, dry_run: bool = False, drain_timeout: float = 30.0,
          body_deadline_s: float | None = None, insecure: bool = False) -> None:
    """Serve the models of a cluster file through an OpenAI-compatible HTTP API until Ctrl-C (or SIGTERM).

    Stopping is graceful: new requests get 503 with Retry-After while the ones in flight finish
    (at most --drain-timeout seconds), then every process stops.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # a missing or malformed cluster file, a cluster that does not start: one line, exit 2
        cluster, dep = _start_deployment(
            config_path, port=port, startup_timeout=startup_timeout, log_level=log_level, ready_file=ready_file,
            plan_path=plan_path, scenario_name=scenario_name, provisioner_name=provisioner_name,
            ray_address=ray_address, dry_run=dry_run, body_deadline_s=body_deadline_s, insecure=insecure)
    except CoralError as e:
        raise UserError(str(e)) from None
    _serve_until_stopped(cluster, dep, ready_file, drain_timeout)


def _start_deployment(config_path: str, *, port: int | None, startup_timeout: float, log_level: str,
                      ready_file: str | None, plan_path: str | None, scenario_name: str | None,
                      provisioner_name: str, ray_address: str | None, dry_run: bool,
                      body_deadline_s: float | None, insecure: bool) -> tuple[Any, Any]:
    """Load the cluster file (and the plan), pick the provisioner and the planner, and start every
    process. Returns (cluster, deployment).

    Raises:
        CoralError: a bad file or option, or a cluster that does not start.
    """
    # lazy: the runtime extra (fastapi, uvicorn, msgspec, zmq): `coral --help` lists serve without loading it
    from coral.runtime.deploy.cluster_config import load_cluster
    from coral.runtime.deploy.deployment import Deployment
    from coral.runtime.deploy.mapping import plan_prices

    if ready_file:  # refused before any process starts, not after
        check_output_path(ready_file, "--ready-file", folder=False)
    cluster = load_cluster(config_path)
    check_exposure(cluster.host, cluster.api_key, insecure)
    plan_file = None
    if plan_path:
        cluster, plan_file = _with_plan(cluster, plan_path, scenario_name, remote=provisioner_name == "remote")
    provisioner = _provisioner(cluster, provisioner_name, log_level=log_level, ray_address=ray_address, dry_run=dry_run)
    planner = _planner(cluster, plan_file)
    prices = plan_prices(plan_file, cluster.instances) if plan_file is not None else None
    dep = Deployment(cluster, provisioner, http_port=port, planner=planner, dry_run=dry_run, prices=prices,
                     body_deadline_s=body_deadline_s)
    dep.start(timeout_s=startup_timeout)
    return cluster, dep


def _with_plan(cluster: Any, plan_path: str, scenario_name: str | None, *, remote: bool) -> tuple[Any, Any]:
    """The cluster with the plan file's instances in place of its own, and the plan file."""
    # lazy: the runtime extra (msgspec, zmq): `coral --help` lists serve without loading it
    from coral.runtime.deploy.mapping import cluster_from_plan, with_scheduler_ports
    from coral.runtime.deploy.plan_file import load_plan_file

    plan_file = load_plan_file(plan_path, scenario_name)
    cluster = cluster_from_plan(cluster, plan_file)
    if remote:  # numbered as the SkyPilot export's engine tasks dial them
        cluster = dataclasses.replace(cluster, instances=tuple(with_scheduler_ports(plan_file, list(cluster.instances))))
    return cluster, plan_file


def _provisioner(cluster: Any, name: str, *, log_level: str, ray_address: str | None, dry_run: bool) -> Any:
    """The provisioner `--provisioner` names, checked against the cluster.

    Raises:
        CoralError: remote without a scheduler port or with a re-planning coordinator; ray short of GPUs.
    """
    # lazy: the runtime extra (msgspec, zmq): `coral --help` lists serve without loading it
    from coral.runtime.deploy.provisioner import LocalProvisioner

    if name == "remote":
        unported = [i.name for i in cluster.instances if i.scheduler_port is None]
        if unported:
            raise CoralError(f"--provisioner remote: instance {unported[0]} has no scheduler_port; engines started "
                             "elsewhere dial a fixed one: set scheduler_port on every instance, or pass --plan")
        if cluster.planner != "none" and not dry_run:
            raise CoralError("--provisioner remote cannot start engines for a re-plan: set coordinator.planner "
                             "to none (re-export the new plan instead), or pass --dry-run to only log it")
        return LocalProvisioner(log_level=log_level, start_engines=False)
    if name == "ray":
        # lazy: ray (optional: only with --provisioner ray)
        from coral.runtime.deploy.ray_provisioner import RayProvisioner

        # a plan's instances carry each node's configuration: the provisioner places by it
        ray_provisioner = RayProvisioner(address=ray_address, log_level=log_level)
        ray_provisioner.check_capacity(cluster.instances)
        return ray_provisioner
    return LocalProvisioner(log_level=log_level)


def _planner(cluster: Any, plan_file: Any) -> Any:
    """The coordinator's planner: none, or the allocator over the plan's scenario or the cluster's shapes."""
    if cluster.planner != "allocator":
        return None
    # lazy: the planner loads the allocator (numpy, highspy) only when the cluster re-plans
    from coral.runtime.deploy.planner import AllocatorPlanner, PlanPlanner

    if plan_file is not None:
        return PlanPlanner.from_plan(plan_file, {m.name: m for m in cluster.models})
    return AllocatorPlanner(shapes=cluster.instances, max_nodes=cluster.max_nodes)


def _serve_until_stopped(cluster: Any, dep: Any, ready_file: str | None, drain_timeout: float) -> None:
    """Serve until a signal (then drain, at most `drain_timeout` s) or the engine launcher exits; then stop."""
    stop = threading.Event()
    signals = []

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        stop.set()
        if len(signals) > 1:  # a second signal: stop at once
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    models = ", ".join(m.name for m in cluster.models)
    click.echo(f"coral serve: {len(cluster.instances)} instances of {models} at {dep.url} (Ctrl-C to stop)")
    if ready_file:
        write_text(ready_file, dep.url + "\n")  # whole or not at all: a script polls for it
    reported: set[str] = set()
    try:
        while not stop.wait(0.5):
            # a dead engine or scheduler is a fault the runtime handles (retry, replace next
            # epoch); only the engine launcher is vital
            dead = set(dep.provisioner.dead())
            if "zygote" in dead:
                click.echo("coral serve: the engine launcher exited; stopping", err=True)
                break
            if dead - reported:
                click.echo(f"coral serve: processes exited: {', '.join(sorted(dead - reported))}", err=True)
                reported |= dead
        if signals:
            click.echo(f"coral serve: {signal.Signals(signals[0]).name}: draining (new requests get 503; at most "
                       f"{drain_timeout:g} s for the {dep.api.in_flight if dep.api else 0} in flight)", err=True)
            left = dep.drain(drain_timeout)
            if left:
                click.echo(f"coral serve: {left} request(s) still in flight after {drain_timeout:g} s; stopping them", err=True)
    except KeyboardInterrupt:
        click.echo("coral serve: second signal; stopping now", err=True)
    finally:
        dep.stop()
    click.echo("coral serve: stopped")


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to serve the API on a non-loopback address without an API key, unless `insecure`.

    Raises:
        CoralError: naming the address and the two ways out.
    """
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only localhost is known to stay on this machine
        loopback = False
    if not loopback and not api_key and not insecure:
        raise CoralError(f"coordinator.host {host} is reachable from other machines and coordinator.api_key is not set: "
                         "anyone who reaches the port could use the API; set coordinator.api_key (clients send "
                         "Authorization: Bearer <key>), bind 127.0.0.1, or pass --insecure")


def default_keys_dir() -> Path:
    """Where `coral keys` writes by default: outside any source checkout, private to the user
    (`$XDG_CONFIG_HOME/coral/keys`, else `~/.config/coral/keys`)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "coral" / "keys"


def _git_checkout_of(folder: Path) -> Path | None:
    """The git work tree holding `folder`, if any (a secret key there is one `git add .` from leaking)."""
    for p in (folder.resolve(), *folder.resolve().parents):
        if (p / ".git").exists():
            return p
    return None


@click.command("keys")
@click.option("--dir", "folder", default=None, type=click.Path(file_okay=False),
              help="Folder for cluster.key and cluster.key_secret (created, mode 0700). "
                   "Default: $XDG_CONFIG_HOME/coral/keys or ~/.config/coral/keys, outside any checkout.")
def keys(folder: str | None) -> None:
    """Create the cluster's CurveZMQ keypair; point `coordinator.curve_keys_dir` of the cluster file at the folder.

    Every process of the cluster reads the same keypair: traffic between them is encrypted,
    and a peer without the secret key can neither read nor send control messages. Copy the
    folder to every machine of the cluster over a secure channel; keep the secret file private.
    """
    # lazy: the runtime extra (zmq): `coral --help` lists keys without loading it
    from coral.runtime.transport import generate_keys

    path = Path(folder) if folder else default_keys_dir()
    if path.exists() and not path.is_dir():
        raise UserError(f"--dir {path}: is a file; give a folder for the keypair")
    try:
        public, secret = generate_keys(path)
    except CoralError as e:  # a keypair already there: never overwritten
        raise UserError(str(e)) from None
    click.echo(f"wrote {public} and {secret} (keep it secret); set coordinator.curve_keys_dir: {path}")
    checkout = _git_checkout_of(path)
    if checkout is not None:
        click.echo(f"warning: {path} is inside the git checkout {checkout}; keep it out of commits "
                   "(Coral's .gitignore ignores keys/)", err=True)


if __name__ == "__main__":
    sys.exit(serve())
