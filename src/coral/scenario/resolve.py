"""Turn a scenario file into domain values: model specs, configurations, prices, availability, perf model."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from coral.catalog.catalog import Catalog, builtin_catalog, did_you_mean, load_prices_csv
from coral.catalog.hardware import NodeConfig, split_group_name
from coral.catalog.models import ModelSpec, resolve_model_spec
from coral.catalog.spot import SpotOffer
from coral.errors import CoralError, unknown
from coral.file_kinds import wrong_kind
from coral.perf.model import PerfModel, Phase, SystemParams
from coral.perf.profile import load_profile_csv, profile_from_helix
from coral.perf.roofline import RooflinePerf
from coral.scenario.schema import PlannerEntry, ScenarioFile
from coral.scenario.spot import spot_offers
from coral.slo import Slo
from coral.workload import WorkloadSpec
from coral.workload_data import public_data_path


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """A model with its SLOs and the workload shape that sizes its templates and demand."""

    name: str
    spec: ModelSpec
    slo: Slo
    rate_per_s: float
    prompt_tokens_mean: float
    output_tokens_mean: float
    workload: WorkloadSpec
    regions: tuple[str, ...] | None = None

    @property
    def ttft_ms(self) -> float:
        return self.slo.ttft_ms

    @property
    def tpot_ms(self) -> float:
        return self.slo.tpot_ms

    def slo_ms(self, phase: Phase) -> float:
        return self.slo.ms(phase)

    def demand_tok_per_s(self, phase: Phase) -> float:
        """The raw mean demand `λ·P̄` for prefill, `λ·D̄` for decode (tokens/s); the capacity a plan
        provides for it comes from `coral.allocator.capacity`."""
        per_req = self.prompt_tokens_mean if phase is Phase.PREFILL else self.output_tokens_mean
        return self.rate_per_s * per_req


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A resolved scenario: everything the planner, simulator and runtime read."""

    name: str
    description: str
    models: tuple[ServedModel, ...]
    configs: tuple[NodeConfig, ...]
    regions: tuple[str, ...]
    prices: Mapping[tuple[str, str], float]
    availability: Mapping[tuple[str, str], int]
    perf: PerfModel
    planner: PlannerEntry
    catalog: Catalog = field(repr=False)
    source: ScenarioFile = field(repr=False)
    base_dir: Path | None = None  # relative paths in the scenario file (CSV traces) resolve here
    # (region, config) offers the region does not sell, priced by `derive_missing_prices`
    derived: frozenset[tuple[str, str]] = frozenset()
    # (region, config) -> the [SUSPECT ...] note of the catalog row its price comes from
    suspect: Mapping[tuple[str, str], str] = field(default_factory=dict)
    # (region, config) -> its spot offer, in the regions with `spot: true` (none when spot is off)
    spot: Mapping[tuple[str, str], SpotOffer] = field(default_factory=dict)
    spot_share_cap: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (region, model) -> its cap

    def is_derived(self, region: str, config: str) -> bool:
        return (region, config) in self.derived

    def warnings(self) -> list[str]:
        """One line per rentable offer (available > 0) priced from a row the data tags `[SUSPECT ...]`."""
        return [f"{r} {c} is priced from a suspect catalog row ({self.prices[(r, c)]:.2f} $/h): {note}"
                for (r, c), note in sorted(self.suspect.items()) if self.availability.get((r, c), 0) > 0]

    def model(self, name: str) -> ServedModel:
        for m in self.models:
            if m.name == name:
                return m
        raise unknown("model", name, [m.name for m in self.models])

    def config(self, name: str) -> NodeConfig:
        node, tp = split_group_name(name)
        for c in self.configs:
            if c.name == node:
                if tp is None:
                    return c
                try:
                    return c.group(tp)
                except ValueError as exc:
                    raise CoralError(str(exc)) from None
        raise unknown("configuration", name, [c.name for c in self.configs])


