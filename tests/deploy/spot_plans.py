"""Version-4 plan files with spot lines, written by hand from a version-3 `coral plan --out` (the contract of
issue 30: `instances[].spot`, `instances[].capacity_share`, `nodes[].spot`, spot nodes in their own rows)."""
from __future__ import annotations

import json
from typing import Any


def with_spot(data: dict[str, Any], spot_lines: set[int], *, share: float = 0.8) -> dict[str, Any]:
    """The plan's JSON as version 4, the instance lines at `spot_lines` (their indices) on spot.

    A spot line counts `share` of its capacity; the `nodes` rows are rebuilt from the instances, one row per
    (region, configuration, spot), each keeping the on-demand row's other fields (instance type, derived).
    """
    d = json.loads(json.dumps(data))
    d["plan_version"] = 4
    base = {(n["region"], n["config"]): n for n in d["nodes"]}
    counts: dict[tuple[str, str, bool], int] = {}
    for k, inst in enumerate(d["instances"]):
        inst["spot"] = k in spot_lines
        inst["capacity_share"] = share if inst["spot"] else 1.0
        for c in inst["nodes"]:
            key = (inst["region"], c, inst["spot"])
            counts[key] = counts.get(key, 0) + inst["count"]
    d["nodes"] = [{**base[(r, c)], "count": n, "spot": spot} for (r, c, spot), n in sorted(counts.items())]
    return d
