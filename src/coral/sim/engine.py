"""The discrete-event kernel: one event per micro-batch on one engine node, and `simulate`, the entry point.

The simulator is split along its seams: `cluster` (the simulated parts and event kinds), `core`
(state and instance lifecycle), `flow` (a request's way through the cluster), `replan` (epochs),
`cpu` (the optional host model); this module runs the event loop over them.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence

from coral.policy.lifecycle import Lifecycle
from coral.policy.routing import InstanceSpec
from coral.sim.cluster import (
    ARRIVAL,
    BACKGROUND,
    CTX_GRID_TOK,
    EPOCH,
    FINISH,
    KV_ARRIVE,
    NODE_ARRIVE,
    READY,
    RETIRE,
    SPOT_LOSS,
    SPOT_NOTICE,
    TAKEN,
    LanesFn,
    ProgressFn,
    ReplanFn,
    SimOptions,
    StepTraceFn,
)
from coral.sim.flow import RequestFlow
from coral.sim.hosts import Hosts
from coral.sim.preempt import Preemptions
from coral.sim.result import RunRecord, SimResult, build_result
from coral.sim.spot import AWS_SPOT_NOTICE_S, SpotMarket, SpotRecord
from coral.workload.trace import Trace

__all__ = ["CTX_GRID_TOK", "LanesFn", "ProgressFn", "ReplanFn", "SimOptions", "StepTraceFn", "simulate"]


class _Sim(RequestFlow, Preemptions):
    """One run: the event loop over the request flow, the epochs and the spot preemptions."""

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        n = len(self.r_arrival)
        if n:
            self.push(self.r_arrival[0], ARRIVAL, 0)
        k = 1
        while k * self.epoch_s < self.duration_s - 1e-9:
            self.push(k * self.epoch_s, EPOCH, k)
            k += 1
        q = self.q
        pop = heapq.heappop
        end = self.duration_s
        finish = self._finish if self.hosts is None else self._host_finish
        node_arrive, kv_arrive = self._node_arrive, self._kv_arrive
        if self.spot is not None:  # events of lost instances are dropped (a run without spot skips the check)
            finish, node_arrive, kv_arrive = self._finish_live, self._node_arrive_live, self._kv_arrive_live
        events = 0
        while q:
            t, kind, _, a, b = q[0]
            if t > end:
                break
            pop(q)
            events += 1
            if kind == FINISH:
                finish(t, a, b)
            elif kind == NODE_ARRIVE:
                node_arrive(t, a, b)
            elif kind == KV_ARRIVE:
                kv_arrive(t, a, b)
            elif kind == ARRIVAL:
                self._arrival(t, a)
            elif kind == READY:
                self._ready(t, a)
            elif kind == RETIRE:
                self._retire(t, a)
            elif kind == BACKGROUND:
                a.background = b
                self.cpu.rerate(t, a)
            elif kind == TAKEN:
                a.taken = b
                self.cpu.rerate(t, a)
            elif kind == SPOT_NOTICE:
                self._spot_notice(t, a, b)
            elif kind == SPOT_LOSS:
                self._spot_loss(t, a)
            else:
                self._epoch(t)
        self.events = events
        self._close(end)
        return build_result(self._record(), wall_s=time.perf_counter() - wall0)

    def _record(self) -> RunRecord:
        spot = self._spot_record()  # first: it restores re-queued requests' first tokens
        sc = self.sc
        models = sc.models  # type: ignore[attr-defined]
        return RunRecord(
            scenario=str(getattr(sc, "name", "")), seed=self.seed, duration_s=self.duration_s, epoch_s=self.epoch_s,
            init_s=self.init_s, models=tuple(self.models),
            ttft_slo_s=tuple(m.ttft_ms / 1e3 for m in models), tpot_slo_s=tuple(m.tpot_ms / 1e3 for m in models),
            attainment_target=tuple(m.slo.attainment for m in models),
            model=self.r_model, arrival_s=self.r_arrival, prompt_tokens=self.r_prompt, output_tokens=self.r_out,
            status=self.r_status, reason=self.r_reason, prefill_instance=self.r_pinst, decode_instance=self.r_dinst,
            prefill_start_s=self.r_pstart, first_token_s=self.r_first, kv_arrival_s=self.r_kv,
            decode_start_s=self.r_dstart, done_s=self.r_done, epochs=self.epochs,
            instances=self.instance_records(), events=self.events, spot=spot)

    def _spot_record(self) -> SpotRecord | None:
        if self.spot is None:
            return None
        for rid, first in self.first_seen.items():  # the first token the client got, before a re-queue
            if not first >= self.r_first[rid]:  # also where it has none since (NaN)
                self.r_first[rid] = first
        lost = tuple(i.id for i in self.instances if i.state is Lifecycle.FAILED)
        return SpotRecord(notice_s=self.notice_s, notices=tuple(self.spot_notices), lost=lost,
                          requeued=sum(self.requeued.values()), requeued_requests=len(self.requeued),
                          refused=self.spot_refused, down=tuple(self.spot.down_spells))


def simulate(scenario: object, traces: Mapping[str, Trace], initial: Sequence[InstanceSpec], replan: ReplanFn, *,
             duration_s: float, epoch_s: float, init_s: float, seed: int = 0,
             progress: ProgressFn | None = None, prefill_batching: str = "tokens", lanes: LanesFn | None = None,
             spread: bool = False, hosts: Hosts | None = None, router: str = "least-work",
             decode_at_arrival: bool = False, step_trace: StepTraceFn | None = None,
             spot: SpotMarket | None = None, spot_notice_s: float = AWS_SPOT_NOTICE_S) -> SimResult:
    """Simulate serving `traces` on a cluster that starts as `initial` and is re-planned each epoch.

    Args:
        scenario: the scenario (models with SLOs, prices, the performance model `perf`).
        traces: model name -> its requests (arrivals at or after `duration_s` are ignored).
        initial: the instances serving at time 0 (ready at once; paid from 0).
        replan: called at every epoch boundary `k·epoch_s < duration_s` with the time, the demand
            observed over the last epoch (prompt tokens/s for prefill, output tokens/s for decode,
            of the requests that arrived) and the specs of the running (active + starting)
            instances; returns the new plan. Instances in the plan and running are kept, new ones
            start and serve after `init_s`, the rest drain.
        duration_s: simulated time; work still running then is reported in flight.
        epoch_s: the re-planning period.
        init_s: start-up time of a new instance (paid, not serving).
        seed: recorded in the summary; seeds the spot preemption draws; the run is deterministic
            given its inputs (the traces carry the rest of the randomness).
        progress: called with (now_s, duration_s) after every epoch boundary.
        prefill_batching: "tokens" (default): a prefill micro-batch takes queued prompts up to the
            template's token budget `b·P̄` (at least one prompt), as engines' max-batched-tokens
            does; "requests": up to `b` prompts whatever their lengths.
        lanes: template -> micro-batches an instance keeps in flight at once. None (default): the
            memory model's `2·S·min_s d_s` (prefill) or `S·min_s d_s` (decode). The Coral runtime's
            scheduler keeps `S` groups (`lambda t: len(t.placement.stages)`).
        spread: False (default): a free lane takes queued requests up to its micro-batch, FIFO.
            True: as the runtime's scheduler, at most `ceil((held + queued) / lanes)` requests per
            lane, so that a few waiting requests go to different lanes instead of one.
        router: "least-work" (default): prefill to the active instance whose outstanding prompt
            tokens (with this one) clear soonest at its throughput, decode to the least occupied
            instance (held sequences per slot) in the prefill's region first; "wrr": the paper's
            smooth weighted round-robin ∝ template throughput (`coral.policy.routing`).
        decode_at_arrival: False (default): a request's decode instance is picked when its prefill
            ends, the least held sequences per slot. True: as the Coral runtime's coordinator, when
            it arrives: the least requests assigned (from arrival to completion) per unit of the
            template's throughput, in the prefill's region.
        step_trace: None (default), or called at the end of every micro-batch's pass through all its
            stages with `(instance id, phase, lane, requests, tokens, start_s, end_s)` (tokens: the
            prompts' in prefill, the context in decode; colocated: requests are the decodes and the
            prefills with a chunk in the step, tokens the chunk's prompt tokens plus the decodes'
            context): to compare with the runtime's per-step trace.
        hosts: None (default): every node is its own server. A `Hosts`: nodes share their host's
            cores, a busy node running at speed `min(1, (cores - taken) / (busy nodes on the host + background))`.
        spot: None (default): no spot instance may be in a plan. A `SpotMarket`: spot instances
            (`InstanceSpec.spot`) are paid its spot prices and preempted by its processes
            (`coral.sim.preempt`); the run reseeds it from `seed`, and `replan` is also called at
            every preemption notice (the last epoch's demand and window, the running instances
            without the noticed ones; `spot.notice_at` is then the notice's time).
        spot_notice_s: the cloud's notice before a preempted spot node leaves (AWS: 120 s).

    Returns:
        The run's `SimResult`.

    Raises:
        CoralError: bad durations, an unknown router, a trace or instance for a model the scenario lacks, or an
            instance in a region without a price (spot: a spot offer) for one of its nodes, a spot
            instance without `spot`, `spot` with `hosts`, a `lanes` below 1, a node placed on an unknown host.
    """
    options = SimOptions(prefill_batching=prefill_batching, lanes=lanes, spread=spread, hosts=hosts, router=router,
                         decode_at_arrival=decode_at_arrival, step_trace=step_trace)
    sim = _Sim(scenario, traces, duration_s=duration_s, epoch_s=epoch_s, init_s=init_s, seed=seed,
               replan=replan, progress=progress, options=options, spot=spot, spot_notice_s=spot_notice_s)
    for spec in initial:
        sim.start_instance(spec, 0.0, 0.0)
    return sim.run()
