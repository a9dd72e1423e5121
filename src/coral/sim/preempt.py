"""Spot preemptions in the simulated cluster: the cloud's notice, the unscheduled re-plan, the loss.

The draws come from the run's `SpotMarket` (`coral.sim.spot`, where the model is stated). Here:

- While a region holds spot nodes, the next zone-wide and the next independent event of its
  process are in the event queue; whenever the number of held spot nodes changes (a spot
  instance starts, stops, or is noticed), both are redrawn and the old ones go stale (a version
  per region). Held: starting, serving or draining spot instances not yet noticed.
- At a notice, the spot pools of the noticed instances' configurations go down, and the
  re-planner is called at once with the last epoch's demand and the running instances without
  the noticed ones, so replacements start now and serve `init_s` later. A noticed instance that
  serves keeps serving until then (make before break, as a re-plan's replaced instance does),
  or until `SPOT_NOTICE_MARGIN_S` (10 s) before the loss if that comes first, and then drains,
  as the runtime's `Controller.preempt` does; a starting one stops at once (it
  serves nothing). Draining at the notice instead would leave a model whose only instance of a
  phase is noticed with nothing for `init_s` (measured: phi-4 at 44 % in a `core` epoch).
- At the loss (`notice_s` after the notice), an instance still holding work is lost: the
  requests on it (queued, in a micro-batch, decoding, or prefilled there with their KV waiting
  for a decode instance) lose their KV and go to a new prefill on the model's other instances, or fail with reason "spot preemption" where the model has no
  instance left to take them. A KV transfer from or to a lost instance that had not arrived is
  lost the same way. It is paid until the loss.

A re-queued request starts again from its prompt (its whole output is decoded again, as vLLM's
preemption by recompute does for a request it evicts); its TTFT stays the first token the
client got, so the wait shows in its TPOT.
"""
from __future__ import annotations

import math

from coral.perf.model import Phase
from coral.policy.lifecycle import SPOT_NOTICE_MARGIN_S, Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import InstanceSpec
from coral.sim.cluster import FAILED, RETIRE, SPOT_LOSS, SPOT_NOTICE, WAITING, Batch, Instance, Node
from coral.sim.replan import Replanning
from coral.sim.spot import PREEMPTION_REASON, SpotMarket, SpotNotice

_LIVE = (Lifecycle.STARTING, Lifecycle.ACTIVE, Lifecycle.DRAINING)


