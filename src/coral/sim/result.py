"""What a simulation run measured: per-request records, per-instance costs, per-epoch state; summary and files."""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coral.atomic import building_dir
from coral.perf.model import Phase
from coral.sim.spot import PREEMPTION_REASON, SpotRecord
from coral.slo import attained, phase_attainment, request_attainment, request_tpot_s

STATUS_NAMES = ("in_flight", "in_flight", "in_flight", "finished", "failed")  # by engine status code
_DONE, _FAILED = 3, 4


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochRecord:
    """The cluster at one epoch boundary (and at the end of the run)."""

    t_s: float
    arrived: int
    finished: int
    failed: int
    in_flight: int
    instances: tuple[tuple[str, str, int], ...]  # (instance key, lifecycle state, count)

    @property
    def conserved(self) -> bool:
        return self.arrived == self.finished + self.failed + self.in_flight


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceRecord:
    """One instance's life and bill."""

    id: int
    key: str
    model: str
    phase: str
    region: str
    start_s: float
    ready_s: float
    stop_s: float
    nodes: int
    price_usd_per_h: float  # all its nodes together
    busy_node_s: float
    state: str  # at the end of the run
    spot: bool = False  # on spot nodes (`price_usd_per_h` is then the spot price)
    rented_nodes: int = 0  # the template's nodes (`nodes` counts engines: a node may hold several TP groups)

    def cost_usd(self, lo: float = 0.0, hi: float = math.inf) -> float:
        """What it cost within `[lo, hi)` (paid from start, while starting and draining too)."""
        span = min(self.stop_s, hi) - max(self.start_s, lo)
        return max(0.0, span) * self.price_usd_per_h / 3600.0


