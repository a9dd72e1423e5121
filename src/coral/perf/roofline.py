"""Analytical roofline backend of the performance model (DESIGN §2, default)."""
from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from coral.catalog.catalog import builtin_links
from coral.catalog.hardware import GpuType, LinkFit, NodeConfig
from coral.catalog.models import ModelSpec
from coral.perf.model import PerfModel, Phase, Shape, SystemParams


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Achieved fractions of peak (`η_F`, `η_B`) and a fixed per-layer cost (kernel launches)."""

    flops: float
    bandwidth: float
    decode_flops: float | None = None  # decode's skinny GEMMs reach less of peak; None: same as `flops`
    layer_overhead_s: float = 5e-5

    def __post_init__(self) -> None:
        for name in ("flops", "bandwidth", "decode_flops"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.layer_overhead_s < 0:
            raise ValueError("layer_overhead_s must be >= 0")


# Fitted by `coral calibrate` (coral.perf.calibrate): A100-40GB, V100, L4 and T4 to Helix's
# measured per-layer latencies of LLaMA-2-70B on one GPU (their multi-GPU nodes fit the PCIe
# link in interconnects.csv instead). See docs/reference/perf.md. DEFAULT_EFFICIENCY, the median of these
# four fits, models a GPU with no fit of its own.
FITTED_EFFICIENCY: dict[str, Efficiency] = {
    "A100-40GB": Efficiency(flops=0.843, decode_flops=0.406, bandwidth=0.800, layer_overhead_s=2.0e-4),
    "L4": Efficiency(flops=0.423, decode_flops=0.236, bandwidth=0.784, layer_overhead_s=2.0e-4),
    "T4": Efficiency(flops=0.426, decode_flops=0.276, bandwidth=0.650, layer_overhead_s=2.0e-4),
    "V100-16GB": Efficiency(flops=0.764, decode_flops=0.490, bandwidth=0.553, layer_overhead_s=0.0),
}


def median_efficiency(effs: list[Efficiency]) -> Efficiency:
    """The component-wise median: how a GPU without measurements is modelled."""
    return Efficiency(flops=statistics.median(e.flops for e in effs),
                      decode_flops=statistics.median(e.decode_flops or e.flops for e in effs),
                      bandwidth=statistics.median(e.bandwidth for e in effs),
                      layer_overhead_s=statistics.median(e.layer_overhead_s for e in effs))


DEFAULT_EFFICIENCY = median_efficiency(list(FITTED_EFFICIENCY.values()))
# Fitted by coral.perf.kernels (`coral calibrate`, `python tools/fit_kernels.py --check`) to dense layers
# (Qwen3-32B, Llama-3-70B, Llama-3.2-3B shapes) rebuilt from the vLLM kernel timings aiconfigurator-core
# 0.12.0 measured on each GPU (GEMMs + attention; profiles/aiconfigurator_kernels/ of the public data).
# These are GPU-side kernel times: no CPU launch gaps (vLLM's CUDA graphs hide them in decode).
KERNEL_EFFICIENCY: dict[str, Efficiency] = {
    "L40S": Efficiency(flops=0.621, decode_flops=0.529, bandwidth=0.771, layer_overhead_s=0.0),
    "A100-80GB": Efficiency(flops=0.857, decode_flops=0.684, bandwidth=0.775, layer_overhead_s=63.9e-6),
    "H100": Efficiency(flops=0.762, decode_flops=0.581, bandwidth=0.839, layer_overhead_s=26.9e-6),
    "H200": Efficiency(flops=0.753, decode_flops=0.580, bandwidth=0.808, layer_overhead_s=27.5e-6),
    "B200": Efficiency(flops=0.671, decode_flops=0.566, bandwidth=0.811, layer_overhead_s=25.3e-6),
}
# A10G has no measurements: it borrows the L40S fit (the same class of part: a GDDR6 graphics die on
# PCIe, Ampere GA102 to Ada AD102, running the same FlashAttention-2 kernels). docs/reference/perf.md says why.
KERNEL_BORROWED = {"A10G": "L40S"}
FITTED_EFFICIENCY.update(KERNEL_EFFICIENCY)
FITTED_EFFICIENCY.update({gpu: KERNEL_EFFICIENCY[src] for gpu, src in KERNEL_BORROWED.items()})


class RooflinePerf(PerfModel):
    """`t = max(FLOPs / (n·F·η_F), bytes / (BW·η_B)) + t_elem + t_TP + t_launch` per layer.

    Tensor parallelism over a node's `n` GPUs shards the weights, the KV cache and the math;
    each GPU still reads and writes the full activations around its GEMMs and runs the norms
    and residual adds on every token (Megatron-style TP replicates them), and two all-reduces
    per layer move the activations over the node's measured interconnect (`LinkFit`).
    """

    version = "roofline-2"

    def __init__(self, efficiency: Mapping[str, Efficiency] | None = None, default: Efficiency | None = None,
                 system: SystemParams | None = None, links: Mapping[tuple[str, int], LinkFit] | None = None) -> None:
        super().__init__(system)
        self.efficiency = dict(FITTED_EFFICIENCY if efficiency is None else efficiency)
        self.default = default or DEFAULT_EFFICIENCY
        self.links = dict(builtin_links() if links is None else links)
        # The links time every TP node, so they are part of the version caches are keyed by.
        digest = hashlib.sha256(repr(sorted((k, asdict(v)) for k, v in self.links.items())).encode()).hexdigest()[:8]
        self.version = f"{RooflinePerf.version}+links-{digest}"

    def eff(self, config: NodeConfig) -> Efficiency:
        return self.efficiency.get(config.gpu.name, self.default)

    def _eta_f(self, config: NodeConfig) -> float:
        return self.eff(config).flops

    def _eta_b(self, config: NodeConfig) -> float:
        return self.eff(config).bandwidth

    def link(self, config: NodeConfig) -> LinkFit | None:
        """The all-reduce fit of the node's interconnect at its GPU count; the nearest fitted count
        (ties: the larger) when that count has none; None when the interconnect has no fit at all."""
        fits = [f for (ic, _), f in self.links.items() if ic == config.gpu.interconnect]
        if not fits:
            return None
        return min(fits, key=lambda f: (abs(f.gpus - config.count), -f.gpus))

    def layer_flops_bytes(self, model: ModelSpec, shape: Shape) -> tuple[float, float]:
        """FLOPs and HBM bytes of one layer for one micro-batch (all GPUs of the node together)."""
        hd = model.num_heads * model.head_dim
        kv_l = model.kv_bytes_per_token_layer
        if shape.phase is Phase.PREFILL:
            n_tok = shape.tokens
            flops = 2.0 * n_tok * model.layer_active_params + 2.0 * shape.batch * hd * model.effective_context_sq(shape.prompt_tokens)
            nbytes = model.layer_touched_bytes(n_tok) + n_tok * kv_l
        else:
            ctx = model.effective_context(shape.mean_context)
            flops = 2.0 * shape.batch * model.layer_active_params + 4.0 * shape.batch * hd * ctx
            nbytes = model.layer_touched_bytes(shape.batch) + shape.batch * ctx * kv_l
        return flops, nbytes

    def bound(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> str:
        """Whether one layer on `config` is limited by math or by HBM traffic: `"compute"` when its
        FLOPs at the fitted FLOP rate take longer than its bytes at the fitted bandwidth, else
        `"memory"` (the node's single-GPU datasheet rates times its efficiencies)."""
        flops, nbytes = self.layer_flops_bytes(model, shape)
        eff = self.eff(config)
        compute_s = flops / (config.gpu.bf16_tflops * 1e12 * eff.flops)
        return "compute" if compute_s > nbytes / (config.gpu.hbm_gb_per_s * 1e9 * eff.bandwidth) else "memory"

    def replicated_bytes(self, model: ModelSpec, shape: Shape) -> tuple[float, float]:
        """HBM bytes every GPU of a TP node moves whatever `n` is: (GEMM activations, elementwise ops).

        Prefill GEMMs read and write the full `tokens × h` activations on each GPU (QKV and up
        read the full input, o_proj and down write full partial sums): 4 passes, hidden under
        the math when compute-bound. The two RMS norms (read + write) and the fused residual add
        (two reads, one write) are separate memory-bound kernels on all tokens: 7 passes.
        """
        pass_bytes = shape.tokens * model.hidden_size * self.system.activation_bytes
        gemm = 4.0 * pass_bytes if shape.phase is Phase.PREFILL else 0.0
        return gemm, 7.0 * pass_bytes

    def tp_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        """Two all-reduces per layer of the micro-batch's activations over the node's GPUs, timed
        by the interconnect's measured fit (a nominal-bandwidth ring where there is none)."""
        n = config.count
        if n == 1:
            return 0.0
        nbytes = shape.tokens * model.hidden_size * self.system.activation_bytes
        fit = self.link(config)
        if fit is None:
            return 2.0 * (2.0 * (n - 1) / n * nbytes / (config.gpu.intra_node_gb_per_s * 1e9))
        return 2.0 * fit.allreduce_s(nbytes)

    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        flops, nbytes = self.layer_flops_bytes(model, shape)
        gemm_act, elementwise = self.replicated_bytes(model, shape)
        e = self.eff(config)
        n = config.count
        bw = config.gpu.hbm_gb_per_s * 1e9 * e.bandwidth
        eta_f = e.decode_flops if shape.phase is Phase.DECODE and e.decode_flops else e.flops
        t_compute = flops / (n * config.gpu.bf16_tflops * 1e12 * eta_f)
        t_memory = (nbytes / n + gemm_act) / bw
        return max(t_compute, t_memory) + elementwise / bw + self.tp_time_s(config, model, shape) + e.layer_overhead_s

    def mixed_flops_bytes(self, model: ModelSpec, *, decode_batch: int, decode_context: float, chunk_tokens: int,
                          chunk_context: float) -> tuple[float, float, float]:
        """Chunk FLOPs, decode FLOPs and HBM bytes of one layer of a mixed step (all GPUs together).

        The GEMMs run once over all `b + c` tokens, so the weights are read once per step (the
        whole gain of mixing): FLOPs `2·A_l·(b + c)` plus attention, `4·h_q·ctx` per token (a
        chunk token at mean context `chunk_context`, a decode at `decode_context`, each capped by
        the window on sliding layers). Bytes: the weights the `b + c` tokens touch, the chunk's new
        KV, the KV the chunk's prompt already holds before it (`chunk_context − c/2`, read once per
        chunk) and the decodes' KV. At `c = 0` this is the decode layer, and at `b = 0` with
        `chunk_context = c/2` (a whole prompt in one chunk) the prefill layer, without a window.
        """
        hd = model.num_heads * model.head_dim
        kv_l = model.kv_bytes_per_token_layer
        b, c = float(decode_batch), float(chunk_tokens)
        d_ctx = model.effective_context(decode_context)
        c_ctx = model.effective_context(chunk_context)
        prior = model.effective_context(max(0.0, chunk_context - c / 2))
        chunk_flops = 2.0 * c * model.layer_active_params + 4.0 * c * hd * c_ctx
        decode_flops = 2.0 * b * model.layer_active_params + 4.0 * b * hd * d_ctx
        nbytes = model.layer_touched_bytes(b + c) + (c + (prior if c > 0 else 0.0)) * kv_l + b * d_ctx * kv_l
        return chunk_flops, decode_flops, nbytes

    def mixed_layer_time_s(self, config: NodeConfig, model: ModelSpec, *, decode_batch: int, decode_context: float,
                           chunk_tokens: int, chunk_context: float) -> float:
        """One layer of a mixed step on the roofline (`mixed_flops_bytes`): the chunk's math at the
        prefill FLOP efficiency and the decodes' at the decode one, against one pass over the
        weights and KV; the chunk's GEMM activations and the elementwise passes over all tokens;
        the TP all-reduces carry all `b + c` tokens; one launch overhead."""
        chunk_flops, decode_flops, nbytes = self.mixed_flops_bytes(
            model, decode_batch=decode_batch, decode_context=decode_context, chunk_tokens=chunk_tokens,
            chunk_context=chunk_context)
        e = self.eff(config)
        n = config.count
        bw = config.gpu.hbm_gb_per_s * 1e9 * e.bandwidth
        peak = n * config.gpu.bf16_tflops * 1e12
        t_compute = chunk_flops / (peak * e.flops) + decode_flops / (peak * (e.decode_flops or e.flops))
        pass_bytes = model.hidden_size * self.system.activation_bytes
        t_memory = (nbytes / n + 4.0 * chunk_tokens * pass_bytes) / bw
        elementwise = 7.0 * (decode_batch + chunk_tokens) * pass_bytes
        tokens = decode_batch + chunk_tokens
        tp = self.tp_time_s(config, model, Shape(phase=Phase.DECODE, batch=max(tokens, 1), prompt_tokens=1.0,
                                                 output_tokens=0.0))
        return max(t_compute, t_memory) + elementwise / bw + tp + e.layer_overhead_s


def single_gpu_roofline(model: ModelSpec, gpu: GpuType, phase: Phase, *, batch: int = 1,
                        context: float = 1024.0, compute_share: float = 0.6) -> float:
    """A first-principles tok/s per GPU to hold a template against (the check the bench prints).

    Prefill: 2 FLOPs per active parameter per prompt token at `compute_share` of the GPU's dense
    BF16 peak. Decode: the fewest GPUs whose memory (90 %) holds the weights stream the weights
    and `batch` sequences of `context` tokens of KV once per step from HBM at its datasheet
    bandwidth, making `batch` tokens: per GPU, `batch / (step · GPUs)`.
    """
    if phase is Phase.PREFILL:
        return compute_share * gpu.bf16_tflops * 1e12 / (2.0 * model.active_params)
    gpus = max(1, math.ceil(model.weights_bytes / (0.9 * gpu.memory_bytes)))
    step = (model.weights_bytes + batch * context * model.kv_bytes_per_token) / (gpus * gpu.hbm_gb_per_s * 1e9)
    return batch / (step * gpus)
