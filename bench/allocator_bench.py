"""Allocation ILP timing on a synthetic library of the extended scenario's size.

6 models x 2 phases x ~2000 templates, 20 configurations, 3 regions (~72,000 integer columns),
with abundant availability and with availability 75 % above the abundant plan's nodes (DESIGN
§7, extended). Run: `.venv/bin/python bench/allocator_bench.py [--quick]`.
"""
from __future__ import annotations

import math
import random
import statistics
import sys
import time

import numpy as np

from coral.allocator import AllocationInputs, allocate_inputs
from coral.allocator.ilp import formulate
from coral.allocator.inputs import build_columns
from coral.perf.model import Phase
from coral.solver import SolveOptions
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template

REGIONS = ("aws:us-east-1", "aws:us-west-2", "aws:eu-west-1")
GPUS = {"A10G": 1.0, "L4": 0.9, "L40S": 2.2, "A100": 3.5, "H100": 6.0}  # relative throughput per GPU
GPU_PRICE = {"A10G": 1.0, "L4": 0.8, "L40S": 1.9, "A100": 3.7, "H100": 6.5}  # $/h per GPU
CONFIGS = tuple(f"{n}x{g}" for g in GPUS for n in (1, 2, 4, 8))
MODELS = tuple(f"model-{i}" for i in range(6))
PHASES = (Phase.PREFILL, Phase.DECODE)
TEMPLATES_PER_GROUP = 2000
MARGIN = 0.75
OPTIONS = SolveOptions(backend="highs", time_limit_s=60.0, mip_gap=1e-4)


def _template(model: str, phase: Phase, nodes: tuple[str, ...], theta: float) -> Template:
    stage = Stage(nodes=nodes, node_index=tuple(range(len(nodes))), layers=1, time_s=0.01,
                  throughput_tok_per_s=theta)
    return Template(model=model, phase=phase, slo_ms=100.0, budget_ms=100.0, nodes=nodes,
                    placement=Placement(stages=(stage,), micro_batch=1, throughput_tok_per_s=theta,
                                        latency_s=0.01, comm_s=0.0))


def synthetic_inputs(seed: int, *, availability: dict[tuple[str, str], int | None] | None = None) -> AllocationInputs:
    """A random library and market of the extended scenario's size (deterministic per seed)."""
    rng = random.Random(seed)
    prices: dict[tuple[str, str], float] = {}
    for r in REGIONS:
        mult = rng.uniform(0.9, 1.2)
        for c in CONFIGS:
            if rng.random() < 0.9:
                n, g = c.split("x", 1)
                prices[(r, c)] = round(int(n) * GPU_PRICE[g] * mult * rng.uniform(0.9, 1.1), 3)
    templates: dict[tuple[str, Phase], tuple[Template, ...]] = {}
    demand: dict[tuple[str, Phase], float] = {}
    for mi, m in enumerate(MODELS):
        min_gpus = (1, 2, 4, 4, 8, 8)[mi]  # bigger models need more GPUs per replica
        for ph in PHASES:
            eff = {g: v * rng.uniform(0.7, 1.3) for g, v in GPUS.items()}  # per-model, per-phase affinity
            seen: set[tuple[str, ...]] = set()
            out: list[Template] = []
            while len(out) < TEMPLATES_PER_GROUP:
                k = rng.randint(1, 6)
                nodes = tuple(sorted(rng.choice(CONFIGS) for _ in range(k)))
                gpus = sum(int(c.split("x")[0]) for c in nodes)
                if nodes in seen or gpus < min_gpus:
                    continue
                seen.add(nodes)
                power = sum(int(c.split("x")[0]) * eff[c.split("x", 1)[1]] for c in nodes)
                theta = 1000.0 * power * rng.uniform(0.6, 1.0) * (1 - 0.04 * (k - 1)) / min_gpus
                out.append(_template(m, ph, nodes, round(theta, 2)))
            templates[(m, ph)] = tuple(out)
            demand[(m, ph)] = 1000.0 * rng.uniform(30, 120)
    avail = availability if availability is not None else dict.fromkeys(prices)
    return AllocationInputs(models=MODELS, regions=REGIONS, configs=CONFIGS, prices=prices, availability=avail,
                            demand=demand, allowed_regions=dict.fromkeys(MODELS, REGIONS),
                            slo_ms={g: 100.0 for g in demand}, templates=templates, init_s=120.0)


def _case(name: str, inputs: AllocationInputs, repeats: int) -> tuple[dict, object]:
    t0 = time.perf_counter()
    cols = build_columns(inputs)
    form = formulate(inputs, cols, np.zeros(cols.num_cols))
    build_s = time.perf_counter() - t0
    plans = [allocate_inputs(inputs, options=OPTIONS) for _ in range(repeats)]
    solve = [p.solve_s for p in plans]
    last = plans[-1]
    row = {"case": name, "columns": form.model.num_cols, "rows": form.model.num_rows,
           "formulate_s": round(build_s, 3), "median_solve_s": round(statistics.median(solve), 3),
           "gap": last.gap, "status": last.status.value, "cost_usd_per_h": round(last.cost_usd_per_h, 2),
           "alpha": round(last.alpha, 4), "nodes": sum(n.count for n in last.nodes),
           "instances": sum(i.count for i in last.instances)}
    return row, last


def run(quick: bool) -> list[dict]:
    """Time the ILP abundant and tight; one seed when `quick`, three otherwise.

    Returns:
        One dict per (seed, case): columns, rows, formulate_s, median_solve_s, gap, status, cost,
        alpha, nodes, instances.
    """
    rows = []
    for seed in ([0] if quick else [0, 1, 2]):
        base = synthetic_inputs(seed)
        row, plan = _case(f"seed {seed} abundant", base, 1 if quick else 3)
        rows.append(row)
        used = {(n.region, n.config): n.count for n in plan.nodes}  # type: ignore[attr-defined]
        tight = {k: math.ceil((1 + MARGIN) * used[k]) if k in used else 0 for k in base.prices}
        tight_in = synthetic_inputs(seed, availability=dict(tight))
        rows.append(_case(f"seed {seed} tight (+{MARGIN:.0%})", tight_in, 1 if quick else 3)[0])
        # scarcer still: half the abundant plan's nodes -> goodput mode
        scarce = {k: used[k] // 2 for k in used} | {k: 0 for k in base.prices if k not in used}
        rows.append(_case(f"seed {seed} scarce (50%)", synthetic_inputs(seed, availability=dict(scarce)), 1)[0])
    _print(rows)
    return rows


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Allocation ILP (HiGHS, gap 1e-4, limit 60 s)")
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("case", "status") else "right")
    for r in rows:
        table.add_row(*("-" if v is None else (f"{v:.2e}" if k == "gap" else str(v)) for k, v in r.items()))
    Console(width=200).print(table)


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
