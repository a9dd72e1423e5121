"""`coral experiment fidelity`: the simulator against the real runtime on the same trace (the paper's Fig. 6).

The same Azure-conversation trace runs through a local PD-disaggregated cluster of the
runtime (`coral serve` with two prefill and two decode instances, uneven pipelines, one stage
with two data-parallel nodes) and through the simulator, timed by the profile `coral profile`
measured of the same engine on this host. Requests are matched one to one (same arrival
offsets, prompt and output lengths; greedy decoding with no EOS forces the output length).
The simulator runs with the runtime's batching (one micro-batch group per stage, waiting
requests spread over the groups) and a host model (all engine nodes share this machine's cores,
with the front end's CPU measured per token). Calibration requests through the same cluster,
before and after the trace (isolated ones, small groups, and a held-out window of the same
dataset at the trace's rate, never part of the trace), fit one node-time multiplier per phase on
the isolated ones; the simulator routes them
(and the warm-up) first, so its routers stand where the runtime's do when the trace starts.
`--repeat` replays the trace twice to score the runtime against itself.
Outputs in `--out`: summary.json, report.md, fidelity_cdf.png, requests.csv, calibration.csv,
host_load.json (what other processes took from the host while each replay ran), the profile and
the cluster file.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from coral.errors import CoralError

__all__ = ["FidelityOptions", "fidelity", "run_fidelity"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelityOptions:
    """Knobs of one fidelity run (the CLI's options)."""

    out: Path
    model: str = "fid-llama"
    node: str = "1xL4"
    profile: Path | None = None
    data_dir: Path | None = None
    dataset: str = "azure-conv"
    duration_s: float = 150.0
    load: float = 0.35
    max_prompt: int = 384
    max_output: int = 48
    seed: int = 0
    quick: bool = False
    repeat: bool = False  # replay the trace a second time: the runtime's own run-to-run error

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if not 0 < self.load <= 1:
            raise ValueError("load must be in (0, 1]")
        if self.max_prompt < 1 or self.max_output < 2:
            raise ValueError("max_prompt must be >= 1 and max_output >= 2")


QUICK = {"duration_s": 25.0, "max_prompt": 128, "max_output": 16}
# Timed runs per profile point (median kept). The per-stage call, embedding and LM-head costs are
# differences of two timings of a few hundred microseconds; with 3 runs they often came out 0.
PROFILE_REPS = 7


# --------------------------------------------------------------------------- pieces


def _scenario(model: str, spec_path: Path, node: str, csv_path: Path, prompt_mean: float, output_mean: float, rate: float) -> Any:
    from coral.catalog import builtin_catalog
    from coral.scenario import parse_scenario, resolve

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


def _templates(scenario: Any, layout: Any, node: str, prompt_mean: float, output_mean: float, prefill_batch: int,
               decode_batch: int) -> dict[str, Any]:
    """Templates whose placements are exactly the runtime's instances; Θ at the nominal shape (b = 1)."""
    from coral.perf import Phase, Shape
    from coral.scenario.traffic import template_budget_ms
    from coral.templates.problem import Placement, Stage
    from coral.templates.template import Template

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
                                  budget_ms=template_budget_ms(scenario, served.name, phase), nodes=(cfg.name,) * k,
                                  placement=placement)
    return out


def _work_s(perf: Any, spec: Any, cfg: Any, prompt: np.ndarray, output: np.ndarray) -> float:
    """Mean engine-seconds one request costs (whole model, alone): sizes the arrival rate."""
    from coral.perf import Phase, Shape

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


