"""Fit the roofline's per-GPU efficiencies to layers rebuilt from measured kernels (aiconfigurator).

aiconfigurator-core (NVIDIA, Apache-2.0) ships vLLM kernel timings per GPU: bf16 GEMMs on an
(m, n, k) grid, prefill ("context") and decode ("generation") attention per batch, length and head
layout, and fused MoE. `tools/aiconfigurator_kernels.py` extracts the rows this module reads into
`profiles/aiconfigurator_kernels/` of the public data; only measurements are taken.

A dense layer on one GPU is rebuilt as the sum of its measured kernels: the QKV, output, gate-up
and down GEMMs at `m` = the micro-batch's tokens, plus the attention kernel at its batch and length.
A GEMM whose `n` or `k` is off the grid is interpolated bilinearly in (n, k) between the grid
neighbours at the same `m` (time is bilinear in n and k for both FLOPs and bytes). The norms,
rotary embedding, activation and residual adds are not in the tables: the roofline's elementwise
term stays modelled, and the fit is against the rest of `RooflinePerf.layer_time_s`.
"""
from __future__ import annotations

import csv
import gzip
import math
import statistics
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec, builtin_model
from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.perf.roofline import Efficiency, RooflinePerf

KERNELS_DIR = "aiconfigurator_kernels"
# aiconfigurator's system folders -> Coral GPU types (its a100_sxm is the 80 GB part: mem_capacity 80 GiB).
AIC_GPUS = {"l40s": "L40S", "a100_sxm": "A100-80GB", "h100_sxm": "H100", "h200_sxm": "H200", "b200_sxm": "B200"}


