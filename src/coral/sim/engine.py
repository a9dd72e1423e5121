"""The discrete-event kernel and the simulated cluster: one event per micro-batch on one engine node."""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.policy.lifecycle import Lifecycle, LifecycleEvent, next_state
from coral.policy.routing import (
    ROUTERS,
    Candidate,
    InstanceSpec,
    SmoothWRR,
    WrrState,
    choose_decode,
    least_work,
)
from coral.sim.hosts import Hosts
from coral.sim.result import EpochRecord, InstanceRecord, RunRecord, SimResult, build_result
from coral.templates.planning import plan_inputs
from coral.templates.template import Template
from coral.workload.trace import Trace

# (now, demand observed over the last epoch, running instances, that epoch's requests per model)
ReplanFn = Callable[[float, dict[tuple[str, Phase], float], list[InstanceSpec], dict[str, Trace]], list[InstanceSpec]]
ProgressFn = Callable[[float, float], None]
LanesFn = Callable[[Template], int]
StepTraceFn = Callable[[tuple[Any, ...]], None]

# Event kinds, which double as priorities at equal times: work completes before new work
# arrives, and the epoch boundary sees the state after everything at its instant.
# A host's background load, and the cores outside processes take from it, change last (host model only).
_FINISH, _NODE_ARRIVE, _KV_ARRIVE, _READY, _RETIRE, _ARRIVAL, _EPOCH, _BACKGROUND, _TAKEN = range(9)

# Decode steps are timed at the micro-batch's mean context rounded to this grid (tokens), so
# that the performance model is asked once per (node, batch, context bucket), not once a step.
CTX_GRID_TOK = 16
PREFILL_MAX_PROMPTS = 256  # most prompts one prefill micro-batch takes, however short

# Request status codes (see result.STATUS_NAMES).
_WAITING, _PREFILL, _DECODE, _DONE, _FAILED = range(5)


class _Host:
    """A machine whose cores the busy nodes on it share equally (processor sharing)."""

    __slots__ = ("background", "busy", "cores", "name", "rate", "taken")

    def __init__(self, name: str, cores: float, background: float) -> None:
        self.name = name
        self.cores = cores
        self.background = background  # always-runnable threads from outside the cluster
        self.taken = 0.0  # cores used by processes outside the cluster (measured), < cores
        self.rate = 1.0  # speed of every busy node: min(1, (cores - taken) / (len(busy) + background))
        self.busy: dict[_Node, None] = {}  # insertion-ordered, so re-planning is deterministic


# vLLM's default --max-num-seqs: the most sequences one engine schedules in a step.
MAX_RUNNING_SEQS = 256


class _Nic:
    """One rented node's NIC (`cfg`: the whole node): KV transfers through it go one after
    another (FIFO), each timed by `perf.kv_transfer_s` over the slower of its two ends; the TP
    groups of a node share it."""

    __slots__ = ("cfg", "free_at", "speed")

    def __init__(self, cfg: object) -> None:
        self.cfg = cfg
        self.speed = getattr(cfg, "network_bytes_per_s", math.inf)
        self.free_at = 0.0


class _Node:
    __slots__ = ("busy", "busy_s", "cfg", "host", "inst", "lane", "nic", "queue", "rem", "since", "started_at",
                 "version")

    def __init__(self, cfg: object, inst: _Instance, nic: _Nic | None = None) -> None:
        self.cfg = cfg
        self.inst = inst
        self.nic = nic or _Nic(cfg)
        self.busy = False
        self.started_at = 0.0
        self.busy_s = 0.0
        self.queue: deque[_Batch] = deque()
        # Host model only: the running micro-batch, its work left (seconds at full speed) as of
        # `since`, and a version that invalidates finish events planned at an older speed.
        self.host: _Host | None = None
        self.lane: _Batch | None = None
        self.rem = 0.0
        self.since = 0.0
        self.version = 0


