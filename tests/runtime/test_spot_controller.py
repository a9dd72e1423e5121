"""`Controller.preempt` without processes (issue 30): which replacement a spot notice starts, with a stand-in
coordinator and provisioner. A spot instance under a spot-aware planner gets the re-plan's instances; without one,
when the planner declines or fails, or in a dry run, a copy of its shape; an on-demand one a copy; under a
provisioner that cannot start engines (`--provisioner remote`) it only drains."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

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

    answer: str = "replan"  # "replan" | "none" | "raise"
    told: list[str] = dataclasses.field(default_factory=list)

    def after_notice(self, lost: InstanceSpec, running: tuple[InstanceSpec, ...]) -> Sequence[InstanceSpec] | None:
        self.told.append(lost.name)
        if self.answer == "raise":
            raise RuntimeError("the solver failed")
        if self.answer == "none":
            return None
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
    assert ["dec"] == ctl.coordinator.drained  # type: ignore[attr-defined]
    assert ["dec-od", "pre"] == sorted(ctl.running)
    assert {"dec-od": ("dec", "preempted")} == {n: (r.replaces, r.reason) for n, r in ctl.repairs.items()}
    assert {"llama"} == set(ctl.coordinator.expected)  # the model's requests are held for it
    body = notice.to_json()
    assert ("dec", "dec-od", [], "llama/decode/1 node(s) in r2") == (
        body["draining"], body["replacement"], body["drained"], body["started"][0]["runs"])


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
    assert {"draining": "dec", "replacement": None, "replanned": False, "started": [], "drained": []} == notice.to_json()
    assert ["dec"] == ctl.coordinator.drained  # type: ignore[attr-defined]
    assert [] == ctl.provisioner.started[2:]  # type: ignore[attr-defined] # the first plan's two, nothing after
    assert ["pre"] == sorted(ctl.running) and {} == ctl.coordinator.expected
