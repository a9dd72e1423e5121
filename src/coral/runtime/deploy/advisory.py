"""Advisory mode: what a new plan would change on a running fleet (instances to start and drain, $/h)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from coral.allocator.spot import spot_region
from coral.runtime.deploy.plan_file import PlanFile, PlannedInstance

#: (region, template key, spot): spot and on-demand instances of one template are different lines of a fleet
LineKey = tuple[str, str, bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One (region, template, market) whose instance count would change."""

    region: str
    key: str  # template key model/phase/nodes
    running: int
    planned: int
    price_usd_per_h: float  # one instance
    spot: bool = False  # its nodes are spot (issue 30)

    @property
    def start(self) -> int:
        return max(0, self.planned - self.running)

    @property
    def drain(self) -> int:
        return max(0, self.running - self.planned)

    @property
    def delta_usd_per_h(self) -> float:
        return (self.planned - self.running) * self.price_usd_per_h


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDiff:
    """Every (region, template, market) whose count changes, and the fleet's $/h before and after."""

    changes: tuple[Change, ...]
    running_usd_per_h: float
    planned_usd_per_h: float
    unchanged: int  # instances that keep running as they are

    @property
    def delta_usd_per_h(self) -> float:
        return self.planned_usd_per_h - self.running_usd_per_h

    @property
    def starts(self) -> int:
        return sum(c.start for c in self.changes)

    @property
    def drains(self) -> int:
        return sum(c.drain for c in self.changes)

    def to_json(self) -> dict[str, Any]:
        return {"running_usd_per_h": self.running_usd_per_h, "planned_usd_per_h": self.planned_usd_per_h,
                "delta_usd_per_h": self.delta_usd_per_h, "start": self.starts, "drain": self.drains,
                "unchanged": self.unchanged,
                "changes": [{"region": c.region, "template": c.key, "spot": c.spot, "running": c.running,
                             "planned": c.planned, "start": c.start, "drain": c.drain, "delta_usd_per_h": c.delta_usd_per_h}
                            for c in self.changes]}


def _counts(plan: PlanFile) -> tuple[Counter[LineKey], dict[LineKey, PlannedInstance]]:
    counts: Counter[LineKey] = Counter()
    first: dict[LineKey, PlannedInstance] = {}
    for i in plan.instances:
        counts[(i.region, i.key, i.spot)] += i.count
        first.setdefault((i.region, i.key, i.spot), i)
    return counts, first


def diff_plans(running: PlanFile, planned: PlanFile) -> PlanDiff:
    """Compare the fleet running `running` with `planned`; pure (reads and changes nothing).

    Args:
        running: the plan the fleet runs now (a plan file of the same scenario).
        planned: the new plan.

    Returns:
        The changes sorted by (region, template), and both plans' $/h.
    """
    old, old_i = _counts(running)
    new, new_i = _counts(planned)
    changes = []
    for k in sorted(set(old) | set(new)):
        if old[k] != new[k]:
            inst = new_i.get(k) or old_i[k]
            changes.append(Change(region=k[0], key=k[1], spot=k[2], running=old[k], planned=new[k],
                                  price_usd_per_h=inst.price_usd_per_h))
    return PlanDiff(changes=tuple(changes), running_usd_per_h=running.cost_usd_per_h,
                    planned_usd_per_h=planned.cost_usd_per_h,
                    unchanged=sum(min(old[k], new[k]) for k in set(old) & set(new)))


def running_counts(plan: PlanFile) -> dict[tuple[str, str], int]:
    """`ν_{r,τ}` of a running plan, keyed as `Plan.counts` (what the allocator takes as `prev`): a spot
    instance under its region's spot market (`coral.allocator.spot.spot_region`)."""
    out: Counter[tuple[str, str]] = Counter()
    for (region, key, spot), n in _counts(plan)[0].items():
        out[(spot_region(region) if spot else region, key)] += n
    return dict(out)


__all__ = ["Change", "PlanDiff", "diff_plans", "running_counts"]
