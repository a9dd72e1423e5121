"""Validated inputs of one allocation (demand, prices, availability, region rules, templates)
and their column view: one candidate column per usable (region, template) pair, as arrays."""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np

from coral.allocator.demand import capacity_targets
from coral.allocator.spot import add_spot_markets, base_region, share_table, spot_region
from coral.catalog.spot import SpotProcess
from coral.errors import CoralError, unknown
from coral.perf.model import Phase
from coral.scenario import Scenario
from coral.templates.planning import no_template_explainer
from coral.templates.table import TemplateTable
from coral.templates.template import ChainedTemplates, Template, TemplateLibrary

PHASES: tuple[Phase, Phase] = (Phase.PREFILL, Phase.DECODE)
#: How a model may be served (`coral plan --mode`): "auto" lets the ILP choose per model between
#: disaggregated templates and colocated ones; the other two force one kind for every model.
MODES = ("auto", "disagg", "colocated")
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
    templates: Mapping[Group, Sequence[Template]]
    init_s: float
    horizon_s: float = HORIZON_S
    epoch_s: float = HORIZON_S  # the re-planning period: a stopped instance's overlap is paid within it
    nearest_latency_ms: Mapping[Group, float] | None = None
    explain: Callable[[Group], str] | None = None  # why a group may have no template (budget, quantile, best latency)
    mode: str = "auto"  # one of MODES; `templates` holds (model, COLOCATED) groups beside the demand groups
    colocated_notes: Mapping[str, tuple[str, ...]] | None = None  # per model: the nodes it is not colocatable on
    model_modes: Mapping[str, str] | None = None  # per model, a mode overriding `mode` (the mix repair)
    # Spot (issue 30): each region with spot offers has a second market, `spot_region(r)`, in
    # `regions`, `prices`, `availability` and `allowed_regions`; `spot` holds its process, and
    # `spot_share_cap` each model's cap there, (spot market, model) -> share (only caps below 1).
    spot: Mapping[str, SpotProcess] | None = None
    spot_share_cap: Mapping[tuple[str, str], float] | None = None
    # (spot market, config) pools a preemption took and that are not back: no spot instance using
    # one may start (a column's count stays at most its running count); what runs there stays
    spot_down: frozenset[tuple[str, str]] = frozenset()

    def __post_init__(self) -> None:
        for m in (self.mode, *(self.model_modes or {}).values()):
            if m not in MODES:
                raise CoralError(f"unknown mode {m!r}; valid: {', '.join(MODES)}")

    def mode_of(self, model: str) -> str:
        """`model`'s mode: its entry in `model_modes`, else `mode`."""
        return (self.model_modes or {}).get(model, self.mode)

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


def _availability(scenario: Scenario, prices: Mapping[tuple[str, str], float], regions: tuple[str, ...],
                  configs: tuple[str, ...], availability: Mapping[tuple[str, str], int] | None,
                  unbounded: bool) -> dict[tuple[str, str], int | None]:
    """Nodes per priced (region, config): the scenario's, `availability`'s where given, None if
    unbounded. A spot market has its region's on-demand count (the scenario's, or `availability`'s
    for the region) unless `availability` names the spot market itself."""
    avail: dict[tuple[str, str], int | None] = {}
    for key in prices:
        base = (base_region(key[0]), key[1])
        avail[key] = None if unbounded else _node_count(scenario.availability.get(base, 0),
                                                         f"availability[{base[0]}, {base[1]}]")
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
                twin = (spot_region(r), c)
                if twin in prices and twin not in availability:
                    avail[twin] = count
            elif count:
                raise CoralError(f"availability[{r}, {c}] = {count}, but {c} has no price in {r}")
    return avail


