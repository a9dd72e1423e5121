"""The fidelity study's calibration: the scenario and templates of the runtime's layout on this host,
the calibration requests, and the fit of the engine's node time on them."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coral.catalog import builtin_catalog
from coral.experiments.fidelity_perf import EnginePerf
from coral.experiments.fidelity_report import ape
from coral.perf import Phase, Shape
from coral.scenario import parse_scenario, resolve
from coral.templates.planning import plan_inputs
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template
from coral.workload import Trace

__all__ = [
    "CAL_LENGTHS", "CAL_LIKE_S", "CAL_ROUNDS", "LIKE", "calibration_trace", "fit_node_time", "runtime_templates", "study_scenario",
    "work_s",
]


def study_scenario(model: str, spec_path: Path, node: str, csv_path: Path, prompt_mean: float, output_mean: float, rate: float) -> Any:
    cat = builtin_catalog()
    regions = sorted({r for (r, c) in cat.offers if c == cat.config(node).name}) or sorted({r for (r, _) in cat.offers})
    data = {
        "name": "fidelity", "description": "simulator fidelity against the local runtime",
        "models": [{"name": model, "spec": str(spec_path.resolve()), "ttft_ms": 1000.0, "tpot_ms": 100.0,
                    "workload": {"rate_per_s": rate, "dataset": "synthetic", "prompt_tokens_mean": prompt_mean, "output_tokens_mean": output_mean}}],
        "configs": [node], "regions": [{"name": regions[0], "prices": {node: 1.0}}],
        "perf": {"backend": "profile", "profile": str(csv_path.resolve())},
    }  # fmt: skip
    return resolve(parse_scenario(data, "fidelity scenario"))


def runtime_templates(scenario: Any, layout: Any, node: str, prompt_mean: float, output_mean: float, prefill_batch: int,
               decode_batch: int) -> dict[str, Any]:
    """Templates whose placements are exactly the runtime's instances; Θ at the nominal shape (b = 1)."""
    served = scenario.models[0]
    spec, perf, cfg = served.spec, scenario.perf, scenario.config(node)
    out = {}
    for inst in layout:
        phase = Phase(inst.phase)
        shape = Shape(phase=phase, batch=1, prompt_tokens=prompt_mean, output_tokens=output_mean)
        stages, k, last = [], 0, len(inst.stages) - 1
        for s, st in enumerate(inst.stages):
            tau = perf.node_time_s(cfg, spec, shape, st.end - st.start, first=s == 0, last=s == last)
            stages.append(Stage(nodes=(cfg.name,) * st.nodes, node_index=tuple(range(k, k + st.nodes)), layers=st.end - st.start,
                                time_s=tau, throughput_tok_per_s=st.nodes * shape.work_tokens / tau))
            k += st.nodes
        comm = perf.transfer_s(spec, shape, cfg, cfg)
        placement = Placement(stages=tuple(stages), micro_batch=prefill_batch if phase is Phase.PREFILL else decode_batch,
                              throughput_tok_per_s=min(s.throughput_tok_per_s for s in stages),
                              latency_s=sum(s.time_s for s in stages) + comm * last, comm_s=comm)
        out[inst.name] = Template(model=served.name, phase=phase, slo_ms=served.slo_ms(phase),
                                  budget_ms=plan_inputs(scenario).of(served.name).budget_ms(phase), nodes=(cfg.name,) * k,
                                  placement=placement)
    return out


def work_s(perf: Any, spec: Any, cfg: Any, prompt: np.ndarray, output: np.ndarray) -> float:
    """Mean engine-seconds one request costs (whole model, alone): sizes the arrival rate."""
    L = spec.num_layers
    tot = 0.0
    for p, d in zip(prompt[:500], output[:500], strict=True):
        pre = perf.node_time_s(cfg, spec, Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=float(p), output_tokens=0.0), L,
                               first=True, last=True)
        dec = perf.node_time_s(cfg, spec, Shape(phase=Phase.DECODE, batch=1, prompt_tokens=float(p), output_tokens=float(d)), L,
                               first=True, last=True)
        tot += pre + (d - 1) * dec
    return tot / min(len(prompt), 500)


CAL_LENGTHS = 3  # prompt lengths of the calibration requests (a quarter, half and all of max_prompt)


CAL_ROUNDS = {False: 4, True: 2}  # rounds of isolated requests, and of groups of 2 and 3 (default, quick)


CAL_LIKE_S = {False: 40.0, True: 20.0}  # seconds of held-out traffic at the trace's rate (default, quick)


LIKE = 0  # the group code of the held-out, traffic-like calibration requests


