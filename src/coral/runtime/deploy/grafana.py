"""`coral export --format grafana`: a Grafana dashboard of a Coral deployment's metrics (vLLM's names and Coral's own).

The JSON is Grafana's dashboard model (schemaVersion 39, `timeseries` / `stat` / `table` panels on a
24-column grid), with a Prometheus data-source input (`DS_PROMETHEUS`, asked for on import) and a
`model_name` variable, so Dashboards -> Import loads it as it is. Every query names only metrics the
front end exports (`tests/deploy/test_grafana.py` checks them against a server's `/metrics`).
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["PANELS", "dashboard", "dashboard_json", "queries"]

_DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
_M = 'model_name=~"$model_name"'
_R = "$__rate_interval"

#: (title, panel type, unit, [(query, legend)], what it shows); laid out two per row
PANELS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...], str], ...] = (
    ("Model health", "table", "none", ((f"max by (model_name, status) (coral:model_health{{{_M}}}) == 1", "{{model_name}}: {{status}}"),),
     "Each model's /health state: ok, degraded (a node lost or an instance being replaced), unavailable, starting."),
    ("Plan cost", "stat", "currencyUSD", (("coral:plan_cost_usd_per_hour", "$/h"),),
     "The running plan's price at the scenario's prices (served plans only)."),
    ("Instances by state", "timeseries", "none", ((f"sum by (model_name, state) (coral:instances{{{_M}}})", "{{model_name}} {{state}}"),),
     "Serving instances starting, active, degraded, draining and repairing."),
    ("Repairs and re-plans", "timeseries", "none",
     ((f"sum by (model_name, reason) (increase(coral:repairs_total{{{_M}}}[{_R}]))", "repair {{model_name}} ({{reason}})"),
      (f"increase(coral:replans_total[{_R}])", "re-plans")),
     "Replacements self-repair started (failed instance, lost node) and plan changes carried out."),
    ("Lost engine nodes", "table", "none", ((f"coral:engine_node_lost{{{_M}}} == 1", "{{instance}} {{node}}"),),
     "Engine nodes a live instance runs without (its data-parallel stage serves on the rest)."),
    ("Requests", "timeseries", "reqps",
     ((f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{{{_M}}}[{_R}]))", "{{model_name}} {{finished_reason}}"),
      (f"sum by (model_name, code) (rate(coral:http_request_errors_total{{{_M}}}[{_R}]))", "{{model_name}} HTTP {{code}}")),
     "Finished requests by reason, and error responses by HTTP status."),
    ("Running and waiting", "timeseries", "none",
     ((f"sum by (model_name) (vllm:num_requests_running{{{_M}}})", "{{model_name}} running"),
      (f"sum by (model_name) (vllm:num_requests_waiting{{{_M}}})", "{{model_name}} waiting")),
     "Requests in batches and queued (parked for a retry or a replacement included)."),
    ("KV-cache usage", "timeseries", "percentunit", ((f"max by (model_name) (vllm:kv_cache_usage_perc{{{_M}}})", "{{model_name}}"),),
     "Share of KV blocks in use on each instance's fullest node."),
    ("Time to first token (p50, p99)", "timeseries", "s",
     ((f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}} p50"),
      (f"histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}} p99")),
     "Arrival at the front end to the first token."),
    ("Time per output token (p50, p99)", "timeseries", "s",
     ((f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:request_time_per_output_token_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}} p50"),
      (f"histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:request_time_per_output_token_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}} p99")),
     "Per request, (end to end - TTFT) / (tokens - 1)."),
    ("Request phases (mean)", "timeseries", "s",
     tuple((f"sum by (model_name) (rate(vllm:request_{p}_time_seconds_sum{{{_M}}}[{_R}])) / sum by (model_name) "
            f"(rate(vllm:request_{p}_time_seconds_count{{{_M}}}[{_R}]))", f"{{{{model_name}}}} {p}")
           for p in ("queue", "prefill", "decode", "inference")),
     "Mean time queued, in prefill, in decode and running (vLLM's phases)."),
    ("End-to-end latency (p99)", "timeseries", "s",
     ((f"histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}}"),),
     "Arrival to last token."),
    ("Tokens", "timeseries", "none",
     ((f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{_M}}}[{_R}]))", "{{model_name}} prompt tok/s"),
      (f"sum by (model_name) (rate(vllm:generation_tokens_total{{{_M}}}[{_R}]))", "{{model_name}} generated tok/s")),
     "Prompt and generated tokens per second."),
    ("Tokens per step (p50) and preemptions", "timeseries", "none",
     ((f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:iteration_tokens_total_bucket{{{_M}}}[{_R}])))", "{{model_name}} tokens/step"),
      (f"sum by (model_name) (rate(vllm:num_preemptions_total{{{_M}}}[{_R}]))", "{{model_name}} preemptions/s")),
     "Tokens in one micro-batch, and requests preempted by recompute for lack of KV blocks."),
    ("KV transfer (prefill to decode)", "timeseries", "none",
     ((f"sum by (model_name) (rate(coral:kv_transfer_bytes_total{{{_M}}}[{_R}]))", "{{model_name}} bytes/s"),
      (f"histogram_quantile(0.99, sum by (le, model_name) (rate(coral:kv_transfer_seconds_bucket{{{_M}}}[{_R}])))", "{{model_name}} p99 s"),
      (f"sum by (model_name) (rate(coral:kv_transfers_total{{{_M}}}[{_R}]))", "{{model_name}} hand-offs/s")),
     "KV-cache bytes moved, the hand-off's p99 time and hand-offs per second."),
    ("Request parameters", "timeseries", "none",
     ((f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:request_params_max_tokens_bucket{{{_M}}}[{_R}])))", "{{model_name}} max_tokens p50"),
      (f"histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:request_params_n_bucket{{{_M}}}[{_R}])))", "{{model_name}} n p99"),
      (f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:request_prompt_tokens_bucket{{{_M}}}[{_R}])))", "{{model_name}} prompt p50"),
      (f"histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:request_generation_tokens_bucket{{{_M}}}[{_R}])))", "{{model_name}} output p50")),
     "What clients ask for: max_tokens, n, and the prompt and output lengths."),
    ("KV cache configuration", "table", "none", ((f"vllm:cache_config_info{{{_M}}}", "{{engine}}: {{num_gpu_blocks}} x {{block_size}}"),),
     "Each instance's KV pool (its smallest node's blocks and block size)."),
)


def _panel(k: int, title: str, kind: str, unit: str, targets: tuple[tuple[str, str], ...], description: str) -> dict[str, Any]:
    panel: dict[str, Any] = {
        "id": k + 1, "type": kind, "title": title, "description": description, "datasource": _DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (k % 2), "y": 8 * (k // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + j), "datasource": _DS, "expr": q, "legendFormat": legend,
                     **({"instant": True, "format": "table"} if kind == "table" else {})}
                    for j, (q, legend) in enumerate(targets)],
    }  # fmt: skip
    if kind == "timeseries":
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    return panel


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (import it: Dashboards -> New -> Import)."""
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "The Prometheus that scrapes Coral's /metrics",
                      "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
                       {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}],
        "id": None, "uid": "coral-serving", "title": "Coral serving", "description": "A Coral deployment: health, repairs, cost, "
        "latency, load, KV cache (vLLM's metric names and Coral's own).", "tags": ["coral", "vllm", "llm-serving"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{
            "name": "model_name", "label": "model", "type": "query", "datasource": _DS,
            "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "models"},
            "definition": "label_values(vllm:num_requests_running, model_name)", "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "sort": 1,
        }]},
        "annotations": {"list": []},
        "panels": [_panel(k, *p) for k, p in enumerate(PANELS)],
    }  # fmt: skip


def dashboard_json() -> str:
    """The dashboard's file text."""
    return json.dumps(dashboard(), indent=2) + "\n"


def queries() -> list[str]:
    """Every PromQL query of the dashboard (its panels' and its variable's)."""
    d = dashboard()
    return [t["expr"] for p in d["panels"] for t in p["targets"]] + [v["query"]["query"] for v in d["templating"]["list"]]
