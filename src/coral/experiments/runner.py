"""The paper's evaluation (§6.3–§6.8) as code: which runs each experiment makes and what it compares."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from coral.allocator import Plan
from coral.cache import default_cache_dir
from coral.errors import CoralError
from coral.experiments.pipeline import Setup, plan, prepare, run_simulation, scaled_scenario
from coral.perf.model import Phase
from coral.scenario import Scenario, load_scenario, with_spot
from coral.templates.library import build_library
from coral.workload.shift import heavy_split_multipliers

EXPERIMENTS = ("cost", "goodput", "skew", "helix", "ablation", "sensitivity", "spot")
SETUPS = ("core", "extended")
BASELINES = ("homo", "cauchy", "template-greedy")
ALL_METHODS = ("coral", *BASELINES)

# Helix's reported numbers for its "high GPU-heterogeneity cluster" (Helix ASPLOS'25, online
# serving of LLaMA-2-70B, used by the Coral paper §6.6). Its cost is the whole cluster's.
HELIX_DECODE_TOK_PER_S = 459.8

# §6.5: "top third of models by size" / "bottom third".
SKEW_GROUPS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "core": {"large-heavy": ("qwen3-32b",), "small-heavy": ("phi-4",)},
    "extended": {"large-heavy": ("qwen3-235b-a22b", "gpt-oss-120b"), "small-heavy": ("phi-4", "gpt-oss-20b")},
}
SKEW_SHARE = 0.8

# §6.8 sweeps. The extended sweep uses the paper's testbed (gpt-oss-120b prefill and
# qwen3-235b decode) only: a full extended library per setting would take hours here.
SENSITIVITY_GRID: Mapping[str, tuple[tuple[int, ...], tuple[float, ...]]] = {
    "core": ((2, 3, 4, 6), (4.0, 8.0, 12.0)),
    "extended": ((2, 3, 4), (4.0, 8.0, 12.0)),
}
SENSITIVITY_QUICK_GRID = ((1, 2), (4.0, 12.0))
SENSITIVITY_TESTBED: Mapping[str, tuple[tuple[str, Phase], ...] | None] = {
    "core": None,  # every (model, phase)
    "extended": (("gpt-oss-120b", Phase.PREFILL), ("qwen3-235b-a22b", Phase.DECODE)),
}

ARRIVALS = (None, "trace", "poisson", "gamma")
QUICK_DURATION_S = 360.0
QUICK_EPOCH_S = 120.0
QUICK_N_MAX = 2


class Ui(Protocol):
    """Where a run reports progress (the CLI draws it with rich; tests pass `NullUi`)."""

    def start(self, description: str, total: float) -> None: ...
    def update(self, completed: float) -> None: ...
    def note(self, message: str) -> None: ...


class NullUi:
    """Progress that goes nowhere."""

    def start(self, description: str, total: float) -> None:
        pass

    def update(self, completed: float) -> None:
        pass

    def note(self, message: str) -> None:
        pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What every experiment of one invocation shares."""

    setup: str
    seed: int = 0
    duration_s: float = 1800.0
    epoch_s: float | None = None  # None: the scenario's (360 s)
    jobs: int = 2
    quick: bool = False
    n_max: int | None = None  # library override (quick mode, or --n-max; recorded in the report)
    cache_dir: Path | None = None
    data_dir: Path | None = None
    arrival: str | None = None  # None: each model's own (trace replay); "poisson": Poisson arrivals, trace lengths

    def __post_init__(self) -> None:
        if self.setup not in SETUPS:
            raise ValueError(f"setup must be one of {', '.join(SETUPS)}, got {self.setup!r}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s}")
        if self.epoch_s is not None and not self.epoch_s > 0:
            raise ValueError(f"epoch_s must be > 0, got {self.epoch_s}")
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(a for a in ARRIVALS if a)}, got {self.arrival!r}")

    @classmethod
    def make(cls, setup: str, *, quick: bool = False, duration_s: float | None = None, **kw: Any) -> RunConfig:
        """A config with the quick defaults filled in (shorter runs, 2-node templates)."""
        if quick:
            kw.setdefault("epoch_s", QUICK_EPOCH_S)
            kw.setdefault("n_max", QUICK_N_MAX)
        if duration_s is None:
            duration_s = QUICK_DURATION_S if quick else 1800.0
        return cls(setup=setup, quick=quick, duration_s=duration_s, **kw)