def build_inputs(scenario: Scenario, library: TemplateLibrary, *,
                 demand: Mapping[tuple[str, Phase | str], float] | None = None,
                 availability: Mapping[tuple[str, str], int] | None = None,
                 unbounded: bool = False,
                 nearest_latency_ms: Mapping[tuple[str, Phase | str], float] | None = None,
                 mode: str = "auto", spot_down: Collection[tuple[str, str]] = ()) -> AllocationInputs:
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
        mode: one of `MODES`: which template kinds the allocation may use.
        spot_down: (region, config) spot pools that cannot be had now (lost to a preemption and
            not back yet): no spot instance using one may start; the running ones stay.

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
    spot_markets, processes, caps = add_spot_markets(scenario, regions, prices)

    avail = _availability(scenario, prices, regions + spot_markets, configs, availability, unbounded)
    down = frozenset((spot_region(r), c) for r, c in spot_down if (spot_region(r), c) in prices)

    dem: dict[Group, float] = {}
    slo: dict[Group, float] = {}
    allowed: dict[str, tuple[str, ...]] = {}
    given = {(k[0], _phase(k[1], f"demand[{k[0]}, {k[1]}]")) for k in demand} if demand is not None else set()
    missing = [(m.name, ph) for m in scenario.models for ph in PHASES if (m.name, ph) not in given]
    if missing:
        targets = capacity_targets(scenario, library=library)
    for m in scenario.models:
        allowed[m.name] = tuple(m.regions) if m.regions else regions
        allowed[m.name] += tuple(spot_region(r) for r in allowed[m.name] if spot_region(r) in processes)
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

    if mode not in MODES:
        raise CoralError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    templates = {g: library.of(*g) for g in dem}  # as the library holds them (lazy columnar tables stay lazy)
    templates.update({(m, Phase.COLOCATED): library.of(m, Phase.COLOCATED) for m in models})
    notes = {st.model: st.notes for st in library.stats if st.phase is Phase.COLOCATED}
    return AllocationInputs(mode=mode, colocated_notes=notes, models=models, regions=regions + spot_markets,
                            configs=configs, prices=prices, availability=avail, spot=processes, spot_share_cap=caps,
                            spot_down=down,
                            demand=dem, allowed_regions=allowed, slo_ms=slo, templates=templates,
                            init_s=_finite_nonneg(scenario.planner.init_s, "planner.init_s"),
                            epoch_s=float(scenario.planner.epoch_s),
                            nearest_latency_ms=near, explain=no_template_explainer(scenario))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Columns:
    """Candidate columns: one per (region, template) where every config of the template is sold
    in the region, the model may run there, and at least one instance fits the availability.

    Per template `t` (templates of groups with demand > 0): `usage[t, c] = U_c(τ)`,
    `throughput[t] = Θ(τ)`, `group[t]`. Per column `j`: `col_t[j]`, `col_r[j]`,
    `price[j] = p_r(τ)`, `ub[j]` the most instances the availability allows (inf: unbounded).
    `templates` is lazy: a template object is made only when a plan uses it.
    """

    groups: tuple[Group, ...]
    demand: np.ndarray  # per group
    templates: Sequence[Template]
    group: np.ndarray
    usage: np.ndarray
    throughput: np.ndarray
    col_t: np.ndarray
    col_r: np.ndarray
    price: np.ndarray
    ub: np.ndarray
    avail: np.ndarray  # (R, C) nodes, inf: unbounded, 0 where not sold
    sold: np.ndarray  # (R, C) bool
    group_start: np.ndarray | None = None  # per group, its first template's index (None: unknown)
    theta_block: np.ndarray | None = None  # per template: rank of Θ within its table, descending,
    # equal Θ sharing one rank, numbered across tables (table-major); see frontier_columns
    # Colocated templates serve two demand rows: `group` is the model's prefill row (Θ = Θ_P) and
    # `cross_group` its decode row, with `cross_throughput` = Θ_D (-1 and 0 for other templates).
    cross_group: np.ndarray | None = None
    cross_throughput: np.ndarray | None = None
    table: np.ndarray | None = None  # per template: its table (a demand group's, or a model's colocated one)
    table_keys: tuple[tuple[str, Phase], ...] | None = None  # per table: (model, phase), phase COLOCATED for those
    # Spot: per region (market) and node count, the share of a template's capacity the plan counts
    # (`coral.allocator.spot.share_table`; None: no spot market, every share is 1), and per
    # template its node count. Per (region, template) rather than per column, so that a subset
    # of the columns (`col_t`, `col_r`, ...) needs nothing else kept in step.
    spot_share: np.ndarray | None = None
    nodes_of: np.ndarray | None = None
    market_spot: np.ndarray | None = None  # per region (market): a spot market (None: none is)
    down_rc: np.ndarray | None = None  # (R, C): a spot pool that is down (`AllocationInputs.spot_down`)

    @property
    def num_cols(self) -> int:
        return int(self.col_t.shape[0])

    def col_share(self) -> np.ndarray:
        """Per column, the share of its template's capacity the plan counts (1 on-demand)."""
        if self.spot_share is None or self.nodes_of is None:
            return np.ones(self.num_cols)
        return self.spot_share[self.col_r, self.nodes_of[self.col_t]]

    def col_theta(self) -> np.ndarray:
        """Per column, the capacity one instance counts for in its primary row: `s_j·Θ(τ_j)`."""
        theta = self.throughput[self.col_t]
        return theta if self.spot_share is None else theta * self.col_share()

    def col_cross_theta(self) -> np.ndarray:
        """Per column, what one instance counts for in its second row (`s_j·Θ_D` of a colocated
        template; 0 for the others)."""
        if self.cross_throughput is None:
            return np.zeros(self.num_cols)
        theta = self.cross_throughput[self.col_t]
        return theta if self.spot_share is None else theta * self.col_share()

    def col_no_start(self) -> np.ndarray:
        """Per column, whether no new instance of it may start: it uses a spot pool that is down."""
        if self.down_rc is None:
            return np.zeros(self.num_cols, dtype=bool)
        return np.any((self.usage[self.col_t] > 0) & self.down_rc[self.col_r], axis=1)

    def start_limit(self, nu_prev: np.ndarray) -> np.ndarray:
        """Per column, the most instances a plan may have for lack of new starts: `ν^prev` where
        it uses a spot pool that is down, else unbounded."""
        return np.where(self.col_no_start(), nu_prev, np.inf)

    def col_spot(self) -> np.ndarray:
        """Per column, whether it rents spot nodes."""
        if self.market_spot is None:
            return np.zeros(self.num_cols, dtype=bool)
        return self.market_spot[self.col_r]

    def template_index(self, key: str) -> int | None:
        """The index into `templates` of the template with this `Template.key`, or None."""
        parsed = parse_key(key)
        if parsed is None or self.group_start is None:
            return None
        model, phase, nodes = parsed
        try:
            gi = (self.table_keys or self.groups).index((model, phase))
        except ValueError:
            return None
        assert isinstance(self.templates, ChainedTemplates)
        row = find_template(self.templates.parts[gi], nodes)
        return None if row is None else int(self.group_start[gi]) + row


