"""``coral serve``: start the coordinator, schedulers and engines of a cluster file on this machine."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from coral.errors import CoralError

__all__ = ["serve"]


@click.command("serve")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Cluster YAML file (see examples/cluster-tiny.yaml).")
@click.option("--port", type=int, default=None, help="HTTP port; overrides the cluster file (0 = any free port).")
@click.option("--startup-timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every instance to register.")
@click.option("--log-level", default="WARNING", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Logging level of every process.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None, help="Write the HTTP base URL here once serving (for scripts).")
def serve(config_path: str, port: int | None, startup_timeout: float, log_level: str, ready_file: str | None) -> None:
    """Serve the models of a cluster file through an OpenAI-compatible HTTP API until Ctrl-C."""
    from coral.runtime.cluster_config import load_cluster
    from coral.runtime.provisioner import Deployment, LocalProvisioner

    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cluster = load_cluster(config_path)
        dep = Deployment(cluster, LocalProvisioner(log_level=log_level), http_port=port)
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
    try:
        while not stop.wait(0.5):
            dead = dep.provisioner.dead()
            if dead:
                click.echo(f"coral serve: processes exited: {', '.join(dead)}; stopping", err=True)
                break
    finally:
        dep.stop()
    click.echo("coral serve: stopped")


if __name__ == "__main__":
    sys.exit(serve())
