"""The Plan -> cluster mapping: a plan file's instances as the runtime's instance specs, with each
node's layer range and routing weight taken from its template."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.runtime.deploy.layout import coral_engine_tp
from coral.runtime.deploy.plan_file import PlanFile, PlannedInstance, load_plan_file

log = logging.getLogger(__name__)


def node_weights(plan: PlanFile, inst: PlannedInstance) -> tuple[tuple[float, ...], ...]:
    """Per stage, per node: the tokens/s the node serves, summing to the stage's planned throughput.

    Nodes of one stage hold the same layers and split its micro-batches; the scheduler routes to
    them in proportion to these weights. A node's share is `1/τ_k` with `τ_k = j·t_k + o_k` its
    time for the stage's `j` layers (the placement's own timing, DESIGN §3), scaled so that the
    stage's nodes add up to the throughput the plan states for the stage. A colocated instance's nodes are
    timed on its prefill shape (its prompt tokens dominate a mixed step's work).

    Args:
        plan: the plan file (its scenario's performance model and catalog time the nodes).
        inst: one of its instances.

    Returns:
        One tuple of weights per stage, in the order of the stage's nodes.
    """
    scenario = plan.scenario
    served = next(m for m in scenario.models if m.name == inst.model)
    spec = served.spec
    prompt = served.prompt_tokens_mean
    phase = Phase.PREFILL if inst.colocated else inst.phase  # `Shape` takes one demand phase
    shape = Shape(phase=phase, batch=1, prompt_tokens=prompt,
                  output_tokens=served.output_tokens_mean if inst.phase is Phase.DECODE else 0.0)
    out: list[tuple[float, ...]] = []
    n = len(inst.stages)
    for s, st in enumerate(inst.stages):
        if len(st.nodes) == 1:
            out.append((st.throughput_tok_per_s,))
            continue
        inv = []
        for c in st.nodes:
            cfg = scenario.catalog.config(c)
            tau = st.layers * scenario.perf.layer_time_s(cfg, spec, shape) + scenario.perf.stage_extra_s(
                cfg, spec, shape, first=s == 0, last=s == n - 1)
            inv.append(1.0 / tau)
        total = sum(inv)
        out.append(tuple(st.throughput_tok_per_s * x / total for x in inv))
    return tuple(out)


def stage_layout(inst: PlannedInstance, model: Any) -> list[dict[str, Any]]:
    """Per stage of `inst`: its entries (`configs`), each engine's TP degree (`tp`) and machine (`hosts`).

    Each stage entry is one engine: a whole node runs tensor-parallel over all its GPUs, a TP group
    (`4xL40S/tp1`) over its own, on the machine `Template.hosts()` says. The degree is the largest that
    Coral's engine runs for the served model (`coral_engine_tp`: vLLM's rule and the engine's own split),
    at most the layout's: a cluster file's stand-in model, or a whole node of a plan made before TP
    groups, may run fewer (the rest of the GPUs idle, logged).

    Args:
        inst: a plan instance.
        model: the cluster file's `ServedModel` of its model (config and architecture).
    """
    out = []
    by_stage: dict[int, list[Any]] = {}
    for e in inst.engines():
        by_stage.setdefault(e.stage, []).append(e)
    for s, st in enumerate(inst.stages):
        engines = by_stage[s]
        tps = [coral_engine_tp(e.tp, model.spec, model.config) for e in engines]
        for e, tp in zip(engines, tps, strict=True):
            if tp < e.tp:
                log.warning("%s stage %d: entry %s runs tensor-parallel %d (%s cannot split %d ways): %d GPU(s) idle",
                            inst.name, s, e.entry, tp, model.name, e.tp, e.tp - tp)
        out.append({"configs": tuple(st.nodes), "tp": tuple(tps), "hosts": tuple(e.host for e in engines)})
    return out


def plan_instance_specs(plan: PlanFile, models: dict[str, Any]) -> list[Any]:
    """Every running instance of the plan (count expanded) as a `coral.runtime.deploy.cluster_config.InstanceSpec`.

    A colocated instance (`Phase.COLOCATED`) becomes a `mixed` one (:data:`~coral.runtime.deploy.cluster_config.MIXED`:
    one engine group serving both phases, no KV transfer) with the template's `chunk_tokens`.

    Args:
        plan: the plan file.
        models: served model name -> the cluster file's `ServedModel` (weights or seed, layers).

    Raises:
        CoralError: a plan model the cluster file does not serve, or one whose layer count differs.
    """
    # lazy: the runtime extra (msgspec, zmq): `coral export` runs without it
    from coral.runtime.deploy.cluster_config import MIXED, InstanceSpec, StageSpec

    specs = []
    for inst in plan.instances:
        if inst.model not in models:
            raise CoralError(f"{plan.path}: the plan serves {inst.model!r}, which the cluster file does not list "
                             f"(models: {', '.join(models)}); add it under models:")
        m = models[inst.model]
        layers = inst.stages[-1].layer_end
        if m.num_layers != layers:
            raise CoralError(f"{plan.path}: {inst.model} has {layers} layers in the plan but "
                             f"{m.num_layers} in the cluster file's config; they must be the same model")
        weights = node_weights(plan, inst)
        layout = stage_layout(inst, m)
        stages = tuple(StageSpec(layer_start=st.layer_start, layer_end=st.layer_end, node_throughputs=w,
                                 configs=lay["configs"], tp=max(lay["tp"]), node_tps=lay["tp"], hosts=lay["hosts"])
                       for st, w, lay in zip(inst.stages, weights, layout, strict=True))
        for r in range(inst.count):
            specs.append(InstanceSpec(name=f"{inst.name}-r{r}", model=inst.model, phase=MIXED if inst.colocated else inst.phase,
                                      region=inst.region, throughput_tok_per_s=inst.throughput_tok_per_s,
                                      stages=stages, seed=m.seed, weights_path=m.weights_path, chunk_tokens=inst.chunk_tokens,
                                      spot=inst.spot))
    return specs


SCHEDULER_BASE_PORT = 47000  # replica r of instance line i: its scheduler listens on base + 100*i + r
MAX_REPLICAS_PER_LINE = 100


def scheduler_port(index: int, replica: int) -> int:
    """The fixed scheduler port of replica `replica` of instance line `index` (SkyPilot export, remote engines).

    Raises:
        CoralError: a replica number the numbering has no room for.
    """
    if not 0 <= replica < MAX_REPLICAS_PER_LINE:
        raise CoralError(f"instance line {index} has replica {replica}; the scheduler ports number at most "
                         f"{MAX_REPLICAS_PER_LINE} per line: split the line or re-plan")
    port = SCHEDULER_BASE_PORT + 100 * index + replica
    if port > 65535:
        raise CoralError(f"instance line {index}: its scheduler port {port} is past 65535; the export numbers "
                         f"at most {(65535 - SCHEDULER_BASE_PORT) // 100 + 1} instance lines: re-plan with fewer")
    return port


def with_scheduler_ports(plan: PlanFile, specs: list[Any]) -> list[Any]:
    """`plan_instance_specs(plan, ...)` with each instance's fixed :func:`scheduler_port`."""
    ports = {f"{inst.name}-r{r}": scheduler_port(inst.index, r) for inst in plan.instances for r in range(inst.count)}
    return [dataclasses.replace(s, scheduler_port=ports[s.name]) for s in specs]


def plan_node_configs(plan: PlanFile) -> dict[str, list[list[str]]]:
    """Runtime instance name -> per stage, each node's configuration (what the Ray provisioner places by)."""
    return {f"{inst.name}-r{r}": [list(st.nodes) for st in inst.stages]
            for inst in plan.instances for r in range(inst.count)}


def cluster_from_plan(cluster: Any, plan: PlanFile) -> Any:
    """The cluster file with its instances replaced by the plan's, and each planned model emitting its first
    token where the plan says (`first_token`; the models' weights and the settings are the file's)."""
    planned = {i.model for i in plan.instances}
    models = tuple(dataclasses.replace(m, first_token=plan.first_token_of(m.name)) if m.name in planned else m
                   for m in cluster.models)
    return dataclasses.replace(cluster, models=models,
                               instances=tuple(plan_instance_specs(plan, {m.name: m for m in models})))


def cluster_from_plan_file(cluster: Any, path: str, scenario: str | None = None) -> Any:
    """`coral serve --plan`: read and check the plan file, then :func:`cluster_from_plan`.

    Raises:
        CoralError: as `load_plan_file` and :func:`plan_instance_specs`.
    """
    return cluster_from_plan(cluster, load_plan_file(path, scenario))


__all__ = ["SCHEDULER_BASE_PORT", "cluster_from_plan", "cluster_from_plan_file", "node_weights", "plan_prices", "plan_instance_specs",
           "plan_node_configs", "scheduler_port", "stage_layout", "with_scheduler_ports"]


def plan_prices(plan: PlanFile, instances: Any) -> dict[tuple[Any, ...], float]:
    """Shape (:func:`coral.runtime.deploy.lifecycle.shape_key`) -> $/h of one instance, for the served plan's
    instances (named `<line>-r<k>` by :func:`plan_instance_specs`): the plan-cost metric adds them up."""
    # lazy: the lifecycle needs the runtime extra (msgspec, zmq): `coral export` runs without it
    from coral.runtime.deploy.lifecycle import shape_key

    price = {line.name: line.price_usd_per_h for line in plan.instances}
    return {shape_key(spec): price[spec.name.rsplit("-r", 1)[0]] for spec in instances if spec.name.rsplit("-r", 1)[0] in price}
