"""The hand-written cluster file of ``coral serve``: pydantic at the edge, frozen dataclasses inside.

A cluster file lists the models (an HF-style config dict or a built-in name, weights by
seed or local safetensors path) and the instances: phase, region, throughput and the
placement, as stages of contiguous layer ranges with one or more nodes each (nodes in a
stage are data-parallel replicas of its layers). See ``examples/cluster-tiny.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coral.catalog.models import ModelSpec, from_hf_config
from coral.errors import CoralError
from coral.file_kinds import wrong_kind
from coral.perf.model import Phase
from coral.runtime.engine.model import model_config_dict
from coral.runtime.serving.tokenizer import load_tokenizer

__all__ = [
    "MIXED",
    "ClusterSpec",
    "InstanceSpec",
    "ServedModel",
    "ServedPhase",
    "StageSpec",
    "load_cluster",
    "model_arch",
    "parse_cluster",
    "parse_instances",
    "served_phase",
]


# ------------------------------------------------------------------------ domain

#: An instance that runs a request's prefill and decode itself (no KV hand-off): a plan's colocated
#: instance (`Phase.COLOCATED`), whose scheduler mixes prompt chunks into decode steps (`chunk_tokens`).
MIXED: Final = "mixed"
#: What a runtime instance serves: one phase of the domain's `Phase`, or both.
ServedPhase = Phase | Literal["mixed"]

# HF `model_type` -> the `architectures` entry the catalog's `from_hf_config` reads, for configs
# (the built-in tiny ones, hand-written hf_config dicts) that name only their model_type.
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                         "gpt_oss": "GptOssForCausalLM", "phi3": "Phi3ForCausalLM"}


def served_phase(value: str | Phase) -> ServedPhase:
    """`prefill` / `decode` as the domain's `Phase`, `mixed` (or a plan's `colocated`) as :data:`MIXED`.

    Raises:
        ValueError: any other value.
    """
    if value in (MIXED, Phase.COLOCATED):
        return MIXED
    try:
        return Phase(value)
    except ValueError:
        raise ValueError(f"phase must be prefill, decode or mixed, got {value!r}") from None


def model_arch(config: dict[str, Any], name: str) -> ModelSpec | None:
    """The catalog's `ModelSpec` (the shape the performance model and the plans use) of an HF-style
    config, or None for an architecture the performance model does not know (the runtime still
    serves it; a plan cannot name it)."""
    cfg = dict(config)
    if not cfg.get("architectures") and cfg.get("model_type") in _ARCHITECTURE_OF_TYPE:
        cfg["architectures"] = [_ARCHITECTURE_OF_TYPE[cfg["model_type"]]]
    try:
        return from_hf_config(cfg, name)
    except (CoralError, ValueError, TypeError):
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """A served model: its HF config and architecture, where its weights come from, its tokenizer."""

    name: str
    config: dict[str, Any]  # the HF-style config the engines build their layers from
    seed: int | None
    weights_path: str | None
    max_context: int
    tokenizer_path: str | None = None  # tokenizer.json or its folder; None = byte tokenizer
    chat_template: str | None = None
    spec: ModelSpec | None = None  # the catalog's architecture of `config` (None: not one it models)
    first_token: str = "prefill"  # which instance emits the first token: "prefill" or "decode" (FIRST_TOKEN_MODES)

    def __post_init__(self) -> None:
        if (self.seed is None) == (self.weights_path is None):
            raise ValueError(f"model {self.name!r}: give exactly one of seed and weights")
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"model {self.name!r}: first_token must be prefill or decode, got {self.first_token!r}")
        if self.spec is not None and self.spec.num_layers != int(self.config["num_hidden_layers"]):
            raise ValueError(f"model {self.name!r}: spec has {self.spec.num_layers} layers, config "
                             f"{self.config['num_hidden_layers']}")

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return self.spec.num_layers if self.spec is not None else int(self.config["num_hidden_layers"])


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSpec:
    """One pipeline stage: layers [layer_start, layer_end) on ``len(node_throughputs)`` nodes."""

    layer_start: int
    layer_end: int
    node_throughputs: tuple[float, ...]
    tp: int = 1  # devices per node (tensor parallelism inside the node)
    devices: tuple[str, ...] = ()  # first device of each node ("cuda:N"); () = assigned per host
    # each node's configuration when a plan placed it: a whole node ("4xL40S") or one TP group of one
    # ("4xL40S/tp1": several engines share that machine); () = unplaced
    configs: tuple[str, ...] = ()
    node_tps: tuple[int, ...] = ()  # each node's TP degree where they differ; () = `tp` for every node
    # each node's machine: the index of the instance's physical node it runs on (engines of one stage or of
    # consecutive stages may share one); () = every node its own machine
    hosts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"empty or negative layer range [{self.layer_start}, {self.layer_end})")
        if not self.node_throughputs or any(not w > 0 for w in self.node_throughputs):
            raise ValueError("a stage needs at least one node, each with a positive throughput")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.devices and len(self.devices) != len(self.node_throughputs):
            raise ValueError(f"devices lists {len(self.devices)} device(s) for {len(self.node_throughputs)} node(s); give one per node")
        bad = [d for d in self.devices if not (d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()))]
        if bad:
            raise ValueError(f"device {bad[0]!r} is not cpu or cuda:N")
        if self.configs and len(self.configs) != len(self.node_throughputs):
            raise ValueError(f"configs lists {len(self.configs)} configuration(s) for {len(self.node_throughputs)} node(s)")
        if self.node_tps and (len(self.node_tps) != len(self.node_throughputs) or min(self.node_tps) < 1):
            raise ValueError(f"tp lists {len(self.node_tps)} degree(s) for {len(self.node_throughputs)} node(s); give one >= 1 per node")
        if self.hosts and (len(self.hosts) != len(self.node_throughputs) or min(self.hosts) < 0):
            raise ValueError(f"hosts lists {len(self.hosts)} machine(s) for {len(self.node_throughputs)} node(s); give one >= 0 per node")

    @property
    def tps(self) -> tuple[int, ...]:
        """Each node's tensor-parallel degree (devices)."""
        return self.node_tps or (self.tp,) * len(self.node_throughputs)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSpec:
    """One serving instance: a model's placement on a few nodes."""

    name: str
    model: str
    phase: ServedPhase  # a plain "prefill" / "decode" string is taken as the Phase
    region: str
    throughput_tok_per_s: float
    stages: tuple[StageSpec, ...]
    seed: int | None
    weights_path: str | None
    scheduler_port: int | None = None  # a fixed port for its scheduler (engines started elsewhere dial it)
    chunk_tokens: int | None = None  # most prompt tokens per step (chunked prefill); None = whole prompts
    spot: bool = False  # its nodes are spot (issue 30): a notice may take them; the live planner re-plans around it

    def __post_init__(self) -> None:
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"instance {self.name!r}: chunk_tokens must be >= 1, got {self.chunk_tokens}")
        try:
            object.__setattr__(self, "phase", served_phase(self.phase))
        except ValueError as e:
            raise ValueError(f"instance {self.name!r}: {e}") from None
        if not self.stages or self.stages[0].layer_start != 0:
            raise ValueError(f"instance {self.name!r}: the first stage must start at layer 0")
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            if a.layer_end != b.layer_start:
                raise ValueError(f"instance {self.name!r}: stages must be contiguous, [{a.layer_start}, {a.layer_end}) then [{b.layer_start}, {b.layer_end})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Everything ``coral serve`` starts."""

    host: str
    http_port: int
    api_key: str | None
    device: str
    dtype: str
    torch_threads: int
    models: tuple[ServedModel, ...]
    instances: tuple[InstanceSpec, ...]
    admin_key: str | None = None
    curve_keys_dir: str | None = None
    heartbeat_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    max_retries: int = 2
    router: str = "least-work"
    epoch_s: float = 0.0
    planner: str = "none"
    max_nodes: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    max_message_bytes: int = 256 * 1024 * 1024
    idle_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_deadline_s: float = 30.0
    metrics_require_key: bool = False
    kv_cache_gib: float = 0.0  # each engine node's KV budget; 0 = from its device's memory

    def model(self, name: str) -> ServedModel:
        """The model of that name (validated to exist)."""
        return next(m for m in self.models if m.name == name)


# ------------------------------------------------------------------------ edge


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WeightsFile(_Strict):
    """Where weights come from: exactly one of ``seed`` and ``path``."""

    seed: int | None = Field(None, description="Random weights drawn from this seed (identical on every node).")
    path: str | None = Field(None, description="A safetensors file, or a folder of them (HF tensor names).")


class ModelFile(_Strict):
    """A served model."""

    name: str = Field(description="The name clients put in the request's `model` field.")
    builtin: str | None = Field(None, description="A built-in config: tiny-llama, tiny-qwen3, tiny-qwen3-moe, small-llama.")
    hf_config: dict[str, Any] | None = Field(None, description="An HF-style config dict with model_type.")
    weights: WeightsFile = Field(default_factory=lambda: WeightsFile(seed=0, path=None), description="Weights of every instance of the model.")
    max_context: int | None = Field(None, ge=2, description="Longest prompt + completion; default max_position_embeddings.")
    tokenizer: str | None = Field(None, description="A local tokenizer.json (Hugging Face tokenizers) or its folder; default: byte tokenizer.")
    chat_template: str | None = Field(None, description="Jinja chat template; default the tokenizer_config.json beside the tokenizer, else <|role|> lines.")
    first_token: Literal["prefill", "decode"] = Field("prefill", description=(
        "Which instance emits a request's first token to the client: 'prefill' as soon as the prefill instance "
        "has sampled it (the KV transfer then counts in TPOT; the paper's runtime), 'decode' once the decode "
        "instance has the KV (the transfer counts in TTFT; vLLM's P/D proxy). `coral serve --plan` takes the "
        "plan file's."))


class StageFile(_Strict):
    """A pipeline stage of an instance."""

    layers: tuple[int, int] = Field(description="Half-open layer range [start, end).")
    nodes: int | list[float] = Field(1, description="Node count, or one relative throughput per node (WRR weights).")
    tp: int | list[int] = Field(1, description=(
        "GPUs per node: the node's layers run tensor-parallel over them (torch.distributed; gloo on CPU); one "
        "degree for every node of the stage, or one per node. A degree vLLM's rule refuses for the model "
        "(attention heads, KV heads, MLP width) is refused, naming the valid ones."))
    devices: list[str] | None = Field(None, description="First device of each node, e.g. [cuda:0, cuda:2]; default: assigned per host in order.")
    configs: list[str] | None = Field(None, description=(
        "Node configuration of each node, e.g. [4xL40S, 4xL40S] (`coral serve --plan` fills it in): the Ray "
        "provisioner places each node on a Ray node of that GPU type; a TP group of a node, e.g. 4xL40S/tp1, "
        "shares that machine with the other groups `hosts` puts there; default: unplaced."))
    hosts: list[int] | None = Field(None, description=(
        "Per node, the instance's machine it runs on (0, 1, ...; `coral serve --plan` fills it in from the "
        "plan's Template.hosts()): nodes of one machine get their own GPUs of it, in order; default: one each."))


class InstanceFile(_Strict):
    """A serving instance."""

    name: str = Field(description="Unique instance id.")
    model: str = Field(description="Name of one of the models.")
    phase: Literal["prefill", "decode", "mixed"] = Field("mixed", description="What the instance serves.")
    region: str = Field("local", description="Region; decode instances in the prefill's region are preferred.")
    throughput_tok_per_s: float = Field(1.0, gt=0, description="Router weight (the template's throughput).")
    stages: list[StageFile] = Field(min_length=1, description="Stages in order, covering every layer.")
    weights: WeightsFile | None = Field(None, description="Override the model's weights for this instance.")
    scheduler_port: int | None = Field(None, ge=1, le=65535, description=(
        "Fixed port of the instance's scheduler, for engines started elsewhere (`coral serve --provisioner "
        "remote`, the SkyPilot export's engine tasks); default any free one."))
    chunk_tokens: int | None = Field(None, ge=1, description=(
        "Chunked prefill (vLLM's --enable-chunked-prefill, Sarathi-Serve): each step of the instance carries its "
        "running decodes plus at most this many prompt tokens, so a long prompt is fed over several steps and the "
        "decodes are not held up by it (`coral serve --plan` sets a colocated instance's from its template); "
        "default: a prompt goes whole into one step."))
    spot: bool = Field(False, description=(
        "Its nodes are spot (`coral serve --plan` sets it from the plan): a preemption notice for one of them "
        "(`POST /admin/preempt`) marks its (region, configuration) spot pool as lost, and the live planner's "
        "replacement comes from on-demand or a spot pool not lost."))


class CoordinatorFile(_Strict):
    """The coordinator's HTTP front end."""

    host: str = Field("127.0.0.1", description="Interface for HTTP and ZeroMQ sockets.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free one).")
    api_key: str | None = Field(None, description="If set, clients must send Authorization: Bearer <key>.")
    admin_key: str | None = Field(None, description="Bearer key of the /admin endpoints (plan changes); default api_key.")
    curve_keys_dir: str | None = Field(None, description="Folder made by `coral keys`: CurveZMQ between all processes (recommended).")
    heartbeat_s: float = Field(0.25, gt=0, description="Heartbeat period between coordinator, schedulers and engines.")
    heartbeat_timeout_s: float = Field(2.0, gt=0, description="A process silent this long is dead (its instance leaves routing).")
    max_retries: int = Field(2, ge=0, description="Times a request hit by an instance failure is resent elsewhere.")
    router: Literal["least-work", "wrr"] = Field("least-work", description=(
        "Request routing (coral.policy.routing, shared with the simulator): 'least-work' sends a prompt to the "
        "instance whose outstanding prompt tokens clear soonest at its throughput and a decode to the least "
        "occupied; 'wrr' is the paper's weighted round-robin in proportion to throughput."))
    epoch_s: float = Field(0.0, ge=0, description="Re-planning period (measure demand, plan, reconcile); 0 = only on request.")
    planner: Literal["none", "allocator"] = Field("none", description=(
        "What re-plans each epoch: 'none' keeps the last pushed plan (replacing lost capacity); 'allocator' "
        "runs the allocation ILP on the observed demand: with `coral serve --plan`, over the plan's scenario "
        "(templates, prices, availability, SLO-sized capacity); alone, over the file's instance shapes."))
    max_nodes: int = Field(64, ge=1, description="With planner 'allocator' and no --plan: most engine processes per region.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest HTTP request body.")
    max_message_mib: float = Field(256.0, gt=0, description="Largest ZeroMQ message (the KV hand-off of a long prompt is the biggest).")
    idle_timeout_s: float = Field(5.0, gt=0, description="An HTTP connection without a request this long is closed (before its first request and between requests).")
    header_timeout_s: float = Field(10.0, gt=0, description="A request head must arrive whole within this (slow clients are cut off).")
    body_timeout_s: float = Field(30.0, gt=0, description="Each read of a request body must complete within this (else 408).")
    body_deadline_s: float = Field(30.0, gt=0, description=(
        "The whole request body must arrive within this of its head (else 408 and the connection closed): a "
        "client trickling a body byte by byte is cut off; `coral serve --body-deadline` overrides it."))
    metrics_require_key: bool = Field(False, description="Whether GET /metrics needs the api_key (open by default, as vLLM's).")


class ClusterFile(_Strict):
    """The whole cluster file."""

    coordinator: CoordinatorFile = Field(default_factory=lambda: CoordinatorFile(), description="Front end settings.")
    device: str = Field("auto", description="cpu, cuda, cuda:N, or auto (cuda if present).")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="Weights and activations dtype.")
    torch_threads: int = Field(1, ge=1, description="PyTorch threads per engine process.")
    kv_cache_gib: float = Field(0.0, ge=0, description="KV-cache budget of each engine node (GiB, split over its TP ranks); 0 = 0.9 x device memory - weights (CPU: sized for 64 sequences at full context).")
    models: list[ModelFile] = Field(min_length=1, description="Served models.")
    instances: list[InstanceFile] = Field(min_length=1, description="Serving instances.")


