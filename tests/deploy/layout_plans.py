"""Hand-made plan files whose stages name TP groups of a node (`4xL40S/tp1`), for the runtime and export tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from coral.runtime.deploy.plan_file import PLAN_FILE_VERSION

PHI_SCENARIO = {
    "name": "layouttest", "description": "phi-4 (40 heads, 10 KV heads) on L40S / L4 nodes",
    "models": [{"name": "phi-4", "ttft_ms": 2000, "tpot_ms": 80,
                "workload": {"rate_per_s": 4, "dataset": "synthetic", "prompt_tokens_mean": 600, "output_tokens_mean": 60}}],
    "configs": ["1xL40S", "4xL40S", "1xL4", "4xL4"],
    "regions": [{"name": "aws:us-east-2"}],
    "planner": {"n_max": 3, "batch_grid": [1, 4, 16, 64], "history_s": 900, "epoch_s": 120},
}
REGION = "aws:us-east-2"

# phi-4 (40 layers) on one 4xL40S, three layouts; and a decode instance on two 1xL4.
DP4 = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1"] * 4, 40)]}  # four TP1 replicas
PP4 = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1"], 10)] * 4}  # an in-node pipeline
TP2X2 = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp2", "4xL40S/tp2"], 40)]}  # 2 x TP2
DECODE = {"phase": "decode", "nodes": ["1xL4", "1xL4"], "stages": [(["1xL4", "1xL4"], 40)]}
# colocated (chunked prefill, no KV transfer): one 1xL40S; and two TP2 replicas on a 4xL40S
COLOCATED = {"phase": "colocated", "nodes": ["1xL40S"], "stages": [(["1xL40S"], 40)], "chunk_tokens": 256,
             "decode_tok_per_s": 400.0}
COLOCATED_TP2X2 = {**TP2X2, "phase": "colocated", "chunk_tokens": 512, "decode_tok_per_s": 900.0}


def plan_json(instances: list[dict[str, Any]], *, first_token: str | None = None, scenario: str = "layouttest",
              count: int = 1) -> dict[str, Any]:
    """A plan file's JSON for `instances` (each: phase, nodes, stages as (entries, layers))."""
    rows, nodes = [], {}
    for inst in instances:
        for n in inst["nodes"]:
            nodes[n] = nodes.get(n, 0) + count
        rows.append({
            "model": inst.get("model", "phi-4"), "phase": inst["phase"], "region": REGION, "nodes": sorted(inst["nodes"]),
            "count": count, "throughput_tok_per_s": 1000.0, "price_usd_per_h": 5.0, "micro_batch": 4, "slo_ms": 80.0,
            "budget_ms": 60.0,
            "stages": [{"nodes": list(e), "layers": j, "throughput_tok_per_s": 1000.0} for e, j in inst["stages"]],
            **({"hosts": inst["hosts"]} if "hosts" in inst else {}),
            **{k: inst[k] for k in ("chunk_tokens", "decode_tok_per_s") if k in inst}})
    data: dict[str, Any] = {
        "plan_version": PLAN_FILE_VERSION, "scenario": scenario, "method": "coral", "status": "optimal", "cost_usd_per_h": 5.0 * len(rows),
        "instances": rows, "nodes": [{"region": REGION, "config": c, "count": n} for c, n in sorted(nodes.items())]}
    if first_token is not None:
        data["models"] = [{"model": "phi-4", "first_token": first_token}]
    return data


def write_layout_plan(folder: Path, instances: list[dict[str, Any]], name: str = "plan.json", **kw: Any) -> tuple[Path, Path]:
    """Write the scenario YAML and a hand-made plan file beside it; return (scenario path, plan path)."""
    s = folder / "layouttest.yaml"
    s.write_text(yaml.safe_dump(PHI_SCENARIO))
    data = plan_json(instances, **kw)
    data["scenario_source"] = str(s)
    p = folder / name
    p.write_text(json.dumps(data))
    return s, p