@dataclass(slots=True)
class Session:
    """One invocation: its config, progress sink, and the runs already made (shared by `all`)."""

    config: RunConfig
    ui: Ui = field(default_factory=NullUi)
    _setups: dict[tuple[str, str, int | None, float | None], Setup] = field(default_factory=dict)
    _runs: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    _library_unit: str | None = None  # the library unit the progress bar shows

    # -- building blocks ---------------------------------------------------------------------------
    def setup(self, scenario_name: str, availability: str, *, n_max: int | None = None, rho: float | None = None) -> Setup:
        """The scenario's library and availability (built once per invocation, cached on disk)."""
        n_max = n_max if n_max is not None else self.config.n_max
        key = (scenario_name, availability, n_max, rho)
        if key not in self._setups:
            self._setups[key] = prepare(self.scenario(scenario_name), availability=availability,
                                        jobs=self.config.jobs, cache_dir=self.config.cache_dir, n_max=n_max, rho=rho,
                                        step=self._library_step)
        return self._setups[key]

    def scenario(self, name: str) -> Scenario:
        """The built-in scenario, with the invocation's arrival process if one was asked for."""
        scenario = scaled_scenario(name)
        if self.config.arrival is None:
            return scenario
        models = scenario.source.model_dump()["models"]
        for m in models:
            m["workload"]["arrival"] = self.config.arrival
        return load_scenario(name, {"models": models})

    def _library_step(self, spec: Any, done: int, total: int) -> None:
        # a parallel build reports its first chunk with done > 1: start a bar per new unit
        unit = f"templates {spec.model.name} {spec.phase.value}"
        if unit != self._library_unit:
            self._library_unit = unit
            self.ui.start(unit, total)
        self.ui.update(done)

    def simulate(self, setup: Setup, method: str, *, label: str, variant: str = "nominal",
                 rate_multipliers: Mapping[str, float] | None = None, throttle: bool = False) -> dict[str, Any]:
        """Simulate `method` on `setup` (with the variant's rates) and return its record.

        With `throttle` (§6.4), a method that cannot plan for the whole nominal demand gets
        every model's rate multiplied by the largest factor it can plan for (`feasible_scale`).
        """
        key = (id(setup), method, variant, throttle)
        if key in self._runs:
            return self._runs[key]
        cfg = self.config
        s = setup
        if rate_multipliers:
            s = dataclasses.replace(setup, scenario=_with_rates(setup.scenario, rate_multipliers))
        factor = 1.0
        if throttle:
            factor = feasible_scale(s, method)
            if factor < 1.0:
                s = _scaled_setup(s, factor)
        self.ui.start(f"simulating {label}", cfg.duration_s)
        t0 = time.perf_counter()
        run = run_simulation(s, method, duration_s=cfg.duration_s, epoch_s=cfg.epoch_s, seed=cfg.seed,
                             data_dir=cfg.data_dir, progress=lambda now, total: self.ui.update(now))
        rec = method_record(run.result, run.plans, method=method, label=label, scenario=s.scenario)
        rec.update({"variant": variant, "availability": setup.availability_mode, "throttle": factor,
                    "wall_s": time.perf_counter() - t0})
        self.ui.note(f"{label}: {rec['cost_usd_per_h']:.2f} $/h, goodput {rec['goodput_tok_per_s']:,.0f} tok/s, "
                     f"SLO {rec['slo_attainment'] or 0:.1%}")
        self._runs[key] = rec
        return rec


THROTTLE_STEPS = 12  # bisection steps: the factor is found to within 2**-12


def _scaled_setup(setup: Setup, factor: float) -> Setup:
    return dataclasses.replace(setup, scenario=_with_rates(setup.scenario, {m.name: factor for m in setup.scenario.models}))