class _Batch:
    """One micro-batch: a prefill pass, or a decode lane (which makes one pass per step)."""

    __slots__ = ("ctx_sum", "finish_at", "inst", "key", "lane", "path", "rids", "running", "shape", "stage", "steps",
                 "t0")

    def __init__(self, inst: _Instance, lane: int) -> None:
        self.inst = inst
        self.lane = lane
        self.rids: dict[int, None] = {}
        self.path: list[_Node] = []  # prefill: the node each stage of this pass ran on (each sends its KV)
        self.stage = 0
        self.shape: Shape | None = None
        self.key: tuple[object, ...] = ()
        self.running = False
        self.steps = 0
        self.ctx_sum = 0
        self.finish_at: dict[int, list[int]] = {}
        self.t0 = 0.0  # when the current pass entered stage 0 (for `step_trace`)


class _Instance:
    __slots__ = ("b", "held", "id", "idle_lanes", "lanes", "load", "max_lanes", "midx", "phase", "queue", "ready_s",
                 "seq_cap",
                 "region", "retiring", "spec", "token_budget", "stage_layers", "stage_weights", "stage_wrr", "stages", "start_s",
                 "state", "stop_s",
                 "weight")

    def __init__(self, iid: int, spec: InstanceSpec, midx: int, start_s: float, ready_s: float,
                 config_of: Callable[[str], object], lanes: LanesFn | None = None) -> None:
        t = spec.template
        self.id = iid
        self.spec = spec
        self.midx = midx
        self.phase = t.phase
        self.region = spec.region
        self.weight = t.throughput_tok_per_s
        self.b = t.placement.micro_batch
        self.seq_cap = self.b  # decode: sequences one lane runs (continuous batching raises it to memory)
        self.start_s = start_s
        self.ready_s = ready_s
        self.stop_s = math.inf
        self.state = Lifecycle.STARTING
        self.retiring = False  # removed by a plan, serving until its replacements are ready
        self.token_budget = math.inf  # prefill: prompt tokens per micro-batch (set in start_instance)
        self.held = 0  # requests queued, running, or whose KV is on the way here
        self.load = 0.0  # prefill: prompt tokens queued or running (the least-work router's figure)
        self.stages: list[list[_Node]] = []
        self.stage_layers: list[int] = []
        self.stage_wrr: list[SmoothWRR] = []
        self.stage_weights: list[list[float]] = []
        # Every stage entry (a whole node or one TP group of it) on the node `Template.hosts` names.
        nics = [_Nic(config_of(n)) for n in t.nodes]
        for st, hosts in zip(t.placement.stages, t.hosts(), strict=True):
            self.stages.append([_Node(config_of(name), self, nics[h]) for name, h in zip(st.nodes, hosts, strict=True)])
            self.stage_layers.append(st.layers)
            # Replaced by weights ∝ node throughput in `_Sim.start_instance` (needs the perf model).
            self.stage_wrr.append(SmoothWRR([1.0] * len(st.nodes)))
            self.stage_weights.append([1.0] * len(st.nodes))
        # Micro-batches in flight, as the memory model budgets them: per node of the narrowest
        # stage, S decode micro-batches of KV, or 2 prefill micro-batches per stage (so the next
        # prompt batch can enter stage 0 while the last one is still in the pipeline).
        if lanes is None:
            per_node = len(self.stages) if t.phase is Phase.DECODE else 2 * len(self.stages)
            self.max_lanes = per_node * min(len(s) for s in self.stages)
        else:
            self.max_lanes = int(lanes(t))
            if self.max_lanes < 1:
                raise CoralError(f"lanes() gave {self.max_lanes} micro-batches for {spec.key}; needs >= 1")
        self.lanes = [_Batch(self, i) for i in range(self.max_lanes)]
        self.idle_lanes = self.max_lanes
        self.queue: deque[int] = deque()


