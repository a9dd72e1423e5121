"""The simulated cluster's parts: hosts, NICs, engine nodes, micro-batches, instances; event kinds and options."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.policy.lifecycle import Lifecycle
from coral.policy.routing import ROUTERS, InstanceSpec, SmoothWRR
from coral.sim.hosts import Hosts
from coral.templates.template import Template
from coral.workload.trace import Trace

# (now, demand observed over the last epoch, running instances, that epoch's requests per model)
ReplanFn = Callable[[float, dict[tuple[str, Phase], float], list[InstanceSpec], dict[str, Trace]], list[InstanceSpec]]
ProgressFn = Callable[[float, float], None]
LanesFn = Callable[[Template], int]
StepTraceFn = Callable[[tuple[Any, ...]], None]

# Event kinds, which double as priorities at equal times: work completes before new work
# arrives, and the epoch boundary sees the state after everything at its instant.
# A host's background load, and the cores outside processes take from it, change last (host model only);
# a spot preemption's notice and its loss after them (spot instances only, `coral.sim.preempt`).
FINISH, NODE_ARRIVE, KV_ARRIVE, READY, RETIRE, ARRIVAL, EPOCH, BACKGROUND, TAKEN, SPOT_NOTICE, SPOT_LOSS = range(11)

# Decode steps are timed at the micro-batch's mean context rounded to this grid (tokens), so
# that the performance model is asked once per (node, batch, context bucket), not once a step.
CTX_GRID_TOK = 16
PREFILL_MAX_PROMPTS = 256  # most prompts one prefill micro-batch takes, however short

# Request status codes (see result.STATUS_NAMES).
WAITING, PREFILL, DECODE, DONE, FAILED = range(5)


class Host:
    """A machine whose cores the busy nodes on it share equally (processor sharing)."""

    __slots__ = ("background", "busy", "cores", "name", "rate", "taken")

    def __init__(self, name: str, cores: float, background: float) -> None:
        self.name = name
        self.cores = cores
        self.background = background  # always-runnable threads from outside the cluster
        self.taken = 0.0  # cores used by processes outside the cluster (measured), < cores
        self.rate = 1.0  # speed of every busy node: min(1, (cores - taken) / (len(busy) + background))
        self.busy: dict[Node, None] = {}  # insertion-ordered, so re-planning is deterministic


# vLLM's default --max-num-seqs: the most sequences one engine schedules in a step.
MAX_RUNNING_SEQS = 256


class Nic:
    """One rented node's NIC (`cfg`: the whole node): KV transfers through it go one after
    another (FIFO), each timed by `perf.kv_transfer_s` over the slower of its two ends; the TP
    groups of a node share it."""

    __slots__ = ("cfg", "free_at", "speed")

    def __init__(self, cfg: object) -> None:
        self.cfg = cfg
        self.speed = getattr(cfg, "network_bytes_per_s", math.inf)
        self.free_at = 0.0


class Node:
    """One engine: a whole rented node, or one TP group of it, in one stage of an instance."""

    __slots__ = ("busy", "busy_s", "cfg", "host", "inst", "lane", "nic", "queue", "rem", "since", "started_at",
                 "version")

    def __init__(self, cfg: object, inst: Instance, nic: Nic | None = None) -> None:
        self.cfg = cfg
        self.inst = inst
        self.nic = nic or Nic(cfg)
        self.busy = False
        self.started_at = 0.0
        self.busy_s = 0.0
        self.queue: deque[Batch] = deque()
        # Host model only: the running micro-batch, its work left (seconds at full speed) as of
        # `since`, and a version that invalidates finish events planned at an older speed.
        self.host: Host | None = None
        self.lane: Batch | None = None
        self.rem = 0.0
        self.since = 0.0
        self.version = 0


class Batch:
    """One micro-batch: a prefill pass, or a decode or colocated lane (which makes one pass per step)."""

    __slots__ = ("chunk", "ctx_sum", "finish_at", "fresh", "inst", "key", "lane", "partial", "path", "rids", "running",
                 "shape", "stage", "steps",
                 "t0")

    def __init__(self, inst: Instance, lane: int) -> None:
        self.inst = inst
        self.lane = lane
        self.rids: dict[int, None] = {}
        self.path: list[Node] = []  # prefill: the node each stage of this pass ran on (each sends its KV)
        self.stage = 0
        self.shape: Shape | None = None
        self.key: tuple[object, ...] = ()
        self.running = False
        self.steps = 0
        self.ctx_sum = 0
        self.finish_at: dict[int, list[int]] = {}
        self.t0 = 0.0  # when the current pass entered stage 0 (for `step_trace`)
        # Colocated lanes only: the prefills this lane has begun and not finished (FCFS), the
        # (request, prompt tokens) pieces of the running step's chunk, and the requests whose
        # first piece it is.
        self.partial: list[int] = []
        self.chunk: list[tuple[int, int]] = []
        self.fresh: list[int] = []


class Instance:
    """One serving instance: its stages of nodes, its micro-batch lanes, its queue and lifecycle."""

    __slots__ = ("b", "held", "id", "idle_lanes", "lanes", "load", "lost_s", "max_lanes", "midx", "phase", "queue",
                 "ready_s", "seq_cap",
                 "chunk_tokens", "region", "retire_s", "retiring", "spec", "token_budget", "stage_layers", "stage_weights", "stage_wrr", "stages", "start_s",
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
        self.retire_s = math.inf  # when those replacements are ready (set with `retiring`)
        self.lost_s = math.inf  # spot: when its nodes leave, set at the cloud's notice
        self.token_budget = math.inf  # prefill: prompt tokens per micro-batch (set in start_instance)
        self.chunk_tokens = t.chunk_tokens or 0  # colocated: the most prompt tokens one step carries
        self.held = 0  # requests queued, running, or whose KV is on the way here
        self.load = 0.0  # prefill: prompt tokens queued or running (the least-work router's figure)
        self.stages: list[list[Node]] = []
        self.stage_layers: list[int] = []
        self.stage_wrr: list[SmoothWRR] = []
        self.stage_weights: list[list[float]] = []
        # Every stage entry (a whole node or one TP group of it) on the node `Template.hosts` names.
        nics = [Nic(config_of(n)) for n in t.nodes]
        for st, hosts in zip(t.placement.stages, t.hosts(), strict=True):
            self.stages.append([Node(config_of(name), self, nics[h]) for name, h in zip(st.nodes, hosts, strict=True)])
            self.stage_layers.append(st.layers)
            # Replaced by weights ∝ node throughput in `_Sim.start_instance` (needs the perf model).
            self.stage_wrr.append(SmoothWRR([1.0] * len(st.nodes)))
            self.stage_weights.append([1.0] * len(st.nodes))
        # Micro-batches in flight, as the memory model budgets them: per node of the narrowest
        # stage, S decode (or colocated) micro-batches of KV, or 2 prefill micro-batches per stage
        # (so the next prompt batch can enter stage 0 while the last one is still in the pipeline).
        if lanes is None:
            per_node = 2 * len(self.stages) if t.phase is Phase.PREFILL else len(self.stages)
            self.max_lanes = per_node * min(len(s) for s in self.stages)
        else:
            self.max_lanes = int(lanes(t))
            if self.max_lanes < 1:
                raise CoralError(f"lanes() gave {self.max_lanes} micro-batches for {spec.key}; needs >= 1")
        self.lanes = [Batch(self, i) for i in range(self.max_lanes)]
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
