"""Build the template library of a scenario: enumerate node multisets, solve, prune, cache (DESIGN §3)."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import json
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coral.catalog.hardware import NodeConfig, split_group_name
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.perf.model import PerfModel, Phase, Shape
from coral.templates import colocated
from coral.templates.multisets import enumerate_multisets
from coral.templates.planning import plan_inputs
from coral.templates.problem import (
    FIRST,
    LAST,
    MIDDLE,
    ONLY,
    Placement,
    PlacementProblem,
    decode_caps,
    evaluate,
)
from coral.templates.serialize import template_from_dict
from coral.templates.serialize import (
    template_to_dict as template_to_dict,  # re-exported: callers import it from here
)
from coral.templates.spec import (
    LIBRARY_FORMAT as LIBRARY_FORMAT,  # re-exported: callers import them from here
)
from coral.templates.spec import TemplateSpec as TemplateSpec
from coral.templates.spec import perf_fingerprint as perf_fingerprint
from coral.templates.table import TemplateTable
from coral.templates.template import LibraryStats, Template, TemplateLibrary
from coral.templates.throughput import realized_throughput

POSITIONS = (FIRST, MIDDLE, LAST, ONLY)

ProgressFn = Callable[[int, int], None]  # (done, total) multisets


class _Timings:
    """Per (config, batch, stages) numbers of the performance model, computed once."""

    def __init__(self, perf: PerfModel, spec: TemplateSpec) -> None:
        self.spec = spec
        self.t: dict[tuple[str, int], float] = {}
        self.o: dict[tuple[str, int], tuple[float, float, float, float]] = {}
        self.cap: dict[tuple[str, int, int], tuple[int, int, int, int]] = {}
        self.comm: dict[tuple[str, int], float] = {}
        self.intra: dict[tuple[str, int], float] = {}
        self.u: dict[int, float] = {}
        m = spec.model
        self.configs = {c.name: c for c in entry_configs(spec)}
        depth = max(spec.n_max, spec.max_entries)
        self.depth = depth
        self.t_max: dict[tuple[str, int], float] = {}  # colocated: the step with the whole chunk (TPOT cap)
        self.o_max: dict[tuple[str, int], tuple[float, float, float, float]] = {}
        for b in spec.batches:
            if spec.phase is Phase.COLOCATED:
                shape = colocated.memory_shape(spec, b)
                hop = colocated.hop_shape(spec, b)
                self.u[b] = float(b)
            else:
                shape = hop = Shape(phase=spec.phase, batch=b, prompt_tokens=spec.prompt_tokens,
                                    output_tokens=spec.output_tokens)
                self.u[b] = shape.work_tokens
            for c in self.configs.values():
                if spec.phase is Phase.COLOCATED:
                    self.t[(c.name, b)], self.o[(c.name, b)] = colocated.step_times(
                        perf, spec, c, b, colocated.mean_chunk(spec, b))
                    self.t_max[(c.name, b)], self.o_max[(c.name, b)] = colocated.step_times(
                        perf, spec, c, b, colocated.chunk_tokens(spec, b))
                else:
                    self.t[(c.name, b)] = perf.layer_time_s(c, m, shape)
                    self.o[(c.name, b)] = tuple(  # type: ignore[assignment]
                        perf.stage_extra_s(c, m, shape, first=p in (FIRST, ONLY), last=p in (LAST, ONLY))
                        for p in POSITIONS)
                self.comm[(c.name, b)] = perf.transfer_s(m, hop, c, c)
                self.intra[(c.name, b)] = perf.intra_transfer_s(m, hop, c)
                for s in range(1, depth + 1):
                    self.cap[(c.name, b, s)] = tuple(  # type: ignore[assignment]
                        perf.max_layers(c, m, shape, stages=s, first=p in (FIRST, ONLY), last=p in (LAST, ONLY))
                        for p in POSITIONS)
        self.network = {n: c.network_bytes_per_s for n, c in self.configs.items()}
        self.curves: dict[tuple[object, ...], Any] = {}  # exact search's stage curves, shared
        # The same numbers as arrays for the compiled search: [batch, config(, position)] and
        # caps [batch, S-1, config, position] with decode's cadence folded in.
        names = list(self.configs)
        self.index = {n: i for i, n in enumerate(names)}
        self.batch_arr = np.array(spec.batches, dtype=np.int64)
        self.work = np.array([self.u[b] for b in spec.batches], dtype=float)
        self.T = np.array([[self.t[(n, b)] for n in names] for b in spec.batches], dtype=float)
        self.O = np.array([[self.o[(n, b)] for n in names] for b in spec.batches], dtype=float)
        self.COMM = np.array([[self.comm[(n, b)] for n in names] for b in spec.batches], dtype=float)
        self.INTRA = np.array([[self.intra[(n, b)] for n in names] for b in spec.batches], dtype=float)
        self.CAP = np.array([[[self._caps(n, b, s) for n in names] for s in range(1, depth + 1)]
                             for b in spec.batches], dtype=np.int64).reshape(len(spec.batches), depth, len(names), 4)

    def hop_s(self, nodes: Sequence[str], batch: int) -> float:
        """One inter-stage hop of `nodes`: over the node's own GPU link when every entry is a TP
        group of one node, else over the slowest entry's NIC (share)."""
        if is_one_node(nodes):
            return self.intra[(nodes[0], batch)]
        return self.comm[(min(nodes, key=lambda n: self.network[n]), batch)]

    def _caps(self, name: str, batch: int, stages: int) -> tuple[int, int, int, int]:
        cap = self.cap[(name, batch, stages)]
        if self.spec.phase is Phase.COLOCATED:  # every step, the whole chunk included, within the step budget
            return decode_caps(self.t_max[(name, batch)], self.o_max[(name, batch)], cap, self.spec.budget_ms / 1e3,
                               stages)
        if self.spec.phase is Phase.DECODE:
            return decode_caps(self.t[(name, batch)], self.o[(name, batch)], cap, self.spec.budget_ms / 1e3, stages)
        return cap

    def problem(self, nodes: Sequence[str], stages: int, batch: int) -> PlacementProblem:
        caps = [self._caps(n, batch, stages) for n in nodes]
        return PlacementProblem(
            num_layers=self.spec.model.num_layers, stages=stages, batch=batch, nodes=tuple(nodes),
            t=tuple(self.t[(n, batch)] for n in nodes), o=tuple(self.o[(n, batch)] for n in nodes),
            cap=tuple(caps), u=self.u[batch],
            budget_s=self.spec.budget_ms / 1e3, comm_s=self.hop_s(nodes, batch) if stages > 1 else 0.0)


