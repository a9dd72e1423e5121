"""The simulator's state and the instance lifecycle: requests, the event queue, starting and stopping instances."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.policy.lifecycle import Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import InstanceSpec, SmoothWRR, WrrState
from coral.sim.cluster import (
    DONE,
    MAX_RUNNING_SEQS,
    READY,
    WAITING,
    Instance,
    Node,
    ProgressFn,
    ReplanFn,
    SimOptions,
)
from coral.sim.cpu import CpuShare
from coral.sim.result import EpochRecord
from coral.sim.spot import AWS_SPOT_NOTICE_S, SpotMarket, SpotNotice
from coral.templates.planning import plan_inputs
from coral.workload.trace import Trace


class SimCore:
    """The simulator's state: options, requests (one column per field, indexed by request id),
    the event queue, instances and what starting, activating and stopping them changes. The
    request flow (`coral.sim.flow`) and the epochs (`coral.sim.replan`) build on it."""

    def __init__(self, scenario: object, traces: Mapping[str, Trace], *, duration_s: float, epoch_s: float,
                 init_s: float, seed: int, replan: ReplanFn, progress: ProgressFn | None,
                 options: SimOptions, spot: SpotMarket | None = None,
                 spot_notice_s: float = AWS_SPOT_NOTICE_S) -> None:
        # the options, copied into attributes the hot paths read without a second lookup
        self.prefill_batching = options.prefill_batching
        self.lanes = options.lanes
        self.spread = options.spread
        self.decode_at_arrival = options.decode_at_arrival
        self.step_trace = options.step_trace
        self.router = options.router
        self.hosts = options.hosts
        self.continuous = options.continuous
        self.cpu = CpuShare(options.hosts, self.push)
        self.fe_request, self.fe_token = (0.0, 0.0) if options.hosts is None else options.hosts.frontend_work
        if not duration_s > 0:
            raise CoralError(f"duration_s must be > 0, got {duration_s}")
        if not epoch_s > 0:
            raise CoralError(f"epoch_s must be > 0, got {epoch_s}")
        if not init_s >= 0:
            raise CoralError(f"init_s must be >= 0, got {init_s}")
        if not (spot_notice_s >= 0 and math.isfinite(spot_notice_s)):
            raise CoralError(f"spot_notice_s must be a finite number >= 0, got {spot_notice_s}")
        if spot is not None and options.hosts is not None:
            raise CoralError("spot preemptions and a host model cannot be simulated together; drop one of them")
        self.spot = spot
        self.notice_s = float(spot_notice_s)
        if spot is not None:
            spot.begin(seed)
        self.sc = scenario
        self.perf = scenario.perf  # type: ignore[attr-defined]
        self.duration_s = float(duration_s)
        self.epoch_s = float(epoch_s)
        self.init_s = float(init_s)
        self.seed = seed
        self.replan = replan
        self.progress = progress
        self.models = [m.name for m in scenario.models]  # type: ignore[attr-defined]
        self.midx = {m: i for i, m in enumerate(self.models)}
        self.specs = [m.spec for m in scenario.models]  # type: ignore[attr-defined]
        # Which instance emits each model's first token: the planner's rule (coral.templates.budget).
        self.first_at_decode = [m.kv.first_token == "decode" for m in plan_inputs(scenario)]  # type: ignore[arg-type]
        for name in traces:
            if name not in self.midx:
                raise CoralError(f"trace for unknown model {name!r}; scenario models: {', '.join(self.models)}")
        self._cfg_cache: dict[str, object] = {}
        self._time_cache: dict[tuple[object, ...], float] = {}
        self._xfer_cache: dict[tuple[object, ...], float] = {}
        self._load_requests(traces)
        self.q: list[tuple[float, int, int, Any, Any]] = []
        self.seq = itertools.count()
        self.events = 0
        self.instances: list[Instance] = []
        self.active: list[list[list[Instance]]] = [[[], []] for _ in self.models]  # [model][phase] ACTIVE ones
        self.prefill_wrr: list[SmoothWRR | None] = [None] * len(self.models)
        self.decode_states: list[dict[tuple[int, ...], WrrState]] = [{} for _ in self.models]
        self.pending_prefill: list[deque[int]] = [deque() for _ in self.models]
        self.pending_decode: list[deque[tuple[int, tuple[Node, ...]]]] = [deque() for _ in self.models]
        self.epochs: list[EpochRecord] = []
        # What the last epoch boundary's `replan` saw: an unscheduled re-plan at a spot notice reuses it.
        self._last_demand: dict[tuple[str, Phase], float] = {}
        self._last_window: dict[str, Trace] = {}
        # Spot preemptions (`coral.sim.preempt`): each region's draw version (a redraw makes the
        # events in the queue stale), the notices, the re-queued requests (id -> the first token
        # the client got before its instance was lost), re-queue events, refused spot starts.
        self.spot_version: dict[str, int] = {}
        self.spot_notices: list[SpotNotice] = []
        self.first_seen: dict[int, float] = {}
        self.requeued: dict[int, int] = {}
        self.spot_refused = 0
        self.n_arrived = 0
        self.n_done = 0
        self.n_failed = 0

    # -- requests ------------------------------------------------------------------------------
    def _load_requests(self, traces: Mapping[str, Trace]) -> None:
        parts = []
        for name, tr in traces.items():
            keep = tr.arrival_s < self.duration_s
            n = int(keep.sum())
            parts.append((np.full(n, self.midx[name], dtype=np.int64), tr.arrival_s[keep],
                          tr.prompt_tokens[keep], tr.output_tokens[keep]))
        if parts:
            model = np.concatenate([p[0] for p in parts])
            arr = np.concatenate([p[1] for p in parts]).astype(np.float64)
            prompt = np.concatenate([p[2] for p in parts]).astype(np.int64)
            out = np.concatenate([p[3] for p in parts]).astype(np.int64)
        else:
            model, arr = np.zeros(0, np.int64), np.zeros(0)
            prompt, out = np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = np.lexsort((np.arange(len(arr)), model, arr))  # by time, then model order, then trace order
        self.r_model: list[int] = model[order].tolist()
        self.r_arrival: list[float] = arr[order].tolist()
        self.r_prompt: list[int] = np.maximum(prompt[order], 1).tolist()
        self.r_out: list[int] = np.maximum(out[order], 1).tolist()
        n = len(self.r_arrival)
        nan = math.nan
        self.r_status = [WAITING] * n
        self.r_reason: list[str] = [""] * n
        self.r_pstart = [nan] * n  # prefill micro-batch entered stage 0
        self.r_first = [nan] * n  # first token out (end of the last prefill stage)
        self.r_kv = [nan] * n  # KV arrived at the decode instance
        self.r_dstart = [nan] * n  # first decode step began
        self.r_done = [nan] * n
        self.r_pinst = [-1] * n
        self.r_dinst = [-1] * n
        self.r_join = [0] * n  # decode lane step at which the sequence joined
        self.r_fed = [0] * n  # colocated: prompt tokens prefilled so far (chunk by chunk)

    # -- kernel ---------------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        heapq.heappush(self.q, (t, kind, next(self.seq), a, b))

    def config(self, name: str) -> object:
        c = self._cfg_cache.get(name)
        if c is None:
            c = self._cfg_cache[name] = self.sc.config(name)  # type: ignore[attr-defined]
        return c

    # -- instances --------------------------------------------------------------------------------
    def start_instance(self, spec: InstanceSpec, now: float, ready_s: float) -> Instance:
        m = spec.template.model
        if m not in self.midx:
            raise CoralError(f"instance of unknown model {m!r}")
        if spec.spot and self.spot is None:
            raise CoralError(f"spot instance {spec.key} needs a spot market: simulate(..., spot=SpotMarket(scenario.spot))")
        for name in spec.template.nodes:
            if spec.spot:
                self.spot.price_usd_per_h(spec.region, name)  # type: ignore[union-attr]  # raises without an offer
            elif (spec.region, name) not in self.sc.prices:  # type: ignore[attr-defined]
                raise CoralError(f"no price for {name} in region {spec.region!r}")
        inst = Instance(len(self.instances), spec, self.midx[m], now, ready_s, self.config, self.lanes)
        if self.hosts is not None:
            for s, nodes in enumerate(inst.stages):
                for k, node in enumerate(nodes):
                    try:
                        name = self.hosts.host_of(spec, s, k)
                    except ValueError as e:
                        raise CoralError(str(e)) from None
                    node.host = self.cpu.host(name, now)
        served = self.sc.models[inst.midx]  # type: ignore[attr-defined]
        prompt = spec.template.prompt_tokens if spec.template.prompt_tokens is not None else served.prompt_tokens_mean
        # Prefill batches by tokens, as serving engines do (a max-batched-tokens budget): the
        # template's micro-batch holds b prompts of the length its latency was checked at (the
        # attainment-quantile prompt), so that many tokens: any batch within it meets that latency.
        if self.prefill_batching == "tokens":
            inst.token_budget = inst.b * max(1.0, prompt)
        if self.continuous and inst.phase is not Phase.PREFILL:
            inst.seq_cap = self._seq_cap(inst, served)
        for s, nodes in enumerate(inst.stages):
            if len(nodes) > 1:  # weights ∝ node throughput u/τ_k at the template's nominal shape
                inst.stage_weights[s] = [1.0 / self._nominal_time_s(inst, s, n, prompt, served) for n in nodes]
                inst.stage_wrr[s] = SmoothWRR(inst.stage_weights[s])
        self.instances.append(inst)
        self.push(ready_s, READY, inst)
        if spec.spot:
            self._spot_held_changed(now, spec.region)
        return inst

    def _nominal_time_s(self, inst: Instance, s: int, node: Node, prompt: float, served: Any) -> float:
        """Node `node` of stage `s` on one micro-batch of the template's nominal shape: `b` prompts
        of `prompt` tokens (prefill), `b` sequences (decode), or, colocated, a step of `b`
        decodes at the mean context and a whole chunk starting a prompt."""
        spec = self.specs[inst.midx]
        last = len(inst.stages) - 1
        if inst.phase is Phase.COLOCATED:
            return float(self.perf.mixed_node_time_s(
                node.cfg, spec, layers=inst.stage_layers[s], decode_batch=inst.b,
                decode_context=max(1.0, prompt) + served.output_tokens_mean / 2, chunk_tokens=inst.chunk_tokens,
                chunk_context=inst.chunk_tokens / 2, first=s == 0, last=s == last))
        shape = Shape(phase=inst.phase, batch=inst.b, prompt_tokens=max(1.0, prompt),
                      output_tokens=served.output_tokens_mean)
        return float(self.perf.node_time_s(node.cfg, spec, shape, inst.stage_layers[s], first=s == 0, last=s == last))

    def _seq_cap(self, inst: Instance, served: Any) -> int:
        """Sequences one decode lane admits under continuous batching (as vLLM does, up to
        `MAX_RUNNING_SEQS`): what the KV memory left by each stage entry's weights holds at the
        model's mean context, shared by the lanes, never below the template's micro-batch.
        Steps slow down with the batch (the perf model times each step at its own size), so a
        burst costs TPOT instead of waiting for a slot."""
        spec = self.specs[inst.midx]
        ctx = spec.effective_context(served.prompt_tokens_mean + served.output_tokens_mean)
        util = self.perf.system.memory_utilization
        seqs = math.inf
        last = len(inst.stages) - 1
        for s, nodes in enumerate(inst.stages):
            j = inst.stage_layers[s]
            extra = (spec.embedding_bytes if s == 0 else 0.0) + (spec.lm_head_bytes if s == last else 0.0)
            for n in nodes:
                free = n.cfg.memory_bytes * util - j * spec.layer_weight_bytes - extra  # type: ignore[attr-defined]
                seqs = min(seqs, free / (j * ctx * spec.kv_bytes_per_token_layer))
        per_lane = int(seqs // inst.max_lanes) if math.isfinite(seqs) else inst.b
        return max(inst.b, min(MAX_RUNNING_SEQS, per_lane))

    def _set_active(self, m: int, phase: Phase) -> None:
        """Refresh model `m`'s active instances that take `phase`'s requests: arrivals go to its
        prefill and colocated instances alike (`active[m][0]`, weighted by Θ, a colocated one's
        Θ_P), finished prefills to its decode instances (`active[m][1]`)."""
        if phase is Phase.DECODE:
            self.active[m][1] = [i for i in self.instances
                                 if i.midx == m and i.phase is phase and i.state is Lifecycle.ACTIVE]
            self.decode_states[m] = {}
            return
        act = [i for i in self.instances
               if i.midx == m and i.phase is not Phase.DECODE and i.state is Lifecycle.ACTIVE]
        self.active[m][0] = act
        self.prefill_wrr[m] = SmoothWRR([i.weight for i in act]) if act else None

    def _spot_held_changed(self, t: float, region: str) -> None:
        """The spot nodes `region` holds changed (`coral.sim.preempt` redraws its events)."""
        raise NotImplementedError

    def _stopped(self, t: float, inst: Instance) -> None:
        """`inst` just stopped: paid until `t`; a spot instance not yet noticed gives its nodes back."""
        inst.stop_s = t
        if inst.spec.spot and inst.lost_s == math.inf:
            self._spot_held_changed(t, inst.region)

    def _release(self, t: float, inst: Instance, n: int) -> None:
        inst.held -= n
        if inst.state is Lifecycle.DRAINING and inst.held == 0:
            inst.state = next_state(inst.state, LifecycleEvent.IDLE, in_flight=0)
            self._stopped(t, inst)
            if inst.phase is Phase.PREFILL:
                self._retire_deferred(t, inst.midx)

    def _remove(self, t: float, inst: Instance) -> None:
        was_active = inst.state is Lifecycle.ACTIVE
        inst.state = next_state(inst.state, LifecycleEvent.REMOVE, in_flight=inst.held)
        if inst.state is Lifecycle.STOPPED:
            self._stopped(t, inst)
        if was_active:
            self._set_active(inst.midx, inst.phase)
        if inst.phase is Phase.PREFILL and inst.state is Lifecycle.STOPPED:
            self._retire_deferred(t, inst.midx)

    def _retire(self, t: float, inst: Instance) -> None:
        """`inst`'s replacements are ready (make before break): it drains. A decode instance
        that would leave its model with none (the model switched to colocated serving) waits
        for the model's prefill instances to stop first, so no prefill ends with nowhere to
        send its KV."""
        if not (inst.retiring and inst.state is Lifecycle.ACTIVE):
            return
        if inst.phase is Phase.DECODE and self._decode_needed(inst.midx):
            return  # `_retire_deferred` removes it when the last prefill instance stops
        self._remove(t, inst)

    def _decode_needed(self, m: int) -> bool:
        """Model `m` has prefill instances still serving or draining and no decode instance
        that stays (every active one is retiring)."""
        return (all(i.retiring for i in self.active[m][1])
                and any(i.midx == m and i.phase is Phase.PREFILL
                        and i.state in (Lifecycle.ACTIVE, Lifecycle.DRAINING) for i in self.instances))

    def _retire_deferred(self, t: float, m: int) -> None:
        """A prefill instance of model `m` stopped: its decode instances whose retirement waited
        for the prefills drain now, once none is left."""
        if self._decode_needed(m):
            return
        for i in list(self.active[m][1]):
            if i.retiring and i.retire_s <= t:
                self._remove(t, i)

    # -- requests through the cluster -----------------------------------------------------------
    def _complete(self, t: float, rid: int) -> None:
        self.r_done[rid] = t
        self.r_status[rid] = DONE
        self.n_done += 1

