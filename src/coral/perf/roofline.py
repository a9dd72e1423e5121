"""Analytical roofline backend of the performance model (DESIGN §2, default)."""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from coral.catalog.hardware import NodeConfig
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
# measured per-layer latencies of LLaMA-2-70B (and their multi-GPU nodes); A100-80GB and H100 to
# Vidur's per-operator GEMM timings (a layer's four projections, 1-8-way TP; Vidur has no
# attention or launch figures, so their decode efficiency equals the GEMM fit and their overhead
# is the Helix median). See docs/perf.md. Other GPUs use DEFAULT_EFFICIENCY, the median of the
# Helix fits.
FITTED_EFFICIENCY: dict[str, Efficiency] = {
    "A100-40GB": Efficiency(flops=0.832, decode_flops=0.403, bandwidth=0.798, layer_overhead_s=2.0e-4),
    "L4": Efficiency(flops=0.351, decode_flops=0.400, bandwidth=0.623, layer_overhead_s=0.0),
    "T4": Efficiency(flops=0.341, decode_flops=0.223, bandwidth=0.594, layer_overhead_s=2.0e-4),
    "V100-16GB": Efficiency(flops=0.755, decode_flops=0.486, bandwidth=0.552, layer_overhead_s=0.0),
}


def median_efficiency(effs: list[Efficiency]) -> Efficiency:
    """The component-wise median: how a GPU without measurements is modelled."""
    return Efficiency(flops=statistics.median(e.flops for e in effs),
                      decode_flops=statistics.median(e.decode_flops or e.flops for e in effs),
                      bandwidth=statistics.median(e.bandwidth for e in effs),
                      layer_overhead_s=statistics.median(e.layer_overhead_s for e in effs))


DEFAULT_EFFICIENCY = median_efficiency(list(FITTED_EFFICIENCY.values()))
FITTED_EFFICIENCY.update({
    "A100-80GB": Efficiency(flops=0.690, decode_flops=0.690, bandwidth=0.552, layer_overhead_s=1.0e-4),
    "H100": Efficiency(flops=0.609, decode_flops=0.609, bandwidth=0.537, layer_overhead_s=1.0e-4),
})


class RooflinePerf(PerfModel):
    """`t = max(FLOPs / (n·F·η_F), bytes / (n·BW·η_B)) + t_TP + t_launch` per layer."""

    version = "roofline-1"

    def __init__(self, efficiency: Mapping[str, Efficiency] | None = None, default: Efficiency | None = None,
                 system: SystemParams | None = None) -> None:
        super().__init__(system)
        self.efficiency = dict(FITTED_EFFICIENCY if efficiency is None else efficiency)
        self.default = default or DEFAULT_EFFICIENCY

    def eff(self, config: NodeConfig) -> Efficiency:
        return self.efficiency.get(config.gpu.name, self.default)

    def _eta_f(self, config: NodeConfig) -> float:
        return self.eff(config).flops

    def _eta_b(self, config: NodeConfig) -> float:
        return self.eff(config).bandwidth

    def layer_flops_bytes(self, model: ModelSpec, shape: Shape) -> tuple[float, float]:
        """FLOPs and HBM bytes of one layer for one micro-batch (all GPUs of the node together)."""
        hd = model.num_heads * model.head_dim
        kv_l = model.kv_bytes_per_token_layer
        if shape.phase is Phase.PREFILL:
            n_tok = shape.tokens
            flops = 2.0 * n_tok * model.layer_active_params + 2.0 * shape.batch * hd * model.effective_context_sq(shape.prompt_tokens)
            act = 4.0 * n_tok * model.hidden_size * self.system.activation_bytes
            nbytes = model.layer_touched_bytes(n_tok) + n_tok * kv_l + act
        else:
            ctx = model.effective_context(shape.mean_context)
            flops = 2.0 * shape.batch * model.layer_active_params + 4.0 * shape.batch * hd * ctx
            nbytes = model.layer_touched_bytes(shape.batch) + shape.batch * ctx * kv_l
        return flops, nbytes

    def tp_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        """Two all-reduces per layer over the node's GPUs (ring: `2(n-1)/n` of the data each)."""
        n = config.count
        if n == 1:
            return 0.0
        nbytes = shape.tokens * model.hidden_size * self.system.activation_bytes
        per = 2.0 * (n - 1) / n * nbytes / (config.gpu.intra_node_gb_per_s * 1e9) + self.system.allreduce_latency_s
        return 2.0 * per

    def layer_time_s(self, config: NodeConfig, model: ModelSpec, shape: Shape) -> float:
        flops, nbytes = self.layer_flops_bytes(model, shape)
        e = self.eff(config)
        n = config.count
        eta_f = e.decode_flops if shape.phase is Phase.DECODE and e.decode_flops else e.flops
        t_compute = flops / (n * config.gpu.bf16_tflops * 1e12 * eta_f)
        t_memory = nbytes / (n * config.gpu.hbm_gb_per_s * 1e9 * e.bandwidth)
        return max(t_compute, t_memory) + self.tp_time_s(config, model, shape) + e.layer_overhead_s
