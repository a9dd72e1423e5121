"""Serving templates `τ = (m, φ, ℓ, G', Ψ*)` and a library of them."""
from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from coral.catalog.hardware import split_group_name
from coral.perf.model import Phase
from coral.templates.problem import Placement


@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    """A model's throughput-optimal placement on one node multiset, for one phase and SLO.

    A colocated template (`phase=Phase.COLOCATED`) serves both phases in one replica with chunked
    prefill: `throughput_tok_per_s` is then `Θ_P` (prompt tokens/s) and `decode_tok_per_s` is `Θ_D`
    (generated tokens/s at the same time), `placement.micro_batch` the decode batch of a step, and
    `chunk_tokens` the most prompt tokens one step carries; `budget_ms` is the step (TPOT) budget.
    """

    model: str
    phase: Phase
    slo_ms: float  # the model's SLO for this phase (TTFT or TPOT), as the scenario states it
    budget_ms: float  # the latency the placement was held to (coral.templates.budget.latency_budget_ms)
    nodes: tuple[str, ...]  # the multiset G', sorted config names
    placement: Placement
    prompt_tokens: float | None = None  # the prompt length the latency was checked at (None: the mean)
    realized_tok_per_s: float | None = None  # Θ on the length distribution; None: the placement's
    decode_tok_per_s: float | None = None  # colocated only: Θ_D, generated tokens/s beside Θ_P
    chunk_tokens: int | None = None  # colocated only: prompt tokens per step (vLLM batched tokens − decode batch)

    def __post_init__(self) -> None:
        if tuple(sorted(self.nodes)) != self.nodes:
            raise ValueError("Template.nodes must be sorted")
        if not self.nodes:
            raise ValueError("a template needs at least one node")
        if not self.budget_ms > 0:
            raise ValueError(f"Template.budget_ms must be > 0, got {self.budget_ms}")
        if self.realized_tok_per_s is not None and not self.realized_tok_per_s > 0:
            raise ValueError(f"Template.realized_tok_per_s must be > 0, got {self.realized_tok_per_s}")
        if self.phase is Phase.COLOCATED:
            if self.decode_tok_per_s is None or not self.decode_tok_per_s > 0:
                raise ValueError(f"a colocated Template needs decode_tok_per_s > 0, got {self.decode_tok_per_s}")
            if self.chunk_tokens is None or self.chunk_tokens < 1:
                raise ValueError(f"a colocated Template needs chunk_tokens >= 1, got {self.chunk_tokens}")
        elif self.decode_tok_per_s is not None or self.chunk_tokens is not None:
            raise ValueError(f"decode_tok_per_s and chunk_tokens are for colocated templates only, "
                             f"not {self.phase.value}")

    @property
    def throughput_tok_per_s(self) -> float:
        """`Θ(τ)`: the rate realized on the model's length distribution (what the allocator counts)."""
        if self.realized_tok_per_s is not None:
            return self.realized_tok_per_s
        return self.placement.throughput_tok_per_s

    def serves_tok_per_s(self, phase: Phase) -> float:
        """What one instance counts towards the model's `phase` demand (`phase` PREFILL or DECODE):
        `Θ` for its own phase, 0 for the other; a colocated one `Θ_P` towards prefill and `Θ_D`
        towards decode."""
        if self.phase is Phase.COLOCATED:
            return self.throughput_tok_per_s if phase is Phase.PREFILL else float(self.decode_tok_per_s or 0.0)
        return self.throughput_tok_per_s if phase is self.phase else 0.0

    @property
    def counts(self) -> dict[str, int]:
        """`U_c(τ)`: nodes per configuration."""
        return dict(Counter(self.nodes))

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.nodes)) == 1

    @property
    def key(self) -> str:
        return f"{self.model}/{self.phase.value}/" + "+".join(self.nodes)

    @property
    def entries(self) -> tuple[str, ...]:
        """The stage entries (whole nodes, or TP groups of them: `NodeConfig.group`) in the order
        the placement problem numbers them (`Stage.node_index`)."""
        out = {k: name for st in self.placement.stages for name, k in zip(st.nodes, st.node_index, strict=True)}
        return tuple(out[k] for k in sorted(out))

    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, per entry: the index into `nodes` of the node that entry runs on.

        A stage entry is a whole node (`4xL40S`) or one tensor-parallel group of one
        (`4xL40S/tp1`, see `NodeConfig.group`); a node split into `g` groups hosts `g` entries.
        The `i`-th entry of a group configuration, counted in stage order, runs on the
        `i // g`-th node of that configuration: the rule the simulator, the runtime and the
        exports share.
        """
        first = {c: self.nodes.index(c) for c in set(self.nodes)}
        seen: dict[str, int] = {}
        out = []
        for st in self.placement.stages:
            row = []
            for entry in st.nodes:
                node, tp = split_group_name(entry)
                k = seen.get(entry, 0)
                seen[entry] = k + 1
                per_node = 1 if tp is None else int(node.split("x", 1)[0]) // tp
                row.append(first[node] + k // per_node)
            out.append(tuple(row))
        return tuple(out)

    def price_usd_per_h(self, prices: Mapping[str, float]) -> float:
        """`p_r(τ) = Σ_c p_r(c)·U_c(τ)` for one region's prices (KeyError where a config is not sold)."""
        return sum(prices[c] * n for c, n in self.counts.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class LibraryStats:
    """What one (model, phase) build did."""

    model: str
    phase: Phase
    multisets: int  # enumerated (within n_max)
    memory_ok: int  # passed the memory filter (weights ≤ memory ≤ rho × weights)
    solved: int  # actually solved (not pruned by dominance during enumeration)
    feasible: int  # had a placement meeting the SLO
    kept: int  # left after dropping dominated templates
    wall_s: float
    cached: bool = False
    notes: tuple[str, ...] = ()  # what the user should know (colocated: the nodes the model is not colocatable on)

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))  # read back from JSON as a list


