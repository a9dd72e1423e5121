"""Plan reconciliation, pure: what makes two instances interchangeable, and the start / drain / keep actions
that turn the running plan into a desired one (:class:`coral.runtime.deploy.lifecycle.Controller` carries them out).

Instances are matched by *shape* (everything but the name), surplus running instances are drained lowest
load first, and missing ones are started under fresh names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coral.runtime.deploy.cluster_config import InstanceSpec

__all__ = ["Action", "describe", "fresh_name", "reconcile", "renamed", "shape_key"]


def shape_key(spec: InstanceSpec) -> tuple[Any, ...]:
    """What makes two instances interchangeable: everything but the name."""
    return (spec.model, spec.phase, spec.region, spec.throughput_tok_per_s, spec.stages, spec.seed, spec.weights_path,
            spec.spot)


def describe(spec: InstanceSpec) -> str:
    """What an instance runs, for logs: `model/phase/4xL40S+1xL4 in region` (its nodes' configurations
    when a plan placed it, else its stages' node counts)."""
    if all(st.configs for st in spec.stages):
        nodes = "+".join(sorted(c for st in spec.stages for c in st.configs))
    else:
        nodes = "|".join(str(len(st.node_throughputs)) for st in spec.stages) + " node(s)"
    return f"{spec.model}/{spec.phase}/{nodes} in {spec.region}" + (" (spot)" if spec.spot else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step of a reconciliation: start, drain or keep one instance."""

    kind: str  # "start" | "drain" | "keep"
    name: str
    spec: InstanceSpec

    def __post_init__(self) -> None:
        if self.kind not in ("start", "drain", "keep"):
            raise ValueError(f"action kind must be start, drain or keep, got {self.kind!r}")


def reconcile(desired: Sequence[InstanceSpec], running: Mapping[str, InstanceSpec], loads: Mapping[str, int], taken: set[str]) -> list[Action]:
    """Turn a desired plan into actions against the running instances.

    Args:
        desired: the new plan.
        running: name -> spec of the instances that take (or will take) traffic.
        loads: name -> requests held now (missing = 0); the least loaded are drained first.
        taken: every name used so far (a new instance never reuses one).

    Returns:
        Actions: ``keep`` for matched instances, ``drain`` for surplus ones, ``start`` for
        missing ones (named after the desired spec, with a ``-N`` suffix when taken).
    """
    want: dict[tuple[Any, ...], list[InstanceSpec]] = {}
    for d in desired:
        want.setdefault(shape_key(d), []).append(d)
    have: dict[tuple[Any, ...], list[str]] = {}
    for name, spec in running.items():
        have.setdefault(shape_key(spec), []).append(name)
    actions: list[Action] = []
    used = set(taken)
    for key, names in have.items():
        n_keep = len(want.get(key, []))
        # keep the busiest, drain the least loaded (ties: by name, for determinism)
        ordered = sorted(names, key=lambda n: (-loads.get(n, 0), n))
        actions += [Action(kind="keep", name=n, spec=running[n]) for n in ordered[:n_keep]]
        actions += [Action(kind="drain", name=n, spec=running[n]) for n in ordered[n_keep:]]
    for key, specs in want.items():
        for spec in specs[len(have.get(key, [])):]:
            name, k = spec.name, 1
            while name in used:
                k += 1
                name = f"{spec.name}-{k}"
            used.add(name)
            actions.append(Action(kind="start", name=name, spec=renamed(spec, name)))
    return actions


def fresh_name(spec: InstanceSpec, taken: set[str]) -> str:
    """A replacement's name: the spec's, with the first free ``-N`` suffix (a replacement of ``c-2`` is ``c-3``)."""
    base = re.sub(r"-\d+$", "", spec.name) or spec.name
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}-{k}"
    return name


def renamed(spec: InstanceSpec, name: str) -> InstanceSpec:
    """``spec`` under another name (a fixed scheduler port is kept only under its own name)."""
    # a fixed scheduler port belongs to the name it was given for (the old one may still drain on it)
    return dataclasses.replace(spec, name=name, scheduler_port=spec.scheduler_port if name == spec.name else None)
