"""`Controller.preempt` without processes (issue 30): which replacement a spot notice starts, and when the noticed
instance drains, with a stand-in coordinator and provisioner. A spot instance under a spot-aware planner gets the
re-plan's instances; without one, when the planner declines or fails, or in a dry run, a copy of its shape; an
on-demand one a copy; under a provisioner that cannot start engines (`--provisioner remote`) it only drains. Make
before break: the noticed instance serves (is not drained) until every replacement has registered, or until the
loss deadline less the margin; it drains at once where nothing replaces it or the deadline is too close."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import pytest

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import InstanceSpec, parse_cluster
from coral.runtime.deploy.lifecycle import Controller

CLUSTER = parse_cluster({
    "device": "cpu",
    "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 3}}],
    "instances": [
        {"name": "dec", "model": "llama", "phase": "decode", "region": "r1", "spot": True, "stages": [{"layers": [0, 6]}]},
        {"name": "pre", "model": "llama", "phase": "prefill", "region": "r1", "stages": [{"layers": [0, 6]}]},
    ],
})  # fmt: skip


class Coordinator:
    """What the controller asks of the coordinator here: every instance registered, drains recorded."""

    def __init__(self) -> None:
        self.instances: dict[str, Any] = {}
        self.retired: set[str] = set()
        self.drained: list[str] = []
        self.expected: dict[str, float] = {}

    def drain(self, name: str, reason: str = "") -> bool:
        self.drained.append(name)
        return True

    def loads(self) -> dict[str, int]:
        return {}

    def snapshot(self) -> list[dict[str, Any]]:
        return []


class Provisioner:
    """Records starts; `can_start_engines` False is the remote mode."""

    def __init__(self, can_start_engines: bool = True) -> None:
        self.can_start_engines = can_start_engines
        self.started: list[InstanceSpec] = []

    def start_instance(self, inst: InstanceSpec, *_: Any) -> None:
        self.started.append(inst)

    def instance_alive(self, name: str) -> bool:
        return True

    def stop_instance(self, name: str, timeout_s: float = 5.0) -> None:
        pass


@dataclasses.dataclass
class Planner:
    """A spot-aware planner: the running plan plus the lost instance on-demand in r2 (or what `answer` says)."""

    answer: str = "replan"  # "replan" | "none" | "raise" | "keep" (the running plan: the others carry the load)
    told: list[str] = dataclasses.field(default_factory=list)

    def after_notice(self, lost: InstanceSpec, running: tuple[InstanceSpec, ...]) -> Sequence[InstanceSpec] | None:
        self.told.append(lost.name)
        if self.answer == "raise":
            raise RuntimeError("the solver failed")
        if self.answer == "none":
            return None
        if self.answer == "keep":
            return list(running)
        return [*running, dataclasses.replace(lost, name="dec-od", region="r2", spot=False)]

    def __call__(self, seen: object, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        return list(running)


def _controller(planner: Any = None, *, can_start_engines: bool = True, dry_run: bool = False) -> Controller:
    coord = Coordinator()
    ctl = Controller(coord, Provisioner(can_start_engines), CLUSTER, "inproc://c", planner=planner,  # type: ignore[arg-type]
                     dry_run=dry_run, repair=False)
    ctl.apply_plan(CLUSTER.instances)
    coord.instances.update({n: object() for n in ctl.running})  # every instance registered
    ctl.starting.clear()
    return ctl


def test_a_spot_notice_under_a_spot_aware_planner_starts_the_replan() -> None:
    planner = Planner()
    ctl = _controller(planner)
    notice = ctl.preempt("dec/0/0")
    assert ["dec"] == planner.told
    assert ("dec", "dec-od", True) == (notice.replaces, notice.name, notice.replanned)
    assert [("dec-od", "r2", False)] == [(a.name, a.spec.region, a.spec.spot) for a in notice.started]
    assert ["dec-od", "pre"] == sorted(ctl.running)  # the replacement takes its place in the plan at once
    assert {"dec-od": ("dec", "preempted")} == {n: (r.replaces, r.reason) for n, r in ctl.repairs.items()}
    # (where no instance of the model takes a request, its requests are held for the replacement)
    assert {"llama"} == set(ctl.coordinator.expected)
    # make before break: it serves until its replacement does
    assert [] == ctl.coordinator.drained  # type: ignore[attr-defined]
    assert ["dec"] == list(ctl.noticed)
    body = notice.to_json()
    assert ("dec", "dec-od", [], "llama/decode/1 node(s) in r2") == (
        body["noticed"], body["replacement"], body["drained"], body["started"][0]["runs"])
    assert 100 < body["drain_by_s"] <= 110  # AWS's 120 s less the 10 s margin
    assert [] == ctl.end_notices()  # the replacement is still starting
    ctl.coordinator.instances["dec-od"] = object()  # type: ignore[attr-defined] # it registered: it serves
    assert ["dec"] == ctl.end_notices()
    assert (["dec"], {}) == (ctl.coordinator.drained, ctl.noticed)  # type: ignore[attr-defined]
    assert "dec" in ctl.draining


@pytest.mark.parametrize("answer", ["none", "raise"])
def test_a_planner_that_declines_or_fails_gets_a_copy(answer: str) -> None:
    ctl = _controller(Planner(answer=answer))
    notice = ctl.preempt("dec")
    assert (False, "dec-2") == (notice.replanned, notice.name)
    assert ("r1", True) == (ctl.running["dec-2"].region, ctl.running["dec-2"].spot)


@pytest.mark.parametrize("kw", [{"planner": None}, {"planner": "spot-aware", "dry_run": True}])
def test_without_a_spot_aware_planner_or_in_a_dry_run_a_spot_notice_starts_a_copy(kw: dict[str, Any]) -> None:
    planner = Planner() if kw.pop("planner") else None
    ctl = _controller(planner, **kw)
    notice = ctl.preempt("dec")
    assert (False, ["dec-2"]) == (notice.replanned, [a.name for a in notice.started])
    assert [] == (planner.told if planner else [])


def test_an_on_demand_notice_does_not_ask_the_planner() -> None:
    planner = Planner()
    ctl = _controller(planner)
    assert "pre-2" == ctl.preempt("pre").name
    assert [] == planner.told


def test_a_remote_control_plane_only_drains() -> None:
    planner = Planner()
    ctl = _controller(planner, can_start_engines=False)
    notice = ctl.preempt("dec")
    assert ((), "", []) == (notice.started, notice.name, planner.told)  # nothing it could start is asked for
    assert {"noticed": "dec", "drain_by_s": 0.0, "replacement": None, "replanned": False, "started": [],
            "drained": []} == notice.to_json()
    assert ["dec"] == ctl.coordinator.drained  # type: ignore[attr-defined]
    assert [] == ctl.provisioner.started[2:]  # type: ignore[attr-defined] # the first plan's two, nothing after
    assert ["pre"] == sorted(ctl.running) and {} == ctl.coordinator.expected


def test_the_noticed_instance_drains_at_the_deadline_less_the_margin_if_the_replacement_is_not_up() -> None:
    ctl = _controller()
    notice = ctl.preempt("pre", deadline_s=100.0)
    assert 80 < notice.drain_by_s <= 90
    t = time.monotonic()
    assert [] == ctl.end_notices(t + 50)  # (the replacement, pre-2, never registers here)
    assert ["pre"] == ctl.end_notices(t + 91)
    assert ["pre"] == ctl.coordinator.drained  # type: ignore[attr-defined]
    assert "pre-2" in ctl.repairs  # its replacement still comes


def test_a_replacement_that_fails_keeps_the_noticed_instance_serving() -> None:
    ctl = _controller()
    ctl.preempt("pre", deadline_s=100.0)
    ctl.start_timeout_s = 0.0  # pre-2 does not come up in time: it counts as failed, and is to be replaced
    assert [] == ctl.end_notices()
    assert ("pre-2" not in ctl.repairs, ["pre"]) == (True, list(ctl.noticed))
    assert [] == ctl.coordinator.drained  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kw", "why"), [
    ({"planner": Planner(answer="keep")}, "the re-plan starts nothing for its model"),
    ({"can_start_engines": False}, "nothing can be started here"),
    ({"deadline_s": 8.0}, "the node goes sooner than the margin"),
])  # fmt: skip
def test_a_notice_drains_at_once_where_nothing_replaces_it_first(kw: dict[str, Any], why: str) -> None:
    deadline_s = kw.pop("deadline_s", None)
    ctl = _controller(**kw)
    notice = ctl.preempt("dec", deadline_s=deadline_s)
    assert (0.0, ["dec"], {}) == (notice.drain_by_s, ctl.coordinator.drained, ctl.noticed), why  # type: ignore[attr-defined]


def test_a_noticed_instance_whose_node_goes_first_is_dropped_not_drained() -> None:
    ctl = _controller()
    ctl.preempt("dec")
    ctl.coordinator.retired.add("dec")  # type: ignore[attr-defined] # the coordinator saw it go
    ctl.coordinator.instances.pop("dec")  # type: ignore[attr-defined]
    assert [] == ctl.end_notices()
    assert ({}, []) == (ctl.noticed, ctl.coordinator.drained)  # type: ignore[attr-defined]
    assert "dec-2" in ctl.running  # its replacement still comes


def test_a_repeated_notice_starts_nothing_more_and_only_brings_the_drain_forward() -> None:
    ctl = _controller()
    first = ctl.preempt("dec", deadline_s=100.0)
    again = ctl.preempt("dec/0/0", deadline_s=200.0)
    assert (["dec-2"], ["dec-2"]) == ([a.name for a in first.started], [a.name for a in again.started])
    assert again.drain_by_s <= first.drain_by_s  # a later deadline does not push it back
    sooner = ctl.preempt("dec", deadline_s=50.0)
    assert 30 < sooner.drain_by_s <= 40
    assert 3 == len(ctl.provisioner.started)  # type: ignore[attr-defined] # the first plan's two, then dec-2
    assert ctl.preempt("dec", deadline_s=5.0).drain_by_s == 0.0  # sooner than the margin: it drains now
    assert ["dec"] == ctl.coordinator.drained  # type: ignore[attr-defined]


@pytest.mark.parametrize("deadline_s", [0.0, -1.0, float("inf"), float("nan")])
def test_a_deadline_that_is_not_a_positive_number_is_refused_and_changes_nothing(deadline_s: float) -> None:
    ctl = _controller()
    with pytest.raises(CoralError, match="deadline_s must be a positive number of seconds"):
        ctl.preempt("dec", deadline_s=deadline_s)
    assert (["dec", "pre"], {}) == (sorted(ctl.running), ctl.noticed)
