"""The Grafana dashboard: Grafana's JSON model, and every query parses as PromQL and names only metrics the
front end exports (read from a server's /metrics: its `# TYPE` lines name every family, with or without data)."""
from __future__ import annotations

import json
import re

import pytest

from coral.runtime.deploy.grafana import PANELS, dashboard, queries

from .conftest import run

promql = pytest.importorskip("promql_parser")


def _selectors(node: object) -> set[str]:
    """The metric names a parsed PromQL expression selects."""
    out: set[str] = set()
    name = getattr(node, "name", None)
    if type(node).__name__ == "VectorSelector" and name:
        out.add(name)
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector", "vs"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            out |= _selectors(child)
    for arg in getattr(node, "args", None) or ():
        out |= _selectors(arg)
    return out


def exported_names(text: str) -> set[str]:
    """Every sample name a /metrics text can carry: a histogram's _bucket/_sum/_count, a counter's _total."""
    names: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if not m:
            continue
        name, kind = m.groups()
        total = name if name.endswith("_total") else f"{name}_total"
        names |= {"histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"}, "counter": {total}}.get(kind, {name})
    return names


def _server_metrics() -> str:
    """/metrics of a real front end (an in-process coordinator, no-op instances) after a request."""
    pytest.importorskip("fastapi")
    from coral.runtime.serving.app import ServerOptions
    from tests.runtime.api_server import AUTH, start_api, stop_api
    from tests.runtime.conftest import http

    a = start_api(ServerOptions(api_key="sekret"))
    try:
        assert 200 == http("POST", a.url + "/v1/completions", {"model": "a", "prompt": [5], "max_tokens": 3}, headers=AUTH)[0]
        return http("GET", a.url + "/metrics")[1]
    finally:
        stop_api(a)


def test_every_query_names_a_metric_the_server_exports() -> None:
    text = _server_metrics()
    exported = exported_names(text)
    # coral:plan_cost_usd_per_hour is exported only where the plan has prices (a served plan file)
    exported.add("coral:plan_cost_usd_per_hour")
    used: set[str] = set()
    for q in queries():
        if q.startswith("label_values("):  # a Grafana variable query, not PromQL: its metric is the first argument
            used.add(q[len("label_values("):].split(",")[0].strip())
            continue
        used |= _selectors(promql.parse(q.replace("$__rate_interval", "5m")))
    assert used and set() == used - exported, f"queries name metrics the server does not export: {sorted(used - exported)}"
    # and the metrics are among them (vLLM's names, Coral's own)
    for name in ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_bucket", "vllm:request_prefill_time_seconds_sum",
                 "vllm:request_decode_time_seconds_sum", "vllm:request_inference_time_seconds_sum",
                 "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket", "vllm:cache_config_info",
                 "coral:instances", "coral:replans_total", "coral:repairs_total", "coral:kv_transfer_bytes_total",
                 "coral:kv_transfer_seconds_bucket"):
        assert name in used and name in exported, name


def test_a_query_naming_an_unknown_metric_is_caught() -> None:
    """The check above can fail: a misspelt metric is not among the exported names."""
    exported = exported_names(_server_metrics())
    assert {"vllm:num_requests_runing"} == _selectors(promql.parse("sum(vllm:num_requests_runing)")) - exported


def test_the_dashboard_is_grafanas_json_model() -> None:
    d = dashboard()
    assert {"DS_PROMETHEUS"} == {i["name"] for i in d["__inputs"]} and 39 == d["schemaVersion"]
    assert len(PANELS) == len(d["panels"]) and len({p["id"] for p in d["panels"]}) == len(d["panels"])
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and p["type"] in ("timeseries", "stat", "table")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']} overlaps another"
                cells.add((x, y))
        assert p["targets"] and all(t["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_export_writes_the_dashboard_without_a_plan(tmp_path) -> None:
    r = run("export", "--format", "grafana", "--out", str(tmp_path / "g"))
    assert r.exit_code == 0, r.output
    assert dashboard() == json.loads((tmp_path / "g" / "coral-dashboard.json").read_text())
    r = run("export", "--format", "vllm", "--out", str(tmp_path / "v"))
    assert r.exit_code == 2 and "pass --plan" in r.output