def is_one_node(entries: Sequence[str]) -> bool:
    """Whether `entries` are all TP groups of a single node (`4xL40S/tp1` x at most 4)."""
    first = entries[0]
    node, tp = split_group_name(first)
    if tp is None or any(e != first for e in entries):
        return False
    return len(entries) <= int(node.split("x", 1)[0]) // tp


def entry_configs(spec: TemplateSpec) -> list[NodeConfig]:
    """The spec's whole nodes and, with layouts on, every TP group of them the model accepts."""
    out = list(spec.configs)
    if spec.layouts:
        for c in spec.configs:
            if not c.is_group:
                out += [c.group(t) for t in spec.model.valid_tp(c.count) if t < c.count]
    return out


def layouts_of(spec: TemplateSpec, nodes: Sequence[str]) -> list[tuple[str, ...]]:
    """The stage entries `nodes` (a multiset of whole nodes) can expand to: each configuration of
    the multiset runs one TP degree the model accepts (all its nodes alike), and a node of `n`
    GPUs at degree `t` becomes `n / t` entries; whole nodes first. Layouts with more than
    `max_entries` entries are left out (the search grows with them), the whole-node one never."""
    configs = {c.name: c for c in spec.configs}
    kinds = sorted(set(nodes))
    options = []
    for k in kinds:
        c = configs[k]
        degrees = sorted(spec.model.valid_tp(c.count), reverse=True) if spec.layouts else [c.count]
        if spec.model.tp_problem(c.count) is not None and spec.layouts:
            degrees = [t for t in degrees if t < c.count]  # vLLM refuses the whole node's degree
        options.append(degrees or [c.count])
    out = []
    for combo in itertools.product(*options):
        entries: list[str] = []
        for k, t in zip(kinds, combo, strict=True):
            c = configs[k]
            name = c.group(t).name
            entries += [name] * (nodes.count(k) * (c.count // t))
        if len(entries) > max(spec.max_entries, len(nodes)):
            continue
        out.append(tuple(sorted(entries)))
    return out


def solve_multiset(timings: _Timings, nodes: Sequence[str], floor: float = 0.0,
                   solver: Callable[[PlacementProblem, float], Placement | None] | None = None) -> Placement | None:
    """The best placement of `nodes` over every pipeline depth and micro-batch, or None when none
    beats `floor` (the throughput of a sub-multiset: then this multiset is dominated).

    Cheap bounds skip `(S, b)` pairs that cannot win: throughput ≤ `Σ_k u/(t_k·L)` (every layer
    runs somewhere), latency ≥ `L·min_k t_k + (S−1)·comm`, and memory needs the `S` largest node
    caps to reach `L`. With the default solver and numba present, the whole loop runs compiled
    (`kernel.solve_multiset`, same order and bounds).
    """
    # lazy: numba and its compiled kernels (seconds to import/load) only when something is solved
    from coral.templates import kernel
    from coral.templates.exact import solve_exact

    if solver is None and kernel.enabled() and len(nodes) <= timings.depth:
        return _solve_multiset_jit(timings, nodes, floor)
    local: dict[int, dict[tuple[object, ...], Any]] = {}  # per micro-batch: slot tables across depths

    def exact(problem: PlacementProblem, floor_: float) -> Placement | None:
        return solve_exact(problem, floor_, timings.curves, local.setdefault(problem.batch, {}))

    solve = solver or exact
    L = timings.spec.model.num_layers
    budget = timings.spec.budget_ms / 1e3
    order = []
    for b in timings.spec.batches:
        ts = [timings.t[(n, b)] for n in nodes]
        ub = sum(timings.u[b] / t for t in ts) / L
        order.append((ub, b, min(ts)))
    order.sort(reverse=True)
    best: Placement | None = None
    for ub, b, t_min in order:
        if ub <= (best.throughput_tok_per_s if best else floor):
            break  # sorted by bound: no later batch can win either
        for stages in range(min(len(nodes), L), 0, -1):  # deep pipelines first: they usually win, raising the bar early
            problem = timings.problem(nodes, stages, b)
            if L * t_min + (stages - 1) * problem.comm_s > budget:
                continue
            # A stage holds at most the smallest cap of its nodes, so S stages hold at most the
            # S largest node caps together.
            if sum(sorted((max(c) for c in problem.cap), reverse=True)[:stages]) < L:
                continue
            got = solve(problem, best.throughput_tok_per_s if best else floor)
            if got is not None and (best is None or got.throughput_tok_per_s > best.throughput_tok_per_s):
                best = got
    return best


def template_timings(perf: PerfModel, spec: TemplateSpec) -> _Timings:
    """The performance model's numbers for `spec` (per config, micro-batch and pipeline depth),
    computed once: what `solve_multiset` and `infeasible_reason` read.

    Args:
        perf: the performance model.
        spec: the template problem (model, phase, budget, shapes, micro-batches).

    Returns:
        The timings, to pass to `solve_multiset` for any multiset of `spec.configs`.
    """
    return _Timings(perf, spec)


def single_template_spec(model: ModelSpec, phase: Phase, slo_ms: float, budget_ms: float, configs: Sequence[NodeConfig],
                         nodes: Sequence[str], *, prompt_tokens: float, output_tokens: float, n_max: int,
                         batches: Sequence[int]) -> TemplateSpec:
    """The problem of one template on one multiset, outside a library (`coral templates solve`):
    no pruning (rho unbounded), prefill micro-batches capped at 8 as a library build caps them.

    Args:
        model, phase, slo_ms, budget_ms: what to place and the latency it must meet.
        configs: the distinct node configurations of `nodes`.
        nodes: the multiset (configuration names, repeated).
        prompt_tokens, output_tokens: the mean request shape.
        n_max: most nodes per template (raised to the multiset's size).
        batches: micro-batch sizes to try, sorted, >= 1.

    Returns:
        The template problem.
    """
    grid = tuple(batches)
    if phase is Phase.PREFILL:
        grid = tuple(b for b in grid if b <= 8) or (1,)
    return TemplateSpec(model=model, phase=phase, slo_ms=slo_ms, budget_ms=budget_ms, prompt_tokens=prompt_tokens,
                        output_tokens=output_tokens, configs=tuple(configs), n_max=max(n_max, len(nodes)), rho=1e9,
                        batches=grid, layouts=False)  # the entries are given: whole nodes or TP groups


def infeasible_reason(perf: PerfModel, timings: _Timings, nodes: Sequence[str]) -> str:
    """Why a multiset has no placement: memory short of the weights, the latency budget below the
    fastest one-node latency, or neither alone (memory with KV cache and the SLO together).

    Args:
        perf: the performance model the timings came from (its memory utilization).
        timings: `template_timings(perf, spec)` of the problem that had no placement.
        nodes: the multiset (configuration names, repeated).

    Returns:
        One sentence for the user.
    """
    tspec, spec = timings.spec, timings.spec.model
    configs = {c.name: c for c in tspec.configs}
    mem = sum(configs[n].memory_bytes for n in nodes) * perf.system.memory_utilization
    if mem < spec.weights_bytes:
        return f"memory short by {(spec.weights_bytes - mem) / 2**30:.1f} GiB (weights {spec.weights_bytes / 2**30:.1f} GiB)"
    b = min(tspec.batches)
    t_min = min(timings.t[(n, b)] for n in nodes)
    lat = spec.num_layers * t_min
    if lat > tspec.budget_ms / 1e3:
        return (f"the latency budget {tspec.budget_ms:g} ms (SLO {tspec.slo_ms:g} ms) is below the minimum achievable "
                f"latency {lat * 1e3:.1f} ms (micro-batch {b})")
    return "no placement fits both memory (incl. KV cache) and the SLO at any pipeline depth and micro-batch"


def _solve_multiset_jit(timings: _Timings, nodes: Sequence[str], floor: float) -> Placement | None:
    # lazy: numba and its compiled kernels (seconds to import/load) only when something is solved
    from coral.templates import kernel
    from coral.templates.exact import assign_blocks

    names = list(dict.fromkeys(nodes))  # node types in order of first appearance
    groups = [[k for k, n in enumerate(nodes) if n == name] for name in names]
    counts = tuple(len(g) for g in groups)
    blocks, rows_all, row_off, keys = kernel.structure(counts, len(nodes))
    slowest = timings.index[min(nodes, key=lambda n: timings.network[n])]
    hops = (timings.INTRA if is_one_node(nodes) else timings.COMM)[:, slowest].copy()
    js = np.zeros(len(nodes), dtype=np.int64)
    _, stages, bi, row = kernel.solve_multiset(
        timings.spec.model.num_layers, timings.spec.budget_ms / 1e3, float(floor),
        np.array([timings.index[n] for n in names], dtype=np.int64), np.array(counts, dtype=np.int64),
        timings.batch_arr, timings.work, timings.T, timings.O, timings.CAP, hops,
        blocks, rows_all, row_off, js)
    if stages < 0:
        return None
    lst = rows_all[row_off[stages] + row, :stages].tolist()
    assignment = assign_blocks(groups, [keys[i] for i in lst])
    placement = evaluate(timings.problem(nodes, stages, int(timings.spec.batches[bi])), assignment, js[:stages].tolist())
    assert placement is not None, "exact search produced a placement that fails verification"
    return placement


class _Solver:
    """Solves one physical multiset of a spec over its layouts, with each layout's KV transfer
    taken off the latency budget and its NICs capping the throughput (`coral.templates.budget`)."""

    def __init__(self, perf: PerfModel, spec: TemplateSpec) -> None:
        self.perf, self.spec = perf, spec
        self.configs = {c.name: c for c in entry_configs(spec)}
        if spec.phase is Phase.COLOCATED:  # Θ_P = r·Θ_D: what Template.throughput_tok_per_s holds
            decode_rate = colocated.realized_decode_rate(perf, spec, self.configs)
            self.realized = lambda nodes, p: spec.prompt_per_output * decode_rate(nodes, p)
        else:
            self.realized = realized_throughput(perf, spec, self.configs)
        self._timings: dict[float, _Timings] = {}

    def timings(self, budget_ms: float) -> _Timings:
        key = round(budget_ms, 3)
        hit = self._timings.get(key)
        if hit is None:
            hit = self._timings[key] = _Timings(self.perf, dataclasses.replace(self.spec, budget_ms=key))
        return hit

    def kv_latency_ms(self, entries: Sequence[str]) -> float:
        """The quantile request's KV over the slowest node of `entries` (a transfer has its node's
        whole NIC; concurrent ones are what `kv_cap` bounds)."""
        if not (self.spec.kv_latency_tokens and self.spec.kv_bytes_per_token):
            return 0.0
        nic = min(self.configs[e].network_bytes_per_s * self.configs[e].groups_per_node for e in entries)
        nbytes = self.spec.kv_latency_tokens * self.spec.kv_bytes_per_token
        return (nbytes / nic + self.perf.system.network_latency_s) * 1e3

    def kv_cap(self, placement: Placement, timings: _Timings) -> float:
        """The work tokens/s the stages' NICs can move KV for: every stage sends (prefill) or
        receives (decode) its layers' share; an entry of a stage takes the stage's traffic in
        proportion to its speed (as the routers split it), over its own NIC share."""
        per_token = self.spec.kv_rate_tokens * self.spec.kv_bytes_per_token
        if not per_token:
            return float("inf")
        L, b = self.spec.model.num_layers, placement.micro_batch
        cap = float("inf")
        for st in placement.stages:
            speed = [1.0 / timings.t[(n, b)] for n in st.nodes]
            for n, v in zip(st.nodes, speed, strict=True):
                share = v / sum(speed)
                cap = min(cap, self.configs[n].network_bytes_per_s / (share * per_token * st.layers / L))
        return cap

    def solve(self, nodes: tuple[str, ...], floor: float) -> tuple[Placement, float] | None:
        """The best (placement, Θ) of `nodes` over its layouts that beats `floor`, or None."""
        best: tuple[Placement, float] | None = None
        for entries in layouts_of(self.spec, nodes):
            if self.kv_latency_ms(entries) > self.spec.kv_allowance_ms:
                continue  # its NIC cannot ship the quantile request's KV within the allowance
            timings = self.timings(self.spec.budget_ms)
            placement = solve_multiset(timings, entries, floor)
            if placement is None:
                continue
            theta = min(self.realized(entries, placement), self.kv_cap(placement, timings))
            if theta > (best[1] if best else floor):
                best = (placement, theta)
        return best


_WORKER: dict[str, Any] = {}


def _init_worker(spec: TemplateSpec, perf: PerfModel) -> None:
    _WORKER["solver"] = _Solver(perf, spec)


def _solve_chunk(chunk: list[tuple[tuple[str, ...], float]]) -> list[tuple[Placement, float] | None]:
    solver = _WORKER["solver"]
    return [solver.solve(nodes, floor) for nodes, floor in chunk]


def build_one(spec: TemplateSpec, perf: PerfModel, progress: ProgressFn | None = None,
              jobs: int = 1) -> tuple[list[Template], LibraryStats]:
    """Solve every multiset of one (model, phase) over its layouts, pruning by dominance on the
    way, and keep the non-dominated feasible templates.

    Multisets are solved by size, smallest first; each one's floor is the best Θ of its
    sub-multisets (found at the previous sizes), so the multisets of one size are independent and
    run in `jobs` processes.
    """
    start = time.perf_counter()
    solver = _Solver(perf, spec)
    total, candidates = enumerate_multisets(spec.configs, spec.model, spec.n_max, spec.rho)
    by_size: dict[int, list[tuple[str, ...]]] = {}
    for nodes in candidates:
        by_size.setdefault(len(nodes), []).append(nodes)
    best_sub: dict[tuple[str, ...], float] = {}  # best Θ of the multiset or any sub-multiset
    found: list[Template] = []
    done = 0
    pool = None
    try:
        for size in sorted(by_size):
            level = by_size[size]
            # Sub-multisets one node smaller come from the previous size; those that failed the
            # memory filter have no placement (0).
            tasks = [(nodes, max((best_sub.get(nodes[:k] + nodes[k + 1:], 0.0) for k in range(size)), default=0.0)
                      if size > 1 else 0.0) for nodes in level]
            if jobs > 1 and len(tasks) >= 64:
                if pool is None:
                    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("fork"),
                                                  initializer=_init_worker, initargs=(spec, perf))
                step = max(16, len(tasks) // (jobs * 8))
                chunks = [tasks[i:i + step] for i in range(0, len(tasks), step)]
                results: list[tuple[Placement, float] | None] = []
                for part in pool.map(_solve_chunk, chunks):
                    results.extend(part)
                    done += len(part)
                    if progress:
                        progress(done, len(candidates))
            else:
                results = []
                for nodes, floor in tasks:
                    results.append(solver.solve(nodes, floor))
                    done += 1
                    if progress and (done % 50 == 0 or done == len(candidates)):
                        progress(done, len(candidates))
            for (nodes, floor), got in zip(tasks, results, strict=True):
                if got is not None:
                    placement, theta = got
                    found.append(_template(spec, nodes, placement, theta))
                    best_sub[nodes] = theta
                else:
                    best_sub[nodes] = floor
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    # Every template in `found` beats all of its proper sub-multisets (its floor), so none is
    # dominated: dropping dominated templates here would be a no-op (tests check it).
    stats = LibraryStats(model=spec.model.name, phase=spec.phase, multisets=total, memory_ok=len(candidates),
                         solved=len(candidates), feasible=len(found), kept=len(found), wall_s=time.perf_counter() - start,
                         notes=colocated.not_colocatable(perf, spec) if spec.phase is Phase.COLOCATED else ())
    return found, stats


def _template(spec: TemplateSpec, nodes: tuple[str, ...], placement: Placement, theta: float) -> Template:
    if spec.phase is Phase.COLOCATED:
        return Template(model=spec.model.name, phase=spec.phase, slo_ms=spec.slo_ms, budget_ms=spec.budget_ms,
                        nodes=nodes, placement=placement, prompt_tokens=spec.ttft_prompt_tokens,
                        realized_tok_per_s=theta, decode_tok_per_s=theta / spec.prompt_per_output,
                        chunk_tokens=colocated.chunk_tokens(spec, placement.micro_batch))
    return Template(model=spec.model.name, phase=spec.phase, slo_ms=spec.slo_ms, budget_ms=spec.budget_ms,
                    nodes=nodes, placement=placement, prompt_tokens=spec.prompt_tokens, realized_tok_per_s=theta)


def cache_path(spec: TemplateSpec, perf: PerfModel, cache_dir: Path) -> Path:
    """Where one (model, phase)'s library lives in the cache: named by its content key."""
    return cache_dir / f"{spec.model.name}-{spec.phase.value}-{spec.cache_key(perf)}.parquet"


def _read_legacy(path: Path) -> tuple[list[Template], LibraryStats] | None:
    """A cache entry in the JSON Lines format that came before Parquet (same key), or None."""
    try:
        lines = path.read_text().splitlines()
        head = json.loads(lines[0])
        if head.get("format") != LIBRARY_FORMAT:
            return None
        stats = LibraryStats(**{**head["stats"], "phase": Phase(head["stats"]["phase"]), "cached": True})
        return [template_from_dict(json.loads(ln)) for ln in lines[1:] if ln.strip()], stats
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None  # missing or unreadable


def build_cached(spec: TemplateSpec, perf: PerfModel, cache_dir: Path | None,
                 progress: ProgressFn | None = None, jobs: int = 1) -> tuple[Sequence[Template], LibraryStats]:
    """`build_one`, reading / writing the content-addressed cache when `cache_dir` is given.

    A cache hit opens the (model, phase)'s Parquet file lazily (`columnar.TemplateTable`: its
    footer now, the columns a caller needs when it asks). An entry left in the older JSON Lines
    format under the same key is converted once instead of being solved again.
    """
    # lazy: pyarrow (heavy) loads only when a library goes through the on-disk cache
    from coral.templates import columnar

    if cache_dir is None:
        templates, stats = build_one(spec, perf, progress, jobs)
        return TemplateTable(model=spec.model.name, phase=spec.phase, stats=stats, objects=templates), stats
    path = cache_path(spec, perf, cache_dir)
    hit = columnar.read(path)
    if hit is None:
        legacy = _read_legacy(path.with_suffix(".jsonl"))
        if legacy is not None:
            columnar.write(path, legacy[0], dataclasses.replace(legacy[1], cached=False))
            hit = columnar.read(path)
    if hit is not None:
        if progress:
            progress(1, 1)
        assert hit.stats is not None
        return hit, hit.stats
    templates, stats = build_one(spec, perf, progress, jobs)
    columnar.write(path, templates, stats)
    return TemplateTable(model=spec.model.name, phase=spec.phase, stats=stats, objects=templates), stats


def check_multiset(nodes: Sequence[str], n_max: int) -> None:
    if not nodes:
        raise CoralError("a node multiset needs at least one node (e.g. --nodes 1xL4,1xL40S)")
    if len(nodes) > n_max:
        raise CoralError(f"{len(nodes)} nodes is more than n_max={n_max}; templates hold at most n_max nodes")


def specs_for(scenario: Any, n_max: int | None = None, rho: float | None = None,
              models: Sequence[str] | None = None, phases: Sequence[Phase] | None = None) -> list[TemplateSpec]:
    """One TemplateSpec per (model, phase) of a resolved scenario: the latency budget, the lengths
    and the KV model come from `coral.templates.budget` and the model's traffic sample.

    Raises:
        CoralError: a model whose traffic can't be read.
    """
    planner = scenario.planner
    planning = plan_inputs(scenario)
    out = []
    for m in scenario.models:
        if models and m.name not in models:
            continue
        mp = planning.of(m.name)
        lengths, kv = mp.lengths, mp.kv
        for phase in phases or (Phase.PREFILL, Phase.DECODE, Phase.COLOCATED):
            budget = mp.budget_ms(phase)
            if not budget > 0:
                raise CoralError(
                    f"model {m.name}: its {phase.value} budget ({m.slo_ms(phase):g} ms x headroom) leaves "
                    f"nothing once the KV allowance ({kv.allowance_ms:g} ms, planner.kv_tpot_share) is taken; "
                    "lower kv_tpot_share, raise tpot_headroom or relax the SLO")
            batches = tuple(b for b in planner.batch_grid if phase is not Phase.PREFILL or b <= planner.prefill_max_batch)
            prefill = phase is Phase.PREFILL
            spec = TemplateSpec(
                model=m.spec, phase=phase, slo_ms=m.slo_ms(phase), budget_ms=budget,
                prompt_tokens=lengths.prompt_q if prefill else lengths.prompt_mean,
                output_tokens=lengths.output_mean, configs=mp.configs, n_max=n_max or planner.n_max,
                rho=rho or planner.rho, batches=batches or (1,),
                work_prompt_tokens=lengths.prompt_work if phase is not Phase.DECODE else None,
                lengths=tuple(sorted(lengths.key().items())))
            if phase is Phase.COLOCATED:  # no KV transfer; its TTFT is checked at the quantile prompt
                spec = dataclasses.replace(spec, ttft_budget_ms=m.slo.ttft_ms * planner.ttft_headroom,
                                           ttft_prompt_tokens=lengths.prompt_q,
                                           prompt_per_output=lengths.prompt_mean / max(lengths.output_mean, 1.0))
            else:
                spec = dataclasses.replace(spec, kv_bytes_per_token=kv.bytes_per_token,
                                           kv_latency_tokens=kv.latency_tokens, kv_allowance_ms=kv.allowance_ms,
                                           kv_rate_tokens=kv.rate_tokens(phase))
            out.append(spec)
    return out


def _build_unit(args: tuple[TemplateSpec, PerfModel, Path | None]) -> tuple[list[Template], LibraryStats]:
    spec, perf, cache_dir = args
    templates, stats = build_cached(spec, perf, cache_dir)
    return list(templates), stats  # plain objects travel back from a Ray worker


StepFn = Callable[[TemplateSpec, int, int], None]  # (unit, multisets done, multisets in the unit)


def build_library(scenario: Any, *, jobs: int = 1, cache_dir: Path | None = None, n_max: int | None = None,
                  rho: float | None = None, models: Sequence[str] | None = None,
                  progress: Callable[[LibraryStats], None] | None = None, step: StepFn | None = None,
                  executor: str = "local", address: str | None = None) -> TemplateLibrary:
    """Build (or read from the cache) the template library of every (model, phase) of a scenario.

    Args:
        scenario: a resolved `coral.scenario.Scenario`.
        jobs: worker processes for the local executor (the multisets of one size run in parallel).
        cache_dir: content-addressed cache folder; None disables caching.
        n_max, rho: override the scenario's planner knobs.
        models: restrict to these model names.
        progress: called with each (model, phase)'s stats as it finishes.
        step: called as multisets are solved, for a progress bar.
        executor: 'local' (processes on this machine) or 'ray' (one (model, phase) per Ray task).
        address: the Ray cluster address (executor 'ray'); None starts or joins a local one.

    Returns:
        The library, with one LibraryStats per (model, phase).

    Raises:
        CoralError: bad knobs, or Ray requested but not installed.
    """
    if jobs < 1:
        raise CoralError(f"--jobs must be >= 1, got {jobs}")
    if n_max is not None and not 1 <= n_max <= 8:
        raise CoralError(f"--n-max must be in [1, 8], got {n_max}")
    if rho is not None and not rho >= 1:
        raise CoralError(f"--rho must be >= 1, got {rho}")
    if executor not in ("local", "ray"):
        raise CoralError(f"unknown executor {executor!r}; valid executors: local, ray")
    specs = specs_for(scenario, n_max, rho, models)
    results: list[tuple[Sequence[Template], LibraryStats]]
    if executor == "ray":
        results = _run_ray([(s, scenario.perf, cache_dir) for s in specs], address, progress)
        order = {(s.model.name, s.phase): i for i, s in enumerate(specs)}
        results.sort(key=lambda r: order[(r[1].model, r[1].phase)])
    else:
        results = []
        for spec in specs:
            cb = (lambda done, total, spec=spec: step(spec, done, total)) if step else None
            results.append(build_cached(spec, scenario.perf, cache_dir, cb, jobs))
            if progress:
                progress(results[-1][1])
    return TemplateLibrary.from_groups({(st.model, st.phase): ts for ts, st in results}, stats=(st for _, st in results))


def _run_ray(tasks: list[tuple[TemplateSpec, PerfModel, Path | None]], address: str | None,
             progress: Callable[[LibraryStats], None] | None) -> list[tuple[Sequence[Template], LibraryStats]]:
    """Run one (model, phase) per Ray task on an existing (or local) Ray cluster."""
    try:  # lazy: Ray is an optional extra, imported only for executor 'ray'
        import ray  # type: ignore[import-not-found]
    except ImportError:
        raise CoralError("executor 'ray' needs Ray: pip install 'coral[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(_build_unit)
    pending = {remote.remote(t): t for t in tasks}
    out = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            pending.pop(ref)
            out.append(ray.get(ref))
            if progress:
                progress(out[-1][1])
    return out
