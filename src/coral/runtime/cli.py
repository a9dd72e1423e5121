"""``coral serve`` (start the coordinator, schedulers and engines of a cluster file) and ``coral keys`` (CurveZMQ keypair)."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from coral.errors import CoralError

__all__ = ["keys", "serve"]


@click.command("serve")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Cluster YAML file (see examples/cluster-tiny.yaml).")
@click.option("--port", type=int, default=None, help="HTTP port; overrides the cluster file (0 = any free port).")
@click.option("--startup-timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every instance to register.")
@click.option("--log-level", default="WARNING", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Logging level of every process.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None, help="Write the HTTP base URL here once serving (for scripts).")
def serve(config_path: str, port: int | None, startup_timeout: float, log_level: str, ready_file: str | None) -> None:
    """Serve the models of a cluster file through an OpenAI-compatible HTTP API until Ctrl-C."""
    from coral.runtime.cluster_config import load_cluster
    from coral.runtime.deploy.deployment import Deployment
    from coral.runtime.provisioner import LocalProvisioner

    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cluster = load_cluster(config_path)
        planner = None
        if cluster.planner == "allocator":
            from coral.runtime.planner import AllocatorPlanner

            planner = AllocatorPlanner(shapes=cluster.instances, max_nodes=cluster.max_nodes)
        dep = Deployment(cluster, LocalProvisioner(log_level=log_level), http_port=port, planner=planner)
        dep.start(timeout_s=startup_timeout)
    except CoralError as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    models = ", ".join(m.name for m in cluster.models)
    click.echo(f"coral serve: {len(cluster.instances)} instances of {models} at {dep.url} (Ctrl-C to stop)")
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(dep.url + "\n")
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
    finally:
        dep.stop()
    click.echo("coral serve: stopped")


@click.command("keys")
@click.option("--dir", "folder", required=True, type=click.Path(file_okay=False), help="Folder for cluster.key and cluster.key_secret (created, mode 0700).")
def keys(folder: str) -> None:
    """Create the cluster's CurveZMQ keypair; point `coordinator.curve_keys_dir` of the cluster file at the folder.

    Every process of the cluster reads the same keypair: traffic between them is encrypted,
    and a peer without the secret key can neither read nor send control messages. Copy the
    folder to every machine of the cluster over a secure channel; keep the secret file private.
    """
    from coral.runtime.transport import generate_keys

    try:
        public, secret = generate_keys(folder)
    except CoralError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {public} and {secret} (keep it secret); set coordinator.curve_keys_dir: {folder}")


if __name__ == "__main__":
    sys.exit(serve())
