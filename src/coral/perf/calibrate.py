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
from coral.catalog.hardware import LINK_REF_BYTES, LinkFit, NodeConfig
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

    # The fit has local optima (a decode efficiency can trade against the per-layer overhead), and
    # which one a single start lands in moves with SciPy's version: take the best of a few starts.
    starts = [np.array([start.flops, start.decode_flops or start.flops, start.bandwidth, start.layer_overhead_s * 1e3])]
    starts += [np.array(x) for x in _EXTRA_STARTS]
    bounds = ([0.05, 0.05, 0.05, 0.0], [0.95, 0.95, 0.95, 0.2])
    fits = [least_squares(residuals, x0, bounds=bounds) for x0 in starts]
    return make(min(fits, key=lambda f: f.cost).x)


# (η_F prefill, η_F decode, η_B, overhead ms): spread over the box so each basin gets a start.
_EXTRA_STARTS = ((0.5, 0.3, 0.8, 0.0), (0.8, 0.5, 0.6, 0.2), (0.4, 0.2, 0.9, 0.05))


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


def calibrate(model: ModelSpec, points: list[Measurement],
              links: dict[tuple[str, int], LinkFit] | None = None) -> tuple[dict[str, Efficiency], list[CalibrationRow]]:
    """Fit one Efficiency per GPU type on its 1-GPU points; predict every point (multi-GPU nodes
    through `links`, default the shipped fits) with its own GPU's fit and leave-one-GPU-out (the
    median of the other GPUs' fits, which is how an unmeasured GPU is modelled).

    Returns:
        The fitted efficiencies and one row per measurement.
    """
    fitted = single_gpu_efficiency(model, points)
    rows: list[CalibrationRow] = []
    own = RooflinePerf(efficiency=fitted, links=links)
    for m in points:
        gpu = m.config.gpu.name
        others = [e for g, e in fitted.items() if g != gpu]
        loo = RooflinePerf(efficiency={}, default=median_efficiency(others) if others else fitted[gpu], links=links)
        rows.append(CalibrationRow(config=m.config.name, phase=m.phase.value, tokens=m.tokens, measured_ms=m.layer_ms,
                                   predicted_ms=_predict_ms(own, model, m), loo_predicted_ms=_predict_ms(loo, model, m),
                                   counted=m.counted))
    return fitted, rows


