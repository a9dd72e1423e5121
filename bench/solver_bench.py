"""Time HiGHS vs CP-SAT on the placement ILP (both formulations): seeded 6-node, 64-layer
problems from the roofline model (Qwen3-32B decode), every pipeline depth S.

Run: `.venv/bin/python bench/solver_bench.py [--quick]`.
"""
from __future__ import annotations

import argparse
import random
import time

from coral.catalog import builtin_catalog, builtin_model
from coral.perf import Phase, RooflinePerf
from coral.solver import SolveOptions
from coral.templates.ilp import solve_placement_ilp
from coral.templates.problem import build_problem

CONFIGS = ("1xL40S", "1xL4", "2xL4", "1xA10G", "4xA10G", "1xA100-40GB", "1xT4", "2xT4", "1xV100-16GB")
COMBOS = (("highs", "tight"), ("highs", "paper"), ("cpsat", "tight"), ("cpsat", "paper"))


def instances(quick: bool) -> list[tuple[int, list[str]]]:
    """Seeded multisets of 6 node configurations."""
    seeds = [0] if quick else [0, 1]
    return [(seed, sorted(random.Random(seed).choices(CONFIGS, k=6))) for seed in seeds]


def run(quick: bool) -> list[dict]:
    """Solve every (instance, S, backend, formulation); one row each.

    Args:
        quick: one instance and a 5 s limit per solve (else two instances, 20 s).

    Returns:
        Rows with seed, nodes, S, backend, formulation, status, throughput, gap, wall_s.
    """
    limit = 5.0 if quick else 20.0
    catalog, model, perf = builtin_catalog(), builtin_model("qwen3-32b"), RooflinePerf()
    rows: list[dict] = []
    for seed, names in instances(quick):
        configs = [catalog.config(n) for n in names]
        for stages in range(1, len(configs) + 1):
            problem = build_problem(perf, model, Phase.DECODE, configs, stages=stages, batch=16,
                                    prompt_tokens=1024, output_tokens=256, budget_ms=250)
            for backend, formulation in COMBOS:
                start = time.perf_counter()
                placement, result = solve_placement_ilp(
                    problem, SolveOptions(backend=backend, time_limit_s=limit, mip_gap=1e-6), formulation)
                rows.append({
                    "seed": seed, "nodes": ",".join(names), "S": stages, "backend": backend,
                    "formulation": formulation, "status": result.status.value,
                    "throughput": placement.throughput_tok_per_s if placement else None,
                    "gap": result.gap, "wall_s": time.perf_counter() - start,
                })
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'seed':>4} {'S':>2} {'backend':>7} {'form':>6} {'status':>10} {'tok/s':>12} {'gap':>9} {'wall_s':>7}"]
    for r in rows:
        thr = f"{r['throughput']:.4f}" if r["throughput"] is not None else "-"
        lines.append(f"{r['seed']:>4} {r['S']:>2} {r['backend']:>7} {r['formulation']:>6} {r['status']:>10} "
                     f"{thr:>12} {r['gap']:>9.2e} {r['wall_s']:>7.2f}")
    lines.append("")
    lines.append("total wall_s per backend/formulation (worst single solve):")
    for backend, formulation in COMBOS:
        mine = [r for r in rows if r["backend"] == backend and r["formulation"] == formulation]
        solved = sum(r["status"] in ("optimal", "infeasible") for r in mine)
        lines.append(f"  {backend:>5} {formulation:>5}: {sum(r['wall_s'] for r in mine):8.2f} s "
                     f"(max {max(r['wall_s'] for r in mine):6.2f} s), proved {solved}/{len(mine)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one instance, 5 s per solve")
    args = parser.parse_args()
    for seed, names in instances(args.quick):
        print(f"instance {seed}: {', '.join(names)}")
    print(table(run(args.quick)))


if __name__ == "__main__":
    main()
