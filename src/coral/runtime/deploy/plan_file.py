"""A plan file (`coral plan --out plan.json`) read back and checked against the scenario it was made for."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coral.allocator.plan import PLAN_JSON_VERSION
from coral.catalog.hardware import split_group_name
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.runtime.deploy.layout import FIRST_TOKEN_MODES, Engine, engine_layout, hosts_of
from coral.scenario import Scenario, load_scenario

# Bumped (in coral.allocator.plan) whenever a reader needs a field older files lack.
PLAN_FILE_VERSION = PLAN_JSON_VERSION
# The versions read: 3 (before spot capacity: every node on-demand) and 4 (`instances[].spot`,
# `instances[].capacity_share`, `nodes[].spot`: spot nodes are their own rows).
READ_VERSIONS = (3, 4)
SPOT_VERSION = 4  # the first version whose instances say whether they are spot


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedStage:
    """One pipeline stage of a planned instance: its entries (data parallel) and layer range."""

    nodes: tuple[str, ...]  # its entries: whole nodes ('4xL40S') or TP groups of one ('4xL40S/tp1')
    layer_start: int
    layer_end: int  # exclusive
    throughput_tok_per_s: float

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedInstance:
    """`count` identical serving instances of one template in one region, as the plan file states them."""

    index: int  # position in the plan's instance list (names exported files)
    model: str
    phase: Phase
    region: str
    count: int
    nodes: tuple[str, ...]  # the template's node multiset, sorted
    stages: tuple[PlannedStage, ...]
    throughput_tok_per_s: float
    price_usd_per_h: float
    derived: tuple[str, ...] = ()  # configurations of `nodes` the region does not sell
    # per stage, per entry: the index into `nodes` of the node it runs on (`Template.hosts`)
    hosts: tuple[tuple[int, ...], ...] = ()
    # a colocated instance (phase COLOCATED): most prompt tokens one step carries beside its decodes, and the
    # generated tokens/s it sustains (`throughput_tok_per_s` is then its prompt tokens/s); None otherwise
    chunk_tokens: int | None = None
    decode_tok_per_s: float | None = None
    micro_batch: int = 0  # the template's micro-batch (a colocated one's decode batch); 0 = not given
    # rented as spot (issue 30): its nodes may be taken with the cloud's notice; its price is the spot price
    spot: bool = False
    capacity_share: float = 1.0  # the share of its capacity the plan counted (spot: the survival discount)

    @property
    def colocated(self) -> bool:
        """One instance serves both phases (chunked prefill, no KV transfer)."""
        return self.phase is Phase.COLOCATED

    def engines(self) -> tuple[Engine, ...]:
        """Every engine of one replica, in stage order, with its node and GPUs (`coral.runtime.deploy.layout`)."""
        return engine_layout(self.nodes, [s.nodes for s in self.stages], self.hosts or None)

    @property
    def key(self) -> str:
        """The template key `model/phase/node+node...` (what `Plan.counts` keys on)."""
        return f"{self.model}/{self.phase.value}/" + "+".join(self.nodes)

    @property
    def market(self) -> str:
        """The market it is rented on: "spot" or "on-demand" (for headers and logs)."""
        return "spot" if self.spot else "on-demand"

    @property
    def name(self) -> str:
        """A file-name-safe label: `03-qwen3-32b-prefill-aws-us-east-2`."""
        return f"{self.index:02d}-{self.model}-{self.phase.value}-{self.region.replace(':', '-')}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanFile:
    """A checked plan file: its instances and node counts, and the scenario it belongs to."""

    path: str
    scenario: Scenario
    method: str
    status: str
    cost_usd_per_h: float
    instances: tuple[PlannedInstance, ...]
    nodes: dict[tuple[str, str], int]  # (region, config) -> nodes the plan rents, spot and on-demand
    availability: str = "abundant"  # the availability mode it was planned under (`coral plan --availability`)
    demand_scale: float = 1.0  # `coral plan --demand-scale`
    engine: str = "coral"  # `coral plan --engine`: the templates it was restricted to
    # model -> where its first token is emitted ("prefill" / "decode", FIRST_TOKEN_MODES); a model the
    # file gives none for: "prefill" (the paper's runtime; plan files before the field)
    first_token: dict[str, str] = field(default_factory=dict)
    spot_nodes: dict[tuple[str, str], int] = field(default_factory=dict)  # (region, config) -> those of `nodes` on spot

    def first_token_of(self, model: str) -> str:
        """Where `model`'s first token is emitted: "prefill" or "decode"."""
        return self.first_token.get(model, "prefill")

    def nodes_of_instances(self, *, spot_only: bool = False) -> dict[tuple[str, str], int]:
        """(region, config) -> nodes its instances use (equals `nodes` in a consistent file; with
        `spot_only`, those of its spot instances, equal to `spot_nodes`)."""
        out: dict[tuple[str, str], int] = {}
        for i in self.instances:
            if spot_only and not i.spot:
                continue
            for c in i.nodes:
                out[(i.region, c)] = out.get((i.region, c), 0) + i.count
        return out