def summarize(rows: list[CalibrationRow]) -> dict[str, float]:
    counted = [r for r in rows if r.counted]
    single = [r for r in counted if r.config.startswith("1x")]
    return {
        "single_gpu_points": float(len(single)),
        "single_gpu_median_abs_error": statistics.median(abs(r.error) for r in single),
        "single_gpu_loo_median_abs_error": statistics.median(abs(r.loo_error) for r in single),
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


# --- Vidur NCCL all-reduce profiles (NVLink nodes) --------------------------------------------------

MIB = 2**20
# Vidur's network profile folders -> the interconnect they measure (DGX A100 / H100: NVSwitch).
VIDUR_NODES = {"h100_dgx": "nvlink4", "a100_dgx": "nvlink3"}
_FIT_BINS = tuple(MIB * 2 ** (k / 2) for k in range(13))  # 1 .. 64 MiB in half octaves
CHECK_BINS = tuple(MIB * 2**k for k in range(7))  # 1, 2, 4, ..., 64 MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveProfile:
    """One Vidur curve: a collective's median ms per message size on `gpus` GPUs of one node."""

    node: str
    collective: str
    gpus: int
    devices_per_node: int
    sizes: tuple[float, ...]
    ms: tuple[float, ...]

    def binned_ms(self, centers: tuple[float, ...], width: float = 2**0.25) -> np.ndarray:
        """Median measured ms of the sizes within `[c/width, c·width)` of each centre: one robust
        figure per size (single sizes are noisy, and NCCL switches protocol near 1 MiB)."""
        s, t = np.array(self.sizes), np.array(self.ms)
        out = []
        for c in centers:
            mask = (s >= c / width) & (s < c * width)
            out.append(float(np.median(t[mask])) if mask.any() else float("nan"))
        return np.array(out)


def load_vidur_network(folder: str | Path, collective: str = "all_reduce") -> list[CollectiveProfile]:
    """Read Vidur's `network_<node>_<collective>.csv.gz` files into one curve per (node, GPUs, GPUs per node)."""
    import gzip

    root = Path(folder)
    curves: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for path in sorted(root.glob(f"network_*_{collective}.csv.gz")):
        node = path.name.removeprefix("network_").removesuffix(f"_{collective}.csv.gz")
        with gzip.open(path, "rt") as f:
            for row in csv.DictReader(f):
                key = (node, int(row["num_workers"]), int(row["devices_per_node"]))
                curves.setdefault(key, []).append((float(row["size"]), float(row[f"time_stats.{collective}.median"])))
    if not curves:
        raise CoralError(f"no Vidur network_<node>_{collective}.csv.gz files in {root}")
    out = []
    for (node, n, per_node), pts in sorted(curves.items()):
        pts.sort()
        out.append(CollectiveProfile(node=node, collective=collective, gpus=n, devices_per_node=per_node,
                                     sizes=tuple(p[0] for p in pts), ms=tuple(p[1] for p in pts)))
    return out


def fit_allreduce(curve: CollectiveProfile, interconnect: str) -> LinkFit:
    """Fit `LinkFit`'s floor, latency, bus bandwidth and size exponent to one intra-node curve:
    least squares on log(pred/measured) over the half-octave medians from 1 to 64 MiB."""
    target = curve.binned_ms(_FIT_BINS) * 1e-3
    sizes = np.array(_FIT_BINS)
    ring = 2.0 * (curve.gpus - 1) / curve.gpus

    def predict(x: np.ndarray) -> np.ndarray:
        t = x[0] * 1e-6 + ring * LINK_REF_BYTES / (x[1] * 1e9) * (sizes / LINK_REF_BYTES) ** x[2]
        return np.maximum(x[3] * 1e-6, t)

    fit = least_squares(lambda x: np.log(predict(x) / target), np.array([10.0, 200.0, 1.0, 30.0]),
                        bounds=([0.0, 1.0, 0.3, 0.0], [1000.0, 5000.0, 1.5, 1000.0]))
    x = fit.x
    return LinkFit(interconnect=interconnect, gpus=curve.gpus, floor_s=round(float(x[3]), 1) * 1e-6,
                   latency_s=round(float(x[0]), 1) * 1e-6, bus_gb_per_s=round(float(x[1]), 1),
                   size_exponent=round(float(x[2]), 3), source=f"vidur {curve.node} all_reduce")


def allreduce_errors(fit: LinkFit, curve: CollectiveProfile) -> dict[str, float]:
    """The fit against the curve: the worst error at 1, 2, ..., 64 MiB (against each size's median)
    and the median error over every raw point from 1 to 64 MiB."""
    at = curve.binned_ms(CHECK_BINS) * 1e-3
    binned = [float(fit.allreduce_s(c) / t - 1) for c, t in zip(CHECK_BINS, at, strict=True)]
    raw = [abs(fit.allreduce_s(s) / (ms * 1e-3) - 1) for s, ms in zip(curve.sizes, curve.ms, strict=True)
           if MIB <= s <= 64 * MIB]
    return {"worst_binned_abs_error": max(abs(e) for e in binned), "median_raw_abs_error": statistics.median(raw),
            **{f"error_{int(c // MIB)}mib": e for c, e in zip(CHECK_BINS, binned, strict=True)}}


def intra_node_curves(curves: list[CollectiveProfile]) -> list[CollectiveProfile]:
    """The curves of Vidur's NVSwitch nodes measured inside one node (all GPUs on the same node)."""
    return [c for c in curves if c.node in VIDUR_NODES and c.gpus == c.devices_per_node]


# --- Tensor-parallel speedups -----------------------------------------------------------------------

# The points the TP target is stated on (the 19): Helix prefill 500/1000/2000 tokens and
# decode batch 16/100 on its multi-GPU PCIe nodes; Vidur whole layers at 2,048 tokens on 4 and 8 GPUs.
HELIX_TP_POINTS = {Phase.PREFILL: (500, 1000, 2000), Phase.DECODE: (16, 100)}
VIDUR_TP_TOKENS = 2048


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedupRow:
    """Measured and predicted `T(1 GPU) / T(n GPUs)` of one layer at one batch."""

    source: str
    config: str
    phase: str
    tokens: int
    measured: float
    predicted: float
    loo_predicted: float
    in_target: bool

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def loo_error(self) -> float:
        return self.loo_predicted / self.measured - 1


def _speedup_pairs(points: list[Measurement], *, all_points: bool) -> list[tuple[Measurement, Measurement]]:
    """(1-GPU, n-GPU) measurement pairs of the same GPU, phase and tokens."""
    single = {(m.config.gpu.name, m.phase, m.tokens): m for m in points if m.config.count == 1}
    out = []
    for m in points:
        if m.config.count == 1:
            continue
        one = single.get((m.config.gpu.name, m.phase, m.tokens))
        wanted = m.counted if all_points else m.tokens in HELIX_TP_POINTS[m.phase]
        if one is not None and wanted:
            out.append((one, m))
    return out


def _speedup(perf: RooflinePerf, model: ModelSpec, one: Measurement, many: Measurement) -> float:
    return perf.layer_time_s(one.config, model, one.shape) / perf.layer_time_s(many.config, model, many.shape)


def fit_pcie(model: ModelSpec, points: list[Measurement], efficiency: dict[str, Efficiency]) -> dict[int, LinkFit]:
    """Fit the PCIe all-reduce (latency and bus bandwidth per GPU count, linear in size, floor =
    latency) to Helix's multi-GPU nodes: least squares on log(predicted/measured speedup) over
    every counted token point with the single-GPU efficiencies held fixed. A GPU count without
    points gets the fit of the nearest count that has them.

    Returns:
        One LinkFit per GPU count seen in `points`.
    """
    pairs = _speedup_pairs(points, all_points=True)
    counts = sorted({many.config.count for _, many in pairs})
    if not counts:
        raise CoralError("no multi-GPU Helix points with a matching single-GPU point to fit the PCIe link to")
    out: dict[int, LinkFit] = {}
    for n in counts:
        mine = [(o, m) for o, m in pairs if m.config.count == n]

        def make(x: np.ndarray, n: int = n) -> LinkFit:
            return LinkFit(interconnect="pcie", gpus=n, floor_s=float(x[0]) * 1e-6, latency_s=float(x[0]) * 1e-6,
                           bus_gb_per_s=float(x[1]), size_exponent=1.0, source="helix")

        def residuals(x: np.ndarray, mine: list[tuple[Measurement, Measurement]] = mine, n: int = n) -> np.ndarray:
            perf = RooflinePerf(efficiency=efficiency, links={("pcie", n): make(x)})
            return np.array([math.log(_speedup(perf, model, o, m) / (o.layer_ms / m.layer_ms)) for o, m in mine])

        fit = least_squares(residuals, np.array([100.0, 5.0]), bounds=([0.0, 0.1], [5000.0, 100.0]))
        x = fit.x
        out[n] = LinkFit(interconnect="pcie", gpus=n, floor_s=round(float(x[0]), 1) * 1e-6,
                         latency_s=round(float(x[0]), 1) * 1e-6, bus_gb_per_s=round(float(x[1]), 2),
                         size_exponent=1.0, source=f"helix {','.join(sorted({m.config.name for _, m in mine}))}")
    return out


def single_gpu_efficiency(model: ModelSpec, points: list[Measurement]) -> dict[str, Efficiency]:
    """One Efficiency per GPU type, fitted to that GPU's 1-GPU points only (TP is the link's job)."""
    start = Efficiency(flops=0.6, decode_flops=0.4, bandwidth=0.7, layer_overhead_s=1e-4)
    by_gpu: dict[str, list[Measurement]] = {}
    for m in points:
        if m.config.count == 1:
            by_gpu.setdefault(m.config.gpu.name, []).append(m)
    return {gpu: fit_efficiency(model, pts, start) for gpu, pts in by_gpu.items()}


def helix_speedups(model: ModelSpec, points: list[Measurement], perf: RooflinePerf) -> list[SpeedupRow]:
    """The Helix TP target points, in-sample (`perf`'s links) and leave-one-node-out: the PCIe link
    re-fitted without that node's points (a GPU count left with none takes the nearest count's fit)."""
    pairs = _speedup_pairs(points, all_points=False)
    eff = dict(perf.efficiency)
    rows = []
    for node in sorted({m.config.name for _, m in pairs}):
        rest = [p for p in points if p.config.name != node]
        loo_links = {("pcie", n): f for n, f in fit_pcie(model, rest, eff).items()}
        loo = RooflinePerf(efficiency=eff, default=perf.default, system=perf.system,
                           links={**{k: v for k, v in perf.links.items() if k[0] != "pcie"}, **loo_links})
        for one, many in pairs:
            if many.config.name != node:
                continue
            rows.append(SpeedupRow(source="helix", config=node, phase=many.phase.value, tokens=many.tokens,
                                   measured=one.layer_ms / many.layer_ms, predicted=_speedup(perf, model, one, many),
                                   loo_predicted=_speedup(loo, model, one, many), in_target=True))
    return rows


_VIDUR_LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
                    "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def vidur_layer_ms(folder: str | Path, gpu_key: str, tokens: int = VIDUR_TP_TOKENS) -> dict[int, float]:
    """Measured Llama-2-70B layer ms without attention (Vidur has no attention timings) per TP degree:
    the sum of the per-op medians of `compute_<gpu>_meta-llama_Llama-2-70b-hf_mlp.csv.gz` at `tokens`."""
    import gzip

    path = Path(folder) / f"compute_{gpu_key}_meta-llama_Llama-2-70b-hf_mlp.csv.gz"
    if not path.exists():
        raise CoralError(f"Vidur profile {path} does not exist")
    per_tp: dict[int, list[float]] = {}
    with gzip.open(path, "rt") as f:
        for row in csv.DictReader(f):
            if int(row["num_tokens"]) == tokens:
                ms = sum(float(row[f"time_stats.{op}.median"]) for op in _VIDUR_LAYER_OPS)
                per_tp.setdefault(int(row["num_tensor_parallel_workers"]), []).append(ms)
    return {tp: statistics.median(v) for tp, v in sorted(per_tp.items())}


def vidur_speedups(folder: str | Path, model: ModelSpec, catalog: Catalog, perf: RooflinePerf) -> list[SpeedupRow]:
    """Whole-layer TP speedups on 4 and 8 H100 / A100-80GB at 2,048 tokens: measured = Vidur's
    per-op layer sum plus two all-reduces of the activations as Vidur measured them on that node;
    predicted = the roofline on 2,048 one-token prompts (attention off, like the measurement).
    Leave-one-out: the all-reduce fit of the nearest *other* GPU count of the same interconnect."""
    curves = {(c.node, c.gpus): c for c in intra_node_curves(load_vidur_network(folder))}
    nbytes = VIDUR_TP_TOKENS * model.hidden_size * 2.0
    shape = Shape(phase=Phase.PREFILL, batch=VIDUR_TP_TOKENS, prompt_tokens=1, output_tokens=0)
    rows = []
    for gpu_key, node in (("h100", "h100_dgx"), ("a100", "a100_dgx")):
        gpu = _VIDUR_GPU[gpu_key]
        layer = vidur_layer_ms(folder, gpu_key)
        for n in (4, 8):
            ar_ms = float(curves[(node, n)].binned_ms((nbytes,))[0])
            measured = layer[1] / (layer[n] + 2 * ar_ms)
            one, many = catalog.config(f"1x{gpu}"), catalog.config(f"{n}x{gpu}")
            ic = one.gpu.interconnect
            others = {k: v for k, v in perf.links.items() if k[0] == ic and k[1] != n}
            loo = RooflinePerf(efficiency=perf.efficiency, default=perf.default, system=perf.system,
                               links={**{k: v for k, v in perf.links.items() if k[0] != ic}, **others})
            rows.append(SpeedupRow(
                source="vidur", config=many.name, phase="prefill", tokens=VIDUR_TP_TOKENS, measured=measured,
                predicted=perf.layer_time_s(one, model, shape) / perf.layer_time_s(many, model, shape),
                loo_predicted=loo.layer_time_s(one, model, shape) / loo.layer_time_s(many, model, shape), in_target=True))
    return rows


def summarize_speedups(rows: list[SpeedupRow]) -> dict[str, float]:
    errs = [abs(r.error) for r in rows if r.in_target]
    loo = [abs(r.loo_error) for r in rows if r.in_target]
    return {"points": float(len(errs)), "median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
            "loo_median_abs_error": statistics.median(loo), "loo_worst_abs_error": max(loo)}


# --- Pipeline sends (Vidur send_recv) -----------------------------------------------------------

def send_check(folder: str | Path, perf: RooflinePerf, catalog: Catalog) -> list[dict[str, Any]]:
    """Vidur's cross-node `send_recv` (one GPU per node) against the model's inter-stage send of the
    same bytes between the two AWS nodes of that GPU type, at 1, 2, ..., 64 MiB. The model times a
    send over the sending instance's whole network (`network_gbps`) plus `network_latency_s`; a
    Vidur pair crosses over one GPU's NIC, so the ratio says how far one NIC is from the node figure."""
    out = []
    for c in load_vidur_network(folder, "send_recv"):
        if c.node not in VIDUR_NODES or c.devices_per_node != 1:
            continue
        gpu = "H100" if c.node.startswith("h100") else "A100-80GB"
        cfg = catalog.config(f"8x{gpu}")
        at = c.binned_ms(CHECK_BINS)
        for size, ms in zip(CHECK_BINS, at, strict=True):
            model_s = size / cfg.network_bytes_per_s + perf.system.network_latency_s
            out.append({"node": c.node, "size_mib": size / MIB, "measured_ms": float(ms), "model_ms": model_s * 1e3,
                        "measured_gb_per_s": size / (ms * 1e-3) / 1e9, "node_network_gbps": cfg.network_gbps})
    return out


# --- The whole report (`coral calibrate`, `make bench`) --------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationReport:
    """Every fit `coral calibrate` makes, with its in-sample and leave-one-out errors."""

    fitted: dict[str, Efficiency]
    layer_rows: list[CalibrationRow]
    layer_summary: dict[str, float]
    pcie: dict[int, LinkFit]
    speedups: list[SpeedupRow]
    speedup_summary: dict[str, float]
    allreduce: list[tuple[LinkFit, dict[str, float]]]
    gemm: dict[str, tuple[float, float, float, int]]
    sends: list[dict[str, Any]]


def calibration_report(helix_folder: str | Path, vidur_folder: str | Path | None, catalog: Catalog) -> CalibrationReport:
    """Fit and check everything against the shipped defaults' structure: single-GPU efficiencies
    (Helix), the PCIe link (Helix multi-GPU), the NVLink links (Vidur all-reduce), GEMM efficiencies
    (Vidur), TP speedups (Helix + Vidur whole layers) and pipeline sends (Vidur send_recv).
    The speedups and sends use the *shipped* model (`RooflinePerf()`), so they check what plans use.

    Raises:
        CoralError: when a profile folder or file is missing.
    """
    from coral.catalog.models import builtin_model

    model = builtin_model("llama-2-70b")
    points = load_helix_profiles(helix_folder, catalog)
    fitted, rows = calibrate(model, points)
    pcie = fit_pcie(model, points, fitted)
    shipped = RooflinePerf()
    speedups = helix_speedups(model, points, shipped)
    allreduce: list[tuple[LinkFit, dict[str, float]]] = []
    gemm: dict[str, tuple[float, float, float, int]] = {}
    sends: list[dict[str, Any]] = []
    if vidur_folder is not None:
        speedups += vidur_speedups(vidur_folder, model, catalog, shipped)
        for curve in intra_node_curves(load_vidur_network(vidur_folder)):
            fit = fit_allreduce(curve, VIDUR_NODES[curve.node])
            shipped_fit = shipped.links.get((fit.interconnect, fit.gpus), fit)
            allreduce.append((fit, allreduce_errors(shipped_fit, curve)))
        by_gpu: dict[str, list[OpMeasurement]] = {}
        for p in load_vidur_mlp(vidur_folder):
            by_gpu.setdefault(p.gpu, []).append(p)
        for g, pts in by_gpu.items():
            ef, eb, err = fit_gemm_efficiency(pts, catalog.gpu(g))
            gemm[g] = (ef, eb, err, len(pts))
        sends = send_check(vidur_folder, shipped, catalog)
    return CalibrationReport(fitted=fitted, layer_rows=rows, layer_summary=summarize(rows), pcie=pcie,
                             speedups=speedups, speedup_summary=summarize_speedups(speedups), allreduce=allreduce,
                             gemm=gemm, sends=sends)