def _pcts(x: np.ndarray) -> dict[str, float | None]:
    x = x[~np.isnan(x)]
    if x.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SimResult:
    """A finished run. Arrays are per request, in arrival order; times are seconds since the start."""

    scenario: str
    seed: int
    duration_s: float
    epoch_s: float
    init_s: float
    models: tuple[str, ...]
    ttft_slo_s: tuple[float, ...]
    tpot_slo_s: tuple[float, ...]
    attainment_target: tuple[float, ...]  # per model, the share of requests the plan is sized to serve in SLO
    model: np.ndarray  # index into `models`
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    status: np.ndarray  # engine status code, see STATUS_NAMES
    reason: tuple[str, ...]  # why a request failed ("" otherwise)
    prefill_instance: np.ndarray  # -1: none
    decode_instance: np.ndarray
    prefill_start_s: np.ndarray  # NaN where it did not happen
    first_token_s: np.ndarray
    kv_arrival_s: np.ndarray
    decode_start_s: np.ndarray
    done_s: np.ndarray
    epochs: tuple[EpochRecord, ...]
    instances: tuple[InstanceRecord, ...]
    events: int
    wall_s: float
    spot: SpotRecord | None = None  # what the spot market did; None: the run had no spot market

    # -- per-request figures ---------------------------------------------------------------------
    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """Mean time between output tokens after the first (0 for one-token outputs), finished requests."""
        return request_tpot_s(self.first_token_s, self.done_s, self.output_tokens)

    @property
    def e2e_s(self) -> np.ndarray:
        return self.done_s - self.arrival_s

    @property
    def queue_s(self) -> np.ndarray:
        """Prefill queueing: arrival to the first stage (includes waiting for any instance)."""
        return self.prefill_start_s - self.arrival_s

    @property
    def decode_queue_s(self) -> np.ndarray:
        """Decode queueing: KV arrival to the first decode step."""
        return self.decode_start_s - self.kv_arrival_s

    @property
    def finished(self) -> np.ndarray:
        return self.status == _DONE

    @property
    def failed(self) -> np.ndarray:
        return self.status == _FAILED

    def phase_latency_s(self, phase: Phase) -> tuple[np.ndarray, np.ndarray]:
        """Per request, `phase`'s latency (TTFT or TPOT) and whether it reached the phase's end
        (its first token, or its last): what `coral.slo.phase_attainment` reads."""
        if phase is Phase.PREFILL:
            return self.ttft_s, ~np.isnan(self.first_token_s)
        return self.tpot_s, self.finished

    @property
    def slo_met(self) -> np.ndarray:
        ttft_slo = np.asarray(self.ttft_slo_s)[self.model]
        tpot_slo = np.asarray(self.tpot_slo_s)[self.model]
        return (self.status == _DONE) & attained(self.ttft_s, self.tpot_s, ttft_slo, tpot_slo)

    # -- summary ------------------------------------------------------------------------------------
    def summary(self, *, timing: bool = True) -> dict[str, Any]:
        """JSON-able figures of the run.

        Args:
            timing: include the host-dependent `wall_s` and `events_per_s` (off for byte-stable output).

        Returns:
            Top level: `requests` (arrived / finished / failed / in_flight), `cost_usd_per_h`,
            `goodput_tok_per_s`, `slo_attainment` (met / (finished + failed), per model and per
            phase too: `coral.slo.request_attainment` / `phase_attainment`),
            `slo_attainment_arrived` (met / arrived), `per_model`, `per_epoch`, `events`, and,
            for a run with a spot market, `spot`: notices (zone-wide and single-node events),
            instances noticed and lost (still holding work when their nodes left), nodes lost,
            requests re-queued and failed by preemption, spot starts refused while a pool was
            down, spot and on-demand node-hours and $, each model's attainment per epoch (of
            the requests that arrived in it, met / resolved) and its worst, every event and
            every spell a spot pool was down.
        """
        met = self.slo_met
        done = self.status == _DONE
        failed = self.status == _FAILED
        n = int(self.status.size)
        hours = self.duration_s / 3600.0
        cost = sum(i.cost_usd() for i in self.instances)
        good_tok = float(self.output_tokens[met].sum())
        out: dict[str, Any] = {
            "scenario": self.scenario, "seed": self.seed, "duration_s": self.duration_s, "epoch_s": self.epoch_s,
            "init_s": self.init_s,
            "requests": {"arrived": n, "finished": int(done.sum()), "failed": int(failed.sum()),
                         "in_flight": int(n - done.sum() - failed.sum())},
            "cost_usd_per_h": cost / hours,
            "goodput_tok_per_s": good_tok / self.duration_s,
            "slo_attainment": request_attainment(met, done, failed),
            "slo_attainment_arrived": _ratio(float(met.sum()), float(n)),
            "events": self.events,
        }
        if timing:
            out["wall_s"] = self.wall_s
            out["events_per_s"] = self.events / self.wall_s if self.wall_s > 0 else None
        out["per_model"] = {name: self._model_summary(m, met) for m, name in enumerate(self.models)}
        out["per_epoch"] = self._epoch_summary(met)
        if self.spot is not None:
            out["spot"] = self._spot_summary(self.spot, met)
        return out

    def _spot_summary(self, sp: SpotRecord, met: np.ndarray) -> dict[str, Any]:
        """The spot block: preemptions, what they took, the bill split, attainment per epoch."""
        node_h = {"spot": 0.0, "on_demand": 0.0}
        cost = {"spot": 0.0, "on_demand": 0.0}
        for i in self.instances:
            k = "spot" if i.spot else "on_demand"
            node_h[k] += i.rented_nodes * max(0.0, i.stop_s - i.start_s) / 3600.0
            cost[k] += i.cost_usd()
        lost = set(sp.lost)
        done, failed = self.status == _DONE, self.status == _FAILED
        epochs: list[dict[str, Any]] = []
        worst: dict[str, float] = {}
        lo = 0.0
        for e in self.epochs:  # by arrival: the requests that came in the epoch, met / resolved
            sel = (self.arrival_s >= lo) & (self.arrival_s < e.t_s)
            by_model: dict[str, float | None] = {}
            for m, name in enumerate(self.models):
                s = sel & (self.model == m)
                a = request_attainment(met[s], done[s], failed[s])
                by_model[name] = a
                if a is not None:
                    worst[name] = min(worst.get(name, a), a)
            epochs.append({"t_start_s": lo, "t_end_s": e.t_s, "slo_attainment_by_model": by_model})
            lo = e.t_s
        return {
            "notice_s": sp.notice_s, "notices": len(sp.notices),
            "zone_events": sum(1 for n in sp.notices if n.kind == "zone"),
            "node_events": sum(1 for n in sp.notices if n.kind == "node"),
            "instances_noticed": sum(len(n.instances) for n in sp.notices),
            "nodes_noticed": sum(n.nodes for n in sp.notices),
            "instances_lost": len(lost),
            "nodes_lost": sum(i.rented_nodes for i in self.instances if i.id in lost),
            "requests_requeued": sp.requeued_requests, "requeues": sp.requeued,
            "requests_failed": sum(1 for i in np.flatnonzero(failed) if self.reason[i] == PREEMPTION_REASON),
            "spot_starts_refused": sp.refused,
            "node_hours": node_h, "cost_usd": cost,
            "worst_epoch_attainment": {name: worst.get(name) for name in self.models},
            "per_epoch": epochs,
            "events": [{"t_s": n.t_s, "loss_s": n.loss_s, "region": n.region, "kind": n.kind,
                        "instances": list(n.instances), "nodes": n.nodes} for n in sp.notices],
            "pools_down": [{"region": r, "config": c, "from_s": a, "until_s": b} for r, c, a, b in sp.down],
        }

    def _phase_summary(self, name: str, phase: str, hours: float) -> dict[str, Any]:
        recs = [i for i in self.instances if i.model == name and i.phase == phase]
        paid_node_s = sum(i.nodes * max(0.0, i.stop_s - i.start_s) for i in recs)
        busy = sum(i.busy_node_s for i in recs)
        return {"instances_started": len(recs), "cost_usd_per_h": sum(i.cost_usd() for i in recs) / hours,
                "utilization": _ratio(busy, paid_node_s)}

    def _model_summary(self, m: int, met: np.ndarray) -> dict[str, Any]:
        name = self.models[m]
        sel = self.model == m
        done = sel & (self.status == _DONE)
        failed = sel & (self.status == _FAILED)
        hours = self.duration_s / 3600.0
        ttft = self.ttft_s[sel]
        first = sel & ~np.isnan(self.first_token_s)
        attain: dict[Phase, float | None] = {}
        for ph, slo_s in ((Phase.PREFILL, self.ttft_slo_s[m]), (Phase.DECODE, self.tpot_slo_s[m])):
            lat, reached = self.phase_latency_s(ph)
            attain[ph] = phase_attainment(lat[sel], slo_s, reached[sel], self.failed[sel])
        prefill = self._phase_summary(name, "prefill", hours)
        prefill.update({"ttft_s": _pcts(ttft), "queue_s": _pcts(self.queue_s[sel]),
                        "slo_attainment": attain[Phase.PREFILL],
                        "tokens_per_s": float(self.prompt_tokens[first].sum()) / self.duration_s})
        decode = self._phase_summary(name, "decode", hours)
        decode.update({"tpot_s": _pcts(self.tpot_s[done]), "queue_s": _pcts(self.decode_queue_s[sel]),
                       "slo_attainment": attain[Phase.DECODE],
                       "tokens_per_s": float(self.output_tokens[done].sum()) / self.duration_s})
        colocated = self._phase_summary(name, "colocated", hours)
        reasons: dict[str, int] = {}
        for i in np.flatnonzero(failed):
            reasons[self.reason[i]] = reasons.get(self.reason[i], 0) + 1
        return {
            "requests": {"arrived": int(sel.sum()), "finished": int(done.sum()), "failed": int(failed.sum()),
                         "in_flight": int(sel.sum() - done.sum() - failed.sum())},
            "failed_reasons": dict(sorted(reasons.items())),
            "slo_attainment": request_attainment(met[sel], done[sel], failed[sel]),
            "attainment_target": self.attainment_target[m],
            "goodput_tok_per_s": float(self.output_tokens[met & sel].sum()) / self.duration_s,
            "cost_usd_per_h": prefill["cost_usd_per_h"] + decode["cost_usd_per_h"] + colocated["cost_usd_per_h"],
            "ttft_s": _pcts(ttft), "tpot_s": _pcts(self.tpot_s[done]), "e2e_s": _pcts(self.e2e_s[done]),
            "prefill": prefill, "decode": decode,
            # instances serving both phases (chunked prefill), reported when the model had any
            **({"colocated": colocated} if colocated["instances_started"] else {}),
        }

    def _epoch_summary(self, met: np.ndarray) -> list[dict[str, Any]]:
        rows = []
        lo = 0.0
        for e in self.epochs:
            hi = e.t_s
            span = hi - lo
            cost = sum(i.cost_usd(lo, hi) for i in self.instances)
            fin = met & (self.done_s >= lo) & (self.done_s < hi) if hi < self.duration_s else met & (self.done_s >= lo)
            inst: dict[str, dict[str, int]] = {}
            for key, state, count in e.instances:
                inst.setdefault(key, {})[state] = count
            started = sum(1 for i in self.instances if lo < i.start_s <= hi or (lo == 0.0 and i.start_s == 0.0))
            stopped = sum(1 for i in self.instances if lo < i.stop_s <= hi and i.stop_s < self.duration_s)
            rows.append({
                "t_start_s": lo, "t_end_s": hi, "arrived": e.arrived, "finished": e.finished, "failed": e.failed,
                "instances_started": started, "instances_stopped": stopped,
                "in_flight": e.in_flight, "conserved": e.conserved, "cost_usd": cost,
                "cost_usd_per_h": cost / (span / 3600.0) if span > 0 else None,
                "goodput_tok_per_s": float(self.output_tokens[fin].sum()) / span if span > 0 else None,
                "instances": inst,
            })
            lo = hi
        return rows

    # -- files ----------------------------------------------------------------------------------------
    def write(self, out_dir: str | Path) -> Path:
        """Write summary.json (without host timings), timing.json, requests.csv and plots/*.png.

        Everything is written into a temporary sibling folder first, which then replaces
        `out_dir`, so a reader never sees a half-written run.

        Args:
            out_dir: the folder to (re)create.

        Returns:
            The folder written.

        Raises:
            OSError: the folder cannot be written.
        """
        out = Path(out_dir)
        with building_dir(out) as tmp:
            (tmp / "summary.json").write_text(json.dumps(_clean(self.summary(timing=False)), indent=2) + "\n")
            (tmp / "timing.json").write_text(json.dumps(
                {"wall_s": self.wall_s, "events": self.events,
                 "events_per_s": self.events / self.wall_s if self.wall_s > 0 else None}, indent=2) + "\n")
            self._write_csv(tmp / "requests.csv")
            # lazy: matplotlib (heavy, seconds to import) loads only when plots are written
            from coral.sim.plots import write_plots

            write_plots(self, tmp / "plots")
        return out

    def _write_csv(self, path: Path) -> None:
        ttft, tpot, e2e, queue, met = self.ttft_s, self.tpot_s, self.e2e_s, self.queue_s, self.slo_met

        def f(x: float) -> str:
            return "" if math.isnan(x) else repr(float(x))

        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "model", "arrival_s", "prompt_tokens", "output_tokens", "status", "reason",
                        "prefill_instance", "decode_instance", "queue_s", "ttft_s", "tpot_s", "e2e_s", "slo_met"])
            for i in range(self.status.size):
                w.writerow([i, self.models[self.model[i]], repr(float(self.arrival_s[i])), int(self.prompt_tokens[i]),
                            int(self.output_tokens[i]), STATUS_NAMES[self.status[i]], self.reason[i],
                            int(self.prefill_instance[i]), int(self.decode_instance[i]), f(queue[i]), f(ttft[i]),
                            f(tpot[i]), f(e2e[i]), int(met[i])])


