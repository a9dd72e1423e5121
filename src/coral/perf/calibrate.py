"""Fit the roofline's per-GPU efficiencies to measured per-layer latencies and report the error.

The measurements are Helix's per-layer LLaMA-2-70B profiles (`<gpu>[x<n>]_{prompt,decode}_bs2time.csv`:
tokens in the batch, ms per decoder layer). Helix does not state the decode context of its
profiles; we assume a mean context of `HELIX_DECODE_CONTEXT` tokens (documented in docs/perf.md).
"""
from __future__ import annotations

import csv
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec
from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.perf.roofline import Efficiency, RooflinePerf, median_efficiency

HELIX_DECODE_CONTEXT = 1024.0
_HELIX_FILE = re.compile(r"^([a-z0-9]+?)(?:x(\d+))?_(prompt|decode)_bs2time\.csv$")
_HELIX_GPU = {"a100": "A100-40GB", "v100": "V100-16GB", "l4": "L4", "t4": "T4"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    config: NodeConfig
    phase: Phase
    tokens: int
    layer_ms: float

    @property
    def shape(self) -> Shape:
        if self.phase is Phase.PREFILL:
            return Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=self.tokens, output_tokens=0)
        return Shape(phase=Phase.DECODE, batch=self.tokens, prompt_tokens=HELIX_DECODE_CONTEXT, output_tokens=0)

    @property
    def counted(self) -> bool:
        """The points the accuracy target is stated on: >= 250 prompt tokens or decode batch >= 8."""
        return self.tokens >= 250 if self.phase is Phase.PREFILL else self.tokens >= 8


def load_helix_profiles(folder: str | Path, catalog: Catalog) -> list[Measurement]:
    """Read every Helix `*_bs2time.csv` in `folder` (rows with 0 tokens are skipped)."""
    root = Path(folder)
    if not root.is_dir():
        raise CoralError(f"profile folder {root} does not exist; pass the folder holding Helix's *_bs2time.csv files")
    out: list[Measurement] = []
    for path in sorted(root.glob("*_bs2time.csv")):
        match = _HELIX_FILE.match(path.name)
        if not match or match.group(1) not in _HELIX_GPU:
            continue
        gpu, count, phase = _HELIX_GPU[match.group(1)], int(match.group(2) or 1), match.group(3)
        config = catalog.config(f"{count}x{gpu}")
        for row in csv.reader(path.read_text().splitlines()):
            if len(row) < 2 or not row[0].strip():
                continue
            tokens, ms = int(float(row[0])), float(row[1])
            if tokens > 0 and ms > 0:
                out.append(Measurement(config=config, phase=Phase.PREFILL if phase == "prompt" else Phase.DECODE,
                                       tokens=tokens, layer_ms=ms))
    if not out:
        raise CoralError(f"no Helix profile files (<gpu>[x<n>]_<prompt|decode>_bs2time.csv) in {root}")
    return out


def _predict_ms(perf: RooflinePerf, model: ModelSpec, m: Measurement) -> float:
    return perf.layer_time_s(m.config, model, m.shape) * 1e3


def fit_efficiency(model: ModelSpec, points: list[Measurement], start: Efficiency) -> Efficiency:
    """Least squares on log(predicted / measured) over `points` (all of one GPU type)."""

    def make(x: np.ndarray) -> Efficiency:
        return Efficiency(flops=float(x[0]), decode_flops=float(x[1]), bandwidth=float(x[2]),
                          layer_overhead_s=float(x[3]) * 1e-3)

    def residuals(x: np.ndarray) -> np.ndarray:
        gpu = points[0].config.gpu.name
        perf = RooflinePerf(efficiency={gpu: make(x)})
        return np.array([math.log(_predict_ms(perf, model, m) / m.layer_ms) for m in points])

    x0 = np.array([start.flops, start.decode_flops or start.flops, start.bandwidth, start.layer_overhead_s * 1e3])
    fit = least_squares(residuals, x0, bounds=([0.05, 0.05, 0.05, 0.0], [0.95, 0.95, 0.95, 0.2]))
    return make(fit.x)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationRow:
    config: str
    phase: str
    tokens: int
    measured_ms: float
    predicted_ms: float
    loo_predicted_ms: float
    counted: bool

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1

    @property
    def loo_error(self) -> float:
        return self.loo_predicted_ms / self.measured_ms - 1


