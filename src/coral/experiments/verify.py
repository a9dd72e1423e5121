"""`coral plan --verify / --calibrate / --attainment`: a plan checked in the simulator before it is
applied, capacity raised where the prediction misses, and the cost of each attainment target."""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coral.allocator import Plan
from coral.allocator.demand import capacity_targets
from coral.atomic import write_bytes
from coral.errors import CoralError
from coral.experiments.pipeline import plan as solve
from coral.experiments.pipeline import plan_specs, prepare, scaled_scenario
from coral.perf.model import Phase
from coral.sim import SimResult, simulate
from coral.slo import Slo, component_quantile, phase_attainment, request_attainment
from coral.workload import build_workload

Group = tuple[str, Phase]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """One (model, phase)'s predicted attainment (TTFT for prefill, TPOT for decode) and the model's
    joint one (both SLOs), against the targets the plan was sized for."""

    model: str
    phase: Phase
    attainment: float  # this phase's SLO alone
    phase_target: float  # what the phase was sized to (half the allowed misses)
    model_attainment: float  # both SLOs
    model_target: float
    requests: int

    @property
    def ok(self) -> bool:
        return self.model_attainment >= self.model_target

    @property
    def phase_ok(self) -> bool:
        return self.attainment >= self.phase_target


def verify_plan(setup: Any, plan: Plan, *, duration_s: float | None = None, seed: int = 0) -> list[Verdict]:
    """Simulate `plan` (held fixed, every instance ready) for one epoch of the scenario's traffic.

    Raises:
        CoralError: the traffic can't be generated, or the plan serves no model at all.
    """
    scenario = setup.scenario
    span = float(duration_s or scenario.planner.epoch_s)
    # The plan held fixed for its one epoch: spot instances run as on-demand ones here (no
    # preemption; their counted capacity already carries the survival discount, and prices do
    # not enter the verdicts). `coral simulate` replays preemptions.
    specs = [dataclasses.replace(s, spot=False) for s in plan_specs(plan)]
    if not specs:
        raise CoralError("the plan has no instances to verify")
    traces = build_workload({m.name: m.workload for m in scenario.models}, duration_s=span, seed=seed,
                            base_dir=scenario.base_dir)
    result = simulate(scenario, traces, specs, lambda now, demand, running, window: running, duration_s=span,
                      epoch_s=span, init_s=scenario.planner.init_s, seed=seed, router=scenario.planner.router)
    return result_verdicts(result, {m.name: m.slo for m in scenario.models})


def result_verdicts(result: SimResult, slos: Mapping[str, Slo]) -> list[Verdict]:
    """Each (model, phase)'s attainment in `result` against the targets its SLO sets, read as the
    simulator's summary reads it (`coral.slo.phase_attainment` / `request_attainment`: met over the
    resolved requests, those finished or failed; a model none of whose requests is resolved yet
    counts 0). Models without requests in the run are left out."""
    out = []
    met = result.slo_met
    for i, name in enumerate(result.models):
        sel = result.model == i
        n = int(sel.sum())
        if n == 0 or name not in slos:
            continue
        slo = slos[name]
        joint = request_attainment(met[sel], result.finished[sel], result.failed[sel]) or 0.0
        for ph in (Phase.PREFILL, Phase.DECODE):
            latency_s, reached = result.phase_latency_s(ph)
            a = phase_attainment(latency_s[sel], slo.ms(ph) / 1e3, reached[sel], result.failed[sel]) or 0.0
            out.append(Verdict(model=name, phase=ph, attainment=a, phase_target=component_quantile(slo.attainment),
                               model_attainment=joint, model_target=slo.attainment, requests=n))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationStep:
    iteration: int
    cost_usd_per_h: float
    boost: Mapping[Group, float]
    verdicts: tuple[Verdict, ...]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)


