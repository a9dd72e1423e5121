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
the cluster file, each written whole (`coral.atomic`).

:func:`run_fidelity` is its phases, each taking the previous ones' values and returning its own:
:func:`calibrate_host` (profile, trace, the runtime's layout as templates, its measured overheads:
the engine's perf object is built here, once) -> :func:`replay_runtime` (the real cluster) ->
:func:`fit_engine` (node time fitted on the calibration requests: a new perf object) ->
:func:`simulate_variants` -> :func:`summarize` -> :func:`write_outputs`. The scoring and the report
are :mod:`coral.experiments.fidelity_report`, the calibration pieces
:mod:`coral.experiments.fidelity_calibrate`.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coral.atomic import write_bytes, write_text
from coral.errors import CoralError
from coral.experiments.fidelity_calibrate import (
    CAL_LIKE_S,
    LIKE,
    calibration_trace,
    fit_node_time,
    runtime_templates,
    study_scenario,
    work_s,
)
from coral.experiments.fidelity_perf import EnginePerf, load_engine_perf
from coral.experiments.fidelity_profile import resolve_runtime_model
from coral.experiments.fidelity_report import (
    ape,
    cdf_png,
    compare,
    json_default,
    read_steps,
    repeatability,
    report_markdown,
    step_table,
    taken_steps,
    variant_errors,
)
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

__all__ = [
    "QUICK", "Fit", "FidelityOptions", "HostSetup", "Replays", "SimBench", "calibrate_host", "fit_engine", "replay_runtime",
    "run_fidelity", "simulate_variants", "summarize", "write_outputs",
]


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


def _cores() -> int:
    """CPU cores this process (and the runtime it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _runtime_lanes(template: Any) -> int:
    """Micro-batches the runtime's scheduler keeps in flight per instance: one group per stage (`micro_batches: 0`)."""
    return len(template.placement.stages)


# --------------------------------------------------------------------------- the run


# --------------------------------------------------------------------------- the run, in phases


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSetup:
    """Phase 1's result: the model, its profile on this host, the trace scaled to the host, the
    runtime's layout as templates, and the engine's perf with the runtime's measured overheads."""

    name: str
    config: dict[str, Any]
    csv_path: Path
    scenario: Any  # the study's scenario at the trace's rate, timed by the profile table
    engine: EnginePerf  # the engine's times with the runtime's overheads (node time not yet fitted)
    cfg: Any
    cores: int
    work_s: float
    rate: float
    trace: Trace
    like: Trace | None  # held-out traffic for the calibration
    layout: Any
    templates: dict[str, Any]
    cluster: dict[str, Any]
    noop: tuple[float, float]  # TTFT, TPOT of the no-maths runtime (s)

    @property
    def p_mean(self) -> float:
        return float(self.trace.prompt_tokens.mean())

    @property
    def d_mean(self) -> float:
        return float(self.trace.output_tokens.mean())


@dataclass(frozen=True, slots=True, kw_only=True)
class Replays:
    """Phase 2's result: every request the real runtime served, and what the host did meanwhile."""

    warm_at: np.ndarray
    cal: Trace  # the calibration schedule (replayed before and after the trace)
    cal_group: np.ndarray  # per calibration record: its group size (LIKE: held-out traffic)
    cal_recs: list[Any]
    recs: list[Any]
    recs2: list[Any] | None  # the trace replayed again (--repeat)
    meters: dict[str, Any]  # CpuMeter of calibration_before, trace, calibration_after
    fe_cpu_s: float
    fe_tokens: int
    starts: dict[str, float]
    runtime_s: float

    @property
    def ok(self) -> np.ndarray:
        return np.array([not r.error for r in self.recs])


def _profile_and_trace(opts: FidelityOptions, say: Callable[[str], None]) -> tuple[str, dict[str, Any], Path, Path]:
    """The runtime model, its config.json for the scenario, and its profile on this host (measured
    unless `opts.profile` is given)."""
    name, config = resolve_runtime_model(opts.model)
    ctx = int(config.get("max_position_embeddings", 2048))
    if opts.max_prompt + opts.max_output > ctx:
        raise CoralError(f"max_prompt + max_output = {opts.max_prompt + opts.max_output} exceeds the model's context {ctx}")
    spec_path = opts.out / "model" / "config.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}
    hf = {"architectures": [arch.get(config["model_type"], "LlamaForCausalLM")], "torch_dtype": "float32",
          **{k: v for k, v in config.items() if k != "eos_token_id"}}
    write_text(spec_path, json.dumps(hf, indent=2) + "\n")
    csv_path = opts.profile
    if csv_path is None:
        csv_path = opts.out / "profile.csv"
        top = opts.max_prompt
        prompts = sorted({min(p, top) for p in (16, 64, 128, 256, 384)} | {top}) if not opts.quick else sorted({16, top // 2, top})
        contexts = sorted({32, top // 2, top + opts.max_output // 2, top + opts.max_output - 4})
        say(f"profiling {name} on this host -> {csv_path}")
        run_profile(opts.model, opts.node, csv_path, name=name, batches="1,2" if opts.quick else "1,2,4",
                    prompt_tokens=",".join(map(str, prompts)), decode_batches="1,4" if opts.quick else "1,4,16",
                    contexts=",".join(map(str, contexts)), device="cpu", reps=PROFILE_REPS, progress=None)
    return name, config, spec_path, csv_path


def calibrate_host(opts: FidelityOptions, say: Callable[[str], None]) -> HostSetup:
    """Phase 1: profile the engine, scale the trace to this host's cores, lay the runtime's instances
    out as templates, and measure the runtime's own overheads with no-maths engines."""
    name, config, spec_path, csv_path = _profile_and_trace(opts, say)
    loaded = load_dataset(opts.dataset, opts.data_dir).trace
    prompt = np.clip(loaded.prompt_tokens, 1, opts.max_prompt)
    output = np.clip(loaded.output_tokens, 2, opts.max_output)
    base = Trace(name=name, arrival_s=loaded.arrival_s, prompt_tokens=prompt, output_tokens=output, window_s=loaded.window_s)
    scenario = study_scenario(name, spec_path, opts.node, csv_path, float(prompt.mean()), float(output.mean()), 1.0)
    measured = load_engine_perf(csv_path, scenario.catalog, fallback=scenario.perf.fallback)
    cfg = scenario.config(opts.node)
    cores = _cores()
    work = work_s(measured, scenario.models[0].spec, cfg, prompt, output)
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
    say(f"trace: {len(trace)} requests over {opts.duration_s:g} s ({rate:.2f} req/s for {opts.load:.0%} of {cores} cores; "
        f"{work * 1e3:.0f} engine-ms per request), prompt mean {p_mean:.0f}, output mean {d_mean:.1f}")
    # templates = the runtime's placements, timed by the profile as measured
    layout = default_layout(int(config["num_hidden_layers"]))
    prefill_batch = max(1, 4096 // opts.max_prompt)  # the runtime scheduler's 4096-token micro-batch cap
    templates = runtime_templates(dataclasses.replace(scenario, perf=measured), layout, opts.node, p_mean, d_mean, prefill_batch, 64)
    cluster = cluster_file(name, config, layout, {k: t.throughput_tok_per_s for k, t in templates.items()})
    say("measuring the runtime's own overhead (same cluster, no-maths engines) ...")
    noop_ttft, noop_tpot = runtime_overhead(cluster)
    lat = measured.host.activation.latency_s
    pre = [i for i in layout if i.phase == "prefill"]
    dec = [i for i in layout if i.phase == "decode"]
    modelled_ttft = (4 + float(np.mean([len(i.stages) - 1 for i in pre]))) * lat
    modelled_step = (2 + float(np.mean([len(i.stages) - 1 for i in dec]))) * lat
    engine = measured.calibrated(frontend_extra_s=max(0.0, noop_ttft - modelled_ttft), step_extra_s=max(0.0, noop_tpot - modelled_step))
    say(f"no-maths runtime: TTFT {noop_ttft * 1e3:.2f} ms, TPOT {noop_tpot * 1e3:.2f} ms -> front end +{engine.frontend_extra_s * 1e3:.2f} ms, "
        f"decode step +{engine.step_extra_s * 1e3:.2f} ms beyond the modelled messages")
    return HostSetup(name=name, config=config, csv_path=csv_path, scenario=scenario, engine=engine, cfg=cfg, cores=cores,
                  work_s=work, rate=rate, trace=trace, like=like, layout=layout, templates=templates, cluster=cluster,
                  noop=(noop_ttft, noop_tpot))


def replay_runtime(setup: HostSetup, opts: FidelityOptions, say: Callable[[str], None]) -> Replays:
    """Phase 2: the real runtime (`coral serve`) serves a warm-up, the calibration schedule, the
    trace (twice with --repeat) and the calibration again, each replay metered."""
    name, vocab, trace = setup.name, int(setup.config["vocab_size"]), setup.trace
    say("starting the local cluster (coral serve) ...")
    t_rt = time.perf_counter()
    starts: dict[str, float] = {}  # time.perf_counter() (= the schedulers' monotonic clock) at each replay's start
    with Served(setup.cluster, opts.out, step_trace_dir=opts.out / "steps") as srv:
        say(f"serving at {srv.url} after {time.perf_counter() - t_rt:.1f} s; warming up")
        warm_at = np.arange(2 * len(setup.layout)) * 0.3
        replay(srv.url, name, warm_at, np.full(warm_at.size, opts.max_prompt), np.full(warm_at.size, opts.max_output),
               vocab_size=vocab, seed=opts.seed + 1)
        cal, cal_group = calibration_trace(setup.engine, setup.scenario.models[0].spec, setup.cfg, name, max_prompt=opts.max_prompt,
                                           max_output=opts.max_output, quick=opts.quick, like=setup.like)
        say(f"calibration: {int((cal_group == 1).sum())} isolated requests, then {int((cal_group > 1).sum())} in groups of 2 "
            f"and 3, then {int((cal_group == LIKE).sum())} of held-out traffic at the trace's rate ({cal.window_s:.0f} s) ...")
        # The front end's CPU (the serve process: HTTP + coordinator; this process: the client),
        # measured over the calibration requests, per generated token.
        assert srv.proc is not None
        fe0 = proc_cpu_s(srv.proc.pid) + proc_cpu_s(os.getpid())
        with CpuMeter() as cal_before:
            starts["calibration_before"] = time.perf_counter()
            cal_recs = replay(srv.url, name, cal.arrival_s, cal.prompt_tokens, cal.output_tokens, vocab_size=vocab, seed=opts.seed + 2)
        fe_cpu_s = proc_cpu_s(srv.proc.pid) + proc_cpu_s(os.getpid()) - fe0
        fe_tokens = sum(r.received for r in cal_recs)
        say(f"replaying {len(trace)} requests ...")
        with CpuMeter() as meter:
            starts["trace"] = time.perf_counter()
            recs = replay(srv.url, name, trace.arrival_s, trace.prompt_tokens, trace.output_tokens, vocab_size=vocab, seed=opts.seed)
        recs2 = None
        if opts.repeat:
            say(f"replaying the {len(trace)} requests again (run-to-run repeatability) ...")
            starts["repeat"] = time.perf_counter()
            recs2 = replay(srv.url, name, trace.arrival_s, trace.prompt_tokens, trace.output_tokens, vocab_size=vocab, seed=opts.seed)
        say("calibration again, after the trace (the host's speed drifts over minutes) ...")
        with CpuMeter() as cal_after:
            starts["calibration_after"] = time.perf_counter()
            cal_recs += replay(srv.url, name, cal.arrival_s, cal.prompt_tokens, cal.output_tokens, vocab_size=vocab, seed=opts.seed + 2)
    # Other jobs on this host are measured, not modelled: as fair-share competitors (`background`)
    # they slow the simulated engines far more than they slow the real ones (see docs/results/fidelity.md);
    # that variant is reported as `with_background`.
    say(f"replay: this run used {meter.ours_cores:.2f} cores, other processes {meter.others_cores:.2f} "
        f"({meter.background:.2f} runnable threads on average); this run's threads waited for a core "
        f"{meter.ours_wait_share:.0%} of the time they were runnable")
    real = Replays(warm_at=warm_at, cal=cal, cal_group=np.tile(cal_group, 2), cal_recs=cal_recs, recs=recs, recs2=recs2,
                    meters={"calibration_before": cal_before, "trace": meter, "calibration_after": cal_after},
                    fe_cpu_s=fe_cpu_s, fe_tokens=fe_tokens, starts=starts, runtime_s=time.perf_counter() - t_rt)
    if not real.ok.any():
        raise CoralError("no request finished on the runtime: " + "; ".join([f"#{r.index}: {r.error}" for r in recs if r.error][:3]))
    return real


def _keep(_now: float, _demand: Any, running: list[InstanceSpec], _window: Any) -> list[InstanceSpec]:
    """The re-planner of the study's simulations: the runtime's instances, unchanged."""
    return list(running)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimBench:
    """The simulator set up on the replayed requests. The runtime's routers (WRR over instances, and
    over the nodes of a data-parallel stage) have already placed the warm-up and calibration requests
    when the trace starts; the simulator routes the same requests first (long before the trace, so
    they never meet it) so that every trace request goes where it went on the runtime."""

    setup: HostSetup
    seed: int
    routed: Trace  # warm-up, calibration, trace
    n_cal: int  # warm-up + calibration requests at the head of `routed`
    cal_requests: int  # of those, the calibration ones
    warm_end: float
    cal_end: float

    @classmethod
    def of(cls, setup: HostSetup, real: Replays, opts: FidelityOptions) -> SimBench:
        assert real.cal.window_s is not None  # calibration_trace gives its schedule's length
        warm_end = float(real.warm_at[-1]) + 60.0
        cal_end = warm_end + float(real.cal.window_s) + 600.0
        w, cal, tr = real.warm_at, real.cal, setup.trace
        routed = Trace(name=setup.name, arrival_s=np.concatenate([w, warm_end + cal.arrival_s, cal_end + tr.arrival_s]),
                       prompt_tokens=np.concatenate([np.full(w.size, opts.max_prompt), cal.prompt_tokens, tr.prompt_tokens]),
                       output_tokens=np.concatenate([np.full(w.size, opts.max_output), cal.output_tokens, tr.output_tokens]))
        return cls(setup=setup, seed=opts.seed, routed=routed, n_cal=w.size + len(cal), cal_requests=len(cal), warm_end=warm_end,
                   cal_end=cal_end)

    def scenario(self, perf: Any) -> Any:
        """The study's scenario timed by `perf` (an `EnginePerf`, or the table's own perf)."""
        return dataclasses.replace(self.setup.scenario, perf=perf)

    def run(self, sc: Any, tr: Trace, hosts: Any, like_runtime: bool, step_trace: Any = None) -> Any:
        """One simulation. `like_runtime`: the runtime's batching (S micro-batch groups per instance,
        waiting requests spread over them, decode chosen at arrival); else the simulator's defaults
        (every node its own server, the memory model's lanes)."""
        return simulate(sc, {self.setup.name: tr}, [InstanceSpec(template=self.setup.templates[i.name], region=sc.regions[0])
                                                    for i in self.setup.layout],
                        _keep, duration_s=float(tr.arrival_s[-1]) + 600.0, epoch_s=float(tr.arrival_s[-1]) + 600.0,
                        init_s=0.0, seed=self.seed, lanes=_runtime_lanes if like_runtime else None, spread=like_runtime,
                        hosts=hosts, decode_at_arrival=like_runtime, step_trace=step_trace)

    def trace(self, sc: Any, hosts: Any, like_runtime: bool = True, step_trace: Any = None) -> _Tail:
        """The trace's requests of one simulation of everything routed."""
        return _Tail(self.run(sc, self.routed, hosts, like_runtime, step_trace), len(self.setup.trace))

    def calibration(self, taken_cal: list[list[tuple[float, float]]]) -> Callable[[EnginePerf, tuple[float, float]], tuple[np.ndarray, np.ndarray]]:
        """`fit_node_time`'s simulator: the calibration schedule, before and after the trace, timed by a perf."""
        head = Trace(name=self.setup.name, arrival_s=self.routed.arrival_s[: self.n_cal],
                     prompt_tokens=self.routed.prompt_tokens[: self.n_cal], output_tokens=self.routed.output_tokens[: self.n_cal])
        n, cores = self.cal_requests, self.setup.cores

        def cal_sim(perf: EnginePerf, work: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
            ttft, tpot = [], []
            for taken in taken_cal:  # the same schedule, before and after the trace
                res = _Tail(self.run(self.scenario(perf), head, Hosts.single(cores, frontend_work=work, taken=taken), True), n)
                ttft.append(res.ttft_s)
                tpot.append(res.tpot_s)
            return np.concatenate(ttft), np.concatenate(tpot)
        return cal_sim

    def taken(self, real: Replays, against: float) -> tuple[list[tuple[float, float]], list[list[tuple[float, float]]]]:
        """The cores other processes took from this host while each replay ran (measured, `CpuMeter.taken`):
        the capacity the runtime did not have, for the trace and for the two calibration replays."""
        cores = self.setup.cores
        return (taken_steps(real.meters["trace"], self.cal_end, cores, against),
                [taken_steps(real.meters[k], self.warm_end, cores, against) for k in ("calibration_before", "calibration_after")])


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """Phase 3's result: the engine's perf fitted on the calibration requests, built once, and the fit
    under the other fair-share rule (neighbours against one runtime thread) for comparison."""

    calibration: dict[str, Any]
    cal_ttft: np.ndarray
    cal_tpot: np.ndarray
    perf: EnginePerf
    frontend_work: tuple[float, float]  # s per request, s per token (measured)
    one_thread: tuple[dict[str, Any], EnginePerf, list[tuple[float, float]]]  # its fit, perf, taken cores of the trace


def fit_engine(bench: SimBench, real: Replays, say: Callable[[str], None]) -> Fit:
    """Phase 3: fit the node-time multipliers on the calibration requests (the front end's CPU measured),
    under both fair-share rules for the cores the neighbours took."""
    engine = bench.setup.engine
    fe_work = (0.0, real.fe_cpu_s / real.fe_tokens if real.fe_tokens else 0.0)
    t1_trace, t1_cal = bench.taken(real, 1.0)
    t1_calibration, _, _, t1_perf = fit_node_time(engine, real.cal_recs, real.cal_group, bench.calibration(t1_cal), fe_work)
    _, taken_cal = bench.taken(real, float(bench.setup.cores))
    calibration, cal_ttft, cal_tpot, perf = fit_node_time(engine, real.cal_recs, real.cal_group, bench.calibration(taken_cal), fe_work)
    load = _load_of(calibration)
    b, a = calibration["before"], calibration["after"]
    say(f"calibration: node time x{calibration['prefill_scale']:.3f} (prefill), x{calibration['decode_scale']:.3f} (decode); "
        f"front end (measured) {load[1] * 1e3:.2f} ms CPU per token. MAPE TTFT / TPOT: isolated "
        f"{b['isolated']['ttft_mape']:.1%} / {b['isolated']['tpot_mape']:.1%} -> {a['isolated']['ttft_mape']:.1%} / "
        f"{a['isolated']['tpot_mape']:.1%}, groups {b['groups']['ttft_mape']:.1%} / {b['groups']['tpot_mape']:.1%} -> "
        f"{a['groups']['ttft_mape']:.1%} / {a['groups']['tpot_mape']:.1%}, held-out traffic "
        f"{b['like_traffic']['ttft_mape']:.1%} / {b['like_traffic']['tpot_mape']:.1%} -> "
        f"{a['like_traffic']['ttft_mape']:.1%} / {a['like_traffic']['tpot_mape']:.1%} (fitted on {calibration['fitted_on']})")
    return Fit(calibration=calibration, cal_ttft=cal_ttft, cal_tpot=cal_tpot, perf=perf, frontend_work=fe_work,
                one_thread=(t1_calibration, t1_perf, t1_trace))


def _load_of(calibration: dict[str, Any]) -> tuple[float, float]:
    """The front end's work per request and per token (s) a calibration put in place (`Hosts.frontend_work`)."""
    return (calibration["frontend_work_ms"]["per_request"] / 1e3, calibration["frontend_work_ms"]["per_token"] / 1e3)


#: A simulated variant on the trace's requests: (the run, TTFT with the front end, TPOT).
Variant = tuple[_Tail, np.ndarray, np.ndarray]


def simulate_variants(bench: SimBench, real: Replays, fit: Fit) -> tuple[dict[str, Variant], list[tuple[Any, ...]]]:
    """Phase 4: the trace through the simulator in every variant the report compares, and the fitted
    variant's micro-batches.

    engine: the fitted engine perf, host model (the neighbours' measured cores taken), front end;
    table: the profile table alone; independent: the simulator's defaults (no host model, its own
    batching); no_taken / with_background: the neighbours left out, or as fair-share background
    threads; scale_1: the profile as measured (overheads and front end on); uncalibrated: neither
    the fit nor the front end's work; taken_vs_one_thread: fitted and run under the other rule."""
    setup, cores = bench.setup, bench.setup.cores
    engine, fitted = setup.engine, fit.perf
    taken_trace, _ = bench.taken(real, float(cores))
    fe = engine.frontend_s  # the same for every EnginePerf of the run (overheads only)
    sims: dict[str, Variant] = {}
    uncal = bench.trace(bench.scenario(engine), Hosts.single(cores, taken=taken_trace))
    sims["uncalibrated"] = (uncal, uncal.ttft_s + fe, uncal.tpot_s)
    t1_calibration, t1_perf, t1_trace = fit.one_thread
    t1 = bench.trace(bench.scenario(t1_perf), Hosts.single(cores, frontend_work=_load_of(t1_calibration), taken=t1_trace))
    sims["taken_vs_one_thread"] = (t1, t1.ttft_s + fe, t1.tpot_s)
    load = _load_of(fit.calibration)
    shared = Hosts.single(cores, frontend_work=load, taken=taken_trace)
    background = [(bench.cal_end + t, v) for t, v in real.meters["trace"].steps] or 0.0
    sim_steps: list[tuple[Any, ...]] = []
    for label, sc, hosts, like_runtime in (
        ("engine", bench.scenario(fitted), shared, True), ("table", setup.scenario, shared, True),
        ("independent", bench.scenario(fitted), None, False),
        ("no_taken", bench.scenario(fitted), Hosts.single(cores, frontend_work=load), True),
        ("with_background", bench.scenario(fitted), Hosts.single(cores, background=background, frontend_work=load), True),
    ):
        res = bench.trace(sc, hosts, like_runtime, sim_steps.append if label == "engine" else None)
        sims[label] = (res, res.ttft_s + (fe if sc is not setup.scenario else 0.0), res.tpot_s)
    res1 = bench.trace(bench.scenario(engine), shared)  # the profile as measured, host model and front end on
    sims["scale_1"] = (res1, res1.ttft_s + fe, res1.tpot_s)
    return sims, sim_steps


def _mape_of(real_ttft: np.ndarray, real_tpot: np.ndarray, both: np.ndarray, sim: Variant, *, errors: bool = False) -> dict[str, Any]:
    """MAPE of a variant on the matched requests it finished (None when it finished none), and with
    `errors` the error of its mean / p50 / p90 / p99 too."""
    _, ttft, tpot = sim
    ok = both & np.isfinite(tpot)
    out: dict[str, Any] = {"ttft_mape": float(ape(ttft[ok], real_ttft[ok]).mean()) if ok.any() else None,
                           "tpot_mape": float(ape(tpot[ok], real_tpot[ok]).mean()) if ok.any() else None}
    if errors:
        out["ttft_error_of"] = compare(real_ttft[ok], ttft[ok])["error_of"] if ok.any() else None
        out["tpot_error_of"] = compare(real_tpot[ok], tpot[ok])["error_of"] if ok.any() else None
    return out


def summarize(opts: FidelityOptions, setup: HostSetup, real: Replays, bench: SimBench, fit: Fit, sims: dict[str, Variant],
             sim_steps: list[tuple[Any, ...]], load_start: tuple[float, ...]) -> dict[str, Any]:
    """Phase 5: the figures of the run (summary.json)."""
    res, sim_ttft, sim_tpot = sims["engine"]
    ok, sim_done = real.ok, np.isfinite(sim_tpot)
    both = ok & sim_done
    real_ttft = np.array([r.ttft_s for r in real.recs])
    real_tpot = np.array([r.tpot_s for r in real.recs])
    # per micro-batch over the trace (the first replay): the runtime's scheduler trace, the simulator's steps
    inst_names = [i.name for i in setup.layout]
    trace_end = real.starts.get("repeat", real.starts.get("calibration_after", math.inf))
    real_steps = read_steps(opts.out / "steps", real.starts["trace"], trace_end)
    c = bench.cal_end
    sim_rows = [(inst_names[x[0]], x[1], x[3], x[4], x[5] - c, x[6] - c) for x in sim_steps if x[5] >= c]
    meter = real.meters["trace"]
    taken_trace, _ = bench.taken(real, float(setup.cores))
    load, t1_scale = _load_of(fit.calibration), fit.one_thread[1].scale
    engine = setup.engine
    return {
        "model": setup.name, "node_label": opts.node, "quick": opts.quick, "dataset": opts.dataset,
        "cores": setup.cores, "load": opts.load, "rate_per_s": setup.rate, "duration_s": opts.duration_s,
        "max_prompt": opts.max_prompt, "max_output": opts.max_output,
        "prompt_tokens_mean": setup.p_mean, "output_tokens_mean": setup.d_mean,
        "requests": {"trace": len(setup.trace), "real_finished": int(ok.sum()), "sim_finished": int(sim_done.sum()),
                     "matched": int(both.sum()), "real_errors": [f"#{r.index}: {r.error}" for r in real.recs if r.error][:20]},
        "ttft": compare(real_ttft[both], sim_ttft[both]), "tpot": compare(real_tpot[both], sim_tpot[both]),
        "table_only": _mape_of(real_ttft, real_tpot, both, sims["table"]),
        "no_host_model": _mape_of(real_ttft, real_tpot, both, sims["independent"]),
        "calibration": fit.calibration,
        "repeatability": repeatability(real.recs, real.recs2),
        "uncalibrated": _mape_of(real_ttft, real_tpot, both, sims["uncalibrated"], errors=True),
        "with_background": _mape_of(real_ttft, real_tpot, both, sims["with_background"]),
        "scale_1": _mape_of(real_ttft, real_tpot, both, sims["scale_1"], errors=True),
        "taken_vs_one_thread": {**variant_errors(real_ttft, real_tpot, both, sims["taken_vs_one_thread"]),
                                "prefill_scale": t1_scale[Phase.PREFILL], "decode_scale": t1_scale[Phase.DECODE]},
        "no_taken": _mape_of(real_ttft, real_tpot, both, sims["no_taken"], errors=True),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "sim_options": {"lanes": "one per stage", "spread": True, "host_cores": setup.cores, "host_background": 0,
                        "frontend_work_s": list(load), "host_taken": f"measured per {meter.window_s:g} s window (CpuMeter.taken)"},
        "cpu_during_replay": {"ours_cores": meter.ours_cores, "others_cores": meter.others_cores,
                              "others_runnable_threads": meter.background, "samples": meter.samples,
                              "ours_wait_share": meter.ours_wait_share,
                              "taken_cores_mean": float(np.mean([v for _, v in taken_trace])) if taken_trace else 0.0},
        "cpu_during_calibration": [{"ours_cores": m.ours_cores, "others_cores": m.others_cores,
                                    "others_runnable_threads": m.background, "ours_wait_share": m.ours_wait_share}
                                   for m in (real.meters["calibration_before"], real.meters["calibration_after"])],
        "sim_utilization": {f"{m}/{ph}": res.full.summary(timing=False)["per_model"][m][ph]["utilization"]
                            for m in [setup.name] for ph in ("prefill", "decode")},
        "frontend_ms": engine.frontend_s * 1e3, "decode_step_extra_ms": engine.step_extra_s * 1e3,
        "noop_runtime": {"ttft_ms": setup.noop[0] * 1e3, "tpot_ms": setup.noop[1] * 1e3},
        "instances": {k: {"phase": t.phase.value, "layers": [s.layers for s in t.placement.stages],
                          "nodes": [len(s.nodes) for s in t.placement.stages], "throughput_tok_per_s": t.throughput_tok_per_s}
                      for k, t in setup.templates.items()},
        "replay_starts_monotonic_s": real.starts,
        "steps": {"real": step_table(real_steps), "sim": step_table(sim_rows)},
        "profile": str(setup.csv_path), "runtime_wall_s": real.runtime_s,
    }  # fmt: skip


def _csv_text(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def write_outputs(out: Path, summary: dict[str, Any], setup: HostSetup, real: Replays, fit: Fit, sims: dict[str, Variant]) -> None:
    """Phase 6: requests.csv, calibration.csv, fidelity_cdf.png, host_load.json, summary.json and
    report.md, each written whole or not at all (`coral.atomic`)."""
    res, sim_ttft, sim_tpot = sims["engine"]
    both = real.ok & np.isfinite(sim_tpot)
    real_ttft = np.array([r.ttft_s for r in real.recs])
    real_tpot = np.array([r.tpot_s for r in real.recs])
    names = [i.name for i in setup.layout]
    rows = []
    for i, r in enumerate(real.recs):
        pi, di = int(res.prefill_instance[i]), int(res.decode_instance[i])
        rows.append([i, f"{r.arrival_s:.6f}", r.prompt_tokens, r.output_tokens, f"{real_ttft[i]:.6f}", f"{sim_ttft[i]:.6f}",
                     f"{real_tpot[i]:.6f}", f"{sim_tpot[i]:.6f}", names[pi] if pi >= 0 else "", names[di] if di >= 0 else "",
                     r.error])
    write_text(out / "requests.csv", _csv_text(["index", "arrival_s", "prompt_tokens", "output_tokens", "real_ttft_s", "sim_ttft_s",
                                                "real_tpot_s", "sim_tpot_s", "prefill_instance", "decode_instance", "error"], rows))
    half = len(real.cal_recs) // 2
    rows = [[i, "before" if i < half else "after", int(real.cal_group[i]), f"{r.arrival_s:.6f}", r.prompt_tokens, r.output_tokens,
             f"{r.ttft_s:.6f}", f"{fit.cal_ttft[i]:.6f}", f"{r.tpot_s:.6f}", f"{fit.cal_tpot[i]:.6f}", r.error]
            for i, r in enumerate(real.cal_recs)]
    write_text(out / "calibration.csv", _csv_text(["index", "when", "group", "arrival_s", "prompt_tokens", "output_tokens",
                                                   "real_ttft_s", "sim_ttft_s", "real_tpot_s", "sim_tpot_s", "error"], rows))
    t, p = summary["ttft"], summary["tpot"]
    title = (f"{setup.name}, {int(both.sum())} requests, {setup.rate:.2f} req/s: TTFT MAPE {t['mape']:.1%}, "
             f"TPOT MAPE {p['mape']:.1%}")
    _, b_ttft, b_tpot = sims["table"]
    b_ok = both & np.isfinite(b_tpot)
    whole = b_ok.sum() == both.sum()
    write_bytes(out / "fidelity_cdf.png", cdf_png(real_ttft[both], sim_ttft[both], real_tpot[both], sim_tpot[both],
                                                  b_ttft[b_ok] if whole else None, b_tpot[b_ok] if whole else None, title))
    write_text(out / "host_load.json", json.dumps({
        label: {"window_s": m.window_s, "taken_cores": m.taken, "others_runnable_threads": m.steps}
        for label, m in real.meters.items()}) + "\n")
    write_text(out / "summary.json", json.dumps(summary, indent=2, default=json_default) + "\n")
    write_text(out / "report.md", report_markdown(summary))


def run_fidelity(opts: FidelityOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the study and write its outputs into `opts.out`: calibrate the host (profile, trace,
    overheads), replay on the real runtime, fit the engine's node time, simulate the variants, write.

    Returns:
        The summary (also written as summary.json).

    Raises:
        CoralError: the runtime failed to start, no request finished, a bad option.
    """
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    opts.out.mkdir(parents=True, exist_ok=True)
    setup = calibrate_host(opts, say)
    real = replay_runtime(setup, opts, say)
    bench = SimBench.of(setup, real, opts)
    fit = fit_engine(bench, real, say)
    sims, sim_steps = simulate_variants(bench, real, fit)
    summary = {**summarize(opts, setup, real, bench, fit, sims, sim_steps, load_start), "wall_s": time.perf_counter() - t_start}
    write_outputs(opts.out, summary, setup, real, fit, sims)
    return summary
