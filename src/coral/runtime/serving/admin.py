"""The operators' surface: the plan controller's interface, and the ``/admin/*`` routes that forward to it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import Body, FastAPI
from fastapi.responses import Response

from coral.errors import CoralError
from coral.runtime.serving.coordinator import RequestError
from coral.runtime.serving.metrics import FleetStats
from coral.runtime.serving.responses import json_response

__all__ = ["AdminAction", "AdminNotice", "PlanAdmin", "add_admin_routes", "preempt_body"]


class AdminAction(Protocol):
    """One step a pushed plan caused (``start``, ``drain`` or ``keep`` an instance)."""

    @property
    def kind(self) -> str: ...

    @property
    def name(self) -> str: ...


class AdminNotice(Protocol):
    """What a spot notice did: the instance noticed, what was started in its place, when it drains."""

    @property
    def name(self) -> str:
        """The (first) replacement's name; "" when none was started."""
        ...

    @property
    def replaces(self) -> str: ...

    def to_json(self) -> dict[str, Any]:
        """The answer's body: ``noticed``, ``drain_by_s``, ``replacement``, and every instance ``started`` and
        ``drained``."""
        ...


class PlanAdmin(Protocol):
    """The plan controller behind ``/admin/*`` (:class:`coral.runtime.deploy.lifecycle.Controller`
    implements it). The front end only forwards: it does not know the cluster file's schema."""

    def status(self) -> dict[str, Any]:
        """The controller's view: target plan, instances by state, last demand (JSON-ready)."""
        ...

    def push_plan(self, body: Any) -> Sequence[AdminAction]:
        """Validate a plan body (``{"instances": [...]}``) and make it the target.

        Raises:
            CoralError: the body names the field that is wrong (the answer is a 400).
        """
        ...

    def preempt(self, node: str, deadline_s: float | None = None) -> AdminNotice:
        """A spot preemption notice for ``node`` (an instance name or ``<instance>/<stage>/<k>``), which goes
        in ``deadline_s`` (None: the cloud's default notice): start its instance's replacement (a copy of its
        shape, or, for a spot instance, what the live planner's re-plan without its spot pools starts); the
        instance serves until the replacement does, or until shortly before the deadline, then drains
        (running requests finish).

        Raises:
            CoralError: no running instance of that name (the answer is a 404).
        """
        ...

    def health(self) -> dict[str, str]:
        """model -> ok | degraded | unavailable | starting (the repairs under way included)."""
        ...

    def fleet_stats(self) -> FleetStats:
        """What /metrics reports of the fleet (the registry, starts, repairs, re-plans, the plan's cost)."""
        ...


def add_admin_routes(app: FastAPI, admin: PlanAdmin | None) -> None:
    """``GET /admin/instances``, ``POST /admin/plan`` and ``POST /admin/preempt`` (404 without a plan
    controller; the guard checks the admin key)."""

    @app.get("/admin/instances", summary="The plan controller's view of the instances")
    def admin_instances() -> Response:
        if admin is None:
            raise RequestError(404, "no plan controller")
        return json_response(admin.status())

    @app.post("/admin/plan", summary="Push a new plan")
    def admin_plan(body: Any = Body(...)) -> Response:  # noqa: B008 - FastAPI's idiom
        ctl = admin
        if ctl is None:
            raise RequestError(404, "no plan controller")
        try:
            actions = ctl.push_plan(body)
        except CoralError as e:
            raise RequestError(400, str(e), "instances") from None
        return json_response({"actions": [{"kind": a.kind, "instance": a.name} for a in actions]})

    @app.post("/admin/preempt", summary="A spot preemption notice: start the node's replacement, then drain it")
    def admin_preempt(body: Any = Body(...)) -> Response:  # noqa: B008 - FastAPI's idiom
        ctl = admin
        if ctl is None:
            raise RequestError(404, "no plan controller")
        node, deadline_s = preempt_body(body)
        try:
            rep = ctl.preempt(node, deadline_s)
        except CoralError as e:
            raise RequestError(404, str(e), "node") from None
        return json_response(rep.to_json())


def preempt_body(body: Any) -> tuple[str, float | None]:
    """``POST /admin/preempt``'s body: ``{"node": "<instance>" or "<instance>/<stage>/<k>", "deadline_s": <seconds
    until the node goes, optional>}``.

    Returns:
        (node, deadline_s or None).

    Raises:
        RequestError: 400 naming the field that is wrong.
    """
    if not isinstance(body, dict):
        raise RequestError(400, _PREEMPT_BODY, "node")
    extra = sorted(set(body) - {"node", "deadline_s"})
    if extra:
        raise RequestError(400, f"unknown field {extra[0]!r}; {_PREEMPT_BODY}", extra[0])
    node = body.get("node")
    if not isinstance(node, str) or not node.strip():
        raise RequestError(400, _PREEMPT_BODY, "node")
    deadline_s = body.get("deadline_s")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float)
                                   or not 0 < deadline_s < math.inf):
        raise RequestError(400, f"deadline_s must be a positive number of seconds until the node goes (AWS: the "
                                f"instance-action time less now), got {deadline_s!r}", "deadline_s")
    return node, None if deadline_s is None else float(deadline_s)


_PREEMPT_BODY = 'body must be {"node": "<instance>" or "<instance>/<stage>/<k>", "deadline_s": <seconds, optional>}'
