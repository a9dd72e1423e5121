"""The operators' surface: the plan controller's interface, and the ``/admin/*`` routes that forward to it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import Body, FastAPI
from fastapi.responses import Response

from coral.errors import CoralError
from coral.runtime.serving.coordinator import RequestError
from coral.runtime.serving.metrics import FleetStats
from coral.runtime.serving.responses import json_response

__all__ = ["AdminAction", "AdminNotice", "PlanAdmin", "add_admin_routes"]


class AdminAction(Protocol):
    """One step a pushed plan caused (``start``, ``drain`` or ``keep`` an instance)."""

    @property
    def kind(self) -> str: ...

    @property
    def name(self) -> str: ...


class AdminNotice(Protocol):
    """What a spot notice did: the instance it drains and what was started in its place."""

    @property
    def name(self) -> str:
        """The (first) replacement's name; "" when none was started."""
        ...

    @property
    def replaces(self) -> str: ...

    def to_json(self) -> dict[str, Any]:
        """The answer's body: ``draining``, ``replacement``, and every instance ``started`` and ``drained``."""
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

    def preempt(self, node: str) -> AdminNotice:
        """A spot preemption notice for ``node`` (an instance name or ``<instance>/<stage>/<k>``): drain
        its instance now (running requests finish) and start its replacement (a copy of its shape, or,
        for a spot instance, what the live planner's re-plan without its spot pools starts).

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

    @app.post("/admin/preempt", summary="A spot preemption notice: drain the node's instance, start its replacement")
    def admin_preempt(body: Any = Body(...)) -> Response:  # noqa: B008 - FastAPI's idiom
        ctl = admin
        if ctl is None:
            raise RequestError(404, "no plan controller")
        node = body.get("node") if isinstance(body, dict) else None
        if not isinstance(node, str) or not node.strip():
            raise RequestError(400, 'body must be {"node": "<instance>" or "<instance>/<stage>/<k>"}', "node")
        try:
            rep = ctl.preempt(node)
        except CoralError as e:
            raise RequestError(404, str(e), "node") from None
        return json_response(rep.to_json())