@dataclass(frozen=True, slots=True, kw_only=True)
class SimOptions:
    """How the simulated cluster batches, routes and times its work (see `simulate`'s Args for
    each field). Fixed for a run: the engine takes it at construction."""

    prefill_batching: str = "tokens"
    lanes: LanesFn | None = None
    spread: bool = False
    hosts: Hosts | None = None
    router: str = "least-work"
    decode_at_arrival: bool = False
    step_trace: StepTraceFn | None = None
    continuous: bool = True  # decode lanes admit sequences up to memory (`_Sim._seq_cap`), not the micro-batch

    def __post_init__(self) -> None:
        if self.prefill_batching not in ("tokens", "requests"):
            raise CoralError(f"prefill_batching must be 'tokens' or 'requests', got {self.prefill_batching!r}")
        if self.router not in ROUTERS:
            raise CoralError(f"unknown router {self.router!r}; valid routers: {', '.join(ROUTERS)}")


class _Sim:
    def __init__(self, scenario: object, traces: Mapping[str, Trace], *, duration_s: float, epoch_s: float,
                 init_s: float, seed: int, replan: ReplanFn, progress: ProgressFn | None,
                 options: SimOptions) -> None:
        # the options, copied into attributes the hot paths read without a second lookup
        self.prefill_batching = options.prefill_batching
        self.lanes = options.lanes
        self.spread = options.spread
        self.decode_at_arrival = options.decode_at_arrival
        self.step_trace = options.step_trace
        self.router = options.router
        self.hosts = options.hosts
        self.continuous = options.continuous
        self._hosts: dict[str, _Host] = {}
        self._fe: _Node | None = None  # the front end's pseudo-node (Hosts.frontend_work)
        self.fe_request, self.fe_token = (0.0, 0.0) if options.hosts is None else options.hosts.frontend_work
        if not duration_s > 0:
            raise CoralError(f"duration_s must be > 0, got {duration_s}")
        if not epoch_s > 0:
            raise CoralError(f"epoch_s must be > 0, got {epoch_s}")
        if not init_s >= 0:
            raise CoralError(f"init_s must be >= 0, got {init_s}")
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
        self.instances: list[_Instance] = []
        self.active: list[list[list[_Instance]]] = [[[], []] for _ in self.models]  # [model][phase] ACTIVE ones
        self.prefill_wrr: list[SmoothWRR | None] = [None] * len(self.models)
        self.decode_states: list[dict[tuple[int, ...], WrrState]] = [{} for _ in self.models]
        self.pending_prefill: list[deque[int]] = [deque() for _ in self.models]
        self.pending_decode: list[deque[tuple[int, tuple[_Node, ...]]]] = [deque() for _ in self.models]
        self.epochs: list[EpochRecord] = []
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
        self.r_status = [_WAITING] * n
        self.r_reason: list[str] = [""] * n
        self.r_pstart = [nan] * n  # prefill micro-batch entered stage 0
        self.r_first = [nan] * n  # first token out (end of the last prefill stage)
        self.r_kv = [nan] * n  # KV arrived at the decode instance
        self.r_dstart = [nan] * n  # first decode step began
        self.r_done = [nan] * n
        self.r_pinst = [-1] * n
        self.r_dinst = [-1] * n
        self.r_join = [0] * n  # decode lane step at which the sequence joined

    # -- kernel ---------------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        heapq.heappush(self.q, (t, kind, next(self.seq), a, b))

    def config(self, name: str) -> object:
        c = self._cfg_cache.get(name)
        if c is None:
            c = self._cfg_cache[name] = self.sc.config(name)  # type: ignore[attr-defined]
        return c

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        n = len(self.r_arrival)
        if n:
            self.push(self.r_arrival[0], _ARRIVAL, 0)
        k = 1
        while k * self.epoch_s < self.duration_s - 1e-9:
            self.push(k * self.epoch_s, _EPOCH, k)
            k += 1
        q = self.q
        pop = heapq.heappop
        end = self.duration_s
        finish = self._finish if self.hosts is None else self._host_finish
        node_arrive, kv_arrive = self._node_arrive, self._kv_arrive
        events = 0
        while q:
            t, kind, _, a, b = q[0]
            if t > end:
                break
            pop(q)
            events += 1
            if kind == _FINISH:
                finish(t, a, b)
            elif kind == _NODE_ARRIVE:
                node_arrive(t, a, b)
            elif kind == _KV_ARRIVE:
                kv_arrive(t, a, b)
            elif kind == _ARRIVAL:
                self._arrival(t, a)
            elif kind == _READY:
                self._ready(t, a)
            elif kind == _RETIRE:
                if a.retiring and a.state is Lifecycle.ACTIVE:
                    self._remove(t, a)
            elif kind == _BACKGROUND:
                a.background = b
                self._rerate(t, a)
            elif kind == _TAKEN:
                a.taken = b
                self._rerate(t, a)
            else:
                self._epoch(t)
        self.events = events
        self._close(end)
        return build_result(self._record(), wall_s=time.perf_counter() - wall0)

    def _record(self) -> RunRecord:
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
            instances=self.instance_records(), events=self.events)

    # -- instances --------------------------------------------------------------------------------
    def start_instance(self, spec: InstanceSpec, now: float, ready_s: float) -> _Instance:
        m = spec.template.model
        if m not in self.midx:
            raise CoralError(f"instance of unknown model {m!r}")
        for name in spec.template.nodes:
            if (spec.region, name) not in self.sc.prices:  # type: ignore[attr-defined]
                raise CoralError(f"no price for {name} in region {spec.region!r}")
        inst = _Instance(len(self.instances), spec, self.midx[m], now, ready_s, self.config, self.lanes)
        if self.hosts is not None:
            for s, nodes in enumerate(inst.stages):
                for k, node in enumerate(nodes):
                    try:
                        name = self.hosts.host_of(spec, s, k)
                    except ValueError as e:
                        raise CoralError(str(e)) from None
                    node.host = self._host(name, now)
        served = self.sc.models[inst.midx]  # type: ignore[attr-defined]
        prompt = spec.template.prompt_tokens if spec.template.prompt_tokens is not None else served.prompt_tokens_mean
        shape = Shape(phase=inst.phase, batch=inst.b, prompt_tokens=max(1.0, prompt),
                      output_tokens=served.output_tokens_mean)
        # Prefill batches by tokens, as serving engines do (a max-batched-tokens budget): the
        # template's micro-batch holds b prompts of the length its latency was checked at (the
        # attainment-quantile prompt), so that many tokens: any batch within it meets that latency.
        if self.prefill_batching == "tokens":
            inst.token_budget = inst.b * max(1.0, prompt)
        if self.continuous and inst.phase is Phase.DECODE:
            inst.seq_cap = self._seq_cap(inst, served)
        last = len(inst.stages) - 1
        for s, nodes in enumerate(inst.stages):
            if len(nodes) > 1:  # weights ∝ node throughput u/τ_k at the template's nominal shape
                inst.stage_weights[s] = [
                    1.0 / self.perf.node_time_s(n.cfg, self.specs[inst.midx], shape, inst.stage_layers[s],
                                                first=s == 0, last=s == last) for n in nodes]
                inst.stage_wrr[s] = SmoothWRR(inst.stage_weights[s])
        self.instances.append(inst)
        self.push(ready_s, _READY, inst)
        return inst

    def _seq_cap(self, inst: _Instance, served: Any) -> int:
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

    def _host(self, name: str, now: float) -> _Host:
        """The host named `name`, created on first use with its background steps."""
        assert self.hosts is not None
        h = self._hosts.get(name)
        if h is None:
            h = self._hosts[name] = _Host(name, float(self.hosts.cores[name]), 0.0)
            for at, threads in self.hosts.background_steps(name):
                if at <= now:  # nothing runs on the new host yet: set, no event
                    h.background = threads
                else:
                    self.push(at, _BACKGROUND, h, threads)
            for at, cores in self.hosts.taken_steps(name):
                if at <= now:
                    h.taken = cores
                else:
                    self.push(at, _TAKEN, h, cores)
        return h

    def _frontend_work(self, t: float, work: float) -> None:
        """Give the front end `work` > 0 CPU seconds (host model with `frontend_work` only): a
        pseudo-node on the front-end host, busy while it has work, sharing the cores."""
        assert self.hosts is not None
        fe = self._fe
        if fe is None:
            fe = self._fe = _Node(None, None)  # type: ignore[arg-type]
            fe.host = self._host(self.hosts.frontend_host, t)
        h = fe.host
        assert h is not None
        if fe.busy:
            fe.rem = max(0.0, fe.rem - h.rate * (t - fe.since)) + work
            fe.since = t
            fe.version += 1
            self.push(t + fe.rem / h.rate, _FINISH, fe, fe.version)
            return
        fe.busy = True
        fe.rem = work
        fe.since = t
        h.busy[fe] = None
        self._rerate(t, h, fe)

    def _ready(self, t: float, inst: _Instance) -> None:
        if inst.state is not Lifecycle.STARTING:
            return
        inst.state = next_state(inst.state, LifecycleEvent.READY, in_flight=inst.held)
        self._set_active(inst.midx, inst.phase)
        m = inst.midx
        if inst.phase is Phase.PREFILL:
            pend = self.pending_prefill[m]
            while pend:
                self._route_prefill(t, pend.popleft())
        else:
            pend2 = self.pending_decode[m]
            while pend2:
                rid, src = pend2.popleft()
                self._route_decode(t, rid, src)

    def _set_active(self, m: int, phase: Phase) -> None:
        p = 0 if phase is Phase.PREFILL else 1
        act = [i for i in self.instances if i.midx == m and i.phase is phase and i.state is Lifecycle.ACTIVE]
        self.active[m][p] = act
        if p == 0:
            self.prefill_wrr[m] = SmoothWRR([i.weight for i in act]) if act else None
        else:
            self.decode_states[m] = {}

    def _release(self, t: float, inst: _Instance, n: int) -> None:
        inst.held -= n
        if inst.state is Lifecycle.DRAINING and inst.held == 0:
            inst.state = next_state(inst.state, LifecycleEvent.IDLE, in_flight=0)
            inst.stop_s = t

    def _remove(self, t: float, inst: _Instance) -> None:
        was_active = inst.state is Lifecycle.ACTIVE
        inst.state = next_state(inst.state, LifecycleEvent.REMOVE, in_flight=inst.held)
        if inst.state is Lifecycle.STOPPED:
            inst.stop_s = t
        if was_active:
            self._set_active(inst.midx, inst.phase)

    # -- requests through the cluster -----------------------------------------------------------
    def _arrival(self, t: float, rid: int) -> None:
        self.n_arrived += 1
        if self.fe_request:
            self._frontend_work(t, self.fe_request)
        if rid + 1 < len(self.r_arrival):
            self.push(self.r_arrival[rid + 1], _ARRIVAL, rid + 1)
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

    def _spread_cap(self, inst: _Instance) -> int:
        """Requests per micro-batch when spreading: ceil(held in lanes + queued) / lanes), as the runtime's scheduler."""
        held = sum(len(x.rids) for x in inst.lanes)
        return -(-(held + len(inst.queue)) // inst.max_lanes)

    def _start_prefill(self, t: float, inst: _Instance) -> None:
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
                self.r_status[rid] = _PREFILL
            mean = total / len(rids)
            lane.shape = Shape(phase=Phase.PREFILL, batch=len(rids), prompt_tokens=mean, output_tokens=0.0)
            lane.key = (Phase.PREFILL, len(rids), mean)
            lane.stage = 0
            lane.t0 = t
            self._enter(t, lane, 0)

    def _enter(self, t: float, lane: _Batch, s: int) -> None:
        inst = lane.inst
        nodes = inst.stages[s]
        node = self._pick_node(inst, s) if len(nodes) > 1 else nodes[0]
        self._node_arrive(t, node, lane)

    def _pick_node(self, inst: _Instance, s: int) -> _Node:
        """A node of stage `s` (data parallel) for a micro-batch: with the least-work router, the one
        with the fewest micro-batches running or queued per unit of its weight (∝ its throughput);
        with WRR, the next in the stage's weighted round-robin."""
        nodes = inst.stages[s]
        if self.router == "wrr":
            return nodes[inst.stage_wrr[s].pick()]
        weights = inst.stage_weights[s]
        return nodes[least_work([len(n.queue) + n.busy for n in nodes], weights, 1.0)]

    def _node_time(self, node: _Node, lane: _Batch) -> float:
        inst = lane.inst
        s = lane.stage
        key = (node.cfg, inst.midx, s == 0, s == len(inst.stages) - 1, inst.stage_layers[s], lane.key)
        v = self._time_cache.get(key)
        if v is None:
            spec = self.specs[inst.midx]
            v = self.perf.node_time_s(node.cfg, spec, lane.shape, inst.stage_layers[s],
                                      first=s == 0, last=s == len(inst.stages) - 1)
            self._time_cache[key] = v
        return v

    def _node_arrive(self, t: float, node: _Node, lane: _Batch) -> None:
        if node.busy:
            node.queue.append(lane)
            return
        node.busy = True
        node.started_at = t
        if lane.stage == 0 and lane.inst.phase is Phase.PREFILL:  # queueing ends when stage 0 starts
            pstart = self.r_pstart
            for rid in lane.rids:
                pstart[rid] = t
        host = node.host
        if host is None:
            self.push(t + self._node_time(node, lane), _FINISH, node, lane)
            return
        node.lane = lane
        node.rem = self._node_time(node, lane)
        node.since = t
        host.busy[node] = None
        self._rerate(t, host, node)

    # -- host model (processor sharing) -----------------------------------------------------------
    def _rerate(self, t: float, host: _Host, new: _Node | None = None) -> None:
        """The host's busy count changed: every busy node's speed is min(1, (cores - taken) / (busy + background)).

        Nodes already running are advanced to `t` at the old speed and, if the speed changed,
        get a new finish event (the old one becomes stale through the version); `new` (just
        started, its work in `rem`) always gets one.
        """
        n = len(host.busy)
        rate = min(1.0, (host.cores - host.taken) / (n + host.background)) if n else 1.0
        old = host.rate
        if rate != old:
            host.rate = rate
            for x in host.busy:
                if x is new:
                    continue
                x.rem = max(0.0, x.rem - old * (t - x.since))
                x.since = t
                x.version += 1
                self.push(t + x.rem / rate, _FINISH, x, x.version)
        if new is not None:
            new.version += 1
            self.push(t + new.rem / rate, _FINISH, new, new.version)

    def _host_finish(self, t: float, node: _Node, version: int) -> None:
        if version != node.version or not node.busy:
            return  # planned at a speed that has since changed
        host = node.host
        if node is self._fe:  # the front end ran out of work
            assert host is not None
            node.busy = False
            node.rem = 0.0
            del host.busy[node]
            self._rerate(t, host)
            return
        assert host is not None and node.lane is not None
        lane = node.lane
        node.lane = None
        node.rem = 0.0
        del host.busy[node]
        self._rerate(t, host)
        self._finish(t, node, lane)

    def _finish(self, t: float, node: _Node, lane: _Batch) -> None:
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
            self.push(t + x, _NODE_ARRIVE, nxt, lane)
        elif inst.phase is Phase.PREFILL:
            self._prefill_done(t, node, lane)
        else:
            self._step_done(t, lane)

    def _prefill_done(self, t: float, node: _Node, lane: _Batch) -> None:
        inst = lane.inst
        rids = list(lane.rids)
        if self.step_trace is not None:
            self.step_trace((inst.id, "prefill", lane.lane, len(rids), sum(self.r_prompt[r] for r in rids), lane.t0, t))
        lane.rids.clear()
        lane.running = False
        inst.idle_lanes += 1
        if self.fe_token:  # off (0) unless Hosts.frontend_work: keeps the hot path free
            self._frontend_work(t, self.fe_token * len(rids))
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
                self.r_status[rid] = _DECODE
                self._route_decode(t, rid, path)
        self._release(t, inst, len(rids))
        if inst.queue:
            self._start_prefill(t, inst)

    def _route_decode(self, t: float, rid: int, path: tuple[_Node, ...]) -> None:
        """Send `rid`'s KV from the prefill nodes of `path` (one per stage) to a decode instance."""
        src = path[-1]
        m = self.r_model[rid]
        act = self.active[m][1]
        pre = self.r_dinst[rid]
        if pre >= 0:  # assigned at arrival (`decode_at_arrival`)
            dst = self.instances[pre]
            if dst.state is Lifecycle.ACTIVE or dst.state is Lifecycle.DRAINING:
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

    def _send_kv(self, t: float, rid: int, path: tuple[_Node, ...], dst: _Instance) -> None:
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
        self.push(arrive, _KV_ARRIVE, dst, rid)

    def _kv_time(self, m: int, prompt: int, layers: int, cfg: object) -> float:
        """`layers` layers of one request's KV through a NIC of `cfg` (`perf.kv_transfer_s`, memoized)."""
        key = (cfg, m, prompt, layers)
        x = self._xfer_cache.get(key)
        if x is None:
            x = self._xfer_cache[key] = self.perf.kv_transfer_s(self.specs[m], prompt, cfg, cfg,  # type: ignore[arg-type]
                                                                layers=layers)
        return x

    def _kv_arrive(self, t: float, inst: _Instance, rid: int) -> None:
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

    def _fill(self, t: float, lane: _Batch, cap: int | None = None) -> None:
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

    def _start_step(self, t: float, lane: _Batch) -> None:
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

    def _step_done(self, t: float, lane: _Batch) -> None:
        inst = lane.inst
        if self.step_trace is not None:
            self.step_trace((inst.id, "decode", lane.lane, len(lane.rids), lane.ctx_sum, lane.t0, t))
        lane.steps += 1
        rids = lane.rids
        if self.fe_token:  # off (0) unless Hosts.frontend_work: keeps the hot path free
            self._frontend_work(t, self.fe_token * len(rids))
        lane.ctx_sum += len(rids)
        done = lane.finish_at.pop(lane.steps, None)
        if done:
            for rid in done:
                del rids[rid]
                lane.ctx_sum -= self.r_prompt[rid] + 1 + lane.steps - self.r_join[rid]
                self._complete(t, rid)
            self._release(t, inst, len(done))
        if inst.queue:
            self._fill(t, lane)
        if rids:
            self._start_step(t, lane)
        else:
            lane.running = False
            lane.ctx_sum = 0
            inst.idle_lanes += 1

    def _complete(self, t: float, rid: int) -> None:
        self.r_done[rid] = t
        self.r_status[rid] = _DONE
        self.n_done += 1

    # -- epochs ---------------------------------------------------------------------------------
    def running_specs(self) -> list[InstanceSpec]:
        return [i.spec for i in self.instances
                if i.state in (Lifecycle.ACTIVE, Lifecycle.STARTING) and not i.retiring]

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
        removed: list[_Instance] = []
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
                inst = self.start_instance(spec, t, t + self.init_s)
                starting.add((inst.midx, inst.phase))
        # Make before break: an instance being replaced keeps taking traffic until the new
        # instances of its (model, phase) are ready, then drains; a pure scale-down drains now.
        for inst in removed:
            if (inst.midx, inst.phase) in starting and self.init_s > 0:
                inst.retiring = True
                self.push(t + self.init_s, _RETIRE, inst)
            else:
                self._remove(t, inst)

    def _record_epoch(self, t: float) -> None:
        # Counted from the request states, independently of the finished / failed counters.
        in_flight = sum(1 for s in self.r_status[: self.n_arrived] if s in (_WAITING, _PREFILL, _DECODE))
        self.epochs.append(EpochRecord(
            t_s=t, arrived=self.n_arrived, finished=self.n_done, failed=self.n_failed, in_flight=in_flight,
            instances=tuple(self._instance_counts())))

    def _instance_counts(self) -> list[tuple[str, str, int]]:
        counts: dict[tuple[str, str], int] = {}
        for i in self.instances:
            if i.state is not Lifecycle.STOPPED:
                k = (i.spec.key, i.state.value)
                counts[k] = counts.get(k, 0) + 1
        return [(k, s, n) for (k, s), n in sorted(counts.items())]

    def _close(self, end: float) -> None:
        for m in range(len(self.models)):
            for rid in self.pending_prefill[m]:
                self.r_status[rid] = _FAILED
                self.r_reason[rid] = "no prefill instance of the model was ever ready"
                self.n_failed += 1
            for rid, _ in self.pending_decode[m]:
                self.r_status[rid] = _FAILED
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

    _epoch_first = 0

    def instance_records(self) -> list[InstanceRecord]:
        prices = self.sc.prices  # type: ignore[attr-defined]
        out = []
        for i in self.instances:
            price_h = sum(prices[(i.region, n)] for n in i.spec.template.nodes)
            out.append(InstanceRecord(
                id=i.id, key=i.spec.key, model=self.models[i.midx], phase=i.phase.value, region=i.region,
                start_s=i.start_s, ready_s=min(i.ready_s, self.duration_s), stop_s=i.stop_s,
                nodes=sum(len(s) for s in i.stages), price_usd_per_h=price_h,
                busy_node_s=sum(n.busy_s for s in i.stages for n in s), state=i.state.value))
        return out


def simulate(scenario: object, traces: Mapping[str, Trace], initial: Sequence[InstanceSpec], replan: ReplanFn, *,
             duration_s: float, epoch_s: float, init_s: float, seed: int = 0,
             progress: ProgressFn | None = None, prefill_batching: str = "tokens", lanes: LanesFn | None = None,
             spread: bool = False, hosts: Hosts | None = None, router: str = "least-work",
             decode_at_arrival: bool = False, step_trace: StepTraceFn | None = None) -> SimResult:
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
        seed: recorded in the summary; the run itself is deterministic given its inputs (the
            traces carry the randomness).
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
            prompts' in prefill, the context in decode): to compare with the runtime's per-step trace.
        hosts: None (default): every node is its own server. A `Hosts`: nodes share their host's
            cores, a busy node running at speed `min(1, (cores - taken) / (busy nodes on the host + background))`.

    Returns:
        The run's `SimResult`.

    Raises:
        CoralError: bad durations, an unknown router, a trace or instance for a model the scenario lacks, or an
            instance in a region without a price for one of its nodes, a `lanes` below 1, a node
            placed on an unknown host.
    """
    options = SimOptions(prefill_batching=prefill_batching, lanes=lanes, spread=spread, hosts=hosts, router=router,
                         decode_at_arrival=decode_at_arrival, step_trace=step_trace)
    sim = _Sim(scenario, traces, duration_s=duration_s, epoch_s=epoch_s, init_s=init_s, seed=seed,
               replan=replan, progress=progress, options=options)
    for spec in initial:
        sim.start_instance(spec, 0.0, 0.0)
    return sim.run()