def _calibration_trace(perf: Any, spec: Any, cal_spec: Any, name: str, opts: FidelityOptions,
                       like: Any = None) -> tuple[Any, np.ndarray]:
    """Requests for `_calibrate`, and the size of the group each one belongs to (`LIKE` for the
    traffic-like part).

    First isolated requests (each sent after the previous one should have finished: twice its
    estimated time alone apart), prompts at a quarter, half and all of `max_prompt`; then groups
    of 2 and of 3 requests sent 10 ms apart (full prompts), each group alone; then `like`, a
    window of the same dataset at the trace's rate that the trace does not contain (held out),
    so the host is as busy as during the trace."""
    from coral.workload import Trace

    lengths = np.linspace(max(1, opts.max_prompt // 4), opts.max_prompt, CAL_LENGTHS).astype(np.int64)
    rounds = CAL_ROUNDS[opts.quick]
    alone = _work_s(perf, spec, cal_spec, np.array([opts.max_prompt]), np.array([opts.max_output]))
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
            prompt.append(opts.max_prompt)
            group.append(size)
        t += 2.0 * size * alone + 0.1
    if like is not None and len(like):
        t += 1.0
        arrival += (t + like.arrival_s).tolist()
        prompt += like.prompt_tokens.tolist()
        group += [LIKE] * len(like)
        t += float(like.window_s or like.arrival_s[-1]) + 2.0 * alone + 1.0
    arr = np.array(arrival, dtype=np.float64)
    out = np.full(arr.size, opts.max_output, dtype=np.int64)
    if like is not None and len(like):
        out[-len(like):] = like.output_tokens
    trace = Trace(name=name, arrival_s=arr, prompt_tokens=np.array(prompt, dtype=np.int64), output_tokens=out, window_s=t)
    return trace, np.array(group)


def _calibrate(perf: Any, recs: list[Any], group: np.ndarray,
               simulate_cal: Callable[[tuple[float, float]], tuple[np.ndarray, np.ndarray]],
               frontend_work: tuple[float, float]) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Fit one node-time multiplier per phase (`perf.scale`) on the isolated calibration requests.

    The profile times layers in a tight loop, while the runtime's engines also pay for waking on
    a message, (de)serialising real hidden states and growing the KV cache. The calibration
    schedule runs before and after the trace (the host's speed drifts over minutes; see
    docs/fidelity.md), and both rounds are fitted together. Fixed point: scale <- scale x real /
    simulated mean (the simulated times also hold unscaled hops, so one step is not exact);
    clamped to [0.5, 3].

    `frontend_work` (s per request, s per token; `Hosts.frontend_work`) is measured, not fitted:
    the CPU the serve process (HTTP, coordinator) and the client spent per generated token over
    the calibration requests. It is in place while fitting, and the groups of 2 and 3 requests
    show how well the two together predict requests in flight at once (`after.groups`).
    """
    from coral.perf import Phase

    ok = np.array([not r.error for r in recs])
    iso, multi, like = ok & (group == 1), ok & (group > 1), ok & (group == LIKE)
    # Fitted on the isolated requests. Fitting on the held-out traffic instead (the host as busy as
    # in the trace) measured no better over three quiet runs each (docs/fidelity.md); that traffic
    # is replayed and reported as a check next to the groups.
    real_ttft = np.array([r.ttft_s for r in recs])
    real_tpot = np.array([r.tpot_s for r in recs])

    def sim(work: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
        ttft, tpot = simulate_cal(work)
        return ttft + perf.frontend_s, tpot

    def mape(st: np.ndarray, sp: np.ndarray, sel: np.ndarray) -> dict[str, float]:
        if not sel.any():
            return {"ttft_mape": float("nan"), "tpot_mape": float("nan")}
        return {"ttft_mape": float(_ape(st[sel], real_ttft[sel]).mean()), "tpot_mape": float(_ape(sp[sel], real_tpot[sel]).mean())}

    out: dict[str, Any] = {"requests": int(ok.sum()), "isolated": int(iso.sum()), "in_groups": int(multi.sum()),
                           "like_traffic": int(like.sum()), "fitted_on": "isolated"}
    st, sp = sim((0.0, 0.0))
    out["before"] = {"isolated": mape(st, sp, iso), "groups": mape(st, sp, multi), "like_traffic": mape(st, sp, like)}
    st, sp = sim(frontend_work)
    if iso.sum() >= 2:
        for _ in range(4):
            fe = perf.frontend_s
            ratio_p = (real_ttft[iso] - fe).sum() / max((st[iso] - fe).sum(), 1e-9)
            ratio_d = real_tpot[iso].sum() / max(sp[iso].sum(), 1e-9)
            perf.scale[Phase.PREFILL] = float(np.clip(perf.scale[Phase.PREFILL] * ratio_p, 0.5, 3.0))
            perf.scale[Phase.DECODE] = float(np.clip(perf.scale[Phase.DECODE] * ratio_d, 0.5, 3.0))
            st, sp = sim(frontend_work)
    out.update({"prefill_scale": perf.scale[Phase.PREFILL], "decode_scale": perf.scale[Phase.DECODE],
                "frontend_work_ms": {"per_request": frontend_work[0] * 1e3, "per_token": frontend_work[1] * 1e3},
                "after": {"isolated": mape(st, sp, iso), "groups": mape(st, sp, multi), "like_traffic": mape(st, sp, like)}})
    if ok.sum() < len(recs):
        out["note"] = f"{len(recs) - int(ok.sum())} calibration requests failed and were left out"
    return out, st, sp


@dataclass(frozen=True, slots=True)
class _Tail:
    """The last `n` requests of a simulation: the trace, after the requests routed before it."""

    full: Any
    n: int

    @property
    def ttft_s(self) -> np.ndarray:
        return np.asarray(self.full.ttft_s[-self.n:])

    @property
    def tpot_s(self) -> np.ndarray:
        return np.asarray(self.full.tpot_s[-self.n:])

    @property
    def prefill_instance(self) -> np.ndarray:
        return np.asarray(self.full.prefill_instance[-self.n:])

    @property
    def decode_instance(self) -> np.ndarray:
        return np.asarray(self.full.decode_instance[-self.n:])


def _repeatability(first: list[Any], second: list[Any] | None) -> dict[str, Any] | None:
    """The second real replay against the first, per request, as the simulator is judged: the
    error no model of this runtime can go below on this host."""
    if second is None:
        return None
    ok = np.array([not (a.error or b.error) for a, b in zip(first, second, strict=True)])
    if not ok.any():
        return None
    t1, t2 = (np.array([r.ttft_s for r in x])[ok] for x in (first, second))
    p1, p2 = (np.array([r.tpot_s for r in x])[ok] for x in (first, second))
    return {"requests": int(ok.sum()), "ttft_mape": float(_ape(t2, t1).mean()), "tpot_mape": float(_ape(p2, p1).mean()),
            "ttft_p90_ape": float(np.percentile(_ape(t2, t1), 90)), "tpot_p90_ape": float(np.percentile(_ape(p2, p1), 90)),
            # the percentile errors the simulator is judged by, of the second run against the first
            "ttft_error_of": _compare(t1, t2)["error_of"], "tpot_error_of": _compare(p1, p2)["error_of"]}


STEP_CONCURRENCY = 3  # step tables bin the micro-batches in flight elsewhere at a step's midpoint: 0, 1, 2, 3+


def _read_steps(folder: Path, start: float, end: float) -> list[tuple[str, str, int, int, float, float]]:
    """The runtime's micro-batches (`Scheduler(step_trace=...)` files) dispatched in [start, end)
    (monotonic s), as (instance, phase, requests, tokens or context, start, end), times from `start`."""
    out = []
    for f in sorted(folder.glob("*.steps.csv")):
        with open(f, newline="") as fh:
            for row in csv.reader(fh):
                inst, phase, _g, _bid, n, tok, ctx, t0, t1 = row
                if start <= float(t0) < end:
                    out.append((inst, phase, int(n), int(tok) if phase == "prefill" else int(ctx), float(t0) - start, float(t1) - start))
    return out


def _step_table(steps: list[tuple[str, str, int, int, float, float]]) -> dict[str, Any]:
    """Per phase: micro-batches and request passes (requests summed over them); median step time (ms)
    and count per number of other micro-batches in flight at the step's midpoint (0 ..
    STEP_CONCURRENCY+), per batch size; micro-batches per instance."""
    t0 = np.array([x[4] for x in steps])
    t1 = np.array([x[5] for x in steps])
    out: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        sel = [i for i, x in enumerate(steps) if x[1] == phase]
        by_k: dict[str, list[float]] = {}
        by_b: dict[str, list[float]] = {}
        for i in sel:
            mid = 0.5 * (t0[i] + t1[i])
            k = min(int(((t0 < mid) & (t1 > mid)).sum()) - 1, STEP_CONCURRENCY)
            by_k.setdefault(f"{k}{'+' if k == STEP_CONCURRENCY else ''}", []).append((t1[i] - t0[i]) * 1e3)
            by_b.setdefault(str(steps[i][2]), []).append((t1[i] - t0[i]) * 1e3)
        out[phase] = {"steps": len(sel), "request_passes": sum(steps[i][2] for i in sel),
                      "by_concurrency": {k: {"n": len(v), "median_ms": float(np.median(v))} for k, v in sorted(by_k.items())},
                      "by_batch": {b: {"n": len(v), "median_ms": float(np.median(v))} for b, v in sorted(by_b.items(), key=lambda kv: int(kv[0]))},
                      "by_instance": {inst: sum(1 for i in sel if steps[i][0] == inst) for inst in sorted({steps[i][0] for i in sel})}}
    return out


def _cores() -> int:
    """CPU cores this process (and the runtime it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _taken_steps(meter: Any, offset: float, cores: float, against: float) -> list[tuple[float, float]]:
    """The cores other processes used in each window of a replay (`CpuMeter.taken`), as `Hosts.taken`
    steps from `offset` on (simulated time of the replay's start), back to 0 after the last window.

    In a window, the others take at most `cores · k / (k + against)`, the share a fair scheduler
    gives their `k` runnable threads (sampled there) against `against` runnable threads of the
    runtime. The runtime's threads sleep between messages and Linux runs a thread that wakes
    from sleep ahead of CPU-bound neighbours, so neighbours that used the cores while the runtime
    slept do not keep them when it wakes: a few busy neighbours barely slow it, many do (measured
    in docs/fidelity.md). The study counts the runtime as one thread per core (`against = cores`)."""
    out: list[tuple[float, float]] = []
    taken = meter.taken
    steps = meter.steps
    for i, (t, used) in enumerate(taken):
        end = taken[i + 1][0] if i + 1 < len(taken) else math.inf
        k = [v for s, v in steps if t <= s < end]
        threads = float(np.mean(k)) if k else meter.background
        out.append((offset + t, float(min(used, cores * threads / (threads + against)))))
    if out:
        out.append((offset + (taken[-1][0] + meter.window_s), 0.0))
    return out


def _runtime_lanes(template: Any) -> int:
    """Micro-batches the runtime's scheduler keeps in flight per instance: one group per stage (`micro_batches: 0`)."""
    return len(template.placement.stages)


def _ape(sim: np.ndarray, real: np.ndarray) -> np.ndarray:
    return np.abs(sim - real) / real


def _pct(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(x)), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99))}


