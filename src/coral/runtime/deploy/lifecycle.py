"""Live re-planning: measure demand each epoch, ask a planner for the next plan, reconcile it with the running one.

The planner is injected: ``planner(observation, running_instances) -> desired_instances``
where ``observation`` is what the coordinator saw over the last epoch
(:class:`~coral.runtime.serving.window.EpochObservation`: ``{model: {"prefill": tok/s, "decode":
tok/s}}`` and the accepted requests' arrivals and lengths) and ``running_instances`` is the
running plan (ν_prev).
:class:`coral.runtime.deploy.planner.AllocatorPlanner` runs the allocation ILP here (``planner:
allocator`` in the cluster file); without a planner the last plan pushed
(:meth:`Controller.apply_plan`, ``POST /admin/plan``) is kept, which still replaces lost
capacity each epoch.

:func:`reconcile` is pure: instances are matched by *shape* (everything but the name),
surplus running instances are drained lowest load first, and missing ones are started
under fresh names. The controller carries the actions out: a started instance loads its
layers, registers and only then takes traffic; a drained one takes no new request,
finishes the ones it holds, then exits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coral.runtime.deploy.cluster_config import ClusterSpec, InstanceSpec, parse_instances
from coral.runtime.deploy.provisioner import Provisioner
from coral.runtime.serving.coordinator import Coordinator
from coral.runtime.serving.window import EpochObservation

__all__ = ["Action", "Controller", "Demand", "Planner", "describe", "reconcile", "shape_key"]

log = logging.getLogger(__name__)

#: model -> {"prefill": tok/s, "decode": tok/s}
Demand = dict[str, dict[str, float]]
#: (the last epoch's observation, running plan = ν_prev) -> desired plan
Planner = Callable[[EpochObservation, tuple[InstanceSpec, ...]], Sequence[InstanceSpec]]


def shape_key(spec: InstanceSpec) -> tuple[Any, ...]:
    """What makes two instances interchangeable: everything but the name."""
    return (spec.model, spec.phase, spec.region, spec.throughput_tok_per_s, spec.stages, spec.seed, spec.weights_path)


def describe(spec: InstanceSpec) -> str:
    """What an instance runs, for logs: `model/phase/4xL40S+1xL4 in region` (its nodes' configurations
    when a plan placed it, else its stages' node counts)."""
    if all(st.configs for st in spec.stages):
        nodes = "+".join(sorted(c for st in spec.stages for c in st.configs))
    else:
        nodes = "|".join(str(len(st.node_throughputs)) for st in spec.stages) + " node(s)"
    return f"{spec.model}/{spec.phase}/{nodes} in {spec.region}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step of a reconciliation: start, drain or keep one instance."""

    kind: str  # "start" | "drain" | "keep"
    name: str
    spec: InstanceSpec

    def __post_init__(self) -> None:
        if self.kind not in ("start", "drain", "keep"):
            raise ValueError(f"action kind must be start, drain or keep, got {self.kind!r}")


def reconcile(desired: Sequence[InstanceSpec], running: Mapping[str, InstanceSpec], loads: Mapping[str, int], taken: set[str]) -> list[Action]:
    """Turn a desired plan into actions against the running instances.

    Args:
        desired: the new plan.
        running: name -> spec of the instances that take (or will take) traffic.
        loads: name -> requests held now (missing = 0); the least loaded are drained first.
        taken: every name used so far (a new instance never reuses one).

    Returns:
        Actions: ``keep`` for matched instances, ``drain`` for surplus ones, ``start`` for
        missing ones (named after the desired spec, with a ``-N`` suffix when taken).
    """
    want: dict[tuple[Any, ...], list[InstanceSpec]] = {}
    for d in desired:
        want.setdefault(shape_key(d), []).append(d)
    have: dict[tuple[Any, ...], list[str]] = {}
    for name, spec in running.items():
        have.setdefault(shape_key(spec), []).append(name)
    actions: list[Action] = []
    used = set(taken)
    for key, names in have.items():
        n_keep = len(want.get(key, []))
        # keep the busiest, drain the least loaded (ties: by name, for determinism)
        ordered = sorted(names, key=lambda n: (-loads.get(n, 0), n))
        actions += [Action(kind="keep", name=n, spec=running[n]) for n in ordered[:n_keep]]
        actions += [Action(kind="drain", name=n, spec=running[n]) for n in ordered[n_keep:]]
    for key, specs in want.items():
        for spec in specs[len(have.get(key, [])):]:
            name, k = spec.name, 1
            while name in used:
                k += 1
                name = f"{spec.name}-{k}"
            used.add(name)
            actions.append(Action(kind="start", name=name, spec=_renamed(spec, name)))
    return actions


def _renamed(spec: InstanceSpec, name: str) -> InstanceSpec:
    # a fixed scheduler port belongs to the name it was given for (the old one may still drain on it)
    return dataclasses.replace(spec, name=name, scheduler_port=spec.scheduler_port if name == spec.name else None)


class Controller:
    """Carries plans out on a running cluster: the epoch loop, explicit plan changes, clean-up."""

    def __init__(
        self,
        coordinator: Coordinator,
        provisioner: Provisioner,
        cluster: ClusterSpec,
        coordinator_address: str,
        *,
        planner: Planner | None = None,
        epoch_s: float = 0.0,
        start_timeout_s: float = 300.0,
        dry_run: bool = False,
    ) -> None:
        """Args:
        coordinator: the registry and router.
        provisioner: starts and stops instances.
        cluster: models and cluster-wide settings.
        coordinator_address: where new instances register.
        planner: the re-planning function (None = keep the last plan).
        epoch_s: epoch length; 0 = no epoch thread (call :meth:`epoch` yourself).
        start_timeout_s: an instance not registered by then counts as failed (and is replaced).
        dry_run: after the first plan is running, log (and record in ``history``, marked
            ``dry_run``) the actions each later plan change would take, without taking them.
        """
        self.coordinator = coordinator
        self.provisioner = provisioner
        self.cluster = cluster
        self.coordinator_address = coordinator_address
        self.planner = planner
        self.epoch_s = epoch_s
        self.start_timeout_s = start_timeout_s
        self.dry_run = dry_run
        self._applied = False  # the first plan is always carried out (a dry run still serves)
        self.target: tuple[InstanceSpec, ...] = ()
        self.running: dict[str, InstanceSpec] = {}  # started, not drained, not lost
        self.starting: dict[str, float] = {}  # name -> when started (until registered)
        self.draining: dict[str, float] = {}  # name -> when the drain began
        self.taken: set[str] = set()
        self.history: list[dict[str, Any]] = []  # one entry per plan change: time, actions
        self.last_demand: Demand = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ plans

    def apply_plan(self, desired: Sequence[InstanceSpec]) -> list[Action]:
        """Make ``desired`` the target plan and reconcile now.

        Args:
            desired: every instance the cluster should run.

        Returns:
            The actions taken.
        """
        with self._lock:
            self.target = tuple(desired)
            return self._reconcile()

    def push_plan(self, body: Any) -> list[Action]:
        """``POST /admin/plan``: validate a plan body against the cluster's models, then apply it.

        Args:
            body: ``{"instances": [...]}`` as in the cluster file.

        Returns:
            The actions taken.

        Raises:
            CoralError: naming the first problem in ``body`` (nothing is applied).
        """
        return self.apply_plan(parse_instances(body, self.cluster))

    def epoch(self) -> list[Action]:
        """One epoch: measure demand, call the planner with the running plan, reconcile."""
        with self._lock:
            self._sweep()
            seen = self.coordinator.observe_epoch()
            self.last_demand = seen.demand_tok_per_s
            if self.planner is not None:
                try:
                    self.target = tuple(self.planner(seen, tuple(self.running.values())))
                except Exception:  # a failing planner keeps the current plan
                    log.exception("controller: planner failed; keeping the current plan")
            return self._reconcile()

    def _reconcile(self) -> list[Action]:
        self._sweep()
        actions = reconcile(self.target, self.running, self.coordinator.loads(), self.taken)
        t = time.monotonic()
        if self.dry_run and self._applied:
            planned = [(a.kind, a.name) for a in actions if a.kind != "keep"]
            if planned:
                self.history.append({"t": t, "actions": planned, "dry_run": True,
                                     "templates": [describe(a.spec) for a in actions if a.kind != "keep"]})
                log.warning("controller (dry run, nothing done): would %s",
                            ", ".join(f"{a.kind} {a.name} ({describe(a.spec)})" for a in actions if a.kind != "keep"))
            return actions
        self._applied = True
        for a in actions:
            if a.kind == "drain":
                del self.running[a.name]
                self.starting.pop(a.name, None)
                self.draining[a.name] = t
                if not self.coordinator.drain(a.name):  # not registered yet: nothing to drain
                    self.provisioner.stop_instance(a.name)
                    self.draining.pop(a.name, None)
            elif a.kind == "start":
                self.taken.add(a.name)
                self.running[a.name] = a.spec
                self.starting[a.name] = t
                self.provisioner.start_instance(a.spec, self.cluster.model(a.spec.model), self.cluster, self.coordinator_address)
        if any(a.kind != "keep" for a in actions):
            self.history.append({"t": t, "actions": [(a.kind, a.name) for a in actions if a.kind != "keep"]})
            log.info("controller: %s", ", ".join(f"{a.kind} {a.name}" for a in actions if a.kind != "keep"))
        return actions

    def _sweep(self) -> None:
        """Account instances that registered, drained, died or never came up."""
        now = time.monotonic()
        retired = self.coordinator.retired
        for name in list(self.starting):
            if name in self.coordinator.instances:
                del self.starting[name]
            elif now - self.starting[name] > self.start_timeout_s or (
                now - self.starting[name] > 1.0 and not self.provisioner.instance_alive(name)
            ):
                log.warning("controller: instance %s did not come up; replacing it", name)
                del self.starting[name]
                self.running.pop(name, None)
                self.provisioner.stop_instance(name)
        for name in list(self.running):
            if name in retired:  # lost: the next reconcile starts a replacement
                del self.running[name]
                self.provisioner.stop_instance(name, timeout_s=2.0)
        for name in list(self.draining):
            if name in retired and not self.provisioner.instance_alive(name):
                del self.draining[name]
                self.provisioner.stop_instance(name, timeout_s=0.1)
            elif name in retired and now - self.draining[name] > 600:
                del self.draining[name]
                self.provisioner.stop_instance(name)

    # ------------------------------------------------------------ epoch thread

    def start(self) -> None:
        """Run :meth:`epoch` every ``epoch_s`` in a daemon thread (when ``epoch_s`` > 0)."""
        if self.epoch_s <= 0:
            return
        self._thread = threading.Thread(target=self._loop, name="epochs", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.epoch_s):
            try:
                self.epoch()
            except Exception:
                log.exception("controller: epoch failed")

    def stop(self) -> None:
        """Stop the epoch thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def status(self) -> dict[str, Any]:
        """What the admin endpoint shows: target plan, instances by state, last demand."""
        with self._lock:
            self._sweep()
            return {
                "target": [i.name for i in self.target],
                "running": sorted(self.running),
                "starting": sorted(self.starting),
                "draining": sorted(self.draining),
                "instances": self.coordinator.snapshot(),
                "demand_tok_per_s": self.last_demand,
            }
