"""Which of Coral's input files a parsed YAML/JSON document is (scenario, cluster or plan), so a
file given where another kind is expected is named as such instead of failing field by field."""
from __future__ import annotations

from typing import Any

# Top-level keys only one kind of file has (tests/integration/test_new_user.py checks them against
# the schemas: ScenarioFile, ClusterFile, Plan.to_json).
MARKERS: dict[str, frozenset[str]] = {
    "scenario": frozenset({"configs", "regions", "default_availability", "derive_missing_prices", "prices_csv",
                           "slo_attainment"}),
    "cluster": frozenset({"coordinator", "device", "dtype", "torch_threads", "kv_cache_gib"}),
    "plan": frozenset({"plan_version", "cost_usd_per_h", "alpha"}),
}
WHAT = {
    "scenario": "a scenario file (for `coral plan`, `simulate` and `scenario show`)",
    "cluster": "a cluster file (for `coral serve --config`; examples/cluster-tiny.yaml is one)",
    "plan": "a plan file (written by `coral plan --out`; `coral serve --config CLUSTER --plan` runs it)",
}


def file_kind(data: Any) -> str | None:
    """"scenario", "cluster" or "plan" when the document's top-level keys say so unambiguously, else None."""
    if not isinstance(data, dict):
        return None
    keys = set(data)
    kinds = [kind for kind, markers in MARKERS.items() if keys & markers]
    return kinds[0] if len(kinds) == 1 else None


def wrong_kind(where: str, data: Any, expected: str) -> str | None:
    """A one-line error when `data` is clearly another kind of file than `expected`, else None."""
    kind = file_kind(data)
    if kind is None or kind == expected:
        return None
    return f"{where} is {WHAT[kind]}, not {WHAT[expected].split(' (')[0]}"
