"""What vLLM can run of a template's engine layout, and as which `vllm serve` processes.

vLLM runs one model replica per `vllm serve` as `--pipeline-parallel-size` stages (uneven ones through
`VLLM_PP_LAYER_PARTITION`), each `--tensor-parallel-size` GPUs wide, and `--data-parallel-size` such
replicas in one server. A template's layout (its stage entries: whole nodes or TP groups of one,
`coral.runtime.deploy.layout`) maps to it as follows:

- a pipeline (several stages, one entry each, one TP degree): one server, `--pipeline-parallel-size` =
  stages, `--tensor-parallel-size` = the entries' GPUs; its stages must run on consecutive machines
  (each machine hosting a run of stages, as vLLM places pipeline ranks); Ray when it spans machines;
- one stage: its entries are replicas of the whole model. The entries one machine hosts, all of one TP
  degree, are one server with `--data-parallel-size` = their number; a machine whose entries differ in
  degree runs one server per entry, each on its own GPUs (`CUDA_VISIBLE_DEVICES`); every machine runs
  its own servers;
- a pipeline with a data-parallel stage, or stages of different degrees, has no vLLM equivalent;
- a TP degree vLLM refuses for the model (`ModelSpec.tp_problem`) neither.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coral.catalog.hardware import split_group_name
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.runtime.deploy.layout import engine_layout, node_gpus
from coral.templates.template import Template

__all__ = ["VllmServer", "nodes_of", "template_reason", "vllm_layout", "vllm_reason", "vllm_templates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmServer:
    """One `vllm serve` process of an instance: the machine it runs on, its GPUs there, its sizes."""

    host: int  # the instance's node it runs on (the pipeline's first, when it spans several)
    gpus: tuple[int, ...]  # its GPUs on that machine (CUDA_VISIBLE_DEVICES)
    tp: int
    pp: int = 1
    dp: int = 1
    hosts: tuple[int, ...] = ()  # every machine it runs on, in pipeline order (several: Ray)


def nodes_of(stages: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The physical nodes a layout's entries need, sorted (the inverse of `Template.hosts()`: g groups of a
    g-group node share one node)."""
    count: dict[str, int] = {}
    for entries in stages:
        for e in entries:
            count[e] = count.get(e, 0) + 1
    out: list[str] = []
    for e, n in count.items():
        node, tp = split_group_name(e)
        per = 1 if tp is None else node_gpus(node) // tp
        out += [node] * (-(-n // per))
    return tuple(sorted(out))


def vllm_layout(stages: Sequence[Sequence[str]], *, nodes: Sequence[str] | None = None,
                hosts: Sequence[Sequence[int]] | None = None, spec: ModelSpec | None = None) -> tuple[VllmServer, ...] | str:
    """The `vllm serve` processes of one replica of a layout, or why vLLM cannot run it.

    Args:
        stages: per pipeline stage, its entries (e.g. [["4xL40S/tp1"], ["4xL40S/tp1"]]).
        nodes: the instance's machines (None: :func:`nodes_of`).
        hosts: per stage, per entry, its machine (None: `Template.hosts()`).
        spec: the model (None: its TP degrees are not checked).

    Returns:
        The servers, or a one-line reason naming the stage, the degrees or the machines at fault.
    """
    try:
        engines = engine_layout(tuple(nodes) if nodes is not None else nodes_of(stages), stages, hosts)
    except CoralError as e:
        return str(e)
    degrees = sorted({e.tp for e in engines})
    if spec is not None:
        for t in degrees:
            problem = spec.tp_problem(t)
            if problem:
                return f"vLLM refuses --tensor-parallel-size {t}: {problem}"
    if len(stages) > 1:
        for s, entries in enumerate(stages):
            if len(entries) != 1:
                return (f"stage {s} has {len(entries)} data-parallel entries ({' + '.join(entries)}) in a pipeline; "
                        "vLLM's pipeline stage is one tensor-parallel group")
        if len(degrees) > 1:
            return (f"its stages have {' and '.join(str(c) for c in degrees)} GPUs each; "
                    "vLLM uses one tensor-parallel degree for every stage")
        order = [e.host for e in engines]
        runs = [h for k, h in enumerate(order) if k == 0 or h != order[k - 1]]
        if len(set(runs)) != len(runs):
            return (f"its stages run on machines {order}: a machine hosts stages that are not consecutive, which "
                    "vLLM's pipeline ranks cannot follow")
        return (VllmServer(host=order[0], gpus=tuple(g for e in engines if e.host == order[0] for g in e.gpus),
                           tp=degrees[0], pp=len(stages), hosts=tuple(runs)),)
    servers = []
    for h in sorted({e.host for e in engines}):
        mine = [e for e in engines if e.host == h]
        if len({e.tp for e in mine}) == 1:
            servers.append(VllmServer(host=h, gpus=tuple(g for e in mine for g in e.gpus), tp=mine[0].tp, dp=len(mine),
                                      hosts=(h,)))
        else:
            servers += [VllmServer(host=h, gpus=e.gpus, tp=e.tp, hosts=(h,)) for e in mine]
    return tuple(servers)


def vllm_reason(stages: Sequence[Sequence[str]], *, nodes: Sequence[str] | None = None,
                hosts: Sequence[Sequence[int]] | None = None, spec: ModelSpec | None = None) -> str | None:
    """Why vLLM cannot run a layout (:func:`vllm_layout`), or None when it can."""
    got = vllm_layout(stages, nodes=nodes, hosts=hosts, spec=spec)
    return got if isinstance(got, str) else None


def template_reason(t: Template, spec: ModelSpec | None = None) -> str | None:
    """:func:`vllm_reason` of a template's placement (its TP degrees checked against `spec` when given)."""
    return vllm_reason([s.nodes for s in t.placement.stages], nodes=t.nodes, hosts=t.hosts(), spec=spec)


def vllm_templates(templates: Sequence[Template], specs: Mapping[str, ModelSpec] | None = None) -> tuple[Template, ...]:
    """The templates vLLM can run, in their order (`specs`: model name -> spec, for the TP rule)."""
    specs = specs or {}
    return tuple(t for t in templates if template_reason(t, specs.get(t.model)) is None)