def _dense(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> ModelSpec:
    return ModelSpec(name=name, architecture="LlamaForCausalLM", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=128, intermediate_size=intermediate, vocab_size=vocab,
                     max_context=32768)


# The dense layers the efficiencies are fitted on: Coral's two large dense models (their MLP GEMMs
# are off the grid, so interpolated) and Llama-3.2-3B, whose four GEMMs all lie on the grid and whose
# small kernels make the per-layer overhead visible. Shapes from each model's Hugging Face config.json.
FIT_MODELS: tuple[ModelSpec, ...] = (
    builtin_model("qwen3-32b"),
    builtin_model("llama-3-70b"),
    _dense("llama-3.2-3b", layers=28, hidden=3072, heads=24, kv_heads=8, intermediate=8192, vocab=128256),
)
# Held out (never seen by the fit): two mid-size models (interpolated MLPs) and one small one on the grid.
HELDOUT_MODELS: tuple[ModelSpec, ...] = (
    _dense("llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    _dense("qwen3-14b", layers=40, hidden=5120, heads=40, kv_heads=8, intermediate=17408, vocab=151936),
    _dense("qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8, intermediate=6144, vocab=151936),
)
MOE_MODELS = ("gpt-oss-20b", "gpt-oss-120b")

# The grid of layer points: prefill b prompts of P tokens (256 <= b·P <= 16,384: one GEMM `m`);
# decode b sequences attending `c` tokens (the tables' KV lengths are c - 1), b·c <= 2**19.
PREFILL_PROMPTS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_BATCHES = (1, 2, 4, 8, 16)
PREFILL_TOKENS = (256, 16384)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
DECODE_MAX_KV_TOKENS = 2**19
GEMM_M = tuple(2**i for i in range(15))  # 1 .. 16,384: every m a layer point uses


def layer_gemms(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(n, k) of one unsharded layer's GEMMs as vLLM runs them: fused QKV, output, fused gate-up
    and down for a dense model; QKV, output and the router for a MoE one (experts: the MoE kernel)."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attn = ((q + 2 * kv, h), (h, q))
    if model.is_moe:
        return (*attn, (model.num_experts, h))
    return (*attn, (2 * model.intermediate_size, h), (h, model.intermediate_size))


def attention_layouts(model: ModelSpec) -> tuple[tuple[int, int, int, int], ...]:
    """(heads, KV heads, head dim, window) of the model's attention layers (window 0: full)."""
    full = (model.num_heads, model.num_kv_heads, model.head_dim, 0)
    if model.sliding_layers and model.sliding_window:
        return (full, (model.num_heads, model.num_kv_heads, model.head_dim, model.sliding_window))
    return (full,)


def grid_neighbours(value: int, grid: Iterable[int]) -> tuple[tuple[int, float], ...]:
    """The grid points around `value` with their linear weights: one point with weight 1 when it
    is on the grid, else the two neighbours.

    Raises:
        CoralError: when `value` lies outside the grid.
    """
    g = sorted(set(grid))
    i = bisect_left(g, value)
    if i < len(g) and g[i] == value:
        return ((value, 1.0),)
    if i == 0 or i == len(g):
        raise CoralError(f"GEMM dimension {value} is outside the measured grid {g[0]}..{g[-1]}")
    lo, hi = g[i - 1], g[i]
    w = (value - lo) / (hi - lo)
    return ((lo, 1.0 - w), (hi, w))


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelTables:
    """One GPU's measured kernels, ms per call.

    gemm: (m, n, k); context: (batch, prompt tokens, heads, KV heads, head dim, window);
    generation: (batch, KV length, heads, KV heads, head dim, window); moe: (tokens, hidden,
    expert width, top-k, experts).
    """

    gpu: str
    gemm: Mapping[tuple[int, int, int], float]
    context: Mapping[tuple[int, int, int, int, int, int], float]
    generation: Mapping[tuple[int, int, int, int, int, int], float]
    moe: Mapping[tuple[int, int, int, int, int], float]

    def gemm_ms(self, m: int, n: int, k: int) -> float:
        """The measured GEMM, or its bilinear interpolation in (n, k) at the same `m`.

        Raises:
            CoralError: when `m` is not measured or (n, k) lies outside the grid.
        """
        exact = self.gemm.get((m, n, k))
        if exact is not None:
            return exact
        at_m = [(nn, kk) for (mm, nn, kk) in self.gemm if mm == m]
        if not at_m:
            raise CoralError(f"{self.gpu}: no GEMM measured at m={m}")
        total = 0.0
        for nn, wn in grid_neighbours(n, (p[0] for p in at_m)):
            for kk, wk in grid_neighbours(k, (p[1] for p in at_m)):
                if (m, nn, kk) not in self.gemm:
                    raise CoralError(f"{self.gpu}: GEMM ({m}, {nn}, {kk}) is not in the table")
                total += wn * wk * self.gemm[(m, nn, kk)]
        return total


def _read_csv(path: Path) -> list[dict[str, str]]:
    with gzip.open(path, "rt", newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def load_kernel_tables(folder: str | Path) -> dict[str, KernelTables]:
    """Read `gemm.csv.gz`, `attention.csv.gz` and `moe.csv.gz` of `folder` into one `KernelTables`
    per Coral GPU type (`AIC_GPUS`; other systems are skipped).

    Raises:
        CoralError: when a file is missing or holds no row of a known GPU.
    """
    root = Path(folder)
    for name in ("gemm", "attention", "moe"):
        if not (root / f"{name}.csv.gz").is_file():
            raise CoralError(f"kernel profile {root / f'{name}.csv.gz'} does not exist; pass the public data folder "
                             f"holding profiles/{KERNELS_DIR}/ (tools/aiconfigurator_kernels.py writes it)")
    gemm: dict[str, dict[tuple[int, int, int], float]] = {}
    ctx: dict[str, dict[tuple[int, int, int, int, int, int], float]] = {}
    gen: dict[str, dict[tuple[int, int, int, int, int, int], float]] = {}
    moe: dict[str, dict[tuple[int, int, int, int, int], float]] = {}
    for r in _read_csv(root / "gemm.csv.gz"):
        if r["gpu"] in AIC_GPUS:
            gemm.setdefault(AIC_GPUS[r["gpu"]], {})[(int(r["m"]), int(r["n"]), int(r["k"]))] = float(r["ms"])
    for r in _read_csv(root / "attention.csv.gz"):
        if r["gpu"] in AIC_GPUS:
            table = ctx if r["phase"] == "context" else gen
            key = (int(r["batch"]), int(r["tokens"]), int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]), int(r["window"]))
            table.setdefault(AIC_GPUS[r["gpu"]], {})[key] = float(r["ms"])
    for r in _read_csv(root / "moe.csv.gz"):
        if r["gpu"] in AIC_GPUS:
            key5 = (int(r["tokens"]), int(r["hidden"]), int(r["inter"]), int(r["topk"]), int(r["experts"]))
            moe.setdefault(AIC_GPUS[r["gpu"]], {})[key5] = float(r["ms"])
    if not gemm:
        raise CoralError(f"{root / 'gemm.csv.gz'} has no rows of {', '.join(AIC_GPUS)}")
    return {g: KernelTables(gpu=g, gemm=gemm[g], context=ctx.get(g, {}), generation=gen.get(g, {}), moe=moe.get(g, {}))
            for g in AIC_GPUS.values() if g in gemm}


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPoint:
    """One rebuilt layer: `batch` prompts of `context` tokens (prefill) or `batch` sequences
    attending `context` tokens (decode), and the sum of its measured kernels."""

    model: ModelSpec
    phase: Phase
    batch: int
    context: int
    measured_ms: float

    @property
    def shape(self) -> Shape:
        return Shape(phase=self.phase, batch=self.batch, prompt_tokens=self.context, output_tokens=0)


def _attention_ms(tables: KernelTables, model: ModelSpec, phase: Phase, batch: int, context: int) -> float | None:
    """The layer-mean attention time (sliding layers at their window), None when not measured."""
    layouts = attention_layouts(model)
    source, length = (tables.context, context) if phase is Phase.PREFILL else (tables.generation, context - 1)
    times = [source.get((batch, length, *lay)) for lay in layouts]
    if any(t is None for t in times):
        return None
    if len(times) == 1:
        return times[0]
    f = model.sliding_fraction
    return (1 - f) * times[0] + f * times[1]  # type: ignore[operator]


def layer_ms(tables: KernelTables, model: ModelSpec, phase: Phase, batch: int, context: int) -> float | None:
    """The measured kernels of one unsharded layer summed, None when a kernel is not measured."""
    m = batch * context if phase is Phase.PREFILL else batch
    attn = _attention_ms(tables, model, phase, batch, context)
    if attn is None or not any(key[0] == m for key in tables.gemm):
        return None
    total = attn + sum(tables.gemm_ms(m, n, k) for n, k in layer_gemms(model))
    if model.is_moe:
        expert = tables.moe.get((m, model.hidden_size, model.expert_intermediate_size, model.experts_per_token,
                                 model.num_experts))
        if expert is None:
            return None
        total += expert
    return total


def layer_points(tables: KernelTables, model: ModelSpec) -> list[LayerPoint]:
    """Every point of the prefill and decode grids whose kernels `tables` measures."""
    out = []
    for p in PREFILL_PROMPTS:
        for b in PREFILL_BATCHES:
            if PREFILL_TOKENS[0] <= b * p <= PREFILL_TOKENS[1] and (ms := layer_ms(tables, model, Phase.PREFILL, b, p)):
                out.append(LayerPoint(model=model, phase=Phase.PREFILL, batch=b, context=p, measured_ms=ms))
    for b in DECODE_BATCHES:
        for c in DECODE_CONTEXTS:
            if b * c <= DECODE_MAX_KV_TOKENS and (ms := layer_ms(tables, model, Phase.DECODE, b, c)):
                out.append(LayerPoint(model=model, phase=Phase.DECODE, batch=b, context=c, measured_ms=ms))
    return out


def kernel_layer_ms(perf: RooflinePerf, config: NodeConfig, point: LayerPoint) -> float:
    """The roofline's layer time without its elementwise term (norms, residual adds), which the
    kernel tables do not measure: what the rebuilt layer is compared against."""
    shape = point.shape
    _, elementwise = perf.replicated_bytes(point.model, shape)
    e = perf.eff(config)
    return (perf.layer_time_s(config, point.model, shape) - elementwise / (config.gpu.hbm_gb_per_s * 1e9 * e.bandwidth)) * 1e3


# (η_F prefill, η_F decode, η_B, overhead ms): starts spread over the box, best fit kept.
_STARTS = ((0.6, 0.4, 0.7, 0.02), (0.8, 0.6, 0.9, 0.0), (0.4, 0.2, 0.5, 0.1))


def fit_kernel_efficiency(config: NodeConfig, points: list[LayerPoint]) -> Efficiency:
    """Least squares on log(predicted / measured) over one GPU's rebuilt layers (`config`: 1 GPU),
    best of a few starts, rounded as shipped (3 decimals, overhead to 0.1 µs)."""

    def make(x: np.ndarray) -> Efficiency:
        return Efficiency(flops=float(x[0]), decode_flops=float(x[1]), bandwidth=float(x[2]),
                          layer_overhead_s=float(x[3]) * 1e-3)

    def residuals(x: np.ndarray) -> np.ndarray:
        perf = RooflinePerf(efficiency={config.gpu.name: make(x)}, links={})
        return np.array([math.log(kernel_layer_ms(perf, config, p) / p.measured_ms) for p in points])

    bounds = ([0.05, 0.05, 0.05, 0.0], [1.0, 1.0, 1.0, 0.2])
    best = min((least_squares(residuals, np.array(x0), bounds=bounds) for x0 in _STARTS), key=lambda f: f.cost)
    x = best.x
    return Efficiency(flops=round(float(x[0]), 3), decode_flops=round(float(x[1]), 3), bandwidth=round(float(x[2]), 3),
                      layer_overhead_s=float(f"{float(x[3]) * 1e3:.1f}e-6"))  # as a literal in µs reads


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelRow:
    """A rebuilt layer against the roofline; `held_out`: its model was not in the fit."""

    gpu: str
    model: str
    phase: str
    batch: int
    context: int
    measured_ms: float
    predicted_ms: float
    held_out: bool

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelReport:
    """The fitted efficiencies per GPU, every dense point (fit and held out), and the MoE check
    (gpt-oss layers with the MoE kernel, predicted with `fitted`)."""

    fitted: dict[str, Efficiency]
    rows: list[KernelRow]
    moe_rows: list[KernelRow]

    def summary(self, rows: list[KernelRow] | None = None) -> dict[tuple[str, str, bool], dict[str, float]]:
        """(GPU, phase, held out) -> points, median and worst |error|."""
        groups: dict[tuple[str, str, bool], list[float]] = {}
        for r in self.rows if rows is None else rows:
            groups.setdefault((r.gpu, r.phase, r.held_out), []).append(abs(r.error))
        return {k: {"points": float(len(v)), "median_abs_error": statistics.median(v), "worst_abs_error": max(v)}
                for k, v in groups.items()}


def _rows(perf: RooflinePerf, config: NodeConfig, points: list[LayerPoint], held_out: bool) -> list[KernelRow]:
    return [KernelRow(gpu=config.gpu.name, model=p.model.name, phase=p.phase.value, batch=p.batch, context=p.context,
                      measured_ms=p.measured_ms, predicted_ms=kernel_layer_ms(perf, config, p), held_out=held_out)
            for p in points]


def kernel_report(folder: str | Path, catalog: Catalog) -> KernelReport:
    """Fit one Efficiency per measured GPU on `FIT_MODELS`, then predict `HELDOUT_MODELS` and the
    gpt-oss MoE layers with it.

    Raises:
        CoralError: when the kernel tables are missing.
    """
    tables = load_kernel_tables(folder)
    fitted: dict[str, Efficiency] = {}
    rows: list[KernelRow] = []
    moe_rows: list[KernelRow] = []
    for gpu, t in tables.items():
        config = catalog.config(f"1x{gpu}")
        fit_points = [p for m in FIT_MODELS for p in layer_points(t, m)]
        fitted[gpu] = fit_kernel_efficiency(config, fit_points)
        perf = RooflinePerf(efficiency=fitted, links={})
        rows += _rows(perf, config, fit_points, held_out=False)
        rows += _rows(perf, config, [p for m in HELDOUT_MODELS for p in layer_points(t, m)], held_out=True)
        moe_rows += _rows(perf, config, [p for name in MOE_MODELS for p in layer_points(t, builtin_model(name))],
                          held_out=True)
    return KernelReport(fitted=fitted, rows=rows, moe_rows=moe_rows)