def _compare(real: np.ndarray, sim: np.ndarray) -> dict[str, Any]:
    ape = _ape(sim, real)
    r, s = _pct(real), _pct(sim)
    return {
        "mape": float(ape.mean()), "p50_ape": float(np.percentile(ape, 50)), "p90_ape": float(np.percentile(ape, 90)),
        "real_s": r, "sim_s": s, "error_of": {k: (s[k] - r[k]) / r[k] for k in r},
        # quantile-matched error: what two CDFs side by side show (mean |Q_sim(q) - Q_real(q)| / Q_real(q))
        "cdf_mape": float(np.mean(np.abs(np.sort(sim) - np.sort(real)) / np.sort(real))),
    }  # fmt: skip


def _variant(real_ttft: np.ndarray, real_tpot: np.ndarray, sel: np.ndarray, sim: tuple[Any, np.ndarray, np.ndarray]) -> dict[str, Any]:
    """MAPE and the errors of mean / p50 / p90 / p99 of one simulator variant on the matched requests."""
    _, ttft, tpot = sim
    ok = sel & np.isfinite(tpot)
    if not ok.any():
        return {"ttft_mape": None, "tpot_mape": None}
    t, p = _compare(real_ttft[ok], ttft[ok]), _compare(real_tpot[ok], tpot[ok])
    return {"ttft_mape": t["mape"], "tpot_mape": p["mape"], "ttft_error_of": t["error_of"], "tpot_error_of": p["error_of"]}


