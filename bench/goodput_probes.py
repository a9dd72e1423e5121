"""Goodput mode's α-fixed feasibility probes, solver against solver on the same model.

The probe is the model `ilp._alpha_bound_probes` builds: the cost ILP's rows at α fixed, objective 0,
on the columns reduced-cost fixing in the max-α LP keeps for that α. An INFEASIBLE answer proves
α* < α. Each probe is solved, with the same time limit, by
* HiGHS (as goodput mode does),
* CP-SAT with 2 workers (`coral.solver`'s 'cpsat' backend: rows scaled to integers),
* HiGHS with one extra row per (model, phase): `Σ_{j∈g} w_j·ν_j ≥ K_g(α)`, `w` the availability
  rows weighted by the max-α LP's duals and `K_g` that group's least integer cover
  (`bounds.cover`): every plan serving α satisfies it (the Lagrangian bound's per-group term).

Cases: the bench's synthetic scarce seeds 1 and 2 and (when the extended library is cached) real
`extended` at half the abundant plan's nodes, each a little above its best known α. Measured
results are in docs/reference/allocator.md (goodput mode, measured). Run:
`.venv/bin/python bench/goodput_probes.py [--limit 10]`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coral.allocator import AllocationInputs, allocate, allocate_inputs  # noqa: E402
from coral.allocator.bounds import _by_group, _weights, availability_duals, cover  # noqa: E402
from coral.allocator.ilp import _relaxed, _sub_columns, formulate  # noqa: E402
from coral.allocator.inputs import build_columns, build_inputs  # noqa: E402
from coral.solver import CsrMatrix, MilpModel, SolveOptions, solve  # noqa: E402

# (case, α probed): a little above the best α known (extended scarce: α* = 0.520565, proved by
# HiGHS alone in 26 s; seeds 1 and 2: the best plans goodput mode has found, 0.4908 and 0.4808)
PROBES = (("synthetic seed 1", 0.4908 * 1.0055), ("synthetic seed 2", 0.4808 * 1.0077),
          ("synthetic seed 2", 0.4808 * 1.005), ("extended scarce", 0.520565 * 1.005))


def case_inputs(name: str) -> AllocationInputs | None:
    if name == "extended scarce":
        from coral.cache import default_cache_dir
        from coral.experiments.pipeline import prepare
        from coral.scenario import load_scenario
        from coral.templates.library import cache_path, specs_for

        s = load_scenario("extended")
        if not all(cache_path(sp, s.perf, default_cache_dir()).exists() for sp in specs_for(s)):
            return None
        tight = prepare(s, availability="tight")
        abundant = allocate(s, tight.library)
        half = {(n.region, n.config): math.ceil(n.count / 2) for n in abundant.nodes}
        return build_inputs(s, tight.library, availability={k: half.get(k, 0) for k in s.prices})
    import allocator_bench as ab

    seed = int(name.rsplit(" ", 1)[1])
    base = ab.synthetic_inputs(seed)
    used = {(n.region, n.config): n.count for n in allocate_inputs(base, options=ab.OPTIONS).nodes}
    avail = {k: used[k] // 2 for k in used} | {k: 0 for k in base.prices if k not in used}
    return ab.synthetic_inputs(seed, availability=dict(avail))


def probe_models(inputs: AllocationInputs, alpha: float) -> tuple[MilpModel, MilpModel, int, int]:
    """The probe at `alpha`, the same with the per-group cover rows, its columns and all columns."""
    cols = build_columns(inputs)
    n = cols.num_cols
    g = formulate(inputs, cols, np.zeros(n), mode="goodput")
    lp = solve(_relaxed(g).model, SolveOptions(backend="highs"))
    assert lp.reduced_costs is not None and lp.x is not None
    alpha_lp = min(float(lp.objective), 1.0)
    d = -np.asarray(lp.reduced_costs, dtype=float)[:n]
    keep = np.flatnonzero((d <= alpha_lp - alpha + 1e-9 * max(alpha_lp, 1.0)) | (np.asarray(lp.x)[:n] > 1e-9))
    form = formulate(inputs, _sub_columns(cols, keep), np.zeros(keep.size), mode="cost", alpha=alpha)
    feas = replace(form.model, c=np.zeros_like(form.model.c))
    lam = availability_duals(cols, np.zeros(n), lp, maximize=True, alpha_col=n)
    assert lam is not None
    w, _ = _weights(cols, lam)
    theta = cols.throughput[cols.col_t]
    ub = g.model.col_upper[:n]
    groups = _by_group(cols)
    K = np.array([cover(w[idx], theta[idx], ub[idx], alpha * float(cols.demand[gi]))[0]
                  for gi, idx in enumerate(groups)])
    wk, gk = w[keep], cols.group[cols.col_t[keep]]
    nz = np.flatnonzero(wk > 0)
    A0, R = feas.A, feas.A.shape[0]
    A = CsrMatrix.from_coo(np.concatenate([A0.data, wk[nz]]), np.concatenate([A0.row_of(), R + gk[nz]]),
                           np.concatenate([A0.indices, nz]), shape=(R + len(groups), feas.num_cols))
    cut = replace(feas, A=A, row_lower=np.concatenate([feas.row_lower, K * (1 - 1e-9)]),
                  row_upper=np.concatenate([feas.row_upper, np.full(len(groups), np.inf)]))
    return feas, cut, keep.size, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=float, default=10.0, help="seconds per solve (default 10)")
    args = ap.parse_args()
    print(f"{'case':18s} {'alpha':>9s} {'columns':>11s} {'solver':14s} {'result':11s} {'s':>6s}  load")
    inputs: dict[str, AllocationInputs | None] = {}
    for name, alpha in PROBES:
        if name not in inputs:
            inputs[name] = case_inputs(name)
        inp = inputs[name]
        if inp is None:
            print(f"{name:18s} skipped: the extended library is not cached")
            continue
        feas, cut, k, n = probe_models(inp, alpha)
        for label, model, opts in (
                ("HiGHS", feas, SolveOptions(backend="highs", time_limit_s=args.limit, mip_gap=5e-3)),
                ("CP-SAT (2)", feas, SolveOptions(backend="cpsat", time_limit_s=args.limit, mip_gap=5e-3,
                                                  threads=2)),
                ("HiGHS + covers", cut, SolveOptions(backend="highs", time_limit_s=args.limit, mip_gap=5e-3))):
            t = time.perf_counter()
            res = solve(model, opts)
            print(f"{name:18s} {alpha:9.6f} {f'{k}/{n}':>11s} {label:14s} {res.status.value:11s} "
                  f"{time.perf_counter() - t:6.2f}  {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