class ChainedTemplates(Sequence[Template]):
    """Several template sequences read as one, without copying them (a library of ~10^6
    templates keeps each (model, phase) in its own lazy columnar table)."""

    def __init__(self, parts: Iterable[Sequence[Template]]) -> None:
        self.parts = tuple(parts)
        self._ends = list(itertools.accumulate(len(p) for p in self.parts))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> Template: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Template]: ...

    def __getitem__(self, i: int | slice) -> Template | Sequence[Template]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"template {i} of {n}")
        i %= n
        part = bisect.bisect_right(self._ends, i)
        return self.parts[part][i - (self._ends[part - 1] if part else 0)]

    def __iter__(self) -> Iterator[Template]:
        for p in self.parts:
            yield from p


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateLibrary:
    """All kept templates of a scenario, grouped by (model, phase).

    Built from `templates` (grouped here), or with `from_groups` from one sequence per
    (model, phase) (the cache's lazy columnar tables: nothing is read until asked for).
    """

    templates: Sequence[Template] = ()
    stats: tuple[LibraryStats, ...] = ()
    _index: dict[tuple[str, Phase], Sequence[Template]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._index:  # from_groups: the groups are given
            return
        index: dict[tuple[str, Phase], list[Template]] = {}
        for t in self.templates:
            index.setdefault((t.model, t.phase), []).append(t)
        self._index.update({k: tuple(v) for k, v in index.items()})

    @classmethod
    def from_groups(cls, groups: Mapping[tuple[str, Phase], Sequence[Template]],
                    stats: Iterable[LibraryStats] = ()) -> TemplateLibrary:
        """A library from one template sequence per (model, phase), used as given."""
        index = {k: v for k, v in groups.items() if len(v)}
        return cls(templates=ChainedTemplates(index.values()), stats=tuple(stats), _index=index)

    @property
    def groups(self) -> tuple[tuple[str, Phase], ...]:
        return tuple(self._index)

    def of(self, model: str, phase: Phase) -> Sequence[Template]:
        return self._index.get((model, phase), ())

    @classmethod
    def merge(cls, parts: Iterable[TemplateLibrary]) -> TemplateLibrary:
        parts = list(parts)
        groups: dict[tuple[str, Phase], list[Sequence[Template]]] = {}
        for p in parts:
            for g in p.groups:
                groups.setdefault(g, []).append(p.of(*g))
        return cls.from_groups({g: v[0] if len(v) == 1 else ChainedTemplates(v) for g, v in groups.items()},
                               stats=(s for p in parts for s in p.stats))


def drop_dominated(templates: list[Template]) -> list[Template]:
    """Drop `τ₁` when another `τ₂` has `U(τ₂) ≤ U(τ₁)` component-wise and `Θ(τ₂) ≥ Θ(τ₁)`
    (lossless for the allocation in every region: `τ₂` costs no more and serves no less).
    Among exact duplicates (same counts and throughput) one is kept."""
    order = sorted(templates, key=lambda t: (-t.throughput_tok_per_s, len(t.nodes), t.nodes))
    kept: list[Template] = []
    kept_counts: list[Counter[str]] = []
    for t in order:
        c = Counter(t.nodes)
        if any(all(kc[k] <= c[k] for k in kc) for kc in kept_counts):
            continue  # some kept template has ≥ throughput (sorted) and a sub-multiset of nodes
        kept.append(t)
        kept_counts.append(c)
    return kept