def _plot(path: Path, real_ttft: np.ndarray, sim_ttft: np.ndarray, real_tpot: np.ndarray, sim_tpot: np.ndarray,
          base_ttft: np.ndarray | None, base_tpot: np.ndarray | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (name, r, s, b) in zip(axes, (("TTFT", real_ttft, sim_ttft, base_ttft), ("TPOT", real_tpot, sim_tpot, base_tpot)), strict=True):
        y = np.arange(1, len(r) + 1) / len(r)
        ax.plot(np.sort(r) * 1e3, y, label="real runtime", color="black", lw=2)
        ax.plot(np.sort(s) * 1e3, y, label="simulator (engine profile)", color="tab:orange", lw=2, ls="--")
        if b is not None:
            ax.plot(np.sort(b) * 1e3, y, label="simulator (table only)", color="tab:blue", lw=1, ls=":")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.set_xscale("log")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    tmp.replace(path)


# --------------------------------------------------------------------------- the run


def run_fidelity(opts: FidelityOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the study and write its outputs into `opts.out`.

    Returns:
        The summary (also written as summary.json).

    Raises:
        CoralError: the runtime failed to start, no request finished, a bad option.
    """
    from coral.experiments.fidelity_perf import load_engine_perf
    from coral.experiments.fidelity_profile import resolve_runtime_model
    from coral.experiments.fidelity_runtime import (
        CpuMeter,
        Served,
        cluster_file,
        default_layout,
        proc_cpu_s,
        replay,
        runtime_overhead,
    )
    from coral.experiments.profile_cmd import run_profile
    from coral.perf import Phase
    from coral.policy import InstanceSpec
    from coral.sim import Hosts, simulate
    from coral.workload import Trace, cut, load_dataset, scale_to_rate

    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    name, config = resolve_runtime_model(opts.model)
    ctx = int(config.get("max_position_embeddings", 2048))
    if opts.max_prompt + opts.max_output > ctx:
        raise CoralError(f"max_prompt + max_output = {opts.max_prompt + opts.max_output} exceeds the model's context {ctx}")
    spec_path = out / "model" / "config.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}
    hf = {"architectures": [arch.get(config["model_type"], "LlamaForCausalLM")], "torch_dtype": "float32",
          **{k: v for k, v in config.items() if k != "eos_token_id"}}
    spec_path.write_text(json.dumps(hf, indent=2) + "\n")

    # 1. profile the engine on this host
    csv_path = opts.profile
    if csv_path is None:
        csv_path = out / "profile.csv"
        top = opts.max_prompt
        prompts = sorted({min(p, top) for p in (16, 64, 128, 256, 384)} | {top}) if not opts.quick else sorted({16, top // 2, top})
        contexts = sorted({32, top // 2, top + opts.max_output // 2, top + opts.max_output - 4})
        say(f"profiling {name} on this host -> {csv_path}")
        run_profile(opts.model, opts.node, csv_path, name=name, batches="1,2" if opts.quick else "1,2,4",
                    prompt_tokens=",".join(map(str, prompts)), decode_batches="1,4" if opts.quick else "1,4,16",
                    contexts=",".join(map(str, contexts)), device="cpu", reps=PROFILE_REPS, progress=None)

    # 2. the trace, clipped to the model's context and scaled to the cluster's capacity
    loaded = load_dataset(opts.dataset, opts.data_dir).trace
    prompt = np.clip(loaded.prompt_tokens, 1, opts.max_prompt)
    output = np.clip(loaded.output_tokens, 2, opts.max_output)
    base = Trace(name=name, arrival_s=loaded.arrival_s, prompt_tokens=prompt, output_tokens=output, window_s=loaded.window_s)
    scenario = _scenario(name, spec_path, opts.node, csv_path, float(prompt.mean()), float(output.mean()), 1.0)
    engine = load_engine_perf(csv_path, scenario.catalog, fallback=scenario.perf.fallback)
    cfg = scenario.config(opts.node)
    cores = _cores()
    work = _work_s(engine, scenario.models[0].spec, cfg, prompt, output)
    rate = opts.load * cores / work
    scaled = scale_to_rate(base, rate)
    trace = cut(scaled, 0.0, opts.duration_s)
    # held out for the calibration: a later window of the same traffic, after the trace's (wrapping
    # round to the start only if the dataset is too short, never overlapping the trace)
    like_s = CAL_LIKE_S[opts.quick]
    span = float(scaled.window_s or scaled.arrival_s[-1])
    like = cut(scaled, opts.duration_s + 1.0, opts.duration_s + 1.0 + like_s) if span >= opts.duration_s + 1.0 + like_s else None
    if len(trace) < 5:
        raise CoralError(f"only {len(trace)} requests in {opts.duration_s:g} s at {rate:.2f} req/s; run longer")
    p_mean, d_mean = float(trace.prompt_tokens.mean()), float(trace.output_tokens.mean())
    scenario = dataclasses.replace(scenario, models=(dataclasses.replace(scenario.models[0], rate_per_s=rate,
                                                                         prompt_tokens_mean=p_mean, output_tokens_mean=d_mean),))
    sc_engine = dataclasses.replace(scenario, perf=engine)
    say(f"trace: {len(trace)} requests over {opts.duration_s:g} s ({rate:.2f} req/s for {opts.load:.0%} of {cores} cores; "
        f"{work * 1e3:.0f} engine-ms per request), prompt mean {p_mean:.0f}, output mean {d_mean:.1f}")

    # 3. templates = the runtime's placements
    layout = default_layout(int(config["num_hidden_layers"]))
    prefill_batch = max(1, 4096 // opts.max_prompt)  # the runtime scheduler's 4096-token micro-batch cap
    templates = _templates(sc_engine, layout, opts.node, p_mean, d_mean, prefill_batch, 64)
    region = scenario.regions[0]
    initial = [InstanceSpec(template=templates[i.name], region=region) for i in layout]

    # 4. the real runtime
    cluster = cluster_file(name, config, layout, {k: t.throughput_tok_per_s for k, t in templates.items()})
    say("measuring the runtime's own overhead (same cluster, no-maths engines) ...")
    noop_ttft, noop_tpot = runtime_overhead(cluster)
    lat = engine.host.activation.latency_s
    pre = [i for i in layout if i.phase == "prefill"]
    dec = [i for i in layout if i.phase == "decode"]
    modelled_ttft = (4 + float(np.mean([len(i.stages) - 1 for i in pre]))) * lat
    modelled_step = (2 + float(np.mean([len(i.stages) - 1 for i in dec]))) * lat
    engine.frontend_extra_s = max(0.0, noop_ttft - modelled_ttft)
    engine.step_extra_s = max(0.0, noop_tpot - modelled_step)
    say(f"no-maths runtime: TTFT {noop_ttft * 1e3:.2f} ms, TPOT {noop_tpot * 1e3:.2f} ms -> front end +{engine.frontend_extra_s * 1e3:.2f} ms, "
        f"decode step +{engine.step_extra_s * 1e3:.2f} ms beyond the modelled messages")
    say("starting the local cluster (coral serve) ...")
    t_rt = time.perf_counter()
    starts: dict[str, float] = {}  # time.perf_counter() (= the schedulers' monotonic clock) at each replay's start
    with Served(cluster, out, step_trace_dir=out / "steps") as srv:
        say(f"serving at {srv.url} after {time.perf_counter() - t_rt:.1f} s; warming up")
        warm_at = np.arange(2 * len(layout)) * 0.3
        replay(srv.url, name, warm_at, np.full(warm_at.size, opts.max_prompt), np.full(warm_at.size, opts.max_output),
               vocab_size=int(config["vocab_size"]), seed=opts.seed + 1)
        cal, cal_group = _calibration_trace(engine, scenario.models[0].spec, cfg, name, opts, like=like)
        say(f"calibration: {int((cal_group == 1).sum())} isolated requests, then {int((cal_group > 1).sum())} in groups of 2 "
            f"and 3, then {int((cal_group == LIKE).sum())} of held-out traffic at the trace's rate ({cal.window_s:.0f} s) ...")
        # The front end's CPU (the serve process: HTTP + coordinator; this process: the client),
        # measured over the calibration requests, per generated token.
        assert srv.proc is not None
        fe0 = proc_cpu_s(srv.proc.pid) + proc_cpu_s(os.getpid())
        with CpuMeter() as cal_meter_before:
            starts["calibration_before"] = time.perf_counter()
            cal_recs = replay(srv.url, name, cal.arrival_s, cal.prompt_tokens, cal.output_tokens,
                              vocab_size=int(config["vocab_size"]), seed=opts.seed + 2)
        fe_cpu_s = proc_cpu_s(srv.proc.pid) + proc_cpu_s(os.getpid()) - fe0
        fe_tokens = sum(r.received for r in cal_recs)
        say(f"replaying {len(trace)} requests ...")
        with CpuMeter() as meter:
            starts["trace"] = time.perf_counter()
            recs = replay(srv.url, name, trace.arrival_s, trace.prompt_tokens, trace.output_tokens,
                          vocab_size=int(config["vocab_size"]), seed=opts.seed)
        recs2 = None
        if opts.repeat:
            say(f"replaying the {len(trace)} requests again (run-to-run repeatability) ...")
            starts["repeat"] = time.perf_counter()
            recs2 = replay(srv.url, name, trace.arrival_s, trace.prompt_tokens, trace.output_tokens,
                           vocab_size=int(config["vocab_size"]), seed=opts.seed)
        say("calibration again, after the trace (the host's speed drifts over minutes) ...")
        with CpuMeter() as cal_meter_after:
            starts["calibration_after"] = time.perf_counter()
            cal_recs += replay(srv.url, name, cal.arrival_s, cal.prompt_tokens, cal.output_tokens,
                               vocab_size=int(config["vocab_size"]), seed=opts.seed + 2)
    cal_group = np.tile(cal_group, 2)
    # Other jobs on this host are measured, not modelled: as fair-share competitors (`background`)
    # they slow the simulated engines far more than they slow the real ones (see docs/fidelity.md);
    # that variant is reported as `with_background`.
    say(f"replay: this run used {meter.ours_cores:.2f} cores, other processes {meter.others_cores:.2f} "
        f"({meter.background:.2f} runnable threads on average); this run's threads waited for a core "
        f"{meter.ours_wait_share:.0%} of the time they were runnable")
    runtime_s = time.perf_counter() - t_rt
    ok = np.array([not r.error for r in recs])
    errors = [f"#{r.index}: {r.error}" for r in recs if r.error]
    if not ok.any():
        raise CoralError("no request finished on the runtime: " + "; ".join(errors[:3]))

    # 5. the simulator, same requests
    def keep(_now: float, _demand: dict[tuple[str, Phase], float], running: list[InstanceSpec],
             _window: Any) -> list[InstanceSpec]:
        return list(running)

    # The runtime's batching: S micro-batch groups per instance, waiting requests spread over them;
    # and its hardware: every engine process on this one host, sharing its cores.
    # ("independent": the simulator's defaults, every node its own server, the memory model's lanes.)
    def run_sim(sc: Any, tr: Any, hosts: Any, like_runtime: bool, step_trace: Any = None) -> Any:
        return simulate(sc, {name: tr}, initial, keep, duration_s=float(tr.arrival_s[-1]) + 600.0,
                        epoch_s=float(tr.arrival_s[-1]) + 600.0, init_s=0.0, seed=opts.seed,
                        lanes=_runtime_lanes if like_runtime else None, spread=like_runtime, hosts=hosts,
                        decode_at_arrival=like_runtime, step_trace=step_trace)

    # The runtime's routers (WRR over instances, and over the nodes of a data-parallel stage) have
    # already placed the warm-up and calibration requests when the trace starts; the simulator
    # routes the same requests first (long before the trace, so they never meet it) so that every
    # trace request goes where it went on the runtime.
    warm_end = float(warm_at[-1]) + 60.0
    cal_end = warm_end + float(cal.window_s) + 600.0
    routed = Trace(name=name, arrival_s=np.concatenate([warm_at, warm_end + cal.arrival_s, cal_end + trace.arrival_s]),
                   prompt_tokens=np.concatenate([np.full(warm_at.size, opts.max_prompt), cal.prompt_tokens, trace.prompt_tokens]),
                   output_tokens=np.concatenate([np.full(warm_at.size, opts.max_output), cal.output_tokens, trace.output_tokens]))

    def run_trace(sc: Any, hosts: Any, like_runtime: bool, step_trace: Any = None) -> _Tail:
        return _Tail(run_sim(sc, routed, hosts, like_runtime, step_trace), len(trace))

    # The cores other processes took from this host while each replay ran (measured, `CpuMeter.taken`):
    # the capacity the runtime did not have. The calibration replays have their own measurements.
    def taken_for(against: float) -> tuple[list[tuple[float, float]], list[list[tuple[float, float]]]]:
        return (_taken_steps(meter, cal_end, cores, against),
                [_taken_steps(m, warm_end, cores, against) for m in (cal_meter_before, cal_meter_after)])

    taken_trace, taken_cal = taken_for(float(cores))
    uncal = run_trace(sc_engine, Hosts.single(cores, taken=taken_trace), True)
    cal_routed = Trace(name=name, arrival_s=routed.arrival_s[: warm_at.size + len(cal)],
                       prompt_tokens=routed.prompt_tokens[: warm_at.size + len(cal)],
                       output_tokens=routed.output_tokens[: warm_at.size + len(cal)])

    def cal_sim_for(taken_cal: list[list[tuple[float, float]]]) -> Callable[[tuple[float, float]], tuple[np.ndarray, np.ndarray]]:
        def cal_sim(work: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
            ttft, tpot = [], []
            for taken in taken_cal:  # the same schedule, before and after the trace
                res = _Tail(run_sim(sc_engine, cal_routed, Hosts.single(cores, frontend_work=work, taken=taken), True), len(cal))
                ttft.append(res.ttft_s)
                tpot.append(res.tpot_s)
            return np.concatenate(ttft), np.concatenate(tpot)
        return cal_sim

    fe_work = (0.0, fe_cpu_s / fe_tokens if fe_tokens else 0.0)
    # the other fair-share rule for what the neighbours take (against one runtime thread), calibrated
    # and run the same way, for comparison (`taken_vs_one_thread` in summary.json)
    t1_trace, t1_cal = taken_for(1.0)
    t1_calibration, _, _ = _calibrate(engine, cal_recs, cal_group, cal_sim_for(t1_cal), fe_work)
    t1_load = (t1_calibration["frontend_work_ms"]["per_request"] / 1e3, t1_calibration["frontend_work_ms"]["per_token"] / 1e3)
    t1_res = run_trace(sc_engine, Hosts.single(cores, frontend_work=t1_load, taken=t1_trace), True)
    t1_sim = (t1_res.ttft_s + engine.frontend_s, t1_res.tpot_s, dict(engine.scale))
    engine.scale = {Phase.PREFILL: 1.0, Phase.DECODE: 1.0}
    calibration, cal_ttft, cal_tpot = _calibrate(engine, cal_recs, cal_group, cal_sim_for(taken_cal), fe_work)
    load = (calibration["frontend_work_ms"]["per_request"] / 1e3, calibration["frontend_work_ms"]["per_token"] / 1e3)
    shared = Hosts.single(cores, frontend_work=load, taken=taken_trace)
    b, a = calibration["before"], calibration["after"]
    say(f"calibration: node time x{calibration['prefill_scale']:.3f} (prefill), x{calibration['decode_scale']:.3f} (decode); "
        f"front end (measured) {load[1] * 1e3:.2f} ms CPU per token. MAPE TTFT / TPOT: isolated "
        f"{b['isolated']['ttft_mape']:.1%} / {b['isolated']['tpot_mape']:.1%} -> {a['isolated']['ttft_mape']:.1%} / "
        f"{a['isolated']['tpot_mape']:.1%}, groups {b['groups']['ttft_mape']:.1%} / {b['groups']['tpot_mape']:.1%} -> "
        f"{a['groups']['ttft_mape']:.1%} / {a['groups']['tpot_mape']:.1%}, held-out traffic "
        f"{b['like_traffic']['ttft_mape']:.1%} / {b['like_traffic']['tpot_mape']:.1%} -> "
        f"{a['like_traffic']['ttft_mape']:.1%} / {a['like_traffic']['tpot_mape']:.1%} (fitted on {calibration['fitted_on']})")
    sims = {}
    sim_steps: list[tuple[Any, ...]] = []
    for label, sc, hosts, like_runtime in (("engine", sc_engine, shared, True), ("table", scenario, shared, True),
                                           ("independent", sc_engine, None, False),
                                           ("no_taken", sc_engine, Hosts.single(cores, frontend_work=load), True),
                                           ("with_background", sc_engine,
                                            Hosts.single(cores, background=[(cal_end + t, v) for t, v in meter.steps] or 0.0,
                                                         frontend_work=load), True)):
        res = run_trace(sc, hosts, like_runtime, sim_steps.append if label == "engine" else None)
        ttft = res.ttft_s + (engine.frontend_s if sc is sc_engine else 0.0)
        sims[label] = (res, ttft, res.tpot_s)
    fitted = dict(engine.scale)
    engine.scale = {Phase.PREFILL: 1.0, Phase.DECODE: 1.0}  # the profile as measured, host model and front end on
    res1 = run_trace(sc_engine, shared, True)
    engine.scale = fitted
    sims["scale_1"] = (res1, res1.ttft_s + engine.frontend_s, res1.tpot_s)
    res, sim_ttft, sim_tpot = sims["engine"]
    sim_done = np.isfinite(sim_tpot)
    both = ok & sim_done
    real_ttft = np.array([r.ttft_s for r in recs])
    real_tpot = np.array([r.tpot_s for r in recs])

    # 6. compare
    # per micro-batch over the trace (the first replay): the runtime's scheduler trace, the simulator's steps
    inst_names = [i.name for i in layout]
    trace_end = starts.get("repeat", starts.get("calibration_after", math.inf))
    real_steps = _read_steps(out / "steps", starts["trace"], trace_end)
    sim_rows = [(inst_names[x[0]], x[1], x[3], x[4], x[5] - cal_end, x[6] - cal_end) for x in sim_steps if x[5] >= cal_end]
    steps_cmp = {"real": _step_table(real_steps), "sim": _step_table(sim_rows)}
    cmp_ttft = _compare(real_ttft[both], sim_ttft[both])
    cmp_tpot = _compare(real_tpot[both], sim_tpot[both])
    _, b_ttft, b_tpot = sims["table"]
    b_ok = both & np.isfinite(b_tpot)
    _, i_ttft, i_tpot = sims["independent"]
    i_ok = both & np.isfinite(i_tpot)
    _, n_ttft, n_tpot = sims["with_background"]
    n_ok = both & np.isfinite(n_tpot)
    sims["taken_vs_one_thread"] = (t1_res, t1_sim[0], t1_sim[1])
    _, o_ttft, o_tpot = sims["scale_1"]
    o_ok = both & np.isfinite(o_tpot)
    _, k_ttft, k_tpot = sims["no_taken"]
    k_ok = both & np.isfinite(k_tpot)
    u_ttft, u_tpot = uncal.ttft_s + engine.frontend_s, uncal.tpot_s
    u_ok = both & np.isfinite(u_tpot)
    summary: dict[str, Any] = {
        "model": name, "node_label": opts.node, "quick": opts.quick, "dataset": opts.dataset,
        "cores": cores, "load": opts.load, "rate_per_s": rate, "duration_s": opts.duration_s,
        "max_prompt": opts.max_prompt, "max_output": opts.max_output,
        "prompt_tokens_mean": p_mean, "output_tokens_mean": d_mean,
        "requests": {"trace": len(trace), "real_finished": int(ok.sum()), "sim_finished": int(sim_done.sum()),
                     "matched": int(both.sum()), "real_errors": errors[:20]},
        "ttft": cmp_ttft, "tpot": cmp_tpot,
        "table_only": {"ttft_mape": float(_ape(b_ttft[b_ok], real_ttft[b_ok]).mean()) if b_ok.any() else None,
                       "tpot_mape": float(_ape(b_tpot[b_ok], real_tpot[b_ok]).mean()) if b_ok.any() else None},
        "no_host_model": {"ttft_mape": float(_ape(i_ttft[i_ok], real_ttft[i_ok]).mean()) if i_ok.any() else None,
                          "tpot_mape": float(_ape(i_tpot[i_ok], real_tpot[i_ok]).mean()) if i_ok.any() else None},
        "calibration": calibration,
        "repeatability": _repeatability(recs, recs2),
        "uncalibrated": {"ttft_mape": float(_ape(u_ttft[u_ok], real_ttft[u_ok]).mean()) if u_ok.any() else None,
                         "tpot_mape": float(_ape(u_tpot[u_ok], real_tpot[u_ok]).mean()) if u_ok.any() else None,
                         "ttft_error_of": _compare(real_ttft[u_ok], u_ttft[u_ok])["error_of"] if u_ok.any() else None,
                         "tpot_error_of": _compare(real_tpot[u_ok], u_tpot[u_ok])["error_of"] if u_ok.any() else None},
        "with_background": {"ttft_mape": float(_ape(n_ttft[n_ok], real_ttft[n_ok]).mean()) if n_ok.any() else None,
                          "tpot_mape": float(_ape(n_tpot[n_ok], real_tpot[n_ok]).mean()) if n_ok.any() else None},
        "scale_1": {"ttft_mape": float(_ape(o_ttft[o_ok], real_ttft[o_ok]).mean()) if o_ok.any() else None,
                    "tpot_mape": float(_ape(o_tpot[o_ok], real_tpot[o_ok]).mean()) if o_ok.any() else None,
                    "ttft_error_of": _compare(real_ttft[o_ok], o_ttft[o_ok])["error_of"] if o_ok.any() else None,
                    "tpot_error_of": _compare(real_tpot[o_ok], o_tpot[o_ok])["error_of"] if o_ok.any() else None},
        "taken_vs_one_thread": {**_variant(real_ttft, real_tpot, both, sims["taken_vs_one_thread"]),
                                "prefill_scale": t1_sim[2][Phase.PREFILL], "decode_scale": t1_sim[2][Phase.DECODE]},
        "no_taken": {"ttft_mape": float(_ape(k_ttft[k_ok], real_ttft[k_ok]).mean()) if k_ok.any() else None,
                     "tpot_mape": float(_ape(k_tpot[k_ok], real_tpot[k_ok]).mean()) if k_ok.any() else None,
                     "ttft_error_of": _compare(real_ttft[k_ok], k_ttft[k_ok])["error_of"] if k_ok.any() else None,
                     "tpot_error_of": _compare(real_tpot[k_ok], k_tpot[k_ok])["error_of"] if k_ok.any() else None},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "sim_options": {"lanes": "one per stage", "spread": True, "host_cores": cores, "host_background": 0,
                        "frontend_work_s": list(load), "host_taken": f"measured per {meter.window_s:g} s window (CpuMeter.taken)"},
        "cpu_during_replay": {"ours_cores": meter.ours_cores, "others_cores": meter.others_cores,
                              "others_runnable_threads": meter.background, "samples": meter.samples,
                              "ours_wait_share": meter.ours_wait_share,
                              "taken_cores_mean": float(np.mean([v for _, v in taken_trace])) if taken_trace else 0.0},
        "cpu_during_calibration": [{"ours_cores": m.ours_cores, "others_cores": m.others_cores,
                                    "others_runnable_threads": m.background, "ours_wait_share": m.ours_wait_share}
                                   for m in (cal_meter_before, cal_meter_after)],
        "sim_utilization": {f"{m}/{ph}": res.full.summary(timing=False)["per_model"][m][ph]["utilization"]
                            for m in [name] for ph in ("prefill", "decode")},
        "frontend_ms": engine.frontend_s * 1e3, "decode_step_extra_ms": engine.step_extra_s * 1e3,
        "noop_runtime": {"ttft_ms": noop_ttft * 1e3, "tpot_ms": noop_tpot * 1e3},
        "instances": {k: {"phase": t.phase.value, "layers": [s.layers for s in t.placement.stages],
                          "nodes": [len(s.nodes) for s in t.placement.stages], "throughput_tok_per_s": t.throughput_tok_per_s}
                      for k, t in templates.items()},
        "replay_starts_monotonic_s": starts,
        "steps": steps_cmp,
        "profile": str(csv_path), "runtime_wall_s": runtime_s, "wall_s": time.perf_counter() - t_start,
    }  # fmt: skip

    # 7. outputs
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "arrival_s", "prompt_tokens", "output_tokens", "real_ttft_s", "sim_ttft_s", "real_tpot_s",
                    "sim_tpot_s", "prefill_instance", "decode_instance", "error"])
        names = [i.name for i in layout]
        for i, r in enumerate(recs):
            pi, di = int(res.prefill_instance[i]), int(res.decode_instance[i])
            w.writerow([i, f"{r.arrival_s:.6f}", r.prompt_tokens, r.output_tokens, f"{real_ttft[i]:.6f}", f"{sim_ttft[i]:.6f}",
                        f"{real_tpot[i]:.6f}", f"{sim_tpot[i]:.6f}", names[pi] if pi >= 0 else "", names[di] if di >= 0 else "",
                        r.error])
    with open(out / "calibration.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "when", "group", "arrival_s", "prompt_tokens", "output_tokens", "real_ttft_s", "sim_ttft_s",
                    "real_tpot_s", "sim_tpot_s", "error"])
        for i, r in enumerate(cal_recs):
            w.writerow([i, "before" if i < len(cal_recs) // 2 else "after", int(cal_group[i]), f"{r.arrival_s:.6f}", r.prompt_tokens, r.output_tokens, f"{r.ttft_s:.6f}",
                        f"{cal_ttft[i]:.6f}", f"{r.tpot_s:.6f}", f"{cal_tpot[i]:.6f}", r.error])
    title = (f"{name}, {int(both.sum())} requests, {rate:.2f} req/s: TTFT MAPE {cmp_ttft['mape']:.1%}, "
             f"TPOT MAPE {cmp_tpot['mape']:.1%}")
    _plot(out / "fidelity_cdf.png", real_ttft[both], sim_ttft[both], real_tpot[both], sim_tpot[both],
          b_ttft[b_ok] if b_ok.sum() == both.sum() else None, b_tpot[b_ok] if b_ok.sum() == both.sum() else None, title)
    (out / "host_load.json").write_text(json.dumps({
        label: {"window_s": m.window_s, "taken_cores": m.taken, "others_runnable_threads": m.steps}
        for label, m in (("calibration_before", cal_meter_before), ("trace", meter), ("calibration_after", cal_meter_after))}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    (out / "report.md").write_text(_report(summary))
    return summary


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def _report(s: dict[str, Any]) -> str:
    t, p = s["ttft"], s["tpot"]

    def row(name: str, c: dict[str, Any]) -> str:
        r, m = c["real_s"], c["sim_s"]
        return (f"| {name} | {c['mape']:.1%} | {c['p90_ape']:.1%} | {c['cdf_mape']:.1%} | {r['mean'] * 1e3:.1f} / {m['mean'] * 1e3:.1f} | "
                f"{r['p50'] * 1e3:.1f} / {m['p50'] * 1e3:.1f} | {r['p90'] * 1e3:.1f} / {m['p90'] * 1e3:.1f} | "
                f"{r['p99'] * 1e3:.1f} / {m['p99'] * 1e3:.1f} |")

    req = s["requests"]
    lines = [
        f"# Simulator fidelity: {s['model']}{' (quick)' if s['quick'] else ''}",
        "",
        f"{req['trace']} requests of {s['dataset']} (prompts clipped to {s['max_prompt']}, outputs to {s['max_output']} tokens; "
        f"means {s['prompt_tokens_mean']:.0f} / {s['output_tokens_mean']:.1f}) at {s['rate_per_s']:.2f} req/s for "
        f"{s['duration_s']:g} s, on {s['cores']} CPU cores. Real finished {req['real_finished']}, simulated finished "
        f"{req['sim_finished']}, matched {req['matched']}.",
        "",
        "| metric | MAPE (per request) | p90 APE | CDF MAPE | mean ms real / sim | p50 | p90 | p99 |",
        "|---|---|---|---|---|---|---|---|",
        row("TTFT", t),
        row("TPOT", p),
        "",
        f"Calibration ({s['calibration']['isolated']} isolated requests, {s['calibration']['in_groups']} in groups of "
        f"2 and 3 and {s['calibration'].get('like_traffic', 0)} of held-out traffic at the trace's rate, through the same "
        f"cluster before and after the trace, not part of it): node time "
        f"x{s['calibration']['prefill_scale']:.3f} in prefill, x{s['calibration']['decode_scale']:.3f} in decode, fitted "
        f"on the isolated ones; the "
        f"front end's CPU, measured, {s['calibration']['frontend_work_ms']['per_token']:.2f} ms "
        f"per generated token. On the groups: TTFT MAPE {_fmt(s['calibration']['after']['groups']['ttft_mape'])}, TPOT MAPE "
        f"{_fmt(s['calibration']['after']['groups']['tpot_mape'])}; on the isolated ones: TTFT MAPE "
        f"{_fmt(s['calibration']['after']['isolated']['ttft_mape'])}, TPOT MAPE "
        f"{_fmt(s['calibration']['after']['isolated']['tpot_mape'])}; on the held-out traffic: TTFT MAPE "
        f"{_fmt(s['calibration']['after'].get('like_traffic', {}).get('ttft_mape'))}, TPOT MAPE "
        f"{_fmt(s['calibration']['after'].get('like_traffic', {}).get('tpot_mape'))}. Without calibration and front end: TTFT MAPE "
        f"{_fmt(s['uncalibrated']['ttft_mape'])}, TPOT MAPE {_fmt(s['uncalibrated']['tpot_mape'])}.",
        "",
        *([f"Run-to-run (the trace replayed twice on the runtime, second run against the first, per request): TTFT "
           f"MAPE {s['repeatability']['ttft_mape']:.1%} (p90 {s['repeatability']['ttft_p90_ape']:.1%}), TPOT MAPE "
           f"{s['repeatability']['tpot_mape']:.1%} (p90 {s['repeatability']['tpot_p90_ape']:.1%}); errors of the second "
           f"run's p50 / p90 / p99: TTFT {_errs(s['repeatability']['ttft_error_of'])}, TPOT "
           f"{_errs(s['repeatability']['tpot_error_of'])}.", ""]
          if s.get("repeatability") else []),
        f"Errors of the simulated p50 / p90 / p99: TTFT {_errs(t['error_of'])}, TPOT {_errs(p['error_of'])}.",
        "",
        *_step_lines(s["steps"]),
        f"Simulator timed by the profile table alone (no engine adapter, no calibration; host model and front end on): TTFT MAPE "
        f"{_fmt(s['table_only']['ttft_mape'])}, TPOT MAPE {_fmt(s['table_only']['tpot_mape'])}. "
        f"Without the host model and the runtime's batching (every node its own server, the memory model's lanes): "
        f"TTFT MAPE {_fmt(s['no_host_model']['ttft_mape'])}, TPOT MAPE {_fmt(s['no_host_model']['tpot_mape'])}. "
        f"Host model with the other processes' runnable threads (sampled, mean {s['cpu_during_replay']['others_runnable_threads']:.2f}) "
        f"as background: TTFT MAPE {_fmt(s['with_background']['ttft_mape'])}, TPOT MAPE {_fmt(s['with_background']['tpot_mape'])}.",
        "",
        f"Load average (1, 5, 15 min) at the start {_loads(s['load_average']['start'])}, at the end "
        f"{_loads(s['load_average']['end'])}. During the replay this run used {s['cpu_during_replay']['ours_cores']:.2f} "
        f"cores, other processes {s['cpu_during_replay']['others_cores']:.2f}; the simulator took "
        f"{s['cpu_during_replay']['taken_cores_mean']:.2f} cores as theirs on average (`Hosts.taken`; without it: TTFT MAPE "
        f"{_fmt(s['no_taken']['ttft_mape'])}, TPOT MAPE {_fmt(s['no_taken']['tpot_mape'])}). This run's threads waited "
        f"for a core {s['cpu_during_replay']['ours_wait_share']:.0%} of the time they were runnable.",
        "",
        "![CDFs](fidelity_cdf.png)",
        "",
        f"Simulated utilization (busy node-s / node-s): {', '.join(f'{k} {v:.1%}' for k, v in s['sim_utilization'].items() if v is not None)}.",
        "",
    ]
    if req["real_errors"]:
        lines += ["Runtime errors:", "", *[f"- {e}" for e in req["real_errors"]], ""]
    return "\n".join(lines)


def _errs(e: dict[str, float]) -> str:
    return " / ".join(f"{e[k]:+.1%}" for k in ("p50", "p90", "p99"))


def _step_lines(st: dict[str, Any]) -> list[str]:
    """The per-micro-batch table of the report: median ms (count), real / simulated, over the trace."""
    bins = [str(k) for k in range(STEP_CONCURRENCY)] + [f"{STEP_CONCURRENCY}+"]

    def cell(side: dict[str, Any], k: str) -> str:
        c = side["by_concurrency"].get(k)
        return f"{c['median_ms']:.1f} ({c['n']})" if c else "-"

    lines = ["Micro-batches over the trace (runtime: the schedulers' step trace; simulator: its steps), median ms (count), "
             "by other micro-batches in flight at the step's midpoint:", "",
             "| phase | side | " + " | ".join(bins) + " | steps per instance |", "|---|---|" + "---|" * len(bins) + "---|"]
    for phase in ("prefill", "decode"):
        for side in ("real", "sim"):
            d = st[side][phase]
            per = ", ".join(f"{k} {v}" for k, v in d["by_instance"].items())
            lines.append(f"| {phase} | {side} | " + " | ".join(cell(d, k) for k in bins) + f" | {per} |")
    return [*lines, ""]


def _loads(x: Any) -> str:
    return " / ".join(f"{v:.2f}" for v in x)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


@click.command("fidelity")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for summary.json, report.md, the PNG and CSVs.")
@click.option("--model", default="fid-llama", show_default=True, help="Runtime model (built-in config name or config.json path).")
@click.option("--node", default="1xL4", show_default=True, help="Catalog configuration used as the label of this host's nodes.")
@click.option("--profile", "profile_csv", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Reuse this `coral profile` CSV (with its .host.json) instead of profiling first.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="Folder holding traces/ (default: $CORAL_DATA_DIR, else the copy shipped with Coral).")
@click.option("--dataset", default="azure-conv", show_default=True, help="Trace: azure-conv, azure-code, burstgpt or a CSV path.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=1), default=None, help="Seconds of trace to replay [150; quick 25].")
@click.option("--load", type=click.FloatRange(0, 1, min_open=True), default=0.35, show_default=True,
              help="Offered load as a share of this host's CPU cores (sizes the arrival rate).")
@click.option("--max-prompt", type=click.IntRange(min=1), default=None, help="Clip prompts to this many tokens [384; quick 128].")
@click.option("--max-output", type=click.IntRange(min=2), default=None, help="Clip outputs to this many tokens [48; quick 16].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="A ~1-minute run (tests): short trace, short sequences, small profile grid.")
@click.option("--repeat", is_flag=True, help="Replay the trace twice on the runtime and report the run-to-run error "
              "(the floor for any simulator on this host); adds one trace duration.")
def fidelity(out_dir: str, model: str, node: str, profile_csv: str | None, data_dir: str | None, dataset: str,
             duration_s: float | None, load: float, max_prompt: int | None, max_output: int | None, seed: int, quick: bool,
             repeat: bool) -> None:
    """Replay a trace through the real local runtime and through the simulator (timed by a profile of the same
    engine), match requests one to one and report the TTFT / TPOT errors (the paper's Fig. 6)."""
    dflt = {**{"duration_s": 150.0, "max_prompt": 384, "max_output": 48}, **(QUICK if quick else {})}
    opts = FidelityOptions(
        out=Path(out_dir), model=model, node=node, profile=Path(profile_csv) if profile_csv else None,
        data_dir=Path(data_dir) if data_dir else None, dataset=dataset,
        duration_s=duration_s if duration_s is not None else dflt["duration_s"], load=load,
        max_prompt=max_prompt if max_prompt is not None else int(dflt["max_prompt"]),
        max_output=max_output if max_output is not None else int(dflt["max_output"]), seed=seed, quick=quick,
        repeat=repeat,
    )  # fmt: skip
    s = run_fidelity(opts, progress=lambda m: click.echo(m, err=True))
    t, p = s["ttft"], s["tpot"]
    click.echo(f"TTFT: MAPE {t['mape']:.1%}, p90 APE {t['p90_ape']:.1%}, CDF MAPE {t['cdf_mape']:.1%}; "
               f"TPOT: MAPE {p['mape']:.1%}, p90 APE {p['p90_ape']:.1%}, CDF MAPE {p['cdf_mape']:.1%} "
               f"({s['requests']['matched']} requests matched; {s['wall_s']:.0f} s)")
    if s.get("repeatability"):
        r = s["repeatability"]
        click.echo(f"run-to-run (real vs real): TTFT MAPE {r['ttft_mape']:.1%}, TPOT MAPE {r['tpot_mape']:.1%}")
    click.echo(f"wrote {opts.out}/summary.json, report.md, fidelity_cdf.png, requests.csv, calibration.csv, host_load.json")