def feasible_scale(setup: Setup, method: str) -> float:
    """The paper's §6.4 throttle: the largest uniform rate factor in (0, 1] at which `method`'s
    plan serves the whole nominal demand with the setup's availability (bisection).

    A greedy baseline's served fraction at full demand (`Plan.alpha`) is not that factor: with
    less demand its first model takes fewer nodes and leaves some to the next.
    """
    if plan(setup, method).alpha >= 1.0 - 1e-6:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(THROTTLE_STEPS):
        mid = (lo + hi) / 2
        if plan(_scaled_setup(setup, mid), method).alpha >= 1.0 - 1e-6:
            lo = mid
        else:
            hi = mid
    return max(lo, 2.0 ** -THROTTLE_STEPS)


def _with_rates(scenario: Scenario, multipliers: Mapping[str, float]) -> Scenario:
    """The scenario with each model's rate multiplied (models absent from `multipliers` keep theirs)."""
    models = scenario.source.model_dump()["models"]
    for m in models:
        m["workload"]["rate_per_s"] *= multipliers.get(m["name"], 1.0)
    return load_scenario(scenario.name, {"models": models})


# -- records ---------------------------------------------------------------------------------------

def _f(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def plan_record(p: Plan) -> dict[str, Any]:
    """The figures of one plan the report shows (and the heterogeneous templates it picked)."""
    hetero = [i for i in p.instances if not i.template.is_homogeneous]
    return {
        "status": p.status.value, "cost_usd_per_h": p.cost_usd_per_h, "init_penalty_usd_per_h": p.init_penalty_usd_per_h,
        "alpha": p.alpha, "goodput_mode": p.goodput_mode, "solve_s": p.solve_s, "gap": p.gap,
        "instances": sum(i.count for i in p.instances), "hetero_instances": sum(i.count for i in hetero),
        "spot_instances": sum(i.count for i in p.instances if i.spot), "spot_cost_usd_per_h": p.spot_cost_usd_per_h,
        "cost_by_model_phase": {f"{m}/{ph.value}": c for (m, ph), c in sorted(p.cost_by_model_phase().items(),
                                                                            key=lambda kv: (kv[0][0], kv[0][1].value))},
        "templates": [
            {"model": i.model, "phase": i.phase.value, "region": i.region, "count": i.count, "spot": i.spot,
             "nodes": list(i.template.nodes), "homogeneous": i.template.is_homogeneous,
             "stages": [{"nodes": list(st.nodes), "layers": st.layers} for st in i.template.placement.stages],
             "throughput_tok_per_s": i.throughput_tok_per_s, "price_usd_per_h": i.price_usd_per_h}
            for i in p.instances
        ],
    }


def method_record(result: Any, plans: Sequence[Plan], *, method: str, label: str, scenario: Scenario) -> dict[str, Any]:
    """One method's run: mean figures, per epoch, per model, and its plans."""
    s = result.summary(timing=False)
    met = result.slo_met
    arrival = result.arrival_s
    epochs = []
    for k, e in enumerate(s["per_epoch"]):
        sel = (arrival >= e["t_start_s"]) & (arrival < e["t_end_s"])
        n = int(sel.sum())
        p = plans[k] if k < len(plans) else None
        by_model = {}
        for mi, mname in enumerate(result.models):
            msel = sel & (result.model == mi)
            by_model[mname] = float(met[msel].sum()) / int(msel.sum()) if msel.any() else None
        epochs.append({
            "epoch": k, "t_start_s": e["t_start_s"], "t_end_s": e["t_end_s"],
            "cost_usd_per_h": _f(e["cost_usd_per_h"]), "goodput_tok_per_s": _f(e["goodput_tok_per_s"]),
            "slo_attainment": float(met[sel].sum()) / n if n else None, "arrived": n,
            "slo_attainment_by_model": by_model,
            "instances_started": e.get("instances_started"), "instances_stopped": e.get("instances_stopped"),
            "plan_cost_usd_per_h": p.cost_usd_per_h if p else None, "plan_alpha": p.alpha if p else None,
            "solve_s": p.solve_s if p else None,
        })
    per_model = {}
    for name, m in s["per_model"].items():
        pre, dec = m["prefill"], m["decode"]
        per_model[name] = {
            "cost_usd_per_h": m["cost_usd_per_h"], "prefill_cost_usd_per_h": pre["cost_usd_per_h"],
            "decode_cost_usd_per_h": dec["cost_usd_per_h"], "goodput_tok_per_s": m["goodput_tok_per_s"],
            "slo_attainment": _f(m["slo_attainment"]), "ttft_slo_attainment": _f(pre["slo_attainment"]),
            "tpot_slo_attainment": _f(dec["slo_attainment"]), "ttft_p50_s": _f(m["ttft_s"].get("p50")),
            "ttft_p99_s": _f(m["ttft_s"].get("p99")), "tpot_p50_s": _f(m["tpot_s"].get("p50")),
            "tpot_p99_s": _f(m["tpot_s"].get("p99")), "prefill_utilization": _f(pre["utilization"]),
            "decode_utilization": _f(dec["utilization"]), "decode_tok_per_s": dec["tokens_per_s"],
            "rate_per_s": scenario.model(name).rate_per_s, "requests": m["requests"],
            "attainment_target": scenario.model(name).slo.attainment,
            "worst_epoch_attainment": min((e["slo_attainment_by_model"][name] for e in epochs
                                           if e["slo_attainment_by_model"].get(name) is not None), default=None),
        }
    cost, good = s["cost_usd_per_h"], s["goodput_tok_per_s"]
    solve = [p.solve_s for p in plans]
    return {
        "method": method, "label": label,
        "slo_attainment_target": min(m.slo.attainment for m in scenario.models),
        "cost_usd_per_h": cost, "goodput_tok_per_s": good, "slo_attainment": _f(s["slo_attainment"]),
        "slo_attainment_arrived": _f(s["slo_attainment_arrived"]),
        # $ per million SLO-meeting tokens: the paper's "goodput-normalized hourly cost"
        "usd_per_mtok_good": cost / (good * 3600 / 1e6) if good > 0 else None,
        "plan_cost_usd_per_h": float(np.mean([p.cost_usd_per_h for p in plans])),
        "solve_s_mean": float(np.mean(solve)), "solve_s_max": float(np.max(solve)),
        "requests": s["requests"], "per_epoch": epochs, "per_model": per_model,
        "plans": [plan_record(p) for p in plans],
        **({"spot": s["spot"]} if s.get("spot") is not None else {}),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def cost_comparison(methods: Mapping[str, Mapping[str, Any]], ref: str = "coral") -> dict[str, Any]:
    """Baseline / Coral ratios of mean simulated cost and mean plan cost, and who was cheapest per epoch."""
    c = methods[ref]
    out: dict[str, Any] = {"cost_ratio": {}, "plan_cost_ratio": {}}
    for name, r in methods.items():
        if name == ref:
            continue
        out["cost_ratio"][name] = ratio(r["cost_usd_per_h"], c["cost_usd_per_h"])
        out["plan_cost_ratio"][name] = ratio(r["plan_cost_usd_per_h"], c["plan_cost_usd_per_h"])
    n_ep = min(len(r["per_epoch"]) for r in methods.values())
    cheapest, cheapest_plan = [], []
    for k in range(n_ep):
        cheapest.append(min(methods, key=lambda m: methods[m]["per_epoch"][k]["cost_usd_per_h"] or math.inf))
        cheapest_plan.append(min(methods, key=lambda m: methods[m]["per_epoch"][k]["plan_cost_usd_per_h"] or math.inf))
    out["cheapest_per_epoch"] = cheapest
    out["cheapest_plan_per_epoch"] = cheapest_plan
    out[f"{ref}_cheapest_every_epoch"] = all(m == ref for m in cheapest)
    out[f"{ref}_cheapest_plan_every_epoch"] = all(m == ref for m in cheapest_plan)
    return out


def goodput_comparison(methods: Mapping[str, Mapping[str, Any]], ref: str = "coral") -> dict[str, Any]:
    """Coral / baseline goodput ratios and baseline / Coral goodput-normalized cost ratios."""
    c = methods[ref]
    return {
        "goodput_ratio": {m: ratio(c["goodput_tok_per_s"], r["goodput_tok_per_s"]) for m, r in methods.items() if m != ref},
        "normalized_cost_ratio": {m: ratio(r["usd_per_mtok_good"], c["usd_per_mtok_good"])
                                  for m, r in methods.items() if m != ref},
        f"{ref}_highest_goodput": max(methods, key=lambda m: methods[m]["goodput_tok_per_s"]) == ref,
    }


# -- experiments -----------------------------------------------------------------------------------

def _methods(session: Session, setup: Setup, methods: Sequence[str], case: str, **kw: Any) -> dict[str, dict[str, Any]]:
    return {m: session.simulate(setup, m, label=f"{case} {m}", **kw) for m in methods}


def _hetero_templates(rec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The distinct heterogeneous templates a run's plans used, with the epochs they ran in."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for k, p in enumerate(rec["plans"]):
        for t in p["templates"]:
            if t["homogeneous"]:
                continue
            key = (t["model"], t["phase"], tuple(t["nodes"]), t["region"])
            entry = seen.setdefault(key, {**{k2: t[k2] for k2 in ("model", "phase", "region", "nodes", "stages",
                                                                    "throughput_tok_per_s", "price_usd_per_h")},
                                          "epochs": [], "max_count": 0})
            entry["epochs"].append(k)
            entry["max_count"] = max(entry["max_count"], t["count"])
    return list(seen.values())


def run_cost(session: Session) -> dict[str, Any]:
    """§6.3: hourly cost per method with abundant GPUs."""
    setup = session.setup(session.config.setup, "abundant")
    methods = _methods(session, setup, ALL_METHODS, "abundant")
    return {"cases": {"abundant": methods}, "comparison": {"abundant": cost_comparison(methods)},
            "coral_hetero_templates": _hetero_templates(methods["coral"]), "library": library_record(setup)}


def run_goodput(session: Session) -> dict[str, Any]:
    """§6.4: goodput and goodput-normalized cost with tight availability (rates throttled to what
    each method's plan can serve)."""
    setup = session.setup(session.config.setup, "tight")
    methods = _methods(session, setup, ALL_METHODS, "tight", throttle=True)
    return {"cases": {"tight": methods}, "comparison": {"tight": goodput_comparison(methods)},
            "availability": availability_record(setup), "library": library_record(setup)}


def run_skew(session: Session) -> dict[str, Any]:
    """§6.5: 80 % of the (unchanged) total rate to the large / small models."""
    setup = session.setup(session.config.setup, "abundant")
    rates = {m.name: m.rate_per_s for m in setup.scenario.models}
    cases, comp, mult = {}, {}, {}
    for variant, heavy in SKEW_GROUPS[session.config.setup].items():
        mult[variant] = heavy_split_multipliers(rates, heavy, SKEW_SHARE)
        cases[variant] = _methods(session, setup, ALL_METHODS, variant, variant=variant,
                                  rate_multipliers=mult[variant])
        comp[variant] = cost_comparison(cases[variant])
    return {"cases": cases, "comparison": comp, "rate_multipliers": mult,
            "heavy_groups": {k: list(v) for k, v in SKEW_GROUPS[session.config.setup].items()},
            "library": library_record(setup)}


def run_helix(session: Session) -> dict[str, Any]:
    """§6.6: Llama-2-70B on Helix's cluster against Helix's reported throughput and the cluster's cost."""
    setup = session.setup("helix", "abundant")
    coral = session.simulate(setup, "coral", label="helix coral")
    sc = setup.scenario
    cluster_cost = sum(n * sc.prices[rc] for rc, n in sc.availability.items() if n and rc in sc.prices)
    gpus = {c.name: c.count for c in sc.configs}
    cluster_gpus = sum(n * gpus[c] for (_, c), n in sc.availability.items() if n)
    used_gpus = [sum(t["count"] * sum(gpus[nd] for nd in t["nodes"]) for t in p["templates"]) for p in coral["plans"]]
    model = next(iter(coral["per_model"].values()))
    helix = {"method": "helix (reported)", "cost_usd_per_h": cluster_cost, "decode_tok_per_s": HELIX_DECODE_TOK_PER_S,
             "gpus": cluster_gpus}
    return {
        "cases": {"helix": {"coral": coral}}, "helix": helix,
        "comparison": {"cost_reduction": 1 - coral["cost_usd_per_h"] / cluster_cost,
                       "throughput_gain": model["decode_tok_per_s"] / HELIX_DECODE_TOK_PER_S - 1,
                       "goodput_vs_helix_throughput": coral["goodput_tok_per_s"] / HELIX_DECODE_TOK_PER_S - 1,
                       "coral_gpus_per_epoch": used_gpus},
        "coral_hetero_templates": _hetero_templates(coral), "library": library_record(setup),
    }


def run_ablation(session: Session) -> dict[str, Any]:
    """§6.7: template-greedy (Coral's templates, per model in isolation) vs the joint ILP."""
    abundant = session.setup(session.config.setup, "abundant")
    tight = session.setup(session.config.setup, "tight")
    a = _methods(session, abundant, ("coral", "template-greedy"), "abundant")
    t = _methods(session, tight, ("coral", "template-greedy"), "tight", throttle=True)
    return {"cases": {"abundant": a, "tight": t},
            "comparison": {"abundant": cost_comparison(a), "tight": goodput_comparison(t)},
            "library": library_record(abundant)}


def run_sensitivity(session: Session) -> dict[str, Any]:
    """§6.8: template count, build time and best efficiency over an n_max x rho grid."""
    cfg = session.config
    n_maxes, rhos = SENSITIVITY_QUICK_GRID if cfg.quick else SENSITIVITY_GRID[cfg.setup]
    testbed = SENSITIVITY_TESTBED[cfg.setup]
    scenario = session.scenario(cfg.setup)
    region = scenario.regions[0]
    rows = []
    for n_max in n_maxes:
        for rho in rhos:
            session.ui.note(f"library n_max={n_max} rho={rho:g}")
            t0 = time.perf_counter()
            if testbed is None:
                setup = session.setup(cfg.setup, "abundant", n_max=n_max, rho=rho)
                lib = setup.library
            else:
                setup = None
                lib = build_library(scenario, jobs=cfg.jobs, cache_dir=_cache_dir(cfg), n_max=n_max, rho=rho,
                                    models=sorted({m for m, _ in testbed}), step=session._library_step)
            wall = time.perf_counter() - t0
            keys = testbed or tuple((m.name, ph) for m in scenario.models for ph in (Phase.PREFILL, Phase.DECODE))
            per = {}
            for model, ph in keys:
                st = next((x for x in lib.stats if x.model == model and x.phase is ph), None)
                best = max((t.throughput_tok_per_s / _price(scenario, region, t.counts) for t in lib.of(model, ph)
                            if _price(scenario, region, t.counts) > 0), default=None)
                per[f"{model}/{ph.value}"] = {"templates": len(lib.of(model, ph)),
                                              "build_s": st.wall_s if st else None,
                                              "best_tok_per_s_per_usd_h": best}
            row: dict[str, Any] = {
                "n_max": n_max, "rho": rho, "templates": sum(v["templates"] for v in per.values()),
                "build_s": sum(v["build_s"] or 0.0 for v in per.values()), "load_s": wall, "per_phase": per,
            }
            if setup is not None:
                try:
                    p = plan(setup, "coral")
                    row.update({"plan_cost_usd_per_h": p.cost_usd_per_h, "plan_alpha": p.alpha, "plan_solve_s": p.solve_s,
                                "plan_status": p.status.value})
                except CoralError as exc:
                    row.update({"plan_cost_usd_per_h": None, "plan_error": str(exc)})
            rows.append(row)
    return {"grid": {"n_max": list(n_maxes), "rho": list(rhos)}, "region": region, "rows": rows,
            "testbed": [f"{m}/{ph.value}" for m, ph in testbed] if testbed else "all (model, phase)"}


SPOT_RATES = (0.5, 1.0, 2.0, 4.0)  # the fitted preemption rate times these (issue 30)
SPOT_METHODS = ("coral", "homo")  # Homo is spot-aware: its columns include the spot markets too
SPOT_COST_SHARE = 0.60  # issue 30's target: spot-on Coral at most this share of on-demand Coral's sim $/h
SPOT_EPOCH_FLOOR = 0.90  # ... with every model at >= this in every epoch (and at its target over the run)


def run_spot(session: Session) -> dict[str, Any]:
    """Issue 30: cost and attainment with spot off, with spot on at the fitted preemption rates, and
    at x0.5 / x2 / x4 those rates, for Coral and a spot-aware Homo; preemptions replayed."""
    base = session.setup(session.config.setup, "abundant")
    setups = [base]  # kept alive: the session keys its runs by the setup's id
    cases = {"on-demand": _methods(session, base, SPOT_METHODS, "on-demand")}
    for x in SPOT_RATES:
        s = dataclasses.replace(base, scenario=with_spot(base.scenario, rate_multiplier=x))
        setups.append(s)
        case = f"spot x{x:g}"
        cases[case] = _methods(session, s, SPOT_METHODS, case, variant=case)
    processes = {f"{r}": {"preemption_per_node_h": o.process.preemption_per_node_h,
                          "co_loss_share": o.process.co_loss_share, "recovery_s": o.process.recovery_s,
                          "source": o.process.source}
                 for (r, _), o in sorted(setups[SPOT_RATES.index(1.0) + 1].scenario.spot.items())}
    return {"cases": cases, "rates": list(SPOT_RATES), "processes": processes,
            "targets": spot_targets(cases), "library": library_record(base)}


def spot_targets(cases: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Issue 30's targets, measured: at the fitted rates Coral keeps every model at its target over
    the run and >= 90 % in every epoch at <= 60 % of on-demand Coral's sim $/h; at x4 every model
    >= 90 % over the run, or the plan fell back to on-demand."""
    on, fit, x4 = cases["on-demand"]["coral"], cases.get("spot x1", {}).get("coral"), cases.get("spot x4", {}).get("coral")
    out: dict[str, Any] = {}
    if fit is not None:
        share = ratio(fit["cost_usd_per_h"], on["cost_usd_per_h"])
        run_ok = all((m["slo_attainment"] or 0) >= m["attainment_target"] for m in fit["per_model"].values())
        epoch_ok = all((m["worst_epoch_attainment"] or 0) >= SPOT_EPOCH_FLOOR for m in fit["per_model"].values())
        out["fitted"] = {"cost_share_of_on_demand": share, "cost_ok": share is not None and share <= SPOT_COST_SHARE,
                         "every_model_at_target": run_ok, "every_epoch_at_90": epoch_ok}
    if x4 is not None:
        spot_usd = (x4.get("spot") or {}).get("cost_usd", {}).get("spot", 0.0)
        out["x4"] = {"every_model_at_90": all((m["slo_attainment"] or 0) >= SPOT_EPOCH_FLOOR
                                              for m in x4["per_model"].values()),
                     "fell_back_to_on_demand": not spot_usd}
    return out


def _cache_dir(cfg: RunConfig) -> Path:
    return cfg.cache_dir or default_cache_dir()


def _price(scenario: Scenario, region: str, counts: Mapping[str, int]) -> float:
    total = 0.0
    for c, n in counts.items():
        p = scenario.prices.get((region, c))
        if p is None:
            return 0.0  # not sold there
        total += n * p
    return total


def library_record(setup: Setup) -> dict[str, Any]:
    """How big the setup's library is and what it took to build."""
    return {"templates": len(setup.library.templates), "load_s": setup.library_s,
            "per_phase": {f"{s.model}/{s.phase.value}": {"kept": s.kept, "multisets": s.multisets, "build_s": s.wall_s,
                                                          "cached": s.cached} for s in setup.library.stats}}


def availability_record(setup: Setup) -> dict[str, int]:
    return {f"{r}/{c}": n for (r, c), n in sorted(setup.availability.items()) if n}


RUNNERS: Mapping[str, Callable[[Session], dict[str, Any]]] = {
    "cost": run_cost, "goodput": run_goodput, "skew": run_skew, "helix": run_helix, "ablation": run_ablation,
    "sensitivity": run_sensitivity, "spot": run_spot,
}


def run_experiment(name: str, session: Session) -> dict[str, Any]:
    """Run one experiment and return its JSON-able result (without the provenance header).

    Raises:
        CoralError: an unknown experiment, or anything the pipeline raises.
    """
    if name not in RUNNERS:
        raise CoralError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}, all")
    t0 = time.perf_counter()
    out = RUNNERS[name](session)
    out["wall_s"] = time.perf_counter() - t0
    return out