def _field(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise CoralError(f"{where}: field '{key}' is missing; re-run `coral plan --out` to write a current plan file")
    return d[key]


def is_derived(scenario: Scenario, region: str, config: str) -> bool:
    """A shape the region does not sell (priced by `derive_missing_prices`).

    Read defensively: scenarios carry `is_derived` since issue 14; without it, a (region, config)
    the catalog has no offer for counts as derived.
    """
    check = getattr(scenario, "is_derived", None)
    if callable(check):
        return bool(check(region, config))
    return scenario.catalog.offers.get((region, config)) is None


def check_version(data: Any, path: str) -> None:
    """Refuse anything but a JSON object of a `plan_version` this reader takes (:data:`READ_VERSIONS`).

    Raises:
        CoralError: naming the version found and the fix.
    """
    if not isinstance(data, dict):
        raise CoralError(f"{path}: not a plan file (expected a JSON object from `coral plan --out`)")
    version = data.get("plan_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        found = "no plan_version (an older Coral)" if version is None else f"plan_version {version!r}"
        raise CoralError(f"{path}: {found}; this Coral reads plan_version {' or '.join(map(str, READ_VERSIONS))}: "
                         "re-run `coral plan --out` to write a current plan file")


def parse_plan(data: Any, scenario: Scenario, path: str = "plan.json") -> PlanFile:
    """Check a plan file's JSON against `scenario` and turn it into a :class:`PlanFile`.

    Raises:
        CoralError: an older or unknown file version, a plan of another scenario, or entries that
            do not match the scenario (unknown model, region or configuration, layers that do not
            add up to the model's, node counts that disagree with the instances).
    """
    check_version(data, path)
    has_spot = data["plan_version"] >= SPOT_VERSION
    name = _field(data, "scenario", path)
    if name != scenario.name:
        raise CoralError(f"{path}: field 'scenario' is {name!r}, but the scenario given is {scenario.name!r}; "
                         f"pass --scenario {name} or re-plan with this scenario")
    models = {m.name: m for m in scenario.models}
    configs = {c.name for c in scenario.configs}
    instances = []
    for k, raw in enumerate(_field(data, "instances", path)):
        at = f"{path}: instances[{k}]"
        model = _field(raw, "model", at)
        if model not in models:
            raise CoralError(f"{at}: model {model!r} is not in scenario {scenario.name!r} "
                             f"(models: {', '.join(models)}); the plan was made for another scenario")
        region = _field(raw, "region", at)
        if region not in scenario.regions:
            raise CoralError(f"{at}: region {region!r} is not in scenario {scenario.name!r}; "
                             "the plan was made for another scenario")
        nodes = tuple(_field(raw, "nodes", at))
        unknown_cfg = sorted(set(nodes) - configs)
        if unknown_cfg:
            raise CoralError(f"{at}: configuration {unknown_cfg[0]!r} is not in scenario {scenario.name!r}; "
                             "the plan was made for another scenario")
        stages, start = [], 0
        for s in _field(raw, "stages", at):
            layers = int(_field(s, "layers", at))
            stages.append(PlannedStage(nodes=tuple(_field(s, "nodes", at)), layer_start=start, layer_end=start + layers,
                                       throughput_tok_per_s=float(_field(s, "throughput_tok_per_s", at))))
            start += layers
        want = models[model].spec.num_layers
        if start != want:
            raise CoralError(f"{at}: its stages hold {start} layers but {model} has {want}; "
                             "the plan was made for another model spec or scenario")
        hosts = _hosts(raw, nodes, stages, models[model].spec, scenario, at)
        count = int(_field(raw, "count", at))
        if count < 1:
            raise CoralError(f"{at}: field 'count' must be >= 1, got {count}")
        phase = _phase(raw, at)
        chunk, decode_tps = _colocated(raw, phase, at)
        spot, share = _spot(raw, at) if has_spot else (False, 1.0)
        instances.append(PlannedInstance(
            index=k, model=model, phase=phase, region=region, count=count, nodes=nodes, chunk_tokens=chunk,
            decode_tok_per_s=decode_tps, micro_batch=int(raw.get("micro_batch") or 0),
            stages=tuple(stages), throughput_tok_per_s=float(_field(raw, "throughput_tok_per_s", at)),
            price_usd_per_h=float(_field(raw, "price_usd_per_h", at)),
            derived=tuple(sorted({c for c in nodes if is_derived(scenario, region, c)})), hosts=hosts,
            spot=spot, capacity_share=share))
    nodes_used, spot_used = _node_rows(_field(data, "nodes", path), has_spot, path)
    plan = PlanFile(path=path, scenario=scenario, method=str(data.get("method", "")), status=str(data.get("status", "")),
                    cost_usd_per_h=float(_field(data, "cost_usd_per_h", path)), instances=tuple(instances),
                    nodes=nodes_used, availability=str(data.get("availability") or "abundant"),
                    demand_scale=float(data.get("demand_scale") or 1.0),
                    engine=str((data.get("engine_restriction") or {}).get("engine", "coral")),
                    first_token=_first_token(data, set(models), path), spot_nodes=spot_used)
    if plan.nodes_of_instances() != nodes_used or plan.nodes_of_instances(spot_only=True) != spot_used:
        raise CoralError(f"{path}: field 'nodes' does not match the nodes of its instances; the file was edited "
                         "or truncated: re-run `coral plan --out`")
    return plan


def _spot(raw: dict[str, Any], at: str) -> tuple[bool, float]:
    """A version-4 instance's `spot` flag (a boolean; absent: on-demand, as a hand-written line) and
    `capacity_share` (in (0, 1]; 1 where absent)."""
    spot = raw.get("spot", False)
    if not isinstance(spot, bool):
        raise CoralError(f"{at}: field 'spot' must be true or false, got {spot!r}; re-run `coral plan --out`")
    share = raw.get("capacity_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise CoralError(f"{at}: field 'capacity_share' must be a number in (0, 1], got {share!r}; re-run `coral plan --out`")
    return spot, float(share)


def _node_rows(rows: Any, has_spot: bool, path: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """The file's `nodes` rows: (region, config) -> nodes rented (spot and on-demand rows added up), and ->
    those on spot (a version-4 row with `"spot": true`; none before version 4)."""
    total: dict[tuple[str, str], int] = {}
    spot: dict[tuple[str, str], int] = {}
    for k, n in enumerate(rows):
        count = int(_field(n, "count", f"{path}: nodes[{k}]"))
        if not count:
            continue
        key = (n["region"], n["config"])
        total[key] = total.get(key, 0) + count
        if has_spot and n.get("spot") is True:
            spot[key] = spot.get(key, 0) + count
    return total, spot


def _phase(raw: dict[str, Any], at: str) -> Phase:
    value = _field(raw, "phase", at)
    try:
        return Phase(value)
    except ValueError:
        raise CoralError(f"{at}: field 'phase' is {value!r}; valid: {', '.join(p.value for p in Phase)}") from None


def _colocated(raw: dict[str, Any], phase: Phase, at: str) -> tuple[int | None, float | None]:
    """A colocated instance's `chunk_tokens` (>= 1) and `decode_tok_per_s` (> 0), its `micro_batch` (>= 1)
    checked; (None, None) for the others."""
    if phase is not Phase.COLOCATED:
        return None, None
    chunk = _field(raw, "chunk_tokens", at)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise CoralError(f"{at}: field 'chunk_tokens' must be an integer >= 1, got {chunk!r}; re-run `coral plan --out`")
    decode = _field(raw, "decode_tok_per_s", at)
    if isinstance(decode, bool) or not isinstance(decode, int | float) or not decode > 0:
        raise CoralError(f"{at}: field 'decode_tok_per_s' must be a number > 0, got {decode!r}; re-run `coral plan --out`")
    batch = _field(raw, "micro_batch", at)  # its decode batch: vLLM's step budget is chunk_tokens + this
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CoralError(f"{at}: field 'micro_batch' must be an integer >= 1, got {batch!r}; re-run `coral plan --out`")
    return chunk, float(decode)


def _hosts(raw: dict[str, Any], nodes: tuple[str, ...], stages: list[PlannedStage], spec: Any, scenario: Scenario,
           at: str) -> tuple[tuple[int, ...], ...]:
    """Check an instance's stage entries against its nodes and the model's TP rule; return its `hosts`
    (the file's, checked against `Template.hosts`, or that rule's where the file has none)."""
    entries = [st.nodes for st in stages]
    for s, st in enumerate(entries):
        for e in st:
            try:
                scenario.config(e)  # a group name resolves to its node's group (a TP that does not divide it is refused)
            except CoralError as exc:
                raise CoralError(f"{at}: stage {s} entry {e!r}: {exc}") from None
            node, tp = split_group_name(e)
            if tp is not None:
                try:
                    spec.check_tp(tp, int(node.split("x", 1)[0]))
                except CoralError as exc:
                    raise CoralError(f"{at}: stage {s} entry {e!r}: {exc}") from None
    try:
        rule = hosts_of(nodes, entries)
        given = raw.get("hosts")
        hosts = rule if given is None else tuple(tuple(int(h) for h in row) for row in given)
        if hosts != rule:
            raise CoralError(f"field 'hosts' {[list(h) for h in hosts]} is not Template.hosts() of its stages "
                             f"{[list(h) for h in rule]}")
        engine_layout(nodes, entries, hosts)
    except CoralError as exc:
        raise CoralError(f"{at}: {exc}; the stages' entries do not fit the instance's nodes {list(nodes)}") from None
    return hosts


def _first_token(data: dict[str, Any], models: set[str], path: str) -> dict[str, str]:
    """Per model, where its first token is emitted, from the plan file's `models: [{model, first_token}]`
    (absent: "prefill" for every model)."""
    out: dict[str, str] = {}
    rows = data.get("models") or []
    if isinstance(rows, dict):  # {model: {first_token: ...}} is read too
        rows = [{"model": k, **(v if isinstance(v, dict) else {"first_token": v})} for k, v in rows.items()]
    for k, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CoralError(f"{path}: models[{k}] is not an object; re-run `coral plan --out`")
        name = row.get("model", row.get("name"))
        mode = row.get("first_token", "prefill")
        if mode not in FIRST_TOKEN_MODES:
            raise CoralError(f"{path}: models[{k}] ({name}): field 'first_token' is {mode!r}; valid: "
                             f"{', '.join(FIRST_TOKEN_MODES)}")
        if name in models:
            out[str(name)] = str(mode)
    return out


def load_plan_file(path: str | Path, scenario: str | None = None) -> PlanFile:
    """Read `path` and check it against `scenario` (default: the scenario the file names).

    Raises:
        CoralError: a missing or unreadable file, bad JSON, or any check of :func:`parse_plan`.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CoralError(f"--plan {p}: no such file (write one with `coral plan NAME --out {p}`)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CoralError(f"--plan {p}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise CoralError(f"--plan {p}: not JSON ({e.msg} at line {e.lineno}); pass a file from `coral plan --out`") from None
    check_version(data, str(p))
    source = data.get("scenario_source")
    if scenario is None and isinstance(source, str) and source.endswith((".yaml", ".yml")) and not Path(source).is_file():
        raise CoralError(f"{p}: its scenario file {source} is gone; pass --scenario PATH")
    name = scenario or (source if isinstance(source, str) and source else data.get("scenario"))
    if not isinstance(name, str) or not name:
        raise CoralError(f"{p}: field 'scenario' is missing; pass --scenario NAME")
    return parse_plan(data, load_scenario(name), str(p))


__all__ = ["PLAN_FILE_VERSION", "READ_VERSIONS", "PlanFile", "PlannedInstance", "PlannedStage", "check_version", "is_derived", "load_plan_file",
           "parse_plan"]