def parse_key(key: str) -> tuple[str, Phase, tuple[str, ...]] | None:
    """`Template.key` (`model/phase/node+node`) back into its parts, or None when malformed."""
    parts = key.rsplit("/", 2)
    if len(parts) != 3 or not parts[2]:
        return None
    try:
        phase = Phase(parts[1])
    except ValueError:
        return None
    return parts[0], phase, tuple(parts[2].split("+"))


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


_TABLES: OrderedDict[int, tuple[Sequence[Template], TemplateTable]] = OrderedDict()


def _table(ts: Sequence[Template]) -> TemplateTable | _Rows:
    """A group's templates as a table with arrays: the library's own table, or one made once for
    a plain sequence (memoized per sequence, kept alive by the memo so its id is stable; the 64
    most recent)."""
    if isinstance(ts, TemplateTable | _Rows):
        return ts
    hit = _TABLES.get(id(ts))
    if hit is not None and hit[0] is ts:
        _TABLES.move_to_end(id(ts))
        return hit[1]
    table = TemplateTable(model=ts[0].model if len(ts) else "", phase=ts[0].phase if len(ts) else Phase.PREFILL,
                          objects=ts)
    _TABLES[id(ts)] = (ts, table)
    while len(_TABLES) > 64:
        _TABLES.popitem(last=False)
    return table


