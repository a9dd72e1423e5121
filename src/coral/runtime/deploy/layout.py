"""A template's engine layout as the runtime and the exports read it: each stage entry (a whole node,
or one tensor-parallel group of one, `4xL40S/tp1`) is one engine, on the physical node
`Template.hosts()` says, on its own GPUs of that node.

No torch here: `coral export` runs without the runtime extra.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coral.catalog.hardware import split_config_name, split_group_name
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.templates.problem import Placement, Stage
from coral.templates.template import Template

__all__ = ["FIRST_TOKEN_MODES", "Engine", "coral_engine_tp", "engine_layout", "entry_tp", "hosts_of", "node_gpus"]

#: Where a model's first token is emitted (the plan file's per-model `first_token`): "prefill": the
#: prefill instance, as soon as it has sampled it (the KV transfer then counts in TPOT; the paper's
#: runtime); "decode": the decode instance, once the KV has arrived (the transfer counts in TTFT;
#: vLLM's P/D proxy).
FIRST_TOKEN_MODES = ("prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    """One engine of an instance: a stage entry, the physical node it runs on and its GPUs there."""

    stage: int
    index: int  # its position in the stage (the runtime's node index)
    entry: str  # the stage entry: '4xL40S' (the whole node) or '4xL40S/tp1' (one TP group of it)
    node: str  # the physical node's configuration ('4xL40S')
    host: int  # which node of the instance's `nodes` it runs on
    tp: int  # the entry's GPUs: its tensor-parallel degree
    gpus: tuple[int, ...]  # its GPU ordinals on that node


def node_gpus(name: str) -> int:
    """GPUs of the physical node of a configuration or group name (`4xL40S/tp1` -> 4)."""
    return split_config_name(name)[0]


def entry_tp(entry: str) -> int:
    """The tensor-parallel degree of a stage entry: its group's, or the whole node's GPUs."""
    node, tp = split_group_name(entry)
    return split_config_name(node)[0] if tp is None else tp


def hosts_of(nodes: Sequence[str], stages: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], ...]:
    """Per stage, per entry: the index into `nodes` of the node it runs on (`Template.hosts`, the one rule).

    Args:
        nodes: the instance's physical nodes, sorted (the plan file's `nodes`).
        stages: per stage, its entries.

    Raises:
        CoralError: an entry whose node is not among `nodes`, or a name of another shape.
    """
    try:
        placement = Placement(stages=tuple(Stage(nodes=tuple(s), node_index=tuple(range(len(s))), layers=1, time_s=0.0,
                                                 throughput_tok_per_s=1.0) for s in stages),
                              micro_batch=1, throughput_tok_per_s=1.0, latency_s=0.0, comm_s=0.0)
        t = Template(model="", phase=Phase.PREFILL, slo_ms=1.0, budget_ms=1.0, nodes=tuple(nodes), placement=placement)
        return t.hosts()
    except KeyError as e:
        raise CoralError(f"a stage entry runs on {e.args[0]}, which is not one of the nodes {list(nodes)}") from None
    except ValueError as e:
        raise CoralError(str(e)) from None


def engine_layout(nodes: Sequence[str], stages: Sequence[Sequence[str]],
                  hosts: Sequence[Sequence[int]] | None = None) -> tuple[Engine, ...]:
    """Every engine of an instance, in stage order: its host and GPUs (a host's entries take its GPUs in order).

    Args:
        nodes: the instance's physical nodes.
        stages: per stage, its entries.
        hosts: per stage, per entry, its node (None: :func:`hosts_of`).

    Raises:
        CoralError: a node not hosting any entry, an entry on a node of another configuration, or a
            node whose entries need more GPUs than it has.
    """
    hosts = hosts_of(nodes, stages) if hosts is None else hosts
    if [len(h) for h in hosts] != [len(s) for s in stages]:
        raise CoralError(f"'hosts' has {[len(h) for h in hosts]} entries per stage, the stages {[len(s) for s in stages]}")
    used = [0] * len(nodes)
    out = []
    for s, (entries, where) in enumerate(zip(stages, hosts, strict=True)):
        for k, (entry, h) in enumerate(zip(entries, where, strict=True)):
            if not 0 <= h < len(nodes):
                raise CoralError(f"stage {s} entry {entry!r} runs on node {h}; the instance has {len(nodes)}")
            node = split_group_name(entry)[0]
            if node != nodes[h]:
                raise CoralError(f"stage {s} entry {entry!r} runs on node {h}, a {nodes[h]}")
            tp = entry_tp(entry)
            if used[h] + tp > node_gpus(node):
                raise CoralError(f"node {h} ({node}) hosts entries of {used[h] + tp} GPUs; it has {node_gpus(node)}")
            out.append(Engine(stage=s, index=k, entry=entry, node=node, host=h, tp=tp,
                              gpus=tuple(range(used[h], used[h] + tp))))
            used[h] += tp
    idle = [h for h, n in enumerate(used) if not n]
    if idle:
        raise CoralError(f"node {idle[0]} ({nodes[idle[0]]}) runs no stage entry")
    return tuple(out)


def coral_engine_tp(want: int, spec: ModelSpec | None, config: Mapping[str, Any] | None = None) -> int:
    """The tensor-parallel degree Coral's engine runs for `want` GPUs: the largest `t` dividing `want` that
    vLLM's rule accepts (`ModelSpec.tp_problem`) and that the engine's own split can run: a dense MLP, and
    KV heads that divide by `t` (it does not replicate KV heads). The other GPUs stay idle.

    Args:
        want: the GPUs the layout gives the engine.
        spec: the model's architecture (None: one the catalog does not model; `config` decides).
        config: the model's HF-style config (the engine's split reads it).
    """
    cfg = dict(config or {})
    if (spec is not None and spec.is_moe) or cfg.get("num_experts") or cfg.get("num_local_experts"):
        return 1
    if spec is not None:
        heads, kv, width = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    else:
        heads = int(cfg.get("num_attention_heads", 1))
        kv, width = int(cfg.get("num_key_value_heads") or heads), int(cfg.get("intermediate_size", 1))
    return max(t for t in range(1, want + 1) if want % t == 0 and heads % t == 0 and kv % t == 0 and width % t == 0
               and (spec is None or spec.tp_problem(t) is None))
