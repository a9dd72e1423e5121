"""The placement problem for one node multiset, pipeline depth `S` and micro-batch `b` (DESIGN §3),
as plain numbers both solvers read, and the domain values of a solved placement / template."""
from __future__ import annotations

import math
from dataclasses import dataclass

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.perf.model import PerfModel, Phase, Shape

# Position classes of a stage: the first stage adds the embedding, the last the LM head;
# a 1-stage pipeline has both.
FIRST, MIDDLE, LAST, ONLY = 0, 1, 2, 3


def position(stage: int, stages: int) -> int:
    if stages == 1:
        return ONLY
    if stage == 0:
        return FIRST
    return LAST if stage == stages - 1 else MIDDLE


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementProblem:
    """Sets: nodes `k < K`, stages `s < S`, layer counts `j ∈ [1, L]`.

    Parameters (per node `k` and position class `p` of its stage):
      `t[k]` per-layer time (s), `o[k][p]` first/last-stage overhead (s), `cap[k][p]` most layers
      the node may hold (memory; for decode also the steady-state cadence, see `decode_caps`),
      `u` work tokens per micro-batch, `budget_s` the SLO, `comm_s` one inter-stage hop.
      `τ_{k,s}(j) = j·t[k] + o[k][p(s)]`.
    """

    num_layers: int
    stages: int
    batch: int
    nodes: tuple[str, ...]
    t: tuple[float, ...]
    o: tuple[tuple[float, float, float, float], ...]
    cap: tuple[tuple[int, int, int, int], ...]
    u: float
    budget_s: float
    comm_s: float

    def __post_init__(self) -> None:
        k = len(self.nodes)
        if not 1 <= self.stages <= k:
            raise ValueError(f"stages must be in [1, {k}], got {self.stages}")
        if not (len(self.t) == len(self.o) == len(self.cap) == k):
            raise ValueError("t, o and cap need one entry per node")
        if self.num_layers < self.stages:
            raise ValueError("fewer layers than stages")

    def tau(self, k: int, stage: int, layers: int) -> float:
        return layers * self.t[k] + self.o[k][position(stage, self.stages)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage: its nodes (data parallel) and the consecutive layers they all hold."""

    nodes: tuple[str, ...]
    node_index: tuple[int, ...]
    layers: int
    time_s: float  # the slowest node's time for one micro-batch
    throughput_tok_per_s: float  # Σ_k u / τ_k


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """A solved placement: stages in pipeline order."""

    stages: tuple[Stage, ...]
    micro_batch: int
    throughput_tok_per_s: float
    latency_s: float
    comm_s: float

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """Half-open `[start, end)` layer ranges per stage."""
        out, start = [], 0
        for s in self.stages:
            out.append((start, start + s.layers))
            start += s.layers
        return tuple(out)


def evaluate(problem: PlacementProblem, assignment: list[list[int]], layers: list[int]) -> Placement | None:
    """Check a candidate (nodes per stage, layers per stage) and compute its figures.

    Returns None when it breaks a constraint (a node in no stage or two, an empty stage, layers
    not summing to L, memory, or latency). Both solvers' answers pass through here.
    """
    p = problem
    seen = sorted(k for stage in assignment for k in stage)
    if seen != list(range(len(p.nodes))) or len(assignment) != p.stages or len(layers) != p.stages:
        return None
    if any(not stage for stage in assignment) or any(j < 1 for j in layers) or sum(layers) != p.num_layers:
        return None
    stages = []
    latency = (p.stages - 1) * p.comm_s
    for s, (members, j) in enumerate(zip(assignment, layers, strict=True)):
        pos = position(s, p.stages)
        if any(j > p.cap[k][pos] for k in members):
            return None
        taus = [p.tau(k, s, j) for k in members]
        stages.append(Stage(nodes=tuple(p.nodes[k] for k in members), node_index=tuple(members), layers=j,
                            time_s=max(taus), throughput_tok_per_s=sum(p.u / x for x in taus)))
        latency += max(taus)
    if latency > p.budget_s * (1 + 1e-9):
        return None
    return Placement(stages=tuple(stages), micro_batch=p.batch,
                     throughput_tok_per_s=min(s.throughput_tok_per_s for s in stages),
                     latency_s=latency, comm_s=p.comm_s)


def decode_caps(t: float, o: tuple[float, ...], cap: tuple[int, ...], budget_s: float,
                stages: int) -> tuple[int, int, int, int]:
    """Fold decode's steady-state cadence into the layer caps.

    A decode pipeline of `S` stages keeps `S` micro-batches in flight (the memory model holds
    their KV), so each sequence gets one token every `S·max_s T_s` once the pipeline is full, not
    every `Σ_s T_s`: an unbalanced pipeline meets the one-pass latency but not the TPOT it
    delivers under load (the simulator shows it). Requiring `T_s ≤ ℓ/S` for every stage is the
    same as `j·t_k + o_k ≤ ℓ/S` for every node, i.e. a per-node cap on its layers.
    """
    per_stage = budget_s * (1 + 1e-9) / stages
    return tuple(min(c, max(0, math.floor((per_stage - oo) / t))) for c, oo in zip(cap, o, strict=True))  # type: ignore[return-value]


def build_problem(perf: PerfModel, model: ModelSpec, phase: Phase, configs: list[NodeConfig], *, stages: int,
                  batch: int, prompt_tokens: float, output_tokens: float, budget_ms: float) -> PlacementProblem:
    """Time every node with the performance model for one `(S, b)`."""
    shape = Shape(phase=phase, batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    cache: dict[str, tuple[float, tuple[float, float, float, float], tuple[int, int, int, int]]] = {}
    for c in configs:
        if c.name in cache:
            continue
        t = perf.layer_time_s(c, model, shape)
        extra = {pos: perf.stage_extra_s(c, model, shape, first=pos in (FIRST, ONLY), last=pos in (LAST, ONLY))
                 for pos in (FIRST, MIDDLE, LAST, ONLY)}
        cap = {pos: perf.max_layers(c, model, shape, stages=stages, first=pos in (FIRST, ONLY), last=pos in (LAST, ONLY))
               for pos in (FIRST, MIDDLE, LAST, ONLY)}
        caps = (cap[0], cap[1], cap[2], cap[3])
        if phase is Phase.DECODE:
            caps = decode_caps(t, (extra[0], extra[1], extra[2], extra[3]), caps, budget_ms / 1e3, stages)
        cache[c.name] = (t, (extra[0], extra[1], extra[2], extra[3]), caps)
    slowest = min(configs, key=lambda c: c.network_bytes_per_s)
    comm = perf.transfer_s(model, shape, slowest, slowest) if stages > 1 else 0.0
    return PlacementProblem(
        num_layers=model.num_layers, stages=stages, batch=batch, nodes=tuple(c.name for c in configs),
        t=tuple(cache[c.name][0] for c in configs), o=tuple(cache[c.name][1] for c in configs),
        cap=tuple(cache[c.name][2] for c in configs), u=shape.work_tokens, budget_s=budget_ms / 1e3, comm_s=comm)
