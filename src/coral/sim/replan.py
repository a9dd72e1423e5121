"""Epochs of the simulated cluster: the demand each epoch saw, re-planning, make-before-break, per-epoch records."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coral.perf.model import Phase
from coral.policy.lifecycle import Lifecycle
from coral.policy.routing import InstanceSpec
from coral.sim.cluster import DECODE, FAILED, PREFILL, RETIRE, WAITING, Instance
from coral.sim.core import SimCore
from coral.sim.result import EpochRecord, InstanceRecord
from coral.workload.trace import Trace

# The phases of new instances that take over a removed instance's work: a prefill's arrivals go
# to prefill or colocated instances, a decode's KV to decode or colocated ones (which prefill
# their own); a colocated instance's both phases.
TAKES_OVER = {Phase.PREFILL: (Phase.PREFILL, Phase.COLOCATED), Phase.DECODE: (Phase.DECODE, Phase.COLOCATED),
              Phase.COLOCATED: (Phase.PREFILL, Phase.DECODE, Phase.COLOCATED)}


class Replanning(SimCore):
    """The epoch boundary (demand, `replan`, the new plan applied), the end of the run, and the
    records of epochs and instances."""

    _epoch_first = 0  # the first request not yet counted in an epoch's demand

    def running_specs(self) -> list[InstanceSpec]:
        return [i.spec for i in self.instances
                if i.state in (Lifecycle.ACTIVE, Lifecycle.STARTING) and not i.retiring]

    def _spot_refused(self, t: float, spec: InstanceSpec) -> bool:
        """A plan asked for spot instance `spec` while one of its pools is down (`coral.sim.preempt`)."""
        raise NotImplementedError

    def _epoch(self, t: float) -> None:
        self._record_epoch(t)
        lo = t - self.epoch_s
        demand: dict[tuple[str, Phase], float] = {}
        i = self._epoch_first
        arr = self.r_arrival
        prompt = [0.0] * len(self.models)
        out = [0.0] * len(self.models)
        seen: list[list[int]] = [[] for _ in self.models]
        while i < len(arr) and arr[i] < t:
            if arr[i] >= lo:
                m = self.r_model[i]
                prompt[m] += self.r_prompt[i]
                out[m] += self.r_out[i]
                seen[m].append(i)
            i += 1
        self._epoch_first = i
        window: dict[str, Trace] = {}
        for m, name in enumerate(self.models):
            demand[(name, Phase.PREFILL)] = prompt[m] / self.epoch_s
            demand[(name, Phase.DECODE)] = out[m] / self.epoch_s
            ids = seen[m]
            window[name] = Trace(name=name, arrival_s=np.array([arr[k] - lo for k in ids], dtype=float),
                                 prompt_tokens=np.array([self.r_prompt[k] for k in ids], dtype=np.int64),
                                 output_tokens=np.array([self.r_out[k] for k in ids], dtype=np.int64),
                                 window_s=self.epoch_s)
        self._last_demand, self._last_window = demand, window
        plan = list(self.replan(t, demand, self.running_specs(), window))
        self.apply_plan(t, plan)
        if self.progress is not None:
            self.progress(t, self.duration_s)

    def apply_plan(self, t: float, plan: Sequence[InstanceSpec]) -> None:
        want: dict[InstanceSpec, int] = {}
        for spec in plan:
            want[spec] = want.get(spec, 0) + 1
        # Keep serving instances before starting ones, then oldest first: fewer cold starts.
        keep_order = ([i for i in self.instances if i.state is Lifecycle.ACTIVE and not i.retiring]
                      + [i for i in self.instances if i.state is Lifecycle.STARTING])
        removed: list[Instance] = []
        for inst in keep_order:
            if want.get(inst.spec, 0) > 0:
                want[inst.spec] -= 1
            elif inst.state is Lifecycle.STARTING:
                self._remove(t, inst)  # serves nothing yet: stop at once
            else:
                removed.append(inst)
        starting: set[tuple[int, Phase]] = set()
        for spec in plan:  # plan order, so new instance ids are deterministic
            if want.get(spec, 0) > 0:
                want[spec] -= 1
                if spec.spot and self._spot_refused(t, spec):
                    continue
                inst = self.start_instance(spec, t, t + self.init_s)
                starting.add((inst.midx, inst.phase))
        # Make before break: an instance being replaced keeps taking traffic until the new
        # instances that take over its work are ready (`TAKES_OVER`: a switch of the model's mode
        # replaces its prefill and decode instances by colocated ones, or back), then drains; a
        # pure scale-down drains now.
        for inst in removed:
            if self.init_s > 0 and any((inst.midx, p) in starting for p in TAKES_OVER[inst.phase]):
                inst.retiring = True
                inst.retire_s = t + self.init_s
                self.push(inst.retire_s, RETIRE, inst)
            else:
                self._remove(t, inst)

    def _record_epoch(self, t: float) -> None:
        # Counted from the request states, independently of the finished / failed counters.
        in_flight = sum(1 for s in self.r_status[: self.n_arrived] if s in (WAITING, PREFILL, DECODE))
        self.epochs.append(EpochRecord(
            t_s=t, arrived=self.n_arrived, finished=self.n_done, failed=self.n_failed, in_flight=in_flight,
            instances=tuple(self._instance_counts())))

    def _instance_counts(self) -> list[tuple[str, str, int]]:
        counts: dict[tuple[str, str], int] = {}
        for i in self.instances:
            if i.state is not Lifecycle.STOPPED and i.state is not Lifecycle.FAILED:  # FAILED: lost spot nodes
                k = (i.spec.key, i.state.value)
                counts[k] = counts.get(k, 0) + 1
        return [(k, s, n) for (k, s), n in sorted(counts.items())]

    def _close(self, end: float) -> None:
        for m in range(len(self.models)):
            for rid in self.pending_prefill[m]:
                self.r_status[rid] = FAILED
                self.r_reason[rid] = "no prefill or colocated instance of the model was ever ready"
                self.n_failed += 1
            for rid, _ in self.pending_decode[m]:
                self.r_status[rid] = FAILED
                self.r_reason[rid] = "no decode instance of the model was ever ready"
                self.n_failed += 1
        self._record_epoch(end)
        for inst in self.instances:
            if inst.stop_s > end:
                inst.stop_s = end
            for st in inst.stages:
                for node in st:
                    if node.busy:  # count the running micro-batch's work up to the end
                        node.busy_s += end - node.started_at

    def instance_records(self) -> list[InstanceRecord]:
        prices = self.sc.prices  # type: ignore[attr-defined]
        out = []
        for i in self.instances:
            nodes = i.spec.template.nodes
            if i.spec.spot and self.spot is not None:  # the spot price (`start_instance` checked there is one)
                price_h = sum(self.spot.price_usd_per_h(i.region, n) for n in nodes)
            else:
                price_h = sum(prices[(i.region, n)] for n in nodes)
            out.append(InstanceRecord(
                id=i.id, key=i.spec.key, model=self.models[i.midx], phase=i.phase.value, region=i.region,
                start_s=i.start_s, ready_s=min(i.ready_s, self.duration_s), stop_s=i.stop_s,
                nodes=sum(len(s) for s in i.stages), price_usd_per_h=price_h,
                busy_node_s=sum(n.busy_s for s in i.stages for n in s), state=i.state.value,
                spot=i.spec.spot, rented_nodes=len(nodes)))
        return out