def _weights(w: WeightsFile, where: str) -> tuple[int | None, str | None]:
    if (w.seed is None) == (w.path is None):
        raise CoralError(f"{where}: weights need exactly one of seed and path")
    return w.seed, w.path


def _validate(cls: Any, data: Any, source: str) -> Any:
    """`cls.model_validate(data)`, its first problem as a CoralError naming the field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise CoralError(f"{source}: {loc}: {err['msg']}") from None


def parse_cluster(data: Any, source: str = "cluster file") -> ClusterSpec:
    """Validate a parsed cluster file and build the domain spec.

    Args:
        data: the YAML document (a dict).
        source: named in error messages.

    Returns:
        The cluster spec.

    Raises:
        CoralError: naming the first problem found.
    """
    f = _validate(ClusterFile, data, source)
    models = _models(f.models)
    instances = _instances(f.instances, models, source)
    if f.coordinator.heartbeat_timeout_s <= 2 * f.coordinator.heartbeat_s:
        raise CoralError(f"{source}: coordinator.heartbeat_timeout_s must exceed twice heartbeat_s")
    for m in models:
        if not any(i.model == m.name and i.phase != "decode" for i in instances):
            raise CoralError(f"{source}: model {m.name!r} has no prefill or mixed instance")
    c = f.coordinator
    return ClusterSpec(
        host=c.host, http_port=c.port, api_key=c.api_key, device=f.device,
        dtype=f.dtype, torch_threads=f.torch_threads, models=tuple(models), instances=tuple(instances),
        admin_key=c.admin_key, curve_keys_dir=c.curve_keys_dir, heartbeat_s=c.heartbeat_s,
        heartbeat_timeout_s=c.heartbeat_timeout_s, max_retries=c.max_retries, router=c.router, epoch_s=c.epoch_s,
        planner=c.planner, max_nodes=c.max_nodes, max_body_bytes=c.max_body_bytes, max_message_bytes=int(c.max_message_mib * 1024 * 1024),
        idle_timeout_s=c.idle_timeout_s, header_timeout_s=c.header_timeout_s, body_timeout_s=c.body_timeout_s,
        body_deadline_s=c.body_deadline_s, metrics_require_key=c.metrics_require_key,
        kv_cache_gib=f.kv_cache_gib,
    )  # fmt: skip


class PlanFile(_Strict):
    """Body of ``POST /admin/plan``: the whole desired set of instances."""

    instances: list[InstanceFile] = Field(description="Every instance the cluster should run (same shape as the cluster file's).")


def parse_instances(data: Any, cluster: ClusterSpec, source: str = "plan") -> tuple[InstanceSpec, ...]:
    """Validate a plan pushed at run time against the cluster's models.

    Args:
        data: ``{"instances": [...]}`` as in the cluster file.
        cluster: the running cluster (its models).
        source: named in error messages.

    Returns:
        The desired instances.

    Raises:
        CoralError: naming the first problem found.
    """
    f = _validate(PlanFile, data, source)
    return tuple(_instances(f.instances, list(cluster.models), source))


def _models(files: list[ModelFile]) -> list[ServedModel]:
    models: list[ServedModel] = []
    for m in files:
        seed, path = _weights(m.weights, f"model {m.name}")
        cfg = model_config_dict(m.builtin, m.hf_config, path)
        ctx = m.max_context or int(cfg.get("max_position_embeddings", 2048))
        if m.tokenizer is not None or m.chat_template is not None:
            load_tokenizer(m.tokenizer, m.chat_template, int(cfg.get("vocab_size", 0)), m.name)  # fail at load, not per request
        models.append(ServedModel(name=m.name, config=cfg, seed=seed, weights_path=path, max_context=ctx, tokenizer_path=m.tokenizer,
                                  chat_template=m.chat_template, spec=model_arch(cfg, m.name), first_token=m.first_token))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise CoralError("duplicate model names")
    return models


def _check_tp(model: ServedModel, tp: int, where: str) -> None:
    """vLLM's rule (`ModelSpec.check_tp`: heads, KV heads, MLP width), then what Coral's engine splits
    (dense MLPs; KV heads that divide by tp: it does not replicate them)."""
    cfg, spec = model.config, model.spec
    if spec is not None:
        try:
            spec.check_tp(tp)
        except CoralError as e:
            raise CoralError(f"{where}: tp {tp}: {e}") from None
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise CoralError(f"{where}: tp {tp} is not supported for mixture-of-experts models by Coral's engine; use tp 1")
    heads = int(cfg.get("num_attention_heads", 0))
    for key, val in (("num_attention_heads", heads), ("num_key_value_heads", int(cfg.get("num_key_value_heads") or heads)), ("intermediate_size", int(cfg.get("intermediate_size", 0)))):
        if val % tp:
            raise CoralError(f"{where}: tp {tp} must divide the model's {key} ({val}) for Coral's engine "
                             f"(it does not replicate KV heads); valid: "
                             f"{', '.join(str(t) for t in range(1, 9) if _engine_runs(cfg, t))}")


def _engine_runs(cfg: dict[str, Any], tp: int) -> bool:
    heads = int(cfg.get("num_attention_heads", 0))
    return all(v % tp == 0 for v in (heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("intermediate_size", 0))))


def _instances(files: list[InstanceFile], models: list[ServedModel], source: str) -> list[InstanceSpec]:
    names = [m.name for m in models]
    by_name = {m.name: m for m in models}
    instances: list[InstanceSpec] = []
    for i in files:
        if i.model not in by_name:
            raise CoralError(f"{source}: instance {i.name!r} serves unknown model {i.model!r}; models: {', '.join(names)}")
        seed, path = _weights(i.weights, f"instance {i.name}") if i.weights else (by_name[i.model].seed, by_name[i.model].weights_path)
        try:
            stages = tuple(
                StageSpec(
                    layer_start=s.layers[0], layer_end=s.layers[1], node_throughputs=(1.0,) * s.nodes if isinstance(s.nodes, int) else tuple(s.nodes),
                    tp=s.tp if isinstance(s.tp, int) else max(s.tp), node_tps=() if isinstance(s.tp, int) else tuple(s.tp),
                    devices=tuple(s.devices or ()), configs=tuple(s.configs or ()), hosts=tuple(s.hosts or ()),
                )
                for s in i.stages
            )
            spec = InstanceSpec(
                name=i.name, model=i.model, phase=served_phase(i.phase), region=i.region, throughput_tok_per_s=i.throughput_tok_per_s,
                stages=stages, seed=seed, weights_path=path, scheduler_port=i.scheduler_port, chunk_tokens=i.chunk_tokens,
                spot=i.spot,
            )  # fmt: skip
        except ValueError as e:
            raise CoralError(f"{source}: instance {i.name!r}: {e}") from None
        n = by_name[i.model].num_layers
        for k, st in enumerate(spec.stages):
            for tp in sorted(set(st.tps)):
                if tp > 1:
                    _check_tp(by_name[i.model], tp, f"{source}: instance {i.name!r} stage {k}")
        if spec.stages[-1].layer_end != n:
            raise CoralError(f"{source}: instance {i.name!r}: stages end at layer {spec.stages[-1].layer_end}, the model has {n} layers")
        instances.append(spec)
    if len({i.name for i in instances}) != len(instances):
        raise CoralError(f"{source}: duplicate instance names")
    ports = [i.scheduler_port for i in instances if i.scheduler_port is not None]
    if len(set(ports)) != len(ports):
        raise CoralError(f"{source}: two instances have the same scheduler_port; give each its own")
    return instances


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster YAML file.

    Raises:
        CoralError: if the file is missing, not YAML, or invalid.
    """
    p = Path(path)
    if not p.is_file():
        raise CoralError(f"cluster file {p} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise CoralError(f"{p}: not valid YAML: {e}") from None
    try:
        return parse_cluster(data, str(p))
    except CoralError as e:
        raise CoralError(wrong_kind(str(p), data, "cluster") or str(e)) from None
