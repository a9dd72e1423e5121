"""The spot share caps of the allocation ILP (issue 30, constraint C5): in each spot market, a
model's spot capacity is at most its `spot_share_cap` times its demand, which bounds what one
zone-wide preemption can take."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coral.allocator.inputs import AllocationInputs, Columns


@dataclass(frozen=True, slots=True, kw_only=True)
class CapRows:
    """The spot share caps as rows over the columns: `Σ_j value·ν_j ≤ limit` per row, each row a
    (spot market, demand group) with its model's cap below 1; the terms are (row, column, value)."""

    row: np.ndarray
    col: np.ndarray
    value: np.ndarray
    limit: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.limit.shape[0])


def spot_cap_rows(inputs: AllocationInputs, cols: Columns) -> CapRows:
    """(C5) of the ILP: in each spot market, the capacity a model counts there (`s_j·Θ_j` in its
    primary row, `s_j·Θ_D` in a colocated column's decode row) is at most its `spot_share_cap`
    times the group's demand: what one zone-wide preemption can take."""
    caps = inputs.spot_share_cap or {}
    rows: list[np.ndarray] = []
    colz: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    limits: list[float] = []
    if caps and cols.num_cols:
        r_of = {r: i for i, r in enumerate(inputs.regions)}
        grp = cols.group[cols.col_t]
        cross = cols.cross_group[cols.col_t] if cols.cross_group is not None else np.full(cols.num_cols, -1)
        theta, cross_theta = cols.col_theta(), cols.col_cross_theta()
        for (market, model), cap in sorted(caps.items()):
            in_market = cols.col_r == r_of[market]
            for gi, (m, _) in enumerate(cols.groups):
                if m != model:
                    continue
                prim, sec = np.flatnonzero(in_market & (grp == gi)), np.flatnonzero(in_market & (cross == gi))
                if prim.size + sec.size == 0:
                    continue
                rows.append(np.full(prim.size + sec.size, len(limits)))
                colz.append(np.concatenate([prim, sec]))
                vals.append(np.concatenate([theta[prim], cross_theta[sec]]))
                limits.append(cap * float(cols.demand[gi]))
    return CapRows(row=_cat(rows, np.int64), col=_cat(colz, np.int64), value=_cat(vals, np.float64),
                   limit=np.array(limits, dtype=float))


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

