"""Templates as plain JSON-ready dicts (the legacy cache format, `coral templates show --json`)."""
from __future__ import annotations

from typing import Any

from coral.perf.model import Phase
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template


def template_to_dict(t: Template) -> dict[str, Any]:
    p = t.placement
    return {
        "model": t.model, "phase": t.phase.value, "slo_ms": t.slo_ms, "budget_ms": t.budget_ms, "nodes": list(t.nodes),
        "prompt_tokens": t.prompt_tokens, "realized_tok_per_s": t.realized_tok_per_s,
        "micro_batch": p.micro_batch, "throughput_tok_per_s": p.throughput_tok_per_s, "latency_ms": p.latency_s * 1e3,
        "comm_ms": p.comm_s * 1e3,
        **({"decode_tok_per_s": t.decode_tok_per_s, "chunk_tokens": t.chunk_tokens} if t.phase is Phase.COLOCATED else {}),
        "stages": [{"nodes": list(s.nodes), "node_index": list(s.node_index), "layers": s.layers,
                    "stage_time_ms": s.time_s * 1e3, "stage_time_s": s.time_s,
                    "throughput_tok_per_s": s.throughput_tok_per_s} for s in p.stages],
    }


def template_from_dict(d: dict[str, Any]) -> Template:
    stages = tuple(Stage(nodes=tuple(s["nodes"]), node_index=tuple(s["node_index"]), layers=int(s["layers"]),
                         time_s=s["stage_time_s"] if "stage_time_s" in s else s["stage_time_ms"] / 1e3, throughput_tok_per_s=s["throughput_tok_per_s"])
                   for s in d["stages"])
    placement = Placement(stages=stages, micro_batch=int(d["micro_batch"]), throughput_tok_per_s=d["throughput_tok_per_s"],
                          latency_s=d["latency_ms"] / 1e3, comm_s=d["comm_ms"] / 1e3)
    return Template(model=d["model"], phase=Phase(d["phase"]), slo_ms=d["slo_ms"], budget_ms=d["budget_ms"],
                    nodes=tuple(d["nodes"]), placement=placement, prompt_tokens=d.get("prompt_tokens"),
                    realized_tok_per_s=d.get("realized_tok_per_s"), decode_tok_per_s=d.get("decode_tok_per_s"),
                    chunk_tokens=None if d.get("chunk_tokens") is None else int(d["chunk_tokens"]))
