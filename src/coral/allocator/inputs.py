"""Validated inputs of one allocation (demand, prices, availability, region rules, templates)
and their column view: one candidate column per usable (region, template) pair, as arrays."""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np

from coral.errors import CoralError, unknown
from coral.perf.model import Phase
from coral.scenario import Scenario
from coral.templates.template import Template, TemplateLibrary

PHASES: tuple[Phase, Phase] = (Phase.PREFILL, Phase.DECODE)
HORIZON_S = 3600.0  # `H`: the start-up penalty is amortized over one hour (DESIGN §4)

Group = tuple[str, Phase]  # (model, phase)


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationInputs:
    """Everything one allocation reads, checked once.

    `availability` maps every sold (region, config) to a node count, or None for unbounded
    (used internally for the abundant plan behind `tight_availability`). `prices` holds only
    sold pairs. `demand` has an entry for every (model, phase) of `models`.
    """

    models: tuple[str, ...]
    regions: tuple[str, ...]
    configs: tuple[str, ...]
    prices: Mapping[tuple[str, str], float]
    availability: Mapping[tuple[str, str], int | None]
    demand: Mapping[Group, float]
    allowed_regions: Mapping[str, tuple[str, ...]]
    slo_ms: Mapping[Group, float]
    templates: Mapping[Group, tuple[Template, ...]]
    init_s: float
    horizon_s: float = HORIZON_S
    epoch_s: float = HORIZON_S  # the re-planning period: a stopped instance's overlap is paid within it
    nearest_latency_ms: Mapping[Group, float] | None = None
    explain: Callable[[Group], str] | None = None  # why a group may have no template (budget, quantile, best latency)

    @property
    def groups(self) -> tuple[Group, ...]:
        return tuple((m, p) for m in self.models for p in PHASES)


def _phase(value: Any, field: str) -> Phase:
    if isinstance(value, Phase):
        return value
    try:
        return Phase(str(value))
    except ValueError:
        raise CoralError(f"{field}: unknown phase {value!r}; valid: prefill, decode") from None