class _Rows(Sequence[Template]):
    """Some rows of a table (the templates a filter kept), with the same arrays and lookup."""

    def __init__(self, base: TemplateTable | _Rows, rows: np.ndarray) -> None:
        self.base, self.rows = base, rows
        self.phase: Phase = base.phase
        names, usage, theta = base.arrays()
        self._arrays = (names, usage[rows], theta[rows])

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.base[int(self.rows[i])]

    def arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        return self._arrays

    def decode_rates(self) -> np.ndarray:
        return self.base.decode_rates()[self.rows]

    def find(self, nodes: Sequence[str]) -> int | None:
        row = self.base.find(nodes)
        if row is None:
            return None
        pos = int(np.searchsorted(self.rows, row))
        return pos if pos < self.rows.shape[0] and self.rows[pos] == row else None


_AT_MOST: OrderedDict[tuple[int, int], tuple[Sequence[Template], _Rows]] = OrderedDict()


def _at_most(table: TemplateTable | _Rows, max_nodes: int) -> _Rows:
    """The table's templates of at most `max_nodes` nodes (memoized like `_table`, so the
    layout built on them is reused too)."""
    hit = _AT_MOST.get((id(table), max_nodes))
    if hit is not None and hit[0] is table:
        return hit[1]
    rows = _Rows(table, np.flatnonzero(table.arrays()[1].sum(axis=1, dtype=np.int64) <= max_nodes))
    _AT_MOST[(id(table), max_nodes)] = (table, rows)
    while len(_AT_MOST) > 64:
        _AT_MOST.popitem(last=False)
    return rows


def find_template(ts: Sequence[Template], nodes: Sequence[str]) -> int | None:
    """The index in `ts` (a group's templates) of the template on exactly `nodes`, or None."""
    return _table(ts).find(nodes)