def calibrate(model: ModelSpec, points: list[Measurement]) -> tuple[dict[str, Efficiency], list[CalibrationRow]]:
    """Fit one Efficiency per GPU type; predict each point with its own fit and leave-one-GPU-out
    (the median of the other GPUs' fits, which is how an unmeasured GPU is modelled).

    Returns:
        The fitted efficiencies and one row per measurement.
    """
    by_gpu: dict[str, list[Measurement]] = {}
    for m in points:
        by_gpu.setdefault(m.config.gpu.name, []).append(m)
    start = Efficiency(flops=0.6, decode_flops=0.4, bandwidth=0.7, layer_overhead_s=1e-4)
    fitted = {gpu: fit_efficiency(model, pts, start) for gpu, pts in by_gpu.items()}
    rows: list[CalibrationRow] = []
    for gpu, pts in by_gpu.items():
        own = RooflinePerf(efficiency=fitted)
        others = [e for g, e in fitted.items() if g != gpu]
        loo = RooflinePerf(efficiency={}, default=median_efficiency(others) if others else start)
        for m in pts:
            rows.append(CalibrationRow(config=m.config.name, phase=m.phase.value, tokens=m.tokens, measured_ms=m.layer_ms,
                                       predicted_ms=_predict_ms(own, model, m), loo_predicted_ms=_predict_ms(loo, model, m),
                                       counted=m.counted))
    return fitted, rows


def summarize(rows: list[CalibrationRow]) -> dict[str, float]:
    counted = [r for r in rows if r.counted]
    return {
        "points": float(len(rows)),
        "counted_points": float(len(counted)),
        "median_abs_error": statistics.median(abs(r.error) for r in counted),
        "mean_abs_error": statistics.fmean(abs(r.error) for r in counted),
        "p90_abs_error": float(np.percentile([abs(r.error) for r in counted], 90)),
        "loo_median_abs_error": statistics.median(abs(r.loo_error) for r in counted),
        "loo_mean_abs_error": statistics.fmean(abs(r.loo_error) for r in counted),
    }


# --- Vidur per-operator profiles -------------------------------------------------------------------

_VIDUR_GPU = {"a100": "A100-80GB", "h100": "H100"}  # Vidur's a100 is the 80 GB part
_VIDUR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpMeasurement:
    """One Vidur row: the summed median time of a layer's four GEMMs at `tokens`, on `tp` GPUs."""

    gpu: str
    tokens: int
    tp: int
    flops: float  # per GPU
    nbytes: float  # per GPU: weights + activations in and out
    ms: float


def load_vidur_mlp(folder: str | Path) -> list[OpMeasurement]:
    """Read Vidur's `compute_<gpu>_<org>_<model>_mlp.csv.gz` files (GEMM timings per op)."""
    import gzip

    root = Path(folder)
    out: list[OpMeasurement] = []
    for path in sorted(root.glob("compute_*_mlp.csv.gz")):
        gpu_key = path.name.split("_")[1]
        if gpu_key not in _VIDUR_GPU:
            continue
        with gzip.open(path, "rt") as f:
            for row in csv.DictReader(f):
                h, i = int(row["n_embd"]), int(row["n_expanded_embd"])
                heads, kv = int(row["n_head"]), int(row["n_kv_head"])
                d = h // heads
                n, tp = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
                gated = str(row.get("use_gated_mlp", "True")).lower() in ("true", "1")
                params = h * (heads + 2 * kv) * d + heads * d * h + (3 if gated else 2) * h * i
                ms = sum(float(row[f"time_stats.{op}.median"]) for op in _VIDUR_OPS)
                acts = 2 * n * (2 * h + (heads + 2 * kv) * d + 2 * i) * 2 / tp
                out.append(OpMeasurement(gpu=_VIDUR_GPU[gpu_key], tokens=n, tp=tp, flops=2.0 * n * params / tp,
                                         nbytes=2.0 * params / tp + acts, ms=ms))
    if not out:
        raise CoralError(f"no Vidur compute_<gpu>_*_mlp.csv.gz files in {root}")
    return out


def fit_gemm_efficiency(points: list[OpMeasurement], gpu: Any) -> tuple[float, float, float]:
    """Fit (η_F, η_B) of `max(FLOPs/(F·η_F), bytes/(BW·η_B))` to one GPU's GEMM timings.

    Returns:
        (η_F, η_B, median |error| of the fit).
    """
    flops = np.array([p.flops for p in points])
    nbytes = np.array([p.nbytes for p in points])
    ms = np.array([p.ms for p in points])

    def predict(x: np.ndarray) -> np.ndarray:
        return np.maximum(flops / (gpu.bf16_tflops * 1e12 * x[0]), nbytes / (gpu.hbm_gb_per_s * 1e9 * x[1])) * 1e3

    fit = least_squares(lambda x: np.log(predict(x) / ms), np.array([0.6, 0.7]), bounds=([0.05, 0.05], [1.0, 1.0]))
    err = float(np.median(np.abs(predict(fit.x) / ms - 1)))
    return float(fit.x[0]), float(fit.x[1]), err