def calibrate_plan(setup: Any, method: str, *, iterations: int = 4, factor: float = 1.25, seed: int = 0,
                   options: Any = None, on_step: Callable[[CalibrationStep], None] | None = None,
                   mode: str = "auto") -> tuple[Plan, list[CalibrationStep]]:
    """Verify, and while a model misses its target raise the capacity of its phases that miss
    theirs (by `factor`, compounding) and re-solve; at most `iterations` re-solves.

    Args:
        mode: the serving mode each plan is made in (`coral.allocator.inputs.MODES`).

    Returns:
        The last plan and every step (the first is the plan as sized); the caller checks the last
        step's `ok`.
    """
    if iterations < 0:
        raise CoralError(f"--iterations must be >= 0, got {iterations}")
    boost: dict[Group, float] = {}
    current = solve(setup, method, options=options, mode=mode)
    steps: list[CalibrationStep] = []
    for it in range(iterations + 1):
        verdicts = verify_plan(setup, current, seed=seed)
        step = CalibrationStep(iteration=it, cost_usd_per_h=current.cost_usd_per_h, boost=dict(boost),
                               verdicts=tuple(verdicts))
        steps.append(step)
        if on_step:
            on_step(step)
        if step.ok or it == iterations:
            break
        missing = [v for v in verdicts if not v.ok]
        raise_pairs = [(v.model, v.phase) for v in missing if not v.phase_ok] or [(v.model, v.phase) for v in missing]
        for g in raise_pairs:
            boost[g] = boost.get(g, 1.0) * factor
        targets = capacity_targets(setup.scenario, boost=boost, library=setup.library)
        current = solve(setup, method, demand={g: t.capacity_tok_per_s for g, t in targets.items()}, options=options,
                        mode=mode)
    return current, steps


def attainment_costs(scenario_name: str, targets: Sequence[float], *, method: str, demand_scale: float,
                     availability: str, jobs: int, cache_dir: Any, options: Any = None,
                     on_target: Callable[[float, Plan | str], None] | None = None) -> list[tuple[float, Plan | str]]:
    """The plan at each scenario-wide attainment target (per-model overrides are replaced), or, for a
    target no plan can reach, why (the `CoralError`'s message): the sweep shows where the SLOs stop
    being reachable instead of failing as a whole."""
    out: list[tuple[float, Plan | str]] = []
    for a in targets:
        if not 0 < a < 1:
            raise CoralError(f"--attainment values must be in (0, 1), got {a:g}")
    base = scaled_scenario(scenario_name, demand_scale)
    models = [{**m, "slo_attainment": None} for m in base.source.model_dump()["models"]]
    for a in targets:
        scenario = scaled_scenario(scenario_name, demand_scale, {"slo_attainment": a, "models": models})
        p: Plan | str
        try:
            setup = prepare(scenario, availability=availability, jobs=jobs, cache_dir=cache_dir)
            p = solve(setup, method, options=options)
        except CoralError as exc:
            p = str(exc)
        out.append((a, p))
        if on_target:
            on_target(a, p)
    return out


def attainment_figure(rows: Sequence[tuple[float, float | None]], title: str) -> Any:
    """$/h against the attainment target, as a matplotlib figure; a target no plan reaches (cost
    None) is drawn as a dotted line marked "unreachable" at its place on the axis, not left out."""
    # lazy: matplotlib (only when plotting)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (only when plotting)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    solved = [(a * 100, c) for a, c in rows if c is not None]
    ax.plot([x for x, _ in solved], [c for _, c in solved], marker="o")
    for x, c in solved:
        ax.annotate(f"${c:,.0f}", (x, c), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    for a in (target for target, cost in rows if cost is None):
        ax.axvline(a * 100, color="tab:red", linestyle=":", linewidth=1.2)
        ax.plot([a * 100], [0.6], marker="x", color="tab:red", transform=ax.get_xaxis_transform(), clip_on=False)
        ax.text(a * 100, 0.04, f"{a:.1%}: unreachable ", transform=ax.get_xaxis_transform(), color="tab:red",
                rotation=90, ha="right", va="bottom", fontsize=8)
    ax.set_xlabel("attainment target (% of requests within both SLOs)")
    ax.set_ylabel("plan $/h")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_attainment_costs(rows: Sequence[tuple[float, float | None]], path: Any, title: str) -> None:
    """`attainment_figure` written atomically to `path` (PNG)."""
    # lazy: matplotlib (only when plotting)
    import matplotlib.pyplot as plt

    fig = attainment_figure(rows, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_bytes(path, buf.getvalue())