def _market(inputs: AllocationInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (region, config): the price, whether it is sold there, and the nodes available (inf: unbounded)."""
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
    return price_rc, sold, avail


def _region_columns(lay: _Layout, group: np.ndarray, price_rc: np.ndarray, sold: np.ndarray, avail: np.ndarray,
                    allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (template, region) column that can run: its template, region, price and instance bound."""
    col_t, col_r, col_price, col_ub = [], [], [], []
    ent_c, ent_u, starts = lay.ent_c, lay.ent_u, lay.ent_start
    T = lay.num_templates
    for ri in range(price_rc.shape[0]):
        # Per region, a gather over the (template, config) entries with U_c(τ) > 0 and one
        # reduction per template: runnable where every config is sold and the model may run
        # here; price `Σ_c p_r(c)·U_c(τ)`; instances that fit, `min_c ⌊A_r(c) / U_c(τ)⌋`.
        if T and ent_c.size:
            runnable = np.logical_and.reduceat(sold[ri, ent_c], starts) & lay.usable & allowed[group, ri]
            idx = np.flatnonzero(runnable)
            price = np.add.reduceat(price_rc[ri, ent_c] * ent_u, starts)[idx]
            ub = np.floor(np.minimum.reduceat(avail[ri, ent_c] / ent_u, starts))[idx]
        else:
            idx, price, ub = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
        col_t.append(idx)
        col_r.append(np.full(idx.shape[0], ri, dtype=np.int64))
        col_price.append(price)
        col_ub.append(ub)
    col_t_a = np.concatenate(col_t) if col_t else np.zeros(0, dtype=np.int64)
    col_r_a = np.concatenate(col_r) if col_r else np.zeros(0, dtype=np.int64)
    price_a = np.concatenate(col_price) if col_price else np.zeros(0)
    ub_a = np.concatenate(col_ub) if col_ub else np.zeros(0)
    return col_t_a, col_r_a, price_a, ub_a


def build_columns(inputs: AllocationInputs, *, keep: Callable[[Template], bool] | None = None,
                  max_nodes: int | None = None) -> Columns:
    """Build the column arrays (vectorized over regions and templates).

    The per-template arrays (node codes, throughputs) come from the library's tables, read once
    per library and kept, so a re-plan with the same library only redoes the per-region part;
    no Template object is made here.

    Args:
        inputs: checked inputs.
        keep: optional predicate on a Template (makes every template of the library: prefer
            `max_nodes` where it says the same).
        max_nodes: keep only templates of at most this many nodes (e.g. 1 for the baselines).

    Raises:
        CoralError: a (model, phase) with demand > 0 has no template, or none that can run in
            any of its allowed regions (names model, phase and SLO).
    """
    reg_index = {r: i for i, r in enumerate(inputs.regions)}
    R = len(inputs.regions)
    price_rc, sold, avail = _market(inputs)

    groups = tuple(g for g in inputs.groups if inputs.demand[g] > 0)
    tables, keys, primary, cross = _group_tables(inputs, groups, keep=keep, max_nodes=max_nodes)
    lay = _layout(tables, inputs.configs)
    group = primary[lay.group] if len(tables) else lay.group
    cross_group = cross[lay.group] if len(tables) else lay.group
    with_cross = cross_group >= 0
    cross_theta = np.where(with_cross, lay.decode_throughput, 0.0)
    extra: dict[str, Any] = {"cross_group": cross_group, "cross_throughput": cross_theta, "table": lay.group,
                             "table_keys": keys}
    # model -> allowed region mask, per group
    allowed = np.zeros((len(groups), R), dtype=bool)
    for gi, (m, _) in enumerate(groups):
        for r in inputs.allowed_regions[m]:
            allowed[gi, reg_index[r]] = True

    if inputs.spot:
        processes = [inputs.spot.get(r) for r in inputs.regions]
        extra.update(spot_share=share_table(processes, int(lay.nodes.max(initial=1)), inputs.epoch_s, inputs.init_s),
                     nodes_of=lay.nodes, market_spot=np.array([p is not None for p in processes], dtype=bool))
    if inputs.spot_down:
        r_of, c_of = {r: i for i, r in enumerate(inputs.regions)}, {c: i for i, c in enumerate(inputs.configs)}
        down_rc = np.zeros((len(inputs.regions), len(inputs.configs)), dtype=bool)
        for r, c in inputs.spot_down:
            down_rc[r_of[r], c_of[c]] = True
        extra["down_rc"] = down_rc
    market = (id(lay), price_rc.tobytes(), avail.tobytes(), allowed.tobytes())
    hit = _MARKETS.get(market)
    if hit is not None and hit[0] is lay:  # same library, prices, availability and regions: same columns
        _, col_t_a, col_r_a, price_a, ub_a = hit
        return Columns(groups=groups, demand=np.array([inputs.demand[g] for g in groups], dtype=float),
                       templates=lay.templates, group=group, usage=lay.usage, throughput=lay.throughput,
                       col_t=col_t_a, col_r=col_r_a, price=price_a, ub=ub_a, avail=avail, sold=sold,
                       group_start=lay.group_start, theta_block=lay.theta_block, **extra)
    col_t_a, col_r_a, price_a, ub_a = _region_columns(lay, group, price_rc, sold, avail, allowed)

    runnable_groups = np.zeros(len(groups), dtype=bool)
    runnable_groups[group[col_t_a]] = True
    runnable_groups[cross_group[col_t_a][cross_group[col_t_a] >= 0]] = True
    for bad_g in np.flatnonzero(~runnable_groups):
        g = groups[int(bad_g)]
        raise _no_template(inputs, g, f"none of its {int(np.sum(group == bad_g))} templates can run in its "
                                      f"regions ({', '.join(inputs.allowed_regions[g[0]])}): some "
                                      "configuration of each is not sold there")
    fits = ub_a >= 1
    col_t_a, col_r_a, price_a, ub_a = col_t_a[fits], col_r_a[fits], price_a[fits], ub_a[fits]
    for arr in (col_t_a, col_r_a, price_a, ub_a):
        arr.setflags(write=False)  # shared with the next epoch's Columns on the same market
    _MARKETS[market] = (lay, col_t_a, col_r_a, price_a, ub_a)
    while len(_MARKETS) > 4:
        _MARKETS.popitem(last=False)
    return Columns(groups=groups, demand=np.array([inputs.demand[g] for g in groups], dtype=float),
                   templates=lay.templates, group=group, usage=lay.usage, throughput=lay.throughput,
                   col_t=col_t_a, col_r=col_r_a, price=price_a, ub=ub_a,
                   avail=avail, sold=sold, group_start=lay.group_start, theta_block=lay.theta_block, **extra)


def _filtered(table: TemplateTable | _Rows, keep: Callable[[Template], bool] | None,
              max_nodes: int | None) -> TemplateTable | _Rows:
    if len(table) and max_nodes is not None:
        table = _at_most(table, max_nodes)
    if len(table) and keep is not None:
        table = _Rows(table, np.flatnonzero(np.fromiter((keep(t) for t in table), dtype=bool, count=len(table))))
    return table


def _group_tables(inputs: AllocationInputs, groups: tuple[Group, ...], *, keep: Callable[[Template], bool] | None,
                  max_nodes: int | None) -> tuple[list[TemplateTable | _Rows], tuple[tuple[str, Phase], ...],
                                                  np.ndarray, np.ndarray]:
    """The template tables the columns come from, as `inputs.mode` allows: each demand group's
    disaggregated templates ("auto", "disagg") and each model's colocated ones ("auto",
    "colocated"; for a model with demand in both phases). Returns (tables, their (model, phase)
    keys, per table its primary demand row, per table its second row or -1).

    Raises:
        CoralError: a demand group no allowed table covers (names the model, and for a forced
            colocated mode the nodes it is not colocatable on).
    """
    index = {g: i for i, g in enumerate(groups)}
    tables: list[TemplateTable | _Rows] = []
    keys: list[tuple[str, Phase]] = []
    primary: list[int] = []
    cross: list[int] = []
    colocated: set[str] = set()
    for m in inputs.models:
        if inputs.mode_of(m) != "disagg":
            pre, dec = index.get((m, Phase.PREFILL)), index.get((m, Phase.DECODE))
            table = _filtered(_table(inputs.templates.get((m, Phase.COLOCATED), ())), keep, max_nodes)
            if pre is not None and dec is not None and len(table):
                tables.append(table)
                keys.append((m, Phase.COLOCATED))
                primary.append(pre)
                cross.append(dec)
                colocated.add(m)
            elif inputs.mode_of(m) == "colocated" and (pre is not None or dec is not None):
                notes = "; ".join((inputs.colocated_notes or {}).get(m, ())) or "no placement meets its step and TTFT budgets"
                raise CoralError(f"model {m} has no colocated template ({notes}); plan it with --mode auto or disagg")
    for g in groups:
        if inputs.mode_of(g[0]) == "colocated" and g[0] in colocated:
            continue
        table = _filtered(_table(inputs.templates.get(g, ())), keep, max_nodes)
        if not len(table):
            if g[0] in colocated:
                continue  # its colocated templates serve it
            raise _no_template(inputs, g, "no template meets the SLO" if keep is None and max_nodes is None
                               else "no template of the kind this method uses (single-node) meets the SLO")
        tables.append(table)
        keys.append(g)
        primary.append(index[g])
        cross.append(-1)
    return tables, tuple(keys), np.array(primary, dtype=np.int64), np.array(cross, dtype=np.int64)


def group_capacity(cols: Columns, col_idx: np.ndarray, nu: np.ndarray) -> np.ndarray:
    """Tokens/s per demand group that `nu[i]` instances of the columns `col_idx[i]` serve: `Θ` in
    a template's own group, and a colocated template's `Θ_D` in its model's decode group too."""
    cap = np.zeros(len(cols.groups))
    t = cols.col_t[col_idx]
    np.add.at(cap, cols.group[t], cols.col_theta()[col_idx] * nu)
    if cols.cross_group is not None and cols.cross_throughput is not None:
        cg = cols.cross_group[t]
        has = cg >= 0
        np.add.at(cap, cg[has], cols.col_cross_theta()[col_idx][has] * np.asarray(nu)[has])
    return cap


# (layout id, prices, availability, allowed regions) -> the columns built for them (4 most recent)
_MARKETS: OrderedDict[tuple[int, bytes, bytes, bytes], tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                                             np.ndarray]] = OrderedDict()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Layout:
    """What the columns of a set of group tables share across epochs (it depends on the tables and
    the scenario's configuration order only, not on prices, availability or demand)."""

    tables: tuple[Sequence[Template], ...]  # kept alive: the memo is keyed by their ids
    templates: ChainedTemplates
    group: np.ndarray  # per template
    group_start: np.ndarray  # per group
    throughput: np.ndarray  # per template
    decode_throughput: np.ndarray  # per template: Θ_D of a colocated one, 0 for the others
    usage: np.ndarray  # [template, config] int32 (the scenario's config order)
    usable: np.ndarray  # per template: every config it uses is one the scenario knows
    ent_c: np.ndarray  # per (template, config) entry with U > 0, row-major: the config
    ent_u: np.ndarray  # ... and U_c(τ) (float)
    ent_start: np.ndarray  # per template: its first entry (clipped; unused where not usable)
    theta_block: np.ndarray  # per template: see Columns.theta_block
    nodes: np.ndarray  # per template: its node count (the spot discount's n)

    @property
    def num_templates(self) -> int:
        return int(self.group.shape[0])


