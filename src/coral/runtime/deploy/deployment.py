"""A running cluster: the coordinator and its HTTP front end in this process, every instance
through a provisioner, the plan controller, and a clean stop of all of it (what ``coral serve`` runs).

Moved out of :mod:`coral.runtime.deploy.provisioner`, which the lifecycle controller imports: the
deployment imports both, neither imports it.
"""

from __future__ import annotations

import time
from typing import Any

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import ClusterSpec
from coral.runtime.deploy.lifecycle import Controller
from coral.runtime.deploy.provisioner import LocalProvisioner, Provisioner
from coral.runtime.serving.app import ApiServer, ServerOptions
from coral.runtime.serving.coordinator import Coordinator, ModelInfo
from coral.runtime.serving.tokenizer import Tokenizer, load_tokenizer
from coral.runtime.transport import CurveKeys, ZmqTransport

__all__ = ["Deployment"]


class Deployment:
    """A running cluster: coordinator + HTTP API + plan controller here, instances through a provisioner."""

    def __init__(
        self,
        cluster: ClusterSpec,
        provisioner: Provisioner | None = None,
        http_port: int | None = None,
        *,
        planner: Any = None,
        coordinator_port: int = 0,
        dry_run: bool = False,
        prices: Any = None,
        body_deadline_s: float | None = None,
    ) -> None:
        """Args:
        cluster: what to run (its instances are the first plan).
        provisioner: how to start instances (default: :class:`LocalProvisioner`).
        http_port: override the cluster file's HTTP port (0 = any free port).
        planner: re-planning function for the epoch loop (see :mod:`coral.runtime.deploy.lifecycle`).
        coordinator_port: the coordinator's ZeroMQ port (0 = any free one).
        dry_run: serve the first plan, then only log what later plan changes would do.
        prices: shape -> $/h of one instance (:func:`coral.runtime.deploy.lifecycle.shape_key`), for the
            plan-cost metric; None for a cluster file without prices.
        body_deadline_s: override the cluster file's whole-body deadline of HTTP requests.
        """
        self.cluster = cluster
        self.provisioner = provisioner or LocalProvisioner()
        self.http_port = cluster.http_port if http_port is None else http_port
        self.planner = planner
        self.coordinator_port = coordinator_port
        self.dry_run = dry_run
        self.prices = prices
        self.body_deadline_s = cluster.body_deadline_s if body_deadline_s is None else body_deadline_s
        self.transport: ZmqTransport | None = None
        self.coordinator: Coordinator | None = None
        self.controller: Any = None
        self.api: ApiServer | None = None

    @property
    def url(self) -> str:
        """The HTTP base URL."""
        if self.api is None:
            raise CoralError("deployment not started")
        return self.api.url

    def _tokenizers(self) -> dict[str, Tokenizer]:
        """Each model's tokenizer (its tokenizer.json and chat template, or the byte tokenizer)."""
        return {m.name: load_tokenizer(m.tokenizer_path, m.chat_template, int(m.config["vocab_size"]), m.name)
                for m in self.cluster.models}

    def _infos(self) -> list[ModelInfo]:
        infos = []
        for m in self.cluster.models:
            eos = m.config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            infos.append(ModelInfo(name=m.name, max_context=m.max_context, vocab_size=int(m.config["vocab_size"]), eos_ids=eos_ids,
                                   first_token=m.first_token))
        return infos

    def start_coordinator(self) -> Coordinator:
        """Bind the coordinator's inbox and start its loop (also used to restart it in place)."""
        c = self.cluster
        curve = CurveKeys.load(c.curve_keys_dir) if c.curve_keys_dir else None
        deadline = time.monotonic() + 10
        while True:
            try:
                self.transport = ZmqTransport(host=c.host, port=self.coordinator_port, max_message_bytes=c.max_message_bytes, curve=curve)
                break
            except Exception as e:  # the old socket of a restart is released asynchronously
                if self.coordinator_port == 0 or time.monotonic() > deadline:
                    raise CoralError(f"cannot bind the coordinator at port {self.coordinator_port}: {e}") from None
                time.sleep(0.05)
        self.coordinator_port = int(self.transport.address.rsplit(":", 1)[1])
        self.coordinator = Coordinator(
            self.transport, self._infos(), heartbeat_s=c.heartbeat_s, heartbeat_timeout_s=c.heartbeat_timeout_s,
            max_retries=c.max_retries, router=c.router,
        )  # fmt: skip
        self.coordinator.cache_dtype = c.dtype
        self.coordinator.start()
        if self.controller is not None:
            self.controller.coordinator = self.coordinator
        if self.api is not None:
            self.api.coordinator = self.coordinator
        return self.coordinator

    def restart_coordinator(self) -> None:
        """Simulate a coordinator crash and restart (same address): the registry is rebuilt from heartbeats.

        Requests in flight in the old coordinator are lost with it (their HTTP clients get an error).
        """
        assert self.coordinator is not None and self.transport is not None
        self.coordinator.stop()
        self.transport.close()
        self.start_coordinator()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start everything and wait until every instance has registered.

        Raises:
            CoralError: if a process dies or the instances are not up within ``timeout_s``.
        """
        c = self.cluster
        coord = self.start_coordinator()
        assert self.transport is not None
        self.controller = Controller(coord, self.provisioner, c, self.transport.address, planner=self.planner, epoch_s=c.epoch_s,
                                     dry_run=self.dry_run, prices=self.prices)
        try:
            self.controller.apply_plan(c.instances)
            deadline = time.monotonic() + timeout_s
            want = {i.name for i in c.instances}
            while set(self.coordinator.instances) < want:  # type: ignore[union-attr]
                dead = self.provisioner.dead()
                if dead:
                    raise CoralError(f"runtime processes exited during start-up: {', '.join(dead)}")
                if time.monotonic() > deadline:
                    missing = sorted(want - set(self.coordinator.instances))  # type: ignore[union-attr]
                    raise CoralError(f"instances not up after {timeout_s:.0f} s: {', '.join(missing)}")
                time.sleep(0.05)
            opts = ServerOptions(
                api_key=c.api_key, admin_key=c.admin_key, max_body_bytes=c.max_body_bytes, idle_timeout_s=c.idle_timeout_s,
                header_timeout_s=c.header_timeout_s, body_timeout_s=c.body_timeout_s, metrics_require_key=c.metrics_require_key,
                body_deadline_s=self.body_deadline_s,
            )  # fmt: skip
            self.api = ApiServer(coord, c.host, self.http_port, admin=self.controller, options=opts,
                                 tokenizers=self._tokenizers())
            self.api.start()
            self.controller.start()
        except BaseException:
            self.stop()
            raise

    def drain(self, timeout_s: float = 30.0) -> int:
        """Graceful stop, first half: new API requests get 503 with ``Retry-After``; wait up to
        ``timeout_s`` for the ones in flight (streams included) to finish. Call :meth:`stop` after.

        Returns:
            Requests still in flight when the wait ended (0: none was cut).
        """
        if self.api is None:
            return 0
        if self.controller is not None:
            self.controller.repair = False  # a stopping cluster replaces nothing
        return self.api.drain(timeout_s)

    def stop(self) -> None:
        """Stop the HTTP server, the epoch loop, the instances and the coordinator (idempotent)."""
        if self.api is not None:
            self.api.stop()
            self.api = None
        if self.controller is not None:
            self.controller.stop()
        if self.coordinator is not None:
            self.coordinator.stop(shutdown_instances=True)
        self.provisioner.stop_all()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.coordinator = None

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
