"""How the fidelity study scores the simulator against the runtime, and writes it up: per-request
errors, the step tables of both sides, the cores other processes took, the report and the CDF figure."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "STEP_CONCURRENCY", "ape", "cdf_png", "compare", "json_default", "read_steps", "repeatability", "report_markdown",
    "step_table", "taken_steps", "variant_errors",
]


STEP_CONCURRENCY = 3  # step tables bin the micro-batches in flight elsewhere at a step's midpoint: 0, 1, 2, 3+


def ape(sim: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Absolute percentage error of each simulated value against its real one."""
    return np.abs(sim - real) / real


def _pct(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(x)), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99))}


def compare(real: np.ndarray, sim: np.ndarray) -> dict[str, Any]:
    """Per-request errors of `sim` against `real` (MAPE, p50 / p90 APE), both sides' mean and
    percentiles, the error of each, and the quantile-matched (CDF) error."""
    err = ape(sim, real)
    r, s = _pct(real), _pct(sim)
    return {
        "mape": float(err.mean()), "p50_ape": float(np.percentile(err, 50)), "p90_ape": float(np.percentile(err, 90)),
        "real_s": r, "sim_s": s, "error_of": {k: (s[k] - r[k]) / r[k] for k in r},
        # quantile-matched error: what two CDFs side by side show (mean |Q_sim(q) - Q_real(q)| / Q_real(q))
        "cdf_mape": float(np.mean(np.abs(np.sort(sim) - np.sort(real)) / np.sort(real))),
    }  # fmt: skip


def variant_errors(real_ttft: np.ndarray, real_tpot: np.ndarray, sel: np.ndarray, sim: tuple[Any, np.ndarray, np.ndarray]) -> dict[str, Any]:
    """MAPE and the errors of mean / p50 / p90 / p99 of one simulator variant on the matched requests."""
    _, ttft, tpot = sim
    ok = sel & np.isfinite(tpot)
    if not ok.any():
        return {"ttft_mape": None, "tpot_mape": None}
    t, p = compare(real_ttft[ok], ttft[ok]), compare(real_tpot[ok], tpot[ok])
    return {"ttft_mape": t["mape"], "tpot_mape": p["mape"], "ttft_error_of": t["error_of"], "tpot_error_of": p["error_of"]}


def repeatability(first: list[Any], second: list[Any] | None) -> dict[str, Any] | None:
    """The second real replay against the first, per request, as the simulator is judged: the
    error no model of this runtime can go below on this host."""
    if second is None:
        return None
    ok = np.array([not (a.error or b.error) for a, b in zip(first, second, strict=True)])
    if not ok.any():
        return None
    t1, t2 = (np.array([r.ttft_s for r in x])[ok] for x in (first, second))
    p1, p2 = (np.array([r.tpot_s for r in x])[ok] for x in (first, second))
    return {"requests": int(ok.sum()), "ttft_mape": float(ape(t2, t1).mean()), "tpot_mape": float(ape(p2, p1).mean()),
            "ttft_p90_ape": float(np.percentile(ape(t2, t1), 90)), "tpot_p90_ape": float(np.percentile(ape(p2, p1), 90)),
            # the percentile errors the simulator is judged by, of the second run against the first
            "ttft_error_of": compare(t1, t2)["error_of"], "tpot_error_of": compare(p1, p2)["error_of"]}


def read_steps(folder: Path, start: float, end: float) -> list[tuple[str, str, int, int, float, float]]:
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


def step_table(steps: list[tuple[str, str, int, int, float, float]]) -> dict[str, Any]:
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


def taken_steps(meter: Any, offset: float, cores: float, against: float) -> list[tuple[float, float]]:
    """The cores other processes used in each window of a replay (`CpuMeter.taken`), as `Hosts.taken`
    steps from `offset` on (simulated time of the replay's start), back to 0 after the last window.

    In a window, the others take at most `cores · k / (k + against)`, the share a fair scheduler
    gives their `k` runnable threads (sampled there) against `against` runnable threads of the
    runtime. The runtime's threads sleep between messages and Linux runs a thread that wakes
    from sleep ahead of CPU-bound neighbours, so neighbours that used the cores while the runtime
    slept do not keep them when it wakes: a few busy neighbours barely slow it, many do (measured
    in docs/results/fidelity.md). The study counts the runtime as one thread per core (`against = cores`)."""
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


def cdf_png(real_ttft: np.ndarray, sim_ttft: np.ndarray, real_tpot: np.ndarray, sim_tpot: np.ndarray,
            base_ttft: np.ndarray | None, base_tpot: np.ndarray | None, title: str) -> bytes:
    """The TTFT and TPOT CDFs, real against simulated (and the table-only simulator when given), as PNG bytes."""
    # lazy: matplotlib (only when plotting)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (only when plotting)
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130)
    plt.close(fig)
    return buf.getvalue()


def json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def report_markdown(s: dict[str, Any]) -> str:
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