_LAYOUTS: OrderedDict[tuple[tuple[int, ...], tuple[str, ...]], _Layout] = OrderedDict()


def _layout(tables: Sequence[TemplateTable | _Rows], configs: tuple[str, ...]) -> _Layout:
    """The shared arrays of these tables, built once and kept (the 8 most recent)."""
    key = (tuple(id(t) for t in tables), configs)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    cfg_index = {c: i for i, c in enumerate(configs)}
    C = len(configs)
    sizes = np.array([len(t) for t in tables], dtype=np.int64)
    T = int(sizes.sum())
    usage = np.zeros((T, C), dtype=np.int32)
    usable = np.ones(T, dtype=bool)
    thetas, decodes = [], []
    lo = 0
    for t in tables:
        decodes.append(t.decode_rates() if t.phase is Phase.COLOCATED else np.zeros(len(t)))
        names, u, theta = t.arrays()
        hi = lo + len(t)
        cols = np.array([cfg_index.get(n, -1) for n in names], dtype=np.int64)
        known = cols >= 0
        usage[lo:hi, cols[known]] = u[:, known]
        if not known.all():  # a config the scenario does not know: such templates never run
            usable[lo:hi] &= ~np.any(u[:, ~known] > 0, axis=1)
        thetas.append(theta)
        lo = hi
    throughput = np.concatenate(thetas) if thetas else np.zeros(0)
    if np.any(~np.isfinite(throughput)) or np.any(throughput <= 0):
        raise CoralError("every template needs a finite throughput > 0")
    ent_t, ent_c = np.nonzero(usage)
    usable &= np.bincount(ent_t, minlength=T) > 0
    ent_start = np.minimum(np.searchsorted(ent_t, np.arange(T)), max(ent_t.size - 1, 0))
    group = np.repeat(np.arange(len(tables), dtype=np.int64), sizes)
    # Θ blocks: sort by (group, -Θ); a new block starts at every change of group or Θ.
    order = np.lexsort((-throughput, group))
    new_block = np.ones(T, dtype=bool)
    new_block[1:] = (group[order][1:] != group[order][:-1]) | (throughput[order][1:] != throughput[order][:-1])
    theta_block = np.empty(T, dtype=np.int64)
    theta_block[order] = np.cumsum(new_block) - 1
    lay = _Layout(tables=tuple(tables), templates=ChainedTemplates(tables), group=group, theta_block=theta_block,
                  group_start=np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64),
                  throughput=throughput, usage=usage, usable=usable, ent_c=ent_c,
                  decode_throughput=np.concatenate(decodes) if decodes else np.zeros(0),
                  ent_u=usage[ent_t, ent_c].astype(float), ent_start=ent_start,
                  nodes=usage.sum(axis=1, dtype=np.int64))
    for arr in (lay.group, lay.group_start, lay.throughput, lay.decode_throughput, lay.usage, lay.usable, lay.ent_c, lay.ent_u,
                lay.ent_start, lay.theta_block, lay.nodes):
        arr.setflags(write=False)  # shared by every Columns built from these tables
    _LAYOUTS[key] = lay
    while len(_LAYOUTS) > 8:
        _LAYOUTS.popitem(last=False)
    return lay