def calibration_trace(perf: Any, spec: Any, cal_spec: Any, name: str, *, max_prompt: int, max_output: int, quick: bool,
                      like: Any = None) -> tuple[Any, np.ndarray]:
    """Requests for `fit_node_time`, and the size of the group each one belongs to (`LIKE` for the
    traffic-like part).

    First isolated requests (each sent after the previous one should have finished: twice its
    estimated time alone apart), prompts at a quarter, half and all of `max_prompt`; then groups
    of 2 and of 3 requests sent 10 ms apart (full prompts), each group alone; then `like`, a
    window of the same dataset at the trace's rate that the trace does not contain (held out),
    so the host is as busy as during the trace."""
    lengths = np.linspace(max(1, max_prompt // 4), max_prompt, CAL_LENGTHS).astype(np.int64)
    rounds = CAL_ROUNDS[quick]
    alone = work_s(perf, spec, cal_spec, np.array([max_prompt]), np.array([max_output]))
    arrival, prompt, group = [], [], []
    t = 0.0
    for p in np.tile(lengths, rounds):
        arrival.append(t)
        prompt.append(int(p))
        group.append(1)
        t += 2.0 * alone + 0.1
    for size in [2, 3] * rounds:
        for k in range(size):
            arrival.append(t + 0.01 * k)
            prompt.append(max_prompt)
            group.append(size)
        t += 2.0 * size * alone + 0.1
    if like is not None and len(like):
        t += 1.0
        arrival += (t + like.arrival_s).tolist()
        prompt += like.prompt_tokens.tolist()
        group += [LIKE] * len(like)
        t += float(like.window_s or like.arrival_s[-1]) + 2.0 * alone + 1.0
    arr = np.array(arrival, dtype=np.float64)
    out = np.full(arr.size, max_output, dtype=np.int64)
    if like is not None and len(like):
        out[-len(like):] = like.output_tokens
    trace = Trace(name=name, arrival_s=arr, prompt_tokens=np.array(prompt, dtype=np.int64), output_tokens=out, window_s=t)
    return trace, np.array(group)


def fit_node_time(perf: EnginePerf, recs: list[Any], group: np.ndarray,
               simulate_cal: Callable[[EnginePerf, tuple[float, float]], tuple[np.ndarray, np.ndarray]],
               frontend_work: tuple[float, float]) -> tuple[dict[str, Any], np.ndarray, np.ndarray, EnginePerf]:
    """Fit one node-time multiplier per phase (`EnginePerf.scale`) on the isolated calibration requests.

    The profile times layers in a tight loop, while the runtime's engines also pay for waking on
    a message, (de)serialising real hidden states and growing the KV cache. The calibration
    schedule runs before and after the trace (the host's speed drifts over minutes; see
    docs/results/fidelity.md), and both rounds are fitted together. Fixed point: scale <- scale x real /
    simulated mean (the simulated times also hold unscaled hops, so one step is not exact);
    clamped to [0.5, 3]. Each step simulates a new perf object; `perf` is not changed.

    `frontend_work` (s per request, s per token; `Hosts.frontend_work`) is measured, not fitted:
    the CPU the serve process (HTTP, coordinator) and the client spent per generated token over
    the calibration requests. It is in place while fitting, and the groups of 2 and 3 requests
    show how well the two together predict requests in flight at once (`after.groups`).

    Returns:
        (what the fit found, the simulated TTFT and TPOT of the calibration requests with it, the fitted perf).
    """
    ok = np.array([not r.error for r in recs])
    iso, multi, like = ok & (group == 1), ok & (group > 1), ok & (group == LIKE)
    # Fitted on the isolated requests. Fitting on the held-out traffic instead (the host as busy as
    # in the trace) measured no better over three quiet runs each (docs/results/fidelity.md); that traffic
    # is replayed and reported as a check next to the groups.
    real_ttft = np.array([r.ttft_s for r in recs])
    real_tpot = np.array([r.tpot_s for r in recs])

    def sim(p: EnginePerf, work: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
        ttft, tpot = simulate_cal(p, work)
        return ttft + p.frontend_s, tpot

    def mape(st: np.ndarray, sp: np.ndarray, sel: np.ndarray) -> dict[str, float]:
        if not sel.any():
            return {"ttft_mape": float("nan"), "tpot_mape": float("nan")}
        return {"ttft_mape": float(ape(st[sel], real_ttft[sel]).mean()), "tpot_mape": float(ape(sp[sel], real_tpot[sel]).mean())}

    out: dict[str, Any] = {"requests": int(ok.sum()), "isolated": int(iso.sum()), "in_groups": int(multi.sum()),
                           "like_traffic": int(like.sum()), "fitted_on": "isolated"}
    st, sp = sim(perf, (0.0, 0.0))
    out["before"] = {"isolated": mape(st, sp, iso), "groups": mape(st, sp, multi), "like_traffic": mape(st, sp, like)}
    st, sp = sim(perf, frontend_work)
    if iso.sum() >= 2:
        for _ in range(4):
            fe = perf.frontend_s
            ratio_p = (real_ttft[iso] - fe).sum() / max((st[iso] - fe).sum(), 1e-9)
            ratio_d = real_tpot[iso].sum() / max(sp[iso].sum(), 1e-9)
            perf = perf.calibrated(scale={Phase.PREFILL: float(np.clip(perf.scale[Phase.PREFILL] * ratio_p, 0.5, 3.0)),
                                          Phase.DECODE: float(np.clip(perf.scale[Phase.DECODE] * ratio_d, 0.5, 3.0))})
            st, sp = sim(perf, frontend_work)
    out.update({"prefill_scale": perf.scale[Phase.PREFILL], "decode_scale": perf.scale[Phase.DECODE],
                "frontend_work_ms": {"per_request": frontend_work[0] * 1e3, "per_token": frontend_work[1] * 1e3},
                "after": {"isolated": mape(st, sp, iso), "groups": mape(st, sp, multi), "like_traffic": mape(st, sp, like)}})
    if ok.sum() < len(recs):
        out["note"] = f"{len(recs) - int(ok.sum())} calibration requests failed and were left out"
    return out, st, sp, perf
