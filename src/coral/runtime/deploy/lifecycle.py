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

:func:`~coral.runtime.deploy.actions.reconcile` is pure: instances are matched by *shape*
(everything but the name), surplus running instances are drained lowest load first, and missing
ones are started under fresh names. The controller carries the actions out: a started instance loads its
layers, registers and only then takes traffic; a drained one takes no new request,
finishes the ones it holds, then exits.

Self-repair (a watch thread, every ``repair_poll_s``, whatever the epoch): an instance that
failed (its scheduler reported it, went silent, or never came up) is replaced at once by a new
instance of the same shape, and nothing that still works is drained; while the replacement
starts, the coordinator holds the model's new requests for it instead of refusing them. An
instance that lost a node of a data-parallel stage keeps serving on the others (``degraded``);
a replacement of the same shape is started beside it, and once that one takes traffic the
degraded one is drained (it finishes what it holds).

Spot preemption notice (:meth:`Controller.preempt`, ``POST /admin/preempt``): a provisioner that
learns a spot node will be taken (AWS gives 2 minutes) names it, and may say when it goes
(``deadline_s``, default ``notice_s``, 120 s). Make before break: its replacement starts at once
and takes its place in the plan, while the instance on the node keeps taking requests until the
first of: every replacement the notice started has registered (it serves), or the loss deadline
less ``notice_margin_s`` (10 s, for what it holds to finish). Then it drains: it takes no new
request and finishes the ones it holds; one still on the node when it goes is resent like any
other lost request. It drains at once where the notice starts no replacement of its model (a
re-plan that carries its load on the others), where no engine can be started here
(``--provisioner remote``), or where the deadline less the margin has already passed. (Draining at
the notice left a model whose only instance of a phase was noticed with nothing until the
replacement was up; the simulator's noticed instance serves the same way, docs/reference/simulator.md.) The
model's new requests are held for the replacement only where no instance of it takes them. The
replacement is a copy of the instance's shape, except for a spot instance (issue 30) under a
planner that re-plans around lost spot capacity (:class:`SpotAware`,
:class:`coral.runtime.deploy.planner.PlanPlanner`): there the notice is a loss of the instance's spot
pools, the planner re-plans without them and the instances it starts for the model replace the
lost one (on-demand, or spot from a pool not lost).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from coral.errors import CoralError
from coral.policy.lifecycle import SPOT_NOTICE_MARGIN_S
from coral.runtime.deploy.actions import Action, describe, fresh_name, reconcile, renamed, shape_key
from coral.runtime.deploy.cluster_config import ClusterSpec, InstanceSpec, parse_instances
from coral.runtime.deploy.provisioner import Provisioner
from coral.runtime.serving.coordinator import Coordinator
from coral.runtime.serving.metrics import FleetStats
from coral.runtime.serving.window import EpochObservation

# Action, describe, reconcile and shape_key live in `actions` and are re-exported here, where callers found them
__all__ = ["Action", "Controller", "Demand", "Notice", "Noticed", "Planner", "SpotAware", "describe", "reconcile", "shape_key"]

log = logging.getLogger(__name__)

#: model -> {"prefill": tok/s, "decode": tok/s}
Demand = dict[str, dict[str, float]]
#: (the last epoch's observation, running plan = ν_prev) -> desired plan
Planner = Callable[[EpochObservation, tuple[InstanceSpec, ...]], Sequence[InstanceSpec]]


@runtime_checkable
class SpotAware(Protocol):
    """A planner that re-plans around spot capacity a notice took (:meth:`Controller.preempt`)."""

    def after_notice(self, lost: InstanceSpec, running: tuple[InstanceSpec, ...]) -> Sequence[InstanceSpec] | None:
        """Mark the spot pools of `lost` (its region and node configurations) as down, and return the plan
        to run without them (`running`: the instances left, the lost one not among them: it serves only until
        the instances the re-plan starts for its model do); None: no re-plan (the controller then starts a
        copy of `lost`)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """What a spot preemption notice did: the instance noticed, what was started for it, and when it drains."""

    replaces: str  # the instance on the noticed node (it serves until `drain_by_s`, then drains)
    started: tuple[Action, ...]  # the replacement(s) started (a copy of its shape, or the re-plan's)
    drained: tuple[Action, ...] = ()  # others the re-plan drained
    replanned: bool = False  # the planner re-planned around the lost spot pools
    # seconds from the answer until it drains at the latest (the deadline less the margin; sooner once its
    # replacements serve); 0: it drains now
    drain_by_s: float = 0.0

    def __post_init__(self) -> None:
        if self.drain_by_s < 0:
            raise ValueError(f"drain_by_s must be >= 0, got {self.drain_by_s}")

    @property
    def name(self) -> str:
        """The first replacement's name ("" when the re-plan started none: the rest carries the load)."""
        return self.started[0].name if self.started else ""

    def to_json(self) -> dict[str, Any]:
        """What ``POST /admin/preempt`` answers: the instance noticed, the seconds until it drains at the latest
        (0: now), the replacement (the first started, or null), and every instance started or drained, with what
        it runs and whether it is spot."""
        def row(a: Action) -> dict[str, Any]:
            return {"instance": a.name, "model": a.spec.model, "phase": getattr(a.spec.phase, "value", a.spec.phase),
                    "region": a.spec.region, "spot": a.spec.spot, "runs": describe(a.spec)}

        return {"noticed": self.replaces, "drain_by_s": round(self.drain_by_s, 3), "replacement": self.name or None,
                "replanned": self.replanned,
                "started": [row(a) for a in self.started], "drained": [row(a) for a in self.drained]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Noticed:
    """A noticed instance still serving: out of the plan (its replacements took its place), still routed."""

    notice: Notice
    spec: InstanceSpec
    drain_at: float  # monotonic s: the loss deadline less the margin; it drains then if not before
    replacements: frozenset[str]  # what the notice started for its model: it drains once all of them serve


#: AWS's notice before a spot node goes, when the notice does not say (`deadline_s`)
NOTICE_S = 120.0
#: drain a noticed instance this long before its node goes, for the requests it holds to finish
NOTICE_MARGIN_S = SPOT_NOTICE_MARGIN_S

REPAIR_REASONS = ("failed", "degraded", "preempted")
# reasons whose replacement takes the old instance's place in the plan at once (the old one is lost, or
# noticed: it serves until the replacement does, but the plan no longer counts it)
_IN_PLACE = ("failed", "preempted")


@dataclass(frozen=True, slots=True, kw_only=True)
class Repair:
    """A replacement under way: the instance it replaces, why, and when it was started."""

    name: str  # the replacement
    replaces: str
    # "failed" (the instance was lost) | "degraded" (it lost a node; drained once this one is up) |
    # "preempted" (a spot notice: this one takes its place; the noticed one serves until it is up)
    reason: str
    spec: InstanceSpec
    t_start: float

    def __post_init__(self) -> None:
        if self.reason not in REPAIR_REASONS:
            raise ValueError(f"repair reason must be one of {', '.join(REPAIR_REASONS)}, got {self.reason!r}")


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
        repair: bool = True,
        repair_poll_s: float = 0.2,
        prices: Mapping[tuple[Any, ...], float] | None = None,
        notice_s: float = NOTICE_S,
        notice_margin_s: float = NOTICE_MARGIN_S,
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
        repair: replace failed instances and instances without a node at once (a watch thread,
            started by :meth:`start`); a dry run repairs too (it keeps the plan running).
        repair_poll_s: how often the watch thread looks.
        prices: shape (:func:`shape_key`) -> $/h of one instance, for the plan-cost metric (None:
            unpriced, a hand-written cluster file).
        notice_s: seconds from a spot notice to the node's loss when the notice does not say (AWS: 120).
        notice_margin_s: a noticed instance drains at the latest this long before its node goes.
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
        self.noticed: dict[str, Noticed] = {}  # spot-noticed instances still serving until their replacements do
        self.notice_s = notice_s
        self.notice_margin_s = notice_margin_s
        self.taken: set[str] = set()
        self.history: list[dict[str, Any]] = []  # one entry per plan change: time, actions
        self.last_demand: Demand = {}
        self.repair = repair and getattr(provisioner, "can_start_engines", True)
        self.repair_poll_s = repair_poll_s
        self.prices = dict(prices) if prices is not None else None
        self.repairs: dict[str, Repair] = {}  # replacement name -> what it replaces
        self.repaired: list[dict[str, Any]] = []  # every repair: replaced, by, reason, started, up (monotonic s)
        self.repair_counts: dict[tuple[str, str], int] = {}  # (model, reason) -> repairs started
        self.replans = 0  # plan changes carried out
        self._lost: list[tuple[str, InstanceSpec]] = []  # instances the sweep found gone, to replace
        self._failures: dict[tuple[Any, ...], tuple[int, float]] = {}  # shape -> (replacements that failed, retry after)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: threading.Thread | None = None

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
        self._lost.clear()  # the plan carried out now replaces what it still wants of the lost instances
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
            self.replans += 1
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
                spec = self.running.pop(name, None)
                rep = self.repairs.pop(name, None)
                if rep is not None:  # a replacement that failed: back off before the next one
                    n, _ = self._failures.get(shape_key(rep.spec), (0, 0.0))
                    self._failures[shape_key(rep.spec)] = (n + 1, now + min(60.0, 2.0 ** n))
                    if rep.reason in _IN_PLACE:
                        self._lost.append((rep.replaces, rep.spec))
                elif spec is not None:
                    self._lost.append((name, spec))
                self.provisioner.stop_instance(name)
        for name in list(self.running):
            if name in retired:  # lost: replaced by the watch thread at once (or the next reconcile)
                self._lost.append((name, self.running.pop(name)))
                self.provisioner.stop_instance(name, timeout_s=2.0)
        for name in list(self.draining):
            if name in retired and not self.provisioner.instance_alive(name):
                del self.draining[name]
                self.provisioner.stop_instance(name, timeout_s=0.1)
            elif name in retired and now - self.draining[name] > 600:
                del self.draining[name]
                self.provisioner.stop_instance(name)

    # ------------------------------------------------------------ self-repair

    def repair_now(self) -> list[Repair]:
        """Replace what failed and what runs without a node, now (the watch thread calls it).

        Returns:
            The replacements started.
        """
        with self._lock:
            self._sweep()
            now = time.monotonic()
            started: list[Repair] = []
            lost, self._lost = self._lost, []
            for name, spec in lost:  # failed: a replacement of the same shape, at once
                if any(r.replaces == name for r in self.repairs.values()):
                    continue
                if self._failures.get(shape_key(spec), (0, 0.0))[1] > now:
                    self._lost.append((name, spec))  # its last replacement failed: wait a little
                    continue
                started.append(self._start_repair(name, spec, "failed", now))
            replaced = {r.replaces for r in self.repairs.values()}
            for rec in self.coordinator.snapshot():  # degraded: a replacement beside it, then a drain
                name = rec["id"]
                if rec["state"] == "degraded" and name in self.running and name not in replaced:
                    spec = self.running[name]
                    if self._failures.get(shape_key(spec), (0, 0.0))[1] <= now:
                        started.append(self._start_repair(name, spec, "degraded", now))
            for name, rep in list(self.repairs.items()):  # replacements that came up
                if name not in self.coordinator.instances:
                    continue
                del self.repairs[name]
                self._failures.pop(shape_key(rep.spec), None)
                self.repaired.append({"replaced": rep.replaces, "by": name, "reason": rep.reason, "started": rep.t_start, "up": now})
                log.warning("controller: %s replaced %s (%s) in %.1f s", name, rep.replaces, rep.reason, now - rep.t_start)
                if rep.reason == "degraded":
                    # the new one takes the degraded one's place; if a plan change removed that one meanwhile,
                    # the new one is surplus instead
                    old = rep.replaces if self.running.pop(rep.replaces, None) is not None else name
                    if old == rep.replaces:
                        self.running[name] = rep.spec
                    self.draining[old] = now
                    if not self.coordinator.drain(old, "replaced (it had lost a node)"):
                        self.provisioner.stop_instance(old)
                        self.draining.pop(old, None)
            self._end_notices(now)
            self._expect_replacements(now)
            return started

    def preempt(self, node: str, deadline_s: float | None = None) -> Notice:
        """A spot preemption notice for ``node`` (the instance's name or one of its engine nodes,
        ``<instance>/<stage>/<k>``). Its replacement starts at once and takes its place in the plan: for a
        spot instance under a :class:`SpotAware` planner, what the planner's re-plan without the lost spot
        pools starts for its model (on-demand, or spot from a pool not lost); otherwise a copy of its shape;
        none where the provisioner cannot start engines (`--provisioner remote`). The instance keeps taking
        requests until every replacement serves or until ``deadline_s`` less ``notice_margin_s``, whichever
        comes first, and then drains (it takes no new request and finishes those it holds); it drains now
        where nothing replaces it or that time has passed. A repeated notice for an instance still serving
        changes nothing but an earlier deadline.

        Args:
            node: the noticed node or instance.
            deadline_s: seconds from now until the node goes (None: ``notice_s``, AWS's 2 minutes).

        Returns:
            What was started and drained, and when the noticed instance drains at the latest.

        Raises:
            CoralError: no running instance of that name, or a deadline that is not a positive number
                (nothing is done).
        """
        name = node.strip().split("/", 1)[0]
        until = self.notice_s if deadline_s is None else deadline_s
        if not until > 0 or until == float("inf"):
            raise CoralError(f"deadline_s must be a positive number of seconds until the node goes, got {deadline_s!r}")
        with self._lock:
            self._sweep()
            now = time.monotonic()
            if name in self.noticed:  # a repeated notice (two watchers, or a retry)
                n = self.noticed[name]
                self.noticed[name] = dataclasses.replace(n, drain_at=min(n.drain_at, now + until - self.notice_margin_s))
                self._end_notices(now)
                drain_at = self.noticed[name].drain_at if name in self.noticed else now
                return dataclasses.replace(n.notice, drain_by_s=max(0.0, drain_at - now))
            if name not in self.running or name in self.draining:
                running = ", ".join(sorted(n for n in self.running if n not in self.draining)) or "(none)"
                raise CoralError(f"node {node!r}: no running instance {name!r} to drain; running: {running}")
            spec = self.running.pop(name)
            serving = self.starting.pop(name, None) is None  # registered (a starting one has nothing to serve)
            self.repairs.pop(name, None)  # itself a replacement still starting: the new one replaces it
            for other in [r for r, rep in self.repairs.items() if rep.replaces == name]:
                self.repairs.pop(other)  # a replacement for a degraded node of it: this one replaces it now
                self.running.pop(other, None)
                self.starting.pop(other, None)
                self.provisioner.stop_instance(other)
            notice: Notice | None = None
            if not getattr(self.provisioner, "can_start_engines", True):
                # engines are started elsewhere (`--provisioner remote`): nothing here can replace it; it drains
                log.warning("controller: %s has a spot preemption notice; draining it (no engine can be started "
                            "here: the plan's other instances carry its load)", name)
                notice = Notice(replaces=name, started=())
            else:
                notice = self._replan_after_notice(name, spec, now)
            if notice is None:
                rep = self._start_repair(name, spec, "preempted", now)
                notice = Notice(replaces=name, started=(Action(kind="start", name=rep.name, spec=rep.spec),))
            # held for the replacement only where no instance of the model takes a request (after the drain)
            self._expect_replacements(now)
            mine = frozenset(r for r, rep in self.repairs.items() if rep.replaces == name)
            drain_at = now + until - self.notice_margin_s
            if mine and serving and drain_at > now:  # make before break: it serves until they do
                self.noticed[name] = Noticed(notice=notice, spec=spec, drain_at=drain_at, replacements=mine)
                log.warning("controller: %s serves until %s serve%s (%.0f s at most)", name, ", ".join(sorted(mine)),
                            "" if len(mine) > 1 else "s", drain_at - now)
                return dataclasses.replace(notice, drain_by_s=drain_at - now)
            self._drain_noticed(name, now, "spot preemption notice")
            return notice

    def _drain_noticed(self, name: str, now: float, reason: str) -> None:
        self.draining[name] = now
        if not self.coordinator.drain(name, reason):  # not registered: nothing to drain
            self.provisioner.stop_instance(name)
            self.draining.pop(name, None)

    def end_notices(self, now: float | None = None) -> list[str]:
        """Drain the noticed instances whose replacements all serve, or whose drain time has come (the watch
        thread calls it; ``now``: a monotonic time, default the clock).

        Returns:
            The instances drained.
        """
        with self._lock:
            self._sweep()  # (a replacement that did not come up counts as failed: its noticed one keeps serving)
            return self._end_notices(time.monotonic() if now is None else now)

    def _end_notices(self, now: float) -> list[str]:
        ended: list[str] = []
        for name, n in list(self.noticed.items()):
            if name in self.coordinator.retired:  # its node went first: what it held is resent
                del self.noticed[name]
                self.provisioner.stop_instance(name, timeout_s=2.0)
                continue
            # what it waits for: its replacements still starting, and any started since for one that failed
            mine = n.replacements | {r for r, rep in self.repairs.items() if rep.replaces == name}
            waiting = [r for r in mine if r not in self.coordinator.instances and (r in self.repairs or r in self.starting)]
            lost = any(lost == name for lost, _ in self._lost)  # a failed replacement not restarted yet
            if waiting or lost:
                if now < n.drain_at:
                    continue
                why = f"spot preemption notice: its node goes in {max(0.0, n.drain_at + self.notice_margin_s - now):.0f} s"
            else:
                why = "spot preemption notice: replaced"
            del self.noticed[name]
            log.warning("controller: %s drains (%s)", name, why.split(": ", 1)[1])
            self._drain_noticed(name, now, why)
            ended.append(name)
        return ended

    def _replan_after_notice(self, name: str, spec: InstanceSpec, now: float) -> Notice | None:
        """A spot instance's notice under a :class:`SpotAware` planner: its re-plan without the lost pools,
        carried out; the started instances of the lost one's model replace it (the model's requests are held
        for them). None: not spot, no such planner, or it did not re-plan."""
        if not spec.spot or self.dry_run or not isinstance(self.planner, SpotAware):
            return None  # a dry run starts nothing a re-plan asks for: it keeps the plan running with a copy
        try:
            desired = self.planner.after_notice(spec, tuple(self.running.values()))
        except Exception:  # a failing planner: a copy of the shape, as without one
            log.exception("controller: re-plan after the notice for %s failed; starting a copy of it", name)
            return None
        if desired is None:
            return None
        self.target = tuple(desired)
        actions = self._reconcile()
        started = tuple(a for a in actions if a.kind == "start")
        for a in started:  # those of its model replace it (any phase: the re-plan may serve it colocated)
            if a.spec.model == spec.model:
                self.repairs[a.name] = Repair(name=a.name, replaces=name, reason="preempted", spec=a.spec, t_start=now)
                key = (spec.model, "preempted")
                self.repair_counts[key] = self.repair_counts.get(key, 0) + 1
        log.warning("controller: %s has a spot preemption notice; the re-plan without its spot pools starts %s",
                    name, ", ".join(f"{a.name} ({describe(a.spec)})" for a in started) or "nothing")
        mine = sorted(started, key=lambda a: (a.spec.model != spec.model, a.spec.phase != spec.phase))
        return Notice(replaces=name, started=tuple(mine), drained=tuple(a for a in actions if a.kind == "drain"),
                      replanned=True)

    def _start_repair(self, name: str, spec: InstanceSpec, reason: str, now: float) -> Repair:
        new = renamed(spec, fresh_name(spec, self.taken))
        rep = Repair(name=new.name, replaces=name, reason=reason, spec=new, t_start=now)
        self.repairs[new.name] = rep
        self.taken.add(new.name)
        self.starting[new.name] = now
        if reason in _IN_PLACE:
            self.running[new.name] = new  # it takes the lost one's place in the plan at once
        key = (spec.model, reason)
        self.repair_counts[key] = self.repair_counts.get(key, 0) + 1
        why = {"failed": "failed", "degraded": "lost a node", "preempted": "has a spot preemption notice"}[reason]
        log.warning("controller: %s %s; starting %s (%s) in its place", name, why, new.name, describe(new))
        self.provisioner.start_instance(new, self.cluster.model(new.model), self.cluster, self.coordinator_address)
        return rep

    def _expect_replacements(self, now: float) -> None:
        """Tell the coordinator which models wait for a replacement (their requests are held, not refused)."""
        expected: dict[str, float] = {}
        for r in self.repairs.values():
            if r.reason in _IN_PLACE:
                expected[r.spec.model] = max(expected.get(r.spec.model, 0.0), r.t_start + min(self.start_timeout_s, 120.0))
        self.coordinator.expected = expected

    def repairing_models(self) -> frozenset[str]:
        """Models with a failed instance being replaced."""
        with self._lock:
            return frozenset(r.spec.model for r in self.repairs.values() if r.reason in _IN_PLACE) | frozenset(
                spec.model for _n, spec in self._lost)

    def health(self) -> dict[str, str]:
        """model -> ok | degraded | unavailable | starting (``/health``)."""
        return self.coordinator.health(self.repairing_models())

    def fleet_stats(self) -> FleetStats:
        """What /metrics reports: the coordinator's registry plus starts, repairs, re-plans and the plan's cost."""
        repairing = self.repairing_models()
        base: FleetStats = self.coordinator.fleet_stats(repairing)
        with self._lock:
            states = dict(base.instances)
            for name in self.starting:
                spec = self.running.get(name) or (self.repairs[name].spec if name in self.repairs else None)
                if spec is not None:
                    key = (spec.model, "repairing" if name in self.repairs else "starting")
                    states[key] = states.get(key, 0) + 1
            cost = None
            if self.prices is not None:
                cost = sum(self.prices.get(shape_key(spec), 0.0) for spec in self.running.values())
            return dataclasses.replace(base, instances=states, plan_cost_usd_per_h=cost, replans=self.replans,
                                       repairs=dict(self.repair_counts))

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.repair_poll_s):
            try:
                if self.repair:
                    self.repair_now()
                else:  # turned off (a deployment draining to stop replaces nothing); a noticed instance still drains
                    self.end_notices()
            except Exception:
                log.exception("controller: repair failed")

    # ------------------------------------------------------------ epoch thread

    def start(self) -> None:
        """Run :meth:`epoch` every ``epoch_s`` in a daemon thread (when ``epoch_s`` > 0), and the watch (self-repair,
        and the drain of spot-noticed instances, :meth:`end_notices`)."""
        self._watch = threading.Thread(target=self._watch_loop, name="repair", daemon=True)
        self._watch.start()
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
        """Stop the epoch thread and the repair watch."""
        self._stop.set()
        for t in (self._thread, self._watch):
            if t is not None:
                t.join(timeout=5)

    def status(self) -> dict[str, Any]:
        """What the admin endpoint shows: target plan, instances by state, last demand."""
        with self._lock:
            self._sweep()
            return {
                "target": [i.name for i in self.target],
                "running": sorted(self.running),
                "starting": sorted(self.starting),
                "draining": sorted(self.draining),
                "noticed": [{"instance": name, "replacements": sorted(n.replacements),
                             "drain_by_s": round(max(0.0, n.drain_at - time.monotonic()), 3)} for name, n in self.noticed.items()],
                "repairing": [{"instance": r.name, "replaces": r.replaces, "reason": r.reason} for r in self.repairs.values()],
                "repaired": self.repaired[-20:],
                "instances": self.coordinator.snapshot(),
                "health": self.coordinator.health(self.repairing_models()),
                "demand_tok_per_s": self.last_demand,
            }
