"""The performance model interface (`t_c^φ(b)`) and what every backend shares: memory caps,
first/last-stage extras, inter-stage and KV-transfer times (DESIGN §2)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec

# One device-to-device copy between two engines of a node (CUDA IPC / NCCL send): launch and sync.
INTRA_HOP_S = 2e-5


class Phase(StrEnum):
    """What an instance serves: one phase of disaggregated serving, or both (COLOCATED: one
    replica runs prefill chunks inside its decode steps, DESIGN §4a). `Shape` and `layer_time_s`
    take PREFILL or DECODE only; a colocated step is timed by `PerfModel.mixed_node_time_s`."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


#: The two phases a model's demand is stated in (tok/s of prompt and of output): iterate over
#: these, not over `Phase`, where "both phases" is meant. A colocated instance serves both.
DEMAND_PHASES: tuple[Phase, Phase] = (Phase.PREFILL, Phase.DECODE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """What a micro-batch looks like: `batch` requests of mean prompt and output lengths."""

    phase: Phase
    batch: int
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if self.phase not in DEMAND_PHASES:
            raise ValueError(f"Shape.phase must be prefill or decode, got {self.phase.value} "
                             "(a colocated step is timed by PerfModel.mixed_node_time_s)")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if not self.prompt_tokens >= 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if not self.output_tokens >= 0:
            raise ValueError(f"output_tokens must be >= 0, got {self.output_tokens}")

    @property
    def tokens(self) -> float:
        """Tokens a micro-batch pushes through a layer: whole prompts in prefill, one per sequence in decode."""
        return self.batch * self.prompt_tokens if self.phase is Phase.PREFILL else float(self.batch)

    @property
    def work_tokens(self) -> float:
        """`u(b)`: the tokens one micro-batch counts towards throughput (prompt tokens or generated tokens)."""
        return self.tokens

    @property
    def mean_context(self) -> float:
        """Mean attended context of a decode step, `P + D/2`."""
        return self.prompt_tokens + self.output_tokens / 2


def chunk_shape(chunk_tokens: int, chunk_context: float) -> Shape:
    """The prefill shape whose causal attention matches a chunk of `chunk_tokens` tokens at mean
    attended context `chunk_context`: one prompt of the chunk's length when the chunk starts a
    prompt (`chunk_context = chunk/2`); a later chunk attends further, which only the roofline's
    mixed step counts exactly."""
    return Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=max(float(chunk_tokens), 1.0), output_tokens=0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemParams:
    """Constants of the model that are not per GPU; documented defaults, overridable."""

    memory_utilization: float = 0.9  # `u`: share of GPU memory usable for weights + KV
    network_latency_s: float = 2e-4  # one inter-stage hop inside a region (TCP/RDMA setup, framing)
    sampling_s: float = 5e-5  # sampling on the last stage, per micro-batch
    activation_bytes: float = 2.0  # bf16 activations between stages

    def __post_init__(self) -> None:
        if not 0 < self.memory_utilization <= 1:
            raise ValueError("memory_utilization must be in (0, 1]")


class PerfModel:
    """Base of every backend: `layer_time_s` is the backend's; the rest is shared.

    Every time is for one node of configuration `config` running layers of `model` on one
    micro-batch of `shape`.
    """

    version = "base"

    def __init__(self, system: SystemParams | None = None) -> None:
        self.system = system or SystemParams()

    # -- the backend's part ----------------------------------------------------------------
    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------
    def stage_extra_s(self, config: NodeConfig, model: ModelSpec, shape: Shape, *, first: bool, last: bool) -> float:
        """Embedding on the first stage; LM head (one logit row per sequence) and sampling on the last."""
        return self.extra_s(config, model, tokens=shape.tokens, rows=shape.batch, first=first, last=last)

    def extra_s(self, config: NodeConfig, model: ModelSpec, *, tokens: float, rows: float, first: bool,
                last: bool) -> float:
        """`stage_extra_s` for a step of `tokens` tokens that samples `rows` logit rows."""
        t = 0.0
        n = config.count
        if first:
            t += tokens * model.hidden_size * model.weight_bytes / (n * config.gpu.hbm_gb_per_s * 1e9 * self._eta_b(config))
        if last:
            flops = 2.0 * rows * model.hidden_size * model.vocab_size
            t_c = flops / (n * config.gpu.bf16_tflops * 1e12 * self._eta_f(config))
            t_m = model.lm_head_bytes / (n * config.gpu.hbm_gb_per_s * 1e9 * self._eta_b(config))
            t += max(t_c, t_m) + self.system.sampling_s
        return t

    def mixed_layer_time_s(self, config: NodeConfig, model: ModelSpec, *, decode_batch: int, decode_context: float,
                           chunk_tokens: int, chunk_context: float) -> float:
        """One layer of a mixed (chunked-prefill) step: `decode_batch` running sequences at mean
        context `decode_context` plus `chunk_tokens` prompt tokens attending to a mean context
        `chunk_context`. A backend that only times pure phases (a profile table) has no measure
        of the overlap, so it charges the two parts as separate passes (weights read twice: an
        upper bound); the roofline reads the weights once (`RooflinePerf`)."""
        t = 0.0
        if chunk_tokens > 0:
            t += self.layer_time_s(config, model, chunk_shape(chunk_tokens, chunk_context))
        if decode_batch > 0:
            t += self.layer_time_s(config, model, Shape(phase=Phase.DECODE, batch=decode_batch,
                                                        prompt_tokens=max(decode_context, 1.0), output_tokens=0.0))
        return t

    def mixed_node_time_s(self, config: NodeConfig, model: ModelSpec, *, layers: int, decode_batch: int,
                          decode_context: float, chunk_tokens: int, chunk_context: float, first: bool,
                          last: bool) -> float:
        """One colocated step through `layers` layers on one node (seconds): the running decodes
        plus up to `chunk_tokens` prompt tokens, as vLLM / Sarathi-Serve schedule chunked prefill.

        The first stage embeds all `decode_batch + chunk_tokens` tokens; the last stage computes
        a logit row per decode and one for the prefill the chunk may finish (an upper bound).

        Raises:
            ValueError: a negative batch or chunk, or an empty step.
        """
        if decode_batch < 0 or chunk_tokens < 0 or decode_batch + chunk_tokens < 1:
            raise ValueError(f"a mixed step needs decode_batch, chunk_tokens >= 0 and one token at least, "
                             f"got {decode_batch} and {chunk_tokens}")
        per_layer = self.mixed_layer_time_s(config, model, decode_batch=decode_batch, decode_context=decode_context,
                                            chunk_tokens=chunk_tokens, chunk_context=chunk_context)
        rows = decode_batch + (1 if chunk_tokens > 0 else 0)
        return layers * per_layer + self.extra_s(config, model, tokens=decode_batch + chunk_tokens, rows=rows,
                                                 first=first, last=last)

    def _eta_f(self, config: NodeConfig) -> float:
        return 0.6

    def _eta_b(self, config: NodeConfig) -> float:
        return 0.7

    def transfer_s(self, model: ModelSpec, shape: Shape, src: NodeConfig, dst: NodeConfig) -> float:
        """Activations of one micro-batch from one stage to the next, over the slower NIC."""
        nbytes = shape.tokens * model.hidden_size * self.system.activation_bytes
        bw = min(src.network_bytes_per_s, dst.network_bytes_per_s)
        return nbytes / bw + self.system.network_latency_s

    def intra_transfer_s(self, model: ModelSpec, shape: Shape, config: NodeConfig) -> float:
        """Activations of one micro-batch between two stages on the same node: over its GPU link
        (half the datasheet's bidirectional figure, one way), with a copy's launch latency."""
        nbytes = shape.tokens * model.hidden_size * self.system.activation_bytes
        return nbytes / (config.gpu.intra_node_gb_per_s * 1e9 / 2) + INTRA_HOP_S

    def kv_transfer_s(self, model: ModelSpec, prompt_tokens: float, src: NodeConfig, dst: NodeConfig) -> float:
        """One request's KV cache (`P·L·kv_l` bytes) from a prefill node to a decode node."""
        nbytes = prompt_tokens * model.num_layers * model.kv_bytes_per_token_layer
        bw = min(src.network_bytes_per_s, dst.network_bytes_per_s)
        return nbytes / bw + self.system.network_latency_s

    def kv_bytes_per_layer(self, model: ModelSpec, shape: Shape, stages: int) -> float:
        """KV bytes one layer of a node holds: 2 micro-batches of prompts in prefill; in decode,
        `S` micro-batches of `b` sequences at full context `P + D` (sliding layers keep the window)."""
        if shape.phase is Phase.PREFILL:
            seqs, ctx = 2 * shape.batch, shape.prompt_tokens
        else:
            seqs, ctx = stages * shape.batch, shape.prompt_tokens + shape.output_tokens
        return seqs * model.effective_context(ctx) * model.kv_bytes_per_token_layer

    def max_layers(self, config: NodeConfig, model: ModelSpec, shape: Shape, *, stages: int,
                   first: bool = False, last: bool = False) -> int:
        """The most layers that fit on one node (0 if not even one does)."""
        cap = config.memory_bytes * self.system.memory_utilization
        if first:
            cap -= model.embedding_bytes
        if last:
            cap -= model.lm_head_bytes
        per_layer = model.layer_weight_bytes + self.kv_bytes_per_layer(model, shape, stages)
        if cap <= 0:
            return 0
        return max(0, min(model.num_layers, math.floor(cap / per_layer)))

    def node_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape, layers: int, *,
                    first: bool, last: bool) -> float:
        """`τ_k(j) = j·t_c(b) + o_k`: one micro-batch through `layers` layers on one node."""
        return layers * self.layer_time_s(config, model, shape) + self.stage_extra_s(
            config, model, shape, first=first, last=last)
