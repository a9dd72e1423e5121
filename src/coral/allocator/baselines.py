"""The paper's baselines (DESIGN §4, paper §6.1/§6.7) on the same catalog and templates:
`homo`, `cauchy` and `template-greedy`. Each shares availability sequentially in the
scenario's model order and reports α < 1 when it runs out of nodes."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from coral.allocator.inputs import AllocationInputs, Columns
from coral.allocator.spot_caps import spot_cap_rows
from coral.perf.model import Phase

CAUCHY_MAX_DECODE_PER_PREFILL = 8  # k in a Cauchy GPU combo: 1 prefill replica feeds up to k decode replicas
_TOL = 1e-9


def _efficiency(cols: Columns) -> np.ndarray:
    """Throughput per $ of each column (inf for a free column)."""
    theta = cols.col_theta()
    with np.errstate(divide="ignore"):
        return np.where(cols.price > 0, theta / np.where(cols.price > 0, cols.price, 1.0), np.inf)


def _fits(cols: Columns, j: int, rem: np.ndarray) -> float:
    """Most instances of column `j` the remaining availability allows."""
    u = cols.usage[cols.col_t[j]]
    used = u > 0
    if not used.any():
        return math.inf
    return float(np.floor(np.min(rem[cols.col_r[j], used] / u[used])))


def _take(cols: Columns, j: int, k: int, rem: np.ndarray, nu: np.ndarray) -> None:
    rem[cols.col_r[j]] -= cols.usage[cols.col_t[j]] * k
    nu[j] += k


def _fits_all(cols: Columns, cand: np.ndarray, rem: np.ndarray) -> np.ndarray:
    """Most instances of each candidate column the remaining availability allows."""
    u = cols.usage[cols.col_t[cand]]  # [n, configs]
    r = rem[cols.col_r[cand]]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(u > 0, r / np.where(u > 0, u, 1), np.inf)
    return np.floor(ratio.min(axis=1))


def _uncapped(inputs: AllocationInputs, cols: Columns) -> np.ndarray:
    """Per column, whether a baseline may use it: not under a spot share cap below 1. The
    baselines keep a cap by not renting spot there at all (a cap of 1, the default, leaves every
    spot column open: spot-aware baselines)."""
    ok = np.ones(cols.num_cols, dtype=bool)
    ok[spot_cap_rows(inputs, cols).col] = False
    return ok


def greedy_per_group(inputs: AllocationInputs, cols: Columns, limit: np.ndarray | None = None) -> np.ndarray:
    """`homo` / `template-greedy`: per (model, phase) in the scenario's order, in isolation,
    repeatedly provision the column (region, template) with the most *useful* throughput per $,
    `min(Θ, remaining demand) / price`, until the demand is met; columns whose nodes ran out are
    skipped. Availability is shared in that order.

    While the remaining demand exceeds every column's throughput this is "most throughput per $
    first" (the paper's rule); near the end it prefers a smaller replica over a large one that
    would mostly idle, which keeps the baselines from over-provisioning by a whole big template.

    `limit`: the most instances per column (`Columns.start_limit`: no new start in a spot pool
    that is down); None: no limit.

    Returns:
        instances per column (a new array; `cols` is not modified).
    """
    rem = cols.avail.copy()
    nu = np.zeros(cols.num_cols, dtype=np.int64)
    theta = cols.col_theta()
    grp = cols.group[cols.col_t]
    ok = _uncapped(inputs, cols)
    for gi in range(len(cols.groups)):
        need = float(cols.demand[gi])
        cand = np.flatnonzero((grp == gi) & ok)
        # a fixed order for ties: more throughput, then region / template order
        cand = cand[np.lexsort((cols.col_t[cand], cols.col_r[cand], -theta[cand]))]
        while need > _TOL * cols.demand[gi] and cand.size:
            fits = _fits_all(cols, cand, rem)
            if limit is not None:
                fits = np.minimum(fits, limit[cand] - nu[cand])
            cand = cand[fits >= 1]
            fits = fits[fits >= 1]
            if cand.size == 0:
                break  # out of nodes: this (model, phase) stays short
            useful = np.minimum(theta[cand], need)
            price = cols.price[cand]
            with np.errstate(divide="ignore"):
                score = np.where(price > 0, useful / np.where(price > 0, price, 1.0), np.inf)
            i = int(np.argmax(score))
            j = int(cand[i])
            k = int(min(max(1, math.floor(need / theta[j] + _TOL)), fits[i]))
            _take(cols, j, k, rem, nu)
            need -= k * theta[j]
    return nu


def cauchy(inputs: AllocationInputs, cols: Columns, limit: np.ndarray | None = None) -> np.ndarray:
    """`cauchy`, adapted as in the paper (§6.1): homogeneous single-node replicas per phase.

    Cauchy picks, per phase, the GPU configuration with the best cost-efficiency (throughput
    per $ of that phase's single-node replica), so prefill and decode may run on different
    GPU types, and allocates model by model. Its unit is a GPU combo; following the paper's
    extension, one prefill replica may feed `k` decode replicas (`1 ≤ k ≤ 8`). A combo lives
    in one region (the KV cache moves prefill → decode). Per model, repeatedly:

    1. in every allowed region, take the most cost-efficient prefill and decode columns that
       still have a free node (each chosen by its own phase's efficiency);
    2. pick `k` maximizing the combo's served fraction per $,
       `min(Θ_P/D_P, k·Θ_D/D_D) / (p_P + k·p_D)`, and the region with the best such combo;
    3. provision as many combos as the remaining demand needs (or the nodes allow).

    When one phase is already covered the other is served by lone replicas of its best
    column; when no combo fits anywhere the model stays short (α < 1). `cols` must hold the
    single-node columns only. `limit`: as for `greedy_per_group`; Cauchy plans from scratch, so
    it skips every column with a limit (a spot pool that is down) rather than keep what runs
    there. Returns instances per column.
    """
    rem = cols.avail.copy()
    nu = np.zeros(cols.num_cols, dtype=np.int64)
    eff = _efficiency(cols)
    theta = cols.col_theta()
    grp = cols.group[cols.col_t]
    gidx = {g: i for i, g in enumerate(cols.groups)}
    R = len(inputs.regions)
    ok = _uncapped(inputs, cols)
    if limit is not None:
        ok &= ~np.isfinite(limit)
    for m in inputs.models:
        gp, gd = gidx.get((m, Phase.PREFILL)), gidx.get((m, Phase.DECODE))
        need = {gi: float(cols.demand[gi]) for gi in (gp, gd) if gi is not None}
        if not need:
            continue

        def best(gi: int, r: int, units: int = 1) -> int | None:
            cand = np.flatnonzero((grp == gi) & (cols.col_r == r) & ok)
            cand = cand[np.lexsort((cols.col_t[cand], -theta[cand], -eff[cand]))]
            for j in cand:
                if _fits(cols, int(j), rem) >= units:
                    return int(j)
            return None

        while True:
            open_ = [gi for gi, v in need.items() if v > _TOL * cols.demand[gi]]
            if not open_:
                break
            choice = _cauchy_choice(cols, best, open_, gp, gd, theta, eff, rem, R)
            if choice is None:
                break  # out of nodes: this model stays short
            _, r, jp, jd, k = choice
            if jp is not None and jd is not None:
                assert gp is not None and gd is not None
                units = max(need[gp] / theta[jp], need[gd] / (k * theta[jd]))
                n = min(math.ceil(units - _TOL), _combo_units(cols, jp, jd, k, rem))
                _take(cols, jp, n, rem, nu)
                _take(cols, jd, n * k, rem, nu)
                need[gp] -= n * theta[jp]
                need[gd] -= n * k * theta[jd]
            else:
                j = jp if jp is not None else jd
                assert j is not None
                gi = int(grp[j])
                n = int(min(math.ceil(need[gi] / theta[j] - _TOL), _fits(cols, j, rem)))
                _take(cols, j, n, rem, nu)
                need[gi] -= n * theta[j]
    return nu


def _cauchy_choice(cols: Columns, best: Callable[[int, int], int | None], open_: list[int], gp: int | None,
                   gd: int | None, theta: np.ndarray, eff: np.ndarray, rem: np.ndarray,
                   R: int) -> tuple[float, int, int | None, int | None, int] | None:
    """`cauchy`'s next pick over the regions: (served fraction per $, region, prefill column, decode column,
    decode replicas per prefill), or None when no combo (or lone replica) fits anywhere."""
    choice: tuple[float, int, int | None, int | None, int] | None = None  # (eff, r, jp, jd, k)
    for r in range(R):
        if len(open_) == 2:
            assert gp is not None and gd is not None
            jp, jd = best(gp, r), best(gd, r)
            if jp is None or jd is None:
                continue
            for k in range(1, CAUCHY_MAX_DECODE_PER_PREFILL + 1):
                if not _combo_fits(cols, jp, jd, k, rem):
                    break
                frac = min(theta[jp] / cols.demand[gp], k * theta[jd] / cols.demand[gd])
                cost = cols.price[jp] + k * cols.price[jd]
                e = math.inf if cost <= 0 else frac / cost
                if choice is None or e > choice[0] * (1 + 1e-12):
                    choice = (e, r, jp, jd, k)
        else:
            gi = open_[0]
            j = best(gi, r)
            if j is None:
                continue
            e = eff[j] / cols.demand[gi]
            if choice is None or e > choice[0] * (1 + 1e-12):
                choice = (e, r, j, None, 1) if gi == gp else (e, r, None, j, 1)
    return choice


def _combo_units(cols: Columns, jp: int, jd: int, k: int, rem: np.ndarray) -> int:
    """Most combos (1 × column jp + k × column jd, same region) the remaining nodes allow."""
    u = cols.usage[cols.col_t[jp]] + k * cols.usage[cols.col_t[jd]]
    used = u > 0
    return int(np.floor(np.min(rem[cols.col_r[jp], used] / u[used])))


def _combo_fits(cols: Columns, jp: int, jd: int, k: int, rem: np.ndarray) -> bool:
    return _combo_units(cols, jp, jd, k, rem) >= 1