def _clean(x: Any) -> Any:
    """NaN / inf → None (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RunRecord:
    """What a finished engine run hands `build_result`: the run's parameters and its per-request
    columns (indexed by request id, in arrival order), epochs and instances."""

    scenario: str
    seed: int
    duration_s: float
    epoch_s: float
    init_s: float
    models: tuple[str, ...]
    ttft_slo_s: tuple[float, ...]
    tpot_slo_s: tuple[float, ...]
    attainment_target: tuple[float, ...]
    model: Sequence[int]
    arrival_s: Sequence[float]
    prompt_tokens: Sequence[int]
    output_tokens: Sequence[int]
    status: Sequence[int]
    reason: Sequence[str]
    prefill_instance: Sequence[int]
    decode_instance: Sequence[int]
    prefill_start_s: Sequence[float]
    first_token_s: Sequence[float]
    kv_arrival_s: Sequence[float]
    decode_start_s: Sequence[float]
    done_s: Sequence[float]
    epochs: Sequence[EpochRecord]
    instances: Sequence[InstanceRecord]
    events: int
    spot: SpotRecord | None = None


def build_result(run: RunRecord, *, wall_s: float) -> SimResult:
    """Freeze a finished engine run into a `SimResult`."""
    return SimResult(
        scenario=run.scenario, seed=run.seed, duration_s=run.duration_s, epoch_s=run.epoch_s,
        init_s=run.init_s, models=run.models,
        ttft_slo_s=run.ttft_slo_s, tpot_slo_s=run.tpot_slo_s, attainment_target=run.attainment_target,
        model=np.asarray(run.model, dtype=np.int64), arrival_s=np.asarray(run.arrival_s, dtype=np.float64),
        prompt_tokens=np.asarray(run.prompt_tokens, dtype=np.int64),
        output_tokens=np.asarray(run.output_tokens, dtype=np.int64),
        status=np.asarray(run.status, dtype=np.int64), reason=tuple(run.reason),
        prefill_instance=np.asarray(run.prefill_instance, dtype=np.int64),
        decode_instance=np.asarray(run.decode_instance, dtype=np.int64),
        prefill_start_s=np.asarray(run.prefill_start_s), first_token_s=np.asarray(run.first_token_s),
        kv_arrival_s=np.asarray(run.kv_arrival_s), decode_start_s=np.asarray(run.decode_start_s),
        done_s=np.asarray(run.done_s), epochs=tuple(run.epochs), instances=tuple(run.instances),
        events=run.events, wall_s=wall_s, spot=run.spot)