def _finite_nonneg(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise CoralError(f"{field} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise CoralError(f"{field} must be a finite number >= 0, got {value!r}")
    return v


def _node_count(value: Any, field: str) -> int:
    v = _finite_nonneg(value, field)
    if isinstance(value, Integral):
        return int(value)
    if v != math.floor(v):
        raise CoralError(f"{field} must be a whole number of nodes, got {value!r}")
    return int(v)


def build_inputs(scenario: Scenario, library: TemplateLibrary, *,
                 demand: Mapping[tuple[str, Phase | str], float] | None = None,
                 availability: Mapping[tuple[str, str], int] | None = None,
                 unbounded: bool = False,
                 nearest_latency_ms: Mapping[tuple[str, Phase | str], float] | None = None) -> AllocationInputs:
    """Check and gather the inputs of one allocation.

    Args:
        scenario: models (order, SLOs, nominal demand, region restrictions), prices, availability.
        library: the templates.
        demand: tokens/s per (model, phase) replacing the planned capacity of
            `coral.allocator.demand.capacity_targets` (the queueing model on the scenario's traffic
            sample); pairs not given keep that value.
        availability: nodes per (region, config) replacing the scenario's; pairs not given keep it.
        unbounded: ignore availability altogether (the abundant plan).
        nearest_latency_ms: per (model, phase), the latency of the closest template that missed
            the SLO, quoted when a model has no template.

    Raises:
        CoralError: a negative / NaN / infinite demand, price or availability (naming the
            field), an unknown model, phase, region or configuration.
    """
    models = tuple(m.name for m in scenario.models)
    regions = tuple(scenario.regions)
    prices: dict[tuple[str, str], float] = {}
    for (r, c), p in scenario.prices.items():
        prices[(r, c)] = _finite_nonneg(p, f"prices[{r}, {c}]")
    configs = tuple(dict.fromkeys([c.name for c in scenario.configs] + [c for _, c in prices]))

    avail: dict[tuple[str, str], int | None] = {}
    for key in prices:
        avail[key] = None if unbounded else _node_count(scenario.availability.get(key, 0),
                                                         f"availability[{key[0]}, {key[1]}]")
    if availability is not None and not unbounded:
        for key, n in availability.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise CoralError(f"availability keys must be (region, config) pairs, got {key!r}")
            r, c = key
            if r not in regions:
                raise unknown("region", r, regions)
            if c not in configs:
                raise unknown("configuration", c, configs)
            count = _node_count(n, f"availability[{r}, {c}]")
            if key in prices:
                avail[key] = count
            elif count:
                raise CoralError(f"availability[{r}, {c}] = {count}, but {c} has no price in {r}")

    dem: dict[Group, float] = {}
    slo: dict[Group, float] = {}
    allowed: dict[str, tuple[str, ...]] = {}
    given = {(k[0], _phase(k[1], f"demand[{k[0]}, {k[1]}]")) for k in demand} if demand is not None else set()
    missing = [(m.name, ph) for m in scenario.models for ph in PHASES if (m.name, ph) not in given]
    if missing:
        from coral.allocator.demand import capacity_targets

        targets = capacity_targets(scenario, library=library)
    for m in scenario.models:
        allowed[m.name] = tuple(m.regions) if m.regions else regions
        for ph in PHASES:
            if (m.name, ph) in missing:
                dem[(m.name, ph)] = _finite_nonneg(targets[(m.name, ph)].capacity_tok_per_s,
                                                   f"demand[{m.name}, {ph.value}]")
            slo[(m.name, ph)] = m.slo_ms(ph)
    if demand is not None:
        for key, value in demand.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise CoralError(f"demand keys must be (model, phase) pairs, got {key!r}")
            name, ph = key[0], _phase(key[1], f"demand[{key[0]}, {key[1]}]")
            if name not in models:
                raise unknown("model", name, models)
            dem[(name, ph)] = _finite_nonneg(value, f"demand[{name}, {ph.value}]")

    near: dict[Group, float] | None = None
    if nearest_latency_ms is not None:
        near = {(k[0], _phase(k[1], "nearest_latency_ms")): float(v) for k, v in nearest_latency_ms.items()}

    templates = {g: tuple(library.of(*g)) for g in dem}
    return AllocationInputs(models=models, regions=regions, configs=configs, prices=prices, availability=avail,
                            demand=dem, allowed_regions=allowed, slo_ms=slo, templates=templates,
                            init_s=_finite_nonneg(scenario.planner.init_s, "planner.init_s"),
                            epoch_s=float(scenario.planner.epoch_s),
                            nearest_latency_ms=near, explain=_explainer(scenario))


def _explainer(scenario: Scenario) -> Callable[[Group], str] | None:
    """What to say when a (model, phase) has no template: the budget its templates were held to,
    at which length, and the best any node reaches (computed only then)."""
    if not scenario.configs:
        return None

    def explain(g: Group) -> str:
        from coral.scenario.traffic import fastest_latency_ms, length_summary, template_budget_ms

        try:
            budget = template_budget_ms(scenario, g[0], g[1])
            best, cfg, prompt = fastest_latency_ms(scenario, g[0], g[1])
            q = length_summary(scenario, g[0]).quantile
        except (CoralError, ValueError, KeyError):
            return "its templates are held to the budget of coral.templates.budget"
        at = f"the p{q * 100:g} prompt ({prompt:,.0f} tokens)" if g[1] is Phase.PREFILL else "the mean context"
        return (f"templates must reach {at} within a {budget:.4g} ms budget; the fastest node, {cfg}, "
                f"takes {best:.4g} ms")

    return explain


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Columns:
    """Candidate columns: one per (region, template) where every config of the template is sold
    in the region, the model may run there, and at least one instance fits the availability.

    Per template `t` (templates of groups with demand > 0): `usage[t, c] = U_c(τ)`,
    `throughput[t] = Θ(τ)`, `group[t]`. Per column `j`: `col_t[j]`, `col_r[j]`,
    `price[j] = p_r(τ)`, `ub[j]` the most instances the availability allows (inf: unbounded).
    """

    groups: tuple[Group, ...]
    demand: np.ndarray  # per group
    templates: tuple[Template, ...]
    group: np.ndarray
    usage: np.ndarray
    throughput: np.ndarray
    col_t: np.ndarray
    col_r: np.ndarray
    price: np.ndarray
    ub: np.ndarray
    avail: np.ndarray  # (R, C) nodes, inf: unbounded, 0 where not sold
    sold: np.ndarray  # (R, C) bool

    @property
    def num_cols(self) -> int:
        return int(self.col_t.shape[0])


def _no_template(inputs: AllocationInputs, g: Group, why: str) -> CoralError:
    m, ph = g
    msg = (f"model {m}, phase {ph.value}: {why} (SLO {inputs.slo_ms[g]:g} ms, "
           f"demand {inputs.demand[g]:.6g} tok/s)")
    near = (inputs.nearest_latency_ms or {}).get(g)
    if near is not None:
        msg += f"; the closest template's latency is {near:g} ms"
    if inputs.explain is not None:
        msg += f"; {inputs.explain(g)}"
    return CoralError(msg + "; relax the SLO, lower slo_attainment, add configurations or raise n_max / rho")


_ARRAYS: OrderedDict[int, tuple[tuple[Template, ...], list[str], np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()


def _group_arrays(ts: tuple[Template, ...]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """One group's templates as arrays: node names (a local list), each node as an index into it,
    nodes per template and throughputs. Memoized per tuple (kept alive by the memo, so its id is
    stable; the 64 most recent)."""
    hit = _ARRAYS.get(id(ts))
    if hit is not None and hit[0] is ts:
        _ARRAYS.move_to_end(id(ts))
        return hit[1], hit[2], hit[3], hit[4]
    local: dict[str, int] = {}
    lengths = np.fromiter((len(t.nodes) for t in ts), dtype=np.int64, count=len(ts))
    codes = np.fromiter((local.setdefault(n, len(local)) for t in ts for n in t.nodes), dtype=np.int64,
                        count=int(lengths.sum()))
    throughput = np.fromiter((t.throughput_tok_per_s for t in ts), dtype=float, count=len(ts))
    names = list(local)
    _ARRAYS[id(ts)] = (ts, names, codes, lengths, throughput)
    while len(_ARRAYS) > 64:
        _ARRAYS.popitem(last=False)
    return names, codes, lengths, throughput


def build_columns(inputs: AllocationInputs, *, keep: Any = None) -> Columns:
    """Build the column arrays (vectorized over regions and templates).

    Args:
        inputs: checked inputs.
        keep: optional predicate on a Template (e.g. single-node only, for the baselines).

    Raises:
        CoralError: a (model, phase) with demand > 0 has no template, or none that can run in
            any of its allowed regions (names model, phase and SLO).
    """
    cfg_index = {c: i for i, c in enumerate(inputs.configs)}
    reg_index = {r: i for i, r in enumerate(inputs.regions)}
    R, C = len(inputs.regions), len(inputs.configs)
    price_rc = np.zeros((R, C))
    sold = np.zeros((R, C), dtype=bool)
    avail = np.zeros((R, C))
    for (r, c), p in inputs.prices.items():
        i, k = reg_index[r], cfg_index[c]
        price_rc[i, k] = p
        sold[i, k] = True
        a = inputs.availability.get((r, c), 0)
        avail[i, k] = math.inf if a is None else a

    groups = tuple(g for g in inputs.groups if inputs.demand[g] > 0)
    tuple_groups: list[tuple[Template, ...]] = []
    for g in groups:
        ts = tuple(inputs.templates.get(g, ()))
        if keep is not None:
            ts = tuple(t for t in ts if keep(t))
        if not ts:
            raise _no_template(inputs, g, "no template meets the SLO" if keep is None
                               else "no template of the kind this method uses (single-node) meets the SLO")
        tuple_groups.append(ts)
    templates = tuple(t for ts in tuple_groups for t in ts)
    T = len(templates)
    # Node counts per (template, config), vectorized: a library can hold ~10^6 templates, and its
    # per-group arrays are memoized (the simulator re-plans with the same library every epoch).
    parts = [_group_arrays(ts) for ts in tuple_groups]
    lengths = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    codes = (np.concatenate([np.array([cfg_index.get(n, -1) for n in p[0]] or [-1], dtype=np.int64)[p[1]]
                             for p in parts]) if parts else np.zeros(0, dtype=np.int64))
    owner = np.repeat(np.arange(T, dtype=np.int64), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # every template has >= 1 node
    unknown_cfg = np.zeros(T, dtype=bool)
    unknown_cfg[owner[codes < 0]] = True  # a config the scenario does not know: never usable
    ok = codes >= 0
    usage = np.bincount(owner[ok] * C + codes[ok], minlength=T * C).reshape(T, C).astype(np.int64, copy=False)
    throughput = np.concatenate([p[3] for p in parts]) if parts else np.zeros(0)
    group = np.repeat(np.arange(len(groups), dtype=np.int64), [len(ts) for ts in tuple_groups])
    if np.any(~np.isfinite(throughput)) or np.any(throughput <= 0):
        raise CoralError("every template needs a finite throughput > 0")

    # model -> allowed region mask, per group
    allowed = np.zeros((len(groups), R), dtype=bool)
    for gi, (m, _) in enumerate(groups):
        for r in inputs.allowed_regions[m]:
            allowed[gi, reg_index[r]] = True

    col_t, col_r, col_price, col_ub = [], [], [], []
    used = usage > 0
    price_t = usage.astype(float) @ price_rc.T  # [template, region] (float: BLAS, ~50x an int product)
    for ri in range(R):
        runnable = ~unknown_cfg & ~np.any(used[:, ~sold[ri]], axis=1) & allowed[group, ri]
        # Instances that fit the availability: min over a template's nodes of avail / count.
        ub = np.full(T, np.inf)
        if T:
            per_node = np.where(ok, avail[ri, np.maximum(codes, 0)] / np.maximum(usage[owner, np.maximum(codes, 0)], 1),
                                np.inf)
            ub = np.floor(np.minimum.reduceat(per_node, starts))
        idx = np.flatnonzero(runnable)
        col_t.append(idx)
        col_r.append(np.full(idx.shape[0], ri, dtype=np.int64))
        col_price.append(price_t[idx, ri])
        col_ub.append(ub[idx])
    col_t_a = np.concatenate(col_t) if col_t else np.zeros(0, dtype=np.int64)
    col_r_a = np.concatenate(col_r) if col_r else np.zeros(0, dtype=np.int64)
    price_a = np.concatenate(col_price) if col_price else np.zeros(0)
    ub_a = np.concatenate(col_ub) if col_ub else np.zeros(0)

    runnable_groups = np.zeros(len(groups), dtype=bool)
    runnable_groups[group[col_t_a]] = True
    for bad_g in np.flatnonzero(~runnable_groups):
        g = groups[int(bad_g)]
        raise _no_template(inputs, g, f"none of its {int(np.sum(group == bad_g))} templates can run in its "
                                      f"regions ({', '.join(inputs.allowed_regions[g[0]])}): some "
                                      "configuration of each is not sold there")
    fits = ub_a >= 1
    return Columns(groups=groups, demand=np.array([inputs.demand[g] for g in groups], dtype=float),
                   templates=templates, group=group, usage=usage, throughput=throughput,
                   col_t=col_t_a[fits], col_r=col_r_a[fits], price=price_a[fits], ub=ub_a[fits],
                   avail=avail, sold=sold)