class Preemptions(Replanning):
    """The event handlers of spot preemptions (only a run with a `SpotMarket` has any)."""

    def _route_prefill(self, t: float, rid: int) -> None:
        """Send `rid` to a prefill or colocated instance (the request flow's; declared for `_requeue`)."""
        raise NotImplementedError

    def _finish(self, t: float, node: Node, lane: Batch) -> None:
        raise NotImplementedError

    def _node_arrive(self, t: float, node: Node, lane: Batch) -> None:
        raise NotImplementedError

    def _kv_arrive(self, t: float, inst: Instance, rid: int) -> None:
        raise NotImplementedError

    @property
    def market(self) -> SpotMarket:
        assert self.spot is not None
        return self.spot

    # -- the draws ----------------------------------------------------------------------------------
    def _held(self, region: str) -> list[Instance]:
        return [i for i in self.instances if i.spec.spot and i.region == region and i.lost_s == math.inf
                and i.state in _LIVE]

    def _spot_held_changed(self, t: float, region: str) -> None:
        """Redraw `region`'s next zone-wide and independent events for the nodes it holds now."""
        v = self.spot_version[region] = self.spot_version.get(region, 0) + 1
        nodes = sum(len(i.spec.template.nodes) for i in self._held(region))
        if nodes == 0:
            return
        zone = self.market.next_zone_event_s(region, t)
        if zone < math.inf:
            self.push(zone, SPOT_NOTICE, (region, v), "zone")
        node = self.market.next_node_event_s(region, t, nodes)
        if node < math.inf:
            self.push(node, SPOT_NOTICE, (region, v), "node")

    def _spot_refused(self, t: float, spec: InstanceSpec) -> bool:
        if self.spot is None or not any(self.spot.is_down(spec.region, c, t) for c in spec.template.nodes):
            return False
        self.spot_refused += 1
        return True

    # -- the notice ----------------------------------------------------------------------------------
    def _spot_notice(self, t: float, key: tuple[str, int], kind: str) -> None:
        region, version = key
        if self.spot_version.get(region) != version:
            return  # drawn for a count of held nodes that has changed since
        held = self._held(region)
        if kind == "zone":
            victims = held
        else:
            victims = [held[self.market.pick(region, [len(i.spec.template.nodes) for i in held])]]
        loss = t + self.notice_s
        configs = list(dict.fromkeys(c for i in victims for c in i.spec.template.nodes))
        self.market.take_down(region, configs, t, loss)
        for inst in victims:
            inst.lost_s = loss
            if inst.state is Lifecycle.STARTING:
                inst.retiring = False
                self._remove(t, inst)  # serves nothing yet: stops now
            elif inst.state is Lifecycle.ACTIVE:  # make before break: serves until its replacements are ready
                inst.retiring = True
                inst.retire_s = max(t, min(t + self.init_s, loss - SPOT_NOTICE_MARGIN_S))
                self.push(inst.retire_s, RETIRE, inst)
            if inst.state is not Lifecycle.STOPPED:
                self.push(loss, SPOT_LOSS, inst)
        self.spot_notices.append(SpotNotice(t_s=t, loss_s=loss, region=region, kind=kind,
                                            instances=tuple(i.id for i in victims),
                                            nodes=sum(len(i.spec.template.nodes) for i in victims)))
        self._spot_held_changed(t, region)
        # The unscheduled re-plan: the last epoch's demand, the running instances without the noticed ones.
        self.market.notice_at = t
        try:
            plan = list(self.replan(t, self._last_demand, self.running_specs(), self._last_window))
        finally:
            self.market.notice_at = None
        self.apply_plan(t, plan)

    # -- the loss --------------------------------------------------------------------------------------
    def _spot_loss(self, t: float, inst: Instance) -> None:
        """`inst`'s nodes leave: what it still holds goes to a new prefill elsewhere, or fails."""
        rids: list[int] = []
        if inst.phase is Phase.PREFILL:  # prefills whose KV waited here for a decode instance lose it
            pend = self.pending_decode[inst.midx]
            rids.extend(rid for rid, path in pend if path[0].inst is inst)
            kept = [(rid, path) for rid, path in pend if path[0].inst is not inst]
            pend.clear()
            pend.extend(kept)
        if inst.state is Lifecycle.STOPPED:  # drained before its nodes left
            can = self._can_serve(inst.midx)
            for rid in rids:
                self._requeue(t, rid, can)
            return
        inst.state = next_state(inst.state, LifecycleEvent.FAIL, in_flight=inst.held)
        inst.stop_s = t
        rids.extend(inst.queue)
        inst.queue.clear()
        for lane in inst.lanes:
            rids.extend(lane.rids)
            rids.extend(lane.partial)
            lane.rids.clear()
            lane.partial.clear()
            lane.finish_at.clear()
            lane.running = False
        for st in inst.stages:
            for node in st:
                if node.busy:  # the micro-batch it was running is lost; the node was busy until now
                    node.busy_s += t - node.started_at
                    node.busy = False
                node.queue.clear()
        can = self._can_serve(inst.midx)  # every request here is of its model
        for rid in dict.fromkeys(rids):
            self._requeue(t, rid, can)
        if inst.phase is Phase.PREFILL:
            self._retire_deferred(t, inst.midx)

    def _requeue(self, t: float, rid: int, can_serve: bool) -> None:
        """`rid` lost its KV with its instance: a new prefill on the model's other instances, or a
        failure where the model has none left that could serve it (`can_serve`: `_can_serve`)."""
        first = self.r_first[rid]
        if first == first:  # not NaN: the client got its first token then
            self.first_seen[rid] = min(self.first_seen.get(rid, first), first)
        d = self.r_dinst[rid]
        if d >= 0 and self.instances[d].state is not Lifecycle.FAILED:
            self._release(t, self.instances[d], 1)  # its decode instance held it from arrival
        nan = math.nan
        self.r_pstart[rid] = self.r_first[rid] = self.r_kv[rid] = self.r_dstart[rid] = nan
        self.r_pinst[rid] = self.r_dinst[rid] = -1
        self.r_fed[rid] = 0
        self.r_join[rid] = 0
        if not can_serve:
            self.r_status[rid] = FAILED
            self.r_reason[rid] = PREEMPTION_REASON
            self.n_failed += 1
            return
        self.r_status[rid] = WAITING
        self.requeued[rid] = self.requeued.get(rid, 0) + 1
        self._route_prefill(t, rid)

    def _can_serve(self, m: int) -> bool:
        """Model `m` has an instance serving or starting, not noticed, for each of its phases
        (a colocated one, or a prefill and a decode one)."""
        phases = {i.phase for i in self.instances if i.midx == m and i.lost_s == math.inf
                  and (i.state is Lifecycle.ACTIVE or i.state is Lifecycle.STARTING)}
        return Phase.COLOCATED in phases or {Phase.PREFILL, Phase.DECODE} <= phases

    # -- events of lost instances ------------------------------------------------------------------------
    def _finish_live(self, t: float, node: Node, lane: Batch) -> None:
        if lane.inst.state is not Lifecycle.FAILED:
            self._finish(t, node, lane)

    def _node_arrive_live(self, t: float, node: Node, lane: Batch) -> None:
        if lane.inst.state is not Lifecycle.FAILED:
            self._node_arrive(t, node, lane)

    def _kv_arrive_live(self, t: float, inst: Instance, rid: int) -> None:
        """A KV transfer arrives, unless its source's or its destination's nodes left on the way
        (a source that drained and stopped after its notice loses its KV at the loss all the same)."""
        if inst.lost_s < t or self.instances[self.r_pinst[rid]].lost_s < t:
            self._requeue(t, rid, self._can_serve(inst.midx))
            return
        self._kv_arrive(t, inst, rid)
