"""A request's way through the simulated cluster: routing, prefill micro-batches through the
stages, the KV transfer, decode lanes stepping under continuous batching."""
from __future__ import annotations

import math

from coral.perf.model import Phase, Shape
from coral.policy.lifecycle import Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import Candidate, choose_decode, least_work
from coral.sim.cluster import (
    ARRIVAL,
    CTX_GRID_TOK,
    DECODE,
    FINISH,
    KV_ARRIVE,
    NODE_ARRIVE,
    PREFILL,
    PREFILL_MAX_PROMPTS,
    Batch,
    Instance,
    Node,
)
from coral.sim.colocated import ColocatedSteps


class RequestFlow(ColocatedSteps):
    """The event handlers that move requests: arrival, prefill, KV transfer, decode steps (and,
    through `ColocatedSteps`, the steps of colocated instances)."""

    def _ready(self, t: float, inst: Instance) -> None:
        if inst.state is not Lifecycle.STARTING:
            return
        inst.state = next_state(inst.state, LifecycleEvent.READY, in_flight=inst.held)
        self._set_active(inst.midx, inst.phase)
        m = inst.midx
        if inst.phase is not Phase.DECODE:  # prefill and colocated instances take arrivals
            pend = self.pending_prefill[m]
            while pend:
                self._route_prefill(t, pend.popleft())
        else:
            pend2 = self.pending_decode[m]
            while pend2:
                rid, src = pend2.popleft()
                self._route_decode(t, rid, src)

    # -- requests through the cluster -----------------------------------------------------------
    def _arrival(self, t: float, rid: int) -> None:
        self.n_arrived += 1
        if self.fe_request:
            self.cpu.frontend_work(t, self.fe_request)
        if rid + 1 < len(self.r_arrival):
            self.push(self.r_arrival[rid + 1], ARRIVAL, rid + 1)
        self._route_prefill(t, rid)

    def _route_prefill(self, t: float, rid: int) -> None:
        m = self.r_model[rid]
        wrr = self.prefill_wrr[m]
        if wrr is None:
            self.pending_prefill[m].append(rid)
            return
        act = self.active[m][0]
        if self.router == "wrr" or len(act) == 1:
            inst = act[wrr.pick()]
        else:
            inst = act[least_work([i.load for i in act], [i.weight for i in act], self.r_prompt[rid])]
        self.r_pinst[rid] = inst.id
        inst.queue.append(rid)
        inst.held += 1
        inst.load += self.r_prompt[rid]
        if inst.phase is Phase.COLOCATED:  # it decodes there too
            self.r_dinst[rid] = inst.id
            self._colo_admit(t, inst)
            return
        if self.decode_at_arrival:
            self._assign_decode(rid, inst.region)
        self._start_prefill(t, inst)

    def _assign_decode(self, rid: int, region: str) -> None:
        """`decode_at_arrival` only: pick the decode instance as the runtime's coordinator does when a
        request arrives: least held requests (assigned from arrival to completion) per unit of
        template throughput in the prefill's region (WRR router: `choose_decode`). None active yet:
        picked when the prefill ends, as without the option."""
        m = self.r_model[rid]
        act = self.active[m][1]
        if not act:
            return
        if self.router == "wrr":
            cands = [Candidate(id=k, region=i.region, weight=i.weight) for k, i in enumerate(act)]
            k, self.decode_states[m] = choose_decode(cands, region, self.decode_states[m])
            assert k is not None
            dst = act[k]
        else:
            group = [i for i in act if i.region == region] or act
            dst = group[least_work([i.held for i in group], [i.weight for i in group], 1.0)]
        self.r_dinst[rid] = dst.id
        dst.held += 1

    def _spread_cap(self, inst: Instance) -> int:
        """Requests per micro-batch when spreading: ceil(held in lanes + queued) / lanes), as the runtime's scheduler."""
        held = sum(len(x.rids) for x in inst.lanes)
        return -(-(held + len(inst.queue)) // inst.max_lanes)

    def _start_prefill(self, t: float, inst: Instance) -> None:
        queue = inst.queue
        cap = self._spread_cap(inst) if self.spread and queue else 0
        while queue and inst.idle_lanes:
            lane = next(x for x in inst.lanes if not x.running)
            inst.idle_lanes -= 1
            lane.running = True
            rids = lane.rids
            rids.clear()
            total = 0
            budget = inst.token_budget
            most = PREFILL_MAX_PROMPTS if budget != math.inf else inst.b
            if cap and cap < most:
                most = cap
            while queue and len(rids) < most and (not rids or total + self.r_prompt[queue[0]] <= budget):
                rid = queue.popleft()
                rids[rid] = None
                total += self.r_prompt[rid]
                self.r_status[rid] = PREFILL
            mean = total / len(rids)
            lane.shape = Shape(phase=Phase.PREFILL, batch=len(rids), prompt_tokens=mean, output_tokens=0.0)
            lane.key = (Phase.PREFILL, len(rids), mean)
            lane.stage = 0
            lane.t0 = t
            self._enter(t, lane, 0)

    def _enter(self, t: float, lane: Batch, s: int) -> None:
        inst = lane.inst
        nodes = inst.stages[s]
        node = self._pick_node(inst, s) if len(nodes) > 1 else nodes[0]
        self._node_arrive(t, node, lane)

    def _pick_node(self, inst: Instance, s: int) -> Node:
        """A node of stage `s` (data parallel) for a micro-batch: with the least-work router, the one
        with the fewest micro-batches running or queued per unit of its weight (∝ its throughput);
        with WRR, the next in the stage's weighted round-robin."""
        nodes = inst.stages[s]
        if self.router == "wrr":
            return nodes[inst.stage_wrr[s].pick()]
        weights = inst.stage_weights[s]
        return nodes[least_work([len(n.queue) + n.busy for n in nodes], weights, 1.0)]

    def _node_time(self, node: Node, lane: Batch) -> float:
        inst = lane.inst
        s = lane.stage
        key = (node.cfg, inst.midx, s == 0, s == len(inst.stages) - 1, inst.stage_layers[s], lane.key)
        v = self._time_cache.get(key)
        if v is None:
            if inst.phase is Phase.COLOCATED:
                v = self._mixed_time_s(node.cfg, inst, s, lane.key)
            else:
                v = self.perf.node_time_s(node.cfg, self.specs[inst.midx], lane.shape, inst.stage_layers[s],
                                          first=s == 0, last=s == len(inst.stages) - 1)
            self._time_cache[key] = v
        return v

    def _node_arrive(self, t: float, node: Node, lane: Batch) -> None:
        if node.busy:
            node.queue.append(lane)
            return
        node.busy = True
        node.started_at = t
        if lane.stage == 0 and lane.inst.phase is Phase.PREFILL:  # queueing ends when stage 0 starts
            pstart = self.r_pstart
            for rid in lane.rids:
                pstart[rid] = t
        elif lane.fresh and lane.stage == 0:  # a colocated step with the first chunk of these
            for rid in lane.fresh:
                self.r_pstart[rid] = t
        host = node.host
        if host is None:
            self.push(t + self._node_time(node, lane), FINISH, node, lane)
            return
        node.lane = lane
        node.rem = self._node_time(node, lane)
        node.since = t
        host.busy[node] = None
        self.cpu.rerate(t, host, node)

    # -- host model (processor sharing) -----------------------------------------------------------
    def _host_finish(self, t: float, node: Node, version: int) -> None:
        lane = self.cpu.finished(node, version, t)
        if lane is not None:
            self._finish(t, node, lane)

    def _finish(self, t: float, node: Node, lane: Batch) -> None:
        node.busy_s += t - node.started_at
        node.busy = False
        if lane.inst.phase is Phase.PREFILL:
            if lane.stage == 0:
                lane.path.clear()
            lane.path.append(node)
        if node.queue:
            self._node_arrive(t, node, node.queue.popleft())
        inst = lane.inst
        s = lane.stage
        if s + 1 < len(inst.stages):
            lane.stage = s + 1
            nodes = inst.stages[s + 1]
            nxt = self._pick_node(inst, s + 1) if len(nodes) > 1 else nodes[0]
            local = node.nic is nxt.nic  # two engines of one node: over its GPU link
            key = (node.cfg, nxt.cfg, inst.midx, lane.key, local)
            x = self._xfer_cache.get(key)
            if x is None:
                spec = self.specs[inst.midx]
                x = self._xfer_cache[key] = (self.perf.intra_transfer_s(spec, lane.shape, node.cfg) if local
                                             else self.perf.transfer_s(spec, lane.shape, node.cfg, nxt.cfg))
            self.push(t + x, NODE_ARRIVE, nxt, lane)
        elif inst.phase is Phase.PREFILL:
            self._prefill_done(t, node, lane)
        elif inst.phase is Phase.DECODE:
            self._step_done(t, lane)
        else:
            self._colo_step_done(t, lane)

    def _prefill_done(self, t: float, node: Node, lane: Batch) -> None:
        inst = lane.inst
        rids = list(lane.rids)
        if self.step_trace is not None:
            self.step_trace((inst.id, "prefill", lane.lane, len(rids), sum(self.r_prompt[r] for r in rids), lane.t0, t))
        lane.rids.clear()
        lane.running = False
        inst.idle_lanes += 1
        if self.fe_token:  # off (0) unless Hosts.frontend_work: keeps the hot path free
            self.cpu.frontend_work(t, self.fe_token * len(rids))
        at_decode = self.first_at_decode[inst.midx]
        path = tuple(lane.path)
        for rid in rids:
            if not at_decode or self.r_out[rid] <= 1:
                self.r_first[rid] = t
            inst.load -= self.r_prompt[rid]
            if self.r_out[rid] <= 1:
                if self.r_dinst[rid] >= 0:  # assigned at arrival, never decodes
                    self._release(t, self.instances[self.r_dinst[rid]], 1)
                self._complete(t, rid)
            else:
                self.r_status[rid] = DECODE
                self._route_decode(t, rid, path)
        self._release(t, inst, len(rids))
        if inst.queue:
            self._start_prefill(t, inst)

    def _route_decode(self, t: float, rid: int, path: tuple[Node, ...]) -> None:
        """Send `rid`'s KV from the prefill nodes of `path` (one per stage) to a decode instance."""
        src = path[-1]
        m = self.r_model[rid]
        act = self.active[m][1]
        pre = self.r_dinst[rid]
        if pre >= 0:  # assigned at arrival (`decode_at_arrival`)
            dst = self.instances[pre]
            # not to one whose spot nodes got their notice: it takes no new work
            if (dst.state is Lifecycle.ACTIVE or dst.state is Lifecycle.DRAINING) and dst.lost_s == math.inf:
                self._send_kv(t, rid, path, dst)
                return
            self.r_dinst[rid] = -1
            self._release(t, dst, 1)
        if not act:
            self.pending_decode[m].append((rid, path))
            return
        if self.router == "wrr":
            cands = [Candidate(id=k, region=i.region, weight=i.weight) for k, i in enumerate(act)]
            k, self.decode_states[m] = choose_decode(cands, src.inst.region, self.decode_states[m])
            assert k is not None
            dst = act[k]
        else:  # the least occupied (held sequences per slot), in the prefill's region while it has room
            group = [i for i in act if i.region == src.inst.region and i.held < i.b * i.max_lanes] or act
            dst = group[least_work([i.held for i in group], [i.b * i.max_lanes for i in group], 1.0)]
        self.r_dinst[rid] = dst.id
        dst.held += 1
        self._send_kv(t, rid, path, dst)

    def _send_kv(self, t: float, rid: int, path: tuple[Node, ...], dst: Instance) -> None:
        """Each prefill stage's node sends its layers' KV to the decode stages holding those layers
        (a decode node keeps only its own layers' KV): one transfer per overlapping (prefill stage,
        decode stage) pair; a decode stage of several nodes takes it on the one whose NIC frees
        first. Each NIC is its own FIFO server: a transfer takes `perf.kv_transfer_s` at that NIC's
        speed after what is queued on it, and has arrived when both ends have passed it (alone,
        the slower end's time; a NIC is never held idle waiting for the other end). The KV has
        arrived when the last share has."""
        m = self.r_model[rid]
        prompt = self.r_prompt[rid]
        arrive = t
        lo = 0
        for node, j in zip(path, path[0].inst.stage_layers, strict=True):
            snic, hi = node.nic, lo + j
            d_lo = 0
            for nodes, k in zip(dst.stages, dst.stage_layers, strict=True):
                share = min(hi, d_lo + k) - max(lo, d_lo)  # layers both stages hold
                d_lo += k
                if share <= 0:
                    continue
                dnic = min((n.nic for n in nodes), key=lambda x: x.free_at)
                snic.free_at = max(t, snic.free_at) + self._kv_time(m, prompt, share, snic.cfg)
                dnic.free_at = max(t, dnic.free_at) + self._kv_time(m, prompt, share, dnic.cfg)
                arrive = max(arrive, snic.free_at, dnic.free_at)
            lo = hi
        self.push(arrive, KV_ARRIVE, dst, rid)

    def _kv_time(self, m: int, prompt: int, layers: int, cfg: object) -> float:
        """`layers` layers of one request's KV through a NIC of `cfg` (`perf.kv_transfer_s`, memoized)."""
        key = (cfg, m, prompt, layers)
        x = self._xfer_cache.get(key)
        if x is None:
            x = self._xfer_cache[key] = self.perf.kv_transfer_s(self.specs[m], prompt, cfg, cfg,  # type: ignore[arg-type]
                                                                layers=layers)
        return x

    def _kv_arrive(self, t: float, inst: Instance, rid: int) -> None:
        self.r_kv[rid] = t
        if self.first_at_decode[inst.midx]:  # the decode instance emits the first token (vLLM's P/D)
            self.r_first[rid] = t
        inst.queue.append(rid)
        if not self.spread:
            if inst.idle_lanes:
                lane = next(x for x in inst.lanes if not x.running)
                self._fill(t, lane)
                self._start_step(t, lane)
            return
        # Spread: the queue goes over the idle lanes, ceil(held + queued) / lanes) each at most.
        cap = self._spread_cap(inst)
        while inst.queue and inst.idle_lanes:
            lane = next(x for x in inst.lanes if not x.running)
            self._fill(t, lane, cap)
            self._start_step(t, lane)

    def _fill(self, t: float, lane: Batch, cap: int | None = None) -> None:
        inst = lane.inst
        queue = inst.queue
        rids = lane.rids
        room = inst.seq_cap - len(rids)
        if self.spread:
            room = min(inst.b, cap if cap is not None else self._spread_cap(inst)) - len(rids)
        while room > 0 and queue:
            rid = queue.popleft()
            room -= 1
            rids[rid] = None
            self.r_dstart[rid] = t
            self.r_join[rid] = lane.steps
            lane.ctx_sum += self.r_prompt[rid] + 1
            lane.finish_at.setdefault(lane.steps + self.r_out[rid] - 1, []).append(rid)

    def _start_step(self, t: float, lane: Batch) -> None:
        n = len(lane.rids)
        if not lane.running:
            lane.running = True
            lane.inst.idle_lanes -= 1
        ctx = max(1, round(lane.ctx_sum / n / CTX_GRID_TOK)) * CTX_GRID_TOK
        key = (Phase.DECODE, n, ctx)
        if key != lane.key:
            lane.key = key
            lane.shape = Shape(phase=Phase.DECODE, batch=n, prompt_tokens=float(ctx), output_tokens=0.0)
        lane.stage = 0
        lane.t0 = t
        self._enter(t, lane, 0)

    def _step_done(self, t: float, lane: Batch) -> None:
        inst = lane.inst
        if self.step_trace is not None:
            self.step_trace((inst.id, "decode", lane.lane, len(lane.rids), lane.ctx_sum, lane.t0, t))
        lane.steps += 1
        rids = lane.rids
        if self.fe_token:  # off (0) unless Hosts.frontend_work: keeps the hot path free
            self.cpu.frontend_work(t, self.fe_token * len(rids))
        self._retire_finished(t, lane)
        if inst.queue:
            self._fill(t, lane)
        if rids:
            self._start_step(t, lane)
        else:
            lane.running = False
            lane.ctx_sum = 0
            inst.idle_lanes += 1