def builtin_scenario_names() -> tuple[str, ...]:
    folder = resources.files("coral.scenario").joinpath("builtin")
    return tuple(sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (`X`, `list[X]`, `X | None`, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _tag_matches(model: type[BaseModel], part: str) -> bool:
    """Whether a loc element names this union member (its class name or its `kind` tag)."""
    kind = model.model_fields.get("kind")
    return model.__name__ == part or (kind is not None and part in typing.get_args(kind.annotation))


def fields_at(loc: Sequence[int | str], root: type[BaseModel] = ScenarioFile) -> list[str]:
    """The field names valid at `loc[:-1]` of a scenario (where a misspelled key `loc[-1]` sits).

    Walks the schema along the error's location: list indexes and dict keys are skipped, a
    discriminated union's tag selects its member.
    """
    models: list[type[BaseModel]] = [root]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        inner = [m for model in models if part in model.model_fields
                 for m in _models_in(model.model_fields[part].annotation)]
        if inner:
            models = inner
        elif any(_tag_matches(m, part) for m in models):
            models = [m for m in models if _tag_matches(m, part)]
    return sorted({f for m in models for f in m.model_fields})


def _format_error(err: Any) -> str:
    loc = err["loc"]
    path = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden" and loc:
        valid = fields_at(loc)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        if not close:  # a prefix (`tpot` for `tpot_ms`) is the commonest slip
            close = [f for f in valid if f.startswith(str(loc[-1])) or str(loc[-1]).startswith(f)][:1]
        hint = f"did you mean {close[0]!r}?" if close else f"valid fields here: {', '.join(valid)}"
        return f"  {path}: unknown field; {hint}"
    return f"  {path}: {err['msg']}"


def _format_validation(exc: ValidationError, where: str) -> str:
    lines = [f"scenario {where} is not valid:"]
    lines += [_format_error(err) for err in exc.errors()]
    return "\n".join(lines)


def _yaml_error(exc: yaml.YAMLError, where: str) -> str:
    """One line naming the file, line and column (PyYAML would cite "<unicode string>")."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    extra = f" ({context} at line {cmark.line + 1})" if context and cmark is not None else ""
    return f"scenario {where} is not valid YAML: {at}{problem}{extra}"


def parse_scenario(data: Any, where: str) -> ScenarioFile:
    """Validate a parsed YAML document as a scenario.

    Raises:
        CoralError: listing each bad field by its path and what was expected.
    """
    if not isinstance(data, dict):
        raise CoralError(f"scenario {where} must be a YAML mapping at the top level")
    try:
        return ScenarioFile.model_validate(data)
    except ValidationError as exc:
        raise CoralError(wrong_kind(where, data, "scenario") or _format_validation(exc, where)) from None


def read_scenario_file(name_or_path: str) -> tuple[ScenarioFile, Path | None]:
    """Read a built-in scenario by name, or a YAML file by path."""
    if name_or_path in builtin_scenario_names():
        text = resources.files("coral.scenario").joinpath("builtin", f"{name_or_path}.yaml").read_text()
        base = None
        where = name_or_path
    else:
        p = Path(name_or_path)
        if not p.exists():
            if p.suffix in (".yaml", ".yml") or "/" in name_or_path:
                raise CoralError(f"scenario file {p} does not exist")
            raise unknown("scenario", name_or_path, builtin_scenario_names())
        if p.is_dir():
            raise CoralError(f"scenario {p} is a folder; give a scenario YAML file in it, or a built-in name "
                             f"({', '.join(builtin_scenario_names())}); `coral scenario init my.yaml` writes a starter")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CoralError(f"cannot read scenario file {p}: {getattr(exc, 'strerror', None) or exc}") from None
        base, where = p.parent, str(p)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CoralError(_yaml_error(exc, where)) from None
    return parse_scenario(data, where), base


def _resolve_path(path: str, base: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base is None else base / p


def _derived_price(catalog: Catalog, region: str, config: NodeConfig) -> tuple[float, str] | None:
    """Price of a shape `region` does not sell: the per-GPU price of the nearest *larger* shape of
    the same GPU sold there, times the GPU count (renting that node and splitting it into smaller
    replicas costs at least this). None when the region sells no larger shape of that GPU.

    Returns:
        (price $/h, the [SUSPECT] note of the row it comes from or "").
    """
    larger = []
    for (r, c), offer in catalog.offers.items():
        cfg = catalog.configs[c]
        if r == region and cfg.gpu.name == config.gpu.name and cfg.count > config.count:
            larger.append((cfg.count, offer.price_usd_per_h / cfg.count, offer.suspect))
    if not larger:
        return None
    _, per_gpu, note = min(larger)
    return per_gpu * config.count, note


def _perf_model(file: ScenarioFile, catalog: Catalog, base: Path | None) -> PerfModel:
    system = SystemParams(memory_utilization=file.perf.memory_utilization,
                          network_latency_s=file.perf.network_latency_ms / 1e3)
    roofline = RooflinePerf(system=system)
    if file.perf.backend == "roofline":
        return roofline
    if file.perf.backend == "profile":
        assert file.perf.profile is not None
        return load_profile_csv(_resolve_path(file.perf.profile, base), catalog, fallback=roofline)
    folder = file.perf.profile
    if folder is None:
        folder = str(public_data_path("profiles/helix_llama2_70b"))
    return profile_from_helix(_resolve_path(folder, base), catalog, fallback=roofline)


def resolve(file: ScenarioFile, base: Path | None = None, catalog: Catalog | None = None) -> Scenario:
    """Resolve names against the catalog; price and bound every (region, configuration).

    Raises:
        CoralError / UnknownNameError: an unknown model, configuration or region, naming the valid ones.
    """
    catalog = catalog or builtin_catalog()
    if file.prices_csv:
        catalog = load_prices_csv(_resolve_path(file.prices_csv, base), catalog)
    listed = tuple(catalog.config(c) for c in file.configs)
    names = [c.name for c in listed]
    if len(set(names)) != len(names):
        raise CoralError(f"scenario {file.name}: configs lists a configuration twice: {names}")
    regions = tuple(catalog.check_region(r.name) for r in file.regions)
    # A shape stands for every instance type of it the scenario's regions sell: its default
    # (cheapest) type keeps the shape's name, each other type is `<shape>@<type>`.
    expanded = list(listed)
    for raw, c in zip(file.configs, listed, strict=True):
        if re.fullmatch(r"\d+x[^@/]+", raw.strip()):  # a bare shape; `<shape>@<type>` or a type pins one
            expanded += [catalog.configs[t] for t in catalog.types_of(c.name, regions) if t not in names]
    configs = tuple(dict.fromkeys(expanded))
    names = [c.name for c in configs]
    prices: dict[tuple[str, str], float] = {}
    availability: dict[tuple[str, str], int] = {}
    derived: set[tuple[str, str]] = set()
    suspect: dict[tuple[str, str], str] = {}
    for region in file.regions:
        for key in [*region.prices, *region.availability]:
            if key not in names:
                raise CoralError(f"scenario {file.name}: region {region.name} names configuration {key!r}, "
                                 f"which is not in configs ({', '.join(names)}){did_you_mean(key, names)}")
        for cfg in configs:
            price = region.prices.get(cfg.name)  # a shape's price sets its default type's only
            offer = catalog.offers.get((region.name, cfg.name))
            if price is None and offer is not None:
                price = offer.price_usd_per_h
                if offer.suspect:
                    suspect[(region.name, cfg.name)] = offer.suspect
            if offer is None and file.derive_missing_prices and not cfg.instance_type:  # a type is sold or absent
                # a shape the region does not sell: marked derived, even where `prices` sets its price
                found = _derived_price(catalog, region.name, cfg)
                if price is None and found is not None:
                    price = found[0]
                    if found[1]:
                        suspect[(region.name, cfg.name)] = found[1]
                if price is not None:
                    derived.add((region.name, cfg.name))
            if price is None:
                continue  # not sold there
            prices[(region.name, cfg.name)] = price
            # a shape's availability bounds each of its types (e.g. none of a suspect-priced GPU)
            availability[(region.name, cfg.name)] = region.availability.get(
                cfg.name, region.availability.get(cfg.shape, file.default_availability))
    models = []
    for entry in file.models:
        p_mean, d_mean = entry.workload.mean_lengths_tok(base_dir=base)
        if entry.regions:
            for r in entry.regions:
                if r not in regions:
                    raise unknown("region", r, regions)
        models.append(ServedModel(
            name=entry.name, spec=resolve_model_spec(entry.spec or entry.name, base=base, name=entry.name),
            slo=Slo(ttft_ms=entry.ttft_ms, tpot_ms=entry.tpot_ms,
                    attainment=entry.slo_attainment if entry.slo_attainment is not None else file.slo_attainment),
            rate_per_s=entry.workload.rate_per_s, prompt_tokens_mean=p_mean, output_tokens_mean=d_mean,
            workload=entry.workload, regions=tuple(entry.regions) if entry.regions else None))
    spot, spot_cap = spot_offers(file, catalog, prices, derived)
    return Scenario(name=file.name, description=file.description, models=tuple(models), configs=configs,
                    regions=regions, prices=prices, availability=availability,
                    perf=_perf_model(file, catalog, base), planner=file.planner, catalog=catalog, source=file,
                    base_dir=base, derived=frozenset(derived), suspect=suspect, spot=spot, spot_share_cap=spot_cap)


def with_demand_scale(scenario: Scenario, factor: float) -> Scenario:
    """`scenario` with every model's rate times `factor` (`--demand-scale`); itself at 1."""
    if factor == 1.0:
        return scenario
    data = scenario.source.model_dump()
    for m in data["models"]:
        m["workload"]["rate_per_s"] *= factor
    return resolve(parse_scenario(data, f"{scenario.name} (demand x{factor:g})"), scenario.base_dir)


def with_spot(scenario: Scenario, *, on: bool = True, rate_multiplier: float = 1.0,
              share_cap: float | None = None) -> Scenario:
    """`scenario` with spot on (or off) in every region that sells a configuration of it with a
    spot price, and every spot process's preemption rate times `rate_multiplier` (the spot
    experiment's x0.5 ... x4). Regions with spot already on keep their own rates and caps (then
    multiplied); `share_cap` replaces every region's `spot_share_cap` where given.

    Raises:
        CoralError: a multiplier outside [0, inf) or a cap outside (0, 1]; spot asked for in a
            scenario where no region has a spot price.
    """
    if not (rate_multiplier >= 0 and math.isfinite(rate_multiplier)):
        raise CoralError(f"the spot rate multiplier must be a finite number >= 0, got {rate_multiplier}")
    if share_cap is not None and not 0 < share_cap <= 1:
        raise CoralError(f"the spot share cap must be in (0, 1], got {share_cap}")
    if not on:
        return dataclasses.replace(scenario, spot={}, spot_share_cap={})
    data = scenario.source.model_dump()
    changed = False
    for entry in data["regions"]:
        sells = any(scenario.catalog.spot_offer(r, c) is not None for (r, c) in scenario.prices
                    if r == entry["name"] and (r, c) not in scenario.derived)
        if sells and not entry.get("spot"):
            entry["spot"] = changed = True
        if sells and share_cap is not None:
            entry["spot_share_cap"], changed = share_cap, True
    if changed:
        scenario = resolve(parse_scenario(data, f"{scenario.name} (spot on)"), scenario.base_dir)
    if not scenario.spot:
        raise CoralError(f"scenario {scenario.name}: no region has a spot price for any of its configurations; "
                         "spot needs prices with a spot_price_per_hour column")
    if rate_multiplier == 1.0:
        return scenario
    spot = {key: dataclasses.replace(offer, process=dataclasses.replace(
                offer.process, preemption_per_node_h=offer.process.preemption_per_node_h * rate_multiplier,
                source=f"{offer.process.source}; rate x{rate_multiplier:g}"))
            for key, offer in scenario.spot.items()}
    return dataclasses.replace(scenario, spot=spot)


def load_scenario(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> Scenario:
    """Load a built-in scenario by name or a YAML file, apply `overrides` (top-level keys, e.g.
    `{'planner': {...}}` merged one level deep), validate and resolve it."""
    file, base = read_scenario_file(name_or_path)
    if overrides:
        data = file.model_dump()
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        file = parse_scenario(data, f"{name_or_path} (with overrides)")
    return resolve(file, base)
