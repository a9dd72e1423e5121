"""Fit the roofline's per-GPU efficiencies to measured per-layer latencies and report the error.

The measurements are Helix's per-layer LLaMA-2-70B profiles (`<gpu>[x<n>]_{prompt,decode}_bs2time.csv`:
tokens in the batch, ms per decoder layer), read by `coral.perf.profile.load_helix_profiles`. Helix
does not state the decode context of its profiles; we assume a mean context of
`HELIX_DECODE_CONTEXT` tokens (documented in docs/reference/perf.md). The interconnect fits live in
`coral.perf.collectives`; this module adds the Helix PCIe fit and writes `interconnects.csv`.
"""
from __future__ import annotations

import csv
import gzip
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from coral.catalog.catalog import Catalog
from coral.catalog.hardware import LinkFit
from coral.catalog.models import ModelSpec, builtin_model
from coral.errors import CoralError
from coral.perf.collectives import (
    AIC_FILE,
    AIC_SYSTEMS,
    LINK_FIT_SIZES,
    VIDUR_HELDOUT_SIZES,
    VIDUR_NODES,
    allreduce_errors,
    fit_allreduce,
    intra_node_curves,
    load_nccl_allreduce,
    load_vidur_network,
    measured_links,
    send_check,
)
from coral.perf.model import Phase, Shape
from coral.perf.profile import Measurement, load_helix_profiles
from coral.perf.roofline import Efficiency, RooflinePerf, median_efficiency


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


# --- Tensor-parallel speedups -----------------------------------------------------------------------

# The points the TP target is stated on (the 19): Helix prefill 500/1000/2000 tokens and
# decode batch 16/100 on its multi-GPU PCIe nodes; Vidur whole layers at 2,048 tokens on 4 and 8 GPUs.
HELIX_TP_POINTS = {Phase.PREFILL: (500, 1000, 2000), Phase.DECODE: (16, 100)}
VIDUR_TP_TOKENS = 2048
# L4 and T4 (and A10G, unmeasured) use the link fitted to Helix's multi-GPU L4 / T4 layer speedups.
PCIE_HELIX = "pcie-helix"


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
    """Fit the `pcie-helix` all-reduce (latency and bus bandwidth per GPU count, linear in size,
    floor = latency) to Helix's multi-GPU L4 and T4 nodes: least squares on log(predicted/measured
    speedup) over every counted token point with the single-GPU efficiencies held fixed.

    Returns:
        One LinkFit per GPU count seen in `points`.
    """
    pairs = _speedup_pairs(points, all_points=True)
    counts = sorted({many.config.count for _, many in pairs})
    if not counts:
        raise CoralError("no multi-GPU Helix points with a matching single-GPU point to fit the PCIe link to")
    elsewhere = sorted({m.config.gpu.name for _, m in pairs if m.config.gpu.interconnect != PCIE_HELIX})
    if elsewhere:  # their speedups would not move with the fitted link
        raise CoralError(f"GPU(s) {', '.join(elsewhere)} have Helix multi-GPU profiles but interconnect "
                         f"!= {PCIE_HELIX!r} in gpus.csv; point them at {PCIE_HELIX}")
    out: dict[int, LinkFit] = {}
    for n in counts:
        mine = [(o, m) for o, m in pairs if m.config.count == n]

        def make(x: np.ndarray, n: int = n) -> LinkFit:
            return LinkFit(interconnect=PCIE_HELIX, gpus=n, floor_s=float(x[0]) * 1e-6, latency_s=float(x[0]) * 1e-6,
                           bus_gb_per_s=float(x[1]), size_exponent=1.0, source="helix")

        def residuals(x: np.ndarray, mine: list[tuple[Measurement, Measurement]] = mine, n: int = n) -> np.ndarray:
            perf = RooflinePerf(efficiency=efficiency, links={(PCIE_HELIX, n): make(x)})
            return np.array([math.log(_speedup(perf, model, o, m) / (o.layer_ms / m.layer_ms)) for o, m in mine])

        fit = least_squares(residuals, np.array([100.0, 5.0]), bounds=([0.0, 0.1], [5000.0, 100.0]))
        x = fit.x
        out[n] = LinkFit(interconnect=PCIE_HELIX, gpus=n, floor_s=round(float(x[0]), 1) * 1e-6,
                         latency_s=round(float(x[0]), 1) * 1e-6, bus_gb_per_s=round(float(x[1]), 2),
                         size_exponent=1.0,
                         source=f"fit: helix {' and '.join(sorted({m.config.name for _, m in mine}))} layer speedups")
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
        loo_links = {(PCIE_HELIX, n): f for n, f in fit_pcie(model, rest, eff).items()}
        loo = RooflinePerf(efficiency=eff, default=perf.default, system=perf.system,
                           links={**{k: v for k, v in perf.links.items() if k[0] != PCIE_HELIX}, **loo_links})
        for one, many in pairs:
            if many.config.name != node:
                continue
            rows.append(SpeedupRow(source="helix", config=node, phase=many.phase.value, tokens=many.tokens,
                                   measured=one.layer_ms / many.layer_ms, predicted=_speedup(perf, model, one, many),
                                   loo_predicted=_speedup(loo, model, one, many), in_target=True))
    return rows


def helix_heldout(model: ModelSpec, points: list[Measurement], perf: RooflinePerf,
                  interconnect: str = "pcie-l40s") -> list[SpeedupRow]:
    """The Helix TP target points predicted with another PCIe host's measured all-reduce (default
    the L40S NCCL fit) in place of the `pcie-helix` rows: how far one measured PCIe host is from
    another. No Helix point enters that fit, so `loo_predicted` equals `predicted`.

    Raises:
        CoralError: when `perf` has no rows for `interconnect`.
    """
    swap = {(PCIE_HELIX, n): replace(f, interconnect=PCIE_HELIX) for (ic, n), f in perf.links.items() if ic == interconnect}
    if not swap:
        raise CoralError(f"no all-reduce rows for interconnect {interconnect!r}")
    other = RooflinePerf(efficiency=perf.efficiency, default=perf.default, system=perf.system,
                         links={**{k: v for k, v in perf.links.items() if k[0] != PCIE_HELIX}, **swap})
    rows = []
    for one, many in _speedup_pairs(points, all_points=False):
        predicted = _speedup(other, model, one, many)
        rows.append(SpeedupRow(source=f"helix vs {interconnect}", config=many.config.name, phase=many.phase.value,
                               tokens=many.tokens, measured=one.layer_ms / many.layer_ms, predicted=predicted,
                               loo_predicted=predicted, in_target=False))
    return rows


_VIDUR_LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
                    "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def vidur_layer_ms(folder: str | Path, gpu_key: str, tokens: int = VIDUR_TP_TOKENS) -> dict[int, float]:
    """Measured Llama-2-70B layer ms without attention (Vidur has no attention timings) per TP degree:
    the sum of the per-op medians of `compute_<gpu>_meta-llama_Llama-2-70b-hf_mlp.csv.gz` at `tokens`."""
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


# --- interconnects.csv: every row from the measurements above ----------------------------------------

# V100's NVLink2 is 300 GB/s per GPU where A100's NVLink3 is 600 (datasheets) and no V100 collective
# is measured: its rows are the A100 fit with the bus bandwidth scaled by that ratio.
DERIVED_LINKS = {"nvlink-v100": ("nvlink-a100", 300 / 600)}
LINK_COUNTS = (2, 4, 8)


def link_table(nccl_path: str | Path, helix_folder: str | Path, catalog: Catalog) -> dict[tuple[str, int], LinkFit]:
    """Every row of `interconnects.csv`, in file order:

    - the NCCL fits per measured GPU (`measured_links`);
    - `pcie-helix` 2 and 4 GPUs fitted to Helix's L4 / T4 layer speedups (`fit_pcie`); Helix has no
      8-GPU node, so 8 is the 4-GPU row with latency and bus bandwidth scaled by the L40S host's
      measured 4 -> 8 steps (the one PCIe host measured at 8 GPUs);
    - `DERIVED_LINKS` (not measured).

    Raises:
        CoralError: when a profile file or folder is missing.
    """
    out = measured_links(nccl_path)
    model = builtin_model("llama-2-70b")
    points = load_helix_profiles(helix_folder, catalog)
    helix = fit_pcie(model, points, single_gpu_efficiency(model, points))
    for n in LINK_COUNTS:
        if n in helix:
            out[(PCIE_HELIX, n)] = helix[n]
            continue
        m = max(k for k in helix if k < n)
        base, lo, hi = helix[m], out[("pcie-l40s", m)], out[("pcie-l40s", n)]
        latency_us = round(base.latency_s * hi.latency_s / lo.latency_s * 1e6, 1)
        out[(PCIE_HELIX, n)] = LinkFit(
            interconnect=PCIE_HELIX, gpus=n, floor_s=latency_us * 1e-6, latency_s=latency_us * 1e-6,
            bus_gb_per_s=round(base.bus_gb_per_s * hi.bus_gb_per_s / lo.bus_gb_per_s, 2), size_exponent=1.0,
            source=f"assumed: {PCIE_HELIX} x{m} with latency and bus scaled by pcie-l40s's measured x{m} -> x{n}")
    for name, (base_ic, ratio) in DERIVED_LINKS.items():
        for n in LINK_COUNTS:
            f = out[(base_ic, n)]
            out[(name, n)] = replace(f, interconnect=name, bus_gb_per_s=round(f.bus_gb_per_s * ratio, 1),
                                     source=f"unmeasured: {base_ic} x{n} with bus x {ratio:g}")
    return out


def render_interconnects(links: dict[tuple[str, int], LinkFit]) -> str:
    """The text of `interconnects.csv` for `links` (header comments name the data behind each group)."""
    head = [
        "# All-reduce cost per (interconnect, GPUs per node): t(s) = max(floor, latency + 2(n-1)/n * 32MiB/bus"
        " * (s/32MiB)^size_exponent).",
        "# Written by tools/fit_links.py (coral.perf.calibrate.link_table); see docs/reference/perf.md. Provenance per row"
        " in `source`.",
        f"# {', '.join(AIC_SYSTEMS.values())}: fitted to the measured NCCL all-reduce shipped in",
        f"#   aiconfigurator-core (src/coral/data/profiles/{AIC_FILE}), 4 KiB - 256 MiB, GPUs of one node.",
        f"# {PCIE_HELIX} (L4, T4; A10G assumed): fitted to Helix's LLaMA-2-70B layer speedups on 2xL4, 2xT4 and"
        " 4xT4 (Thesys-lab/Helix-ASPLOS25@148b733);",
        "#   8 GPUs is NOT measured: the 4-GPU row scaled by the L40S host's measured 4 -> 8 steps.",
        f"# {', '.join(DERIVED_LINKS)}: NOT measured; scaled from a measured group (see `source`).",
        "interconnect,gpus,floor_us,latency_us,bus_gb_per_s,size_exponent,source",
    ]
    rows = [f"{f.interconnect},{f.gpus},{f.floor_s * 1e6:.1f},{f.latency_s * 1e6:.1f},{f.bus_gb_per_s:g},"
            f"{f.size_exponent:g},{f.source}" for f in links.values()]
    return "\n".join(head + rows) + "\n"


# --- The whole report (`coral calibrate`, `make bench`) --------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationReport:
    """Every fit `coral calibrate` makes, with its in-sample, leave-one-out and held-out errors."""

    fitted: dict[str, Efficiency]
    layer_rows: list[CalibrationRow]
    layer_summary: dict[str, float]
    pcie: dict[int, LinkFit]
    speedups: list[SpeedupRow]
    speedup_summary: dict[str, float]
    # the NCCL fits (aiconfigurator) with their in-sample errors over LINK_FIT_SIZES
    links: list[tuple[LinkFit, dict[str, float]]]
    # held out: the Helix points with the L40S NCCL fit in place of pcie-helix
    helix_heldout: list[SpeedupRow]
    # held out: Vidur's own fit of each DGX curve, and the shipped fit's errors against that curve
    allreduce: list[tuple[LinkFit, dict[str, float]]]
    gemm: dict[str, tuple[float, float, float, int]]
    sends: list[dict[str, Any]]


def calibration_report(helix_folder: str | Path, vidur_folder: str | Path | None, catalog: Catalog,
                       nccl_path: str | Path | None = None) -> CalibrationReport:
    """Fit and check everything against the shipped defaults' structure: single-GPU efficiencies
    (Helix), the `pcie-helix` link (Helix multi-GPU), the NCCL links (aiconfigurator, when
    `nccl_path` is given), GEMM efficiencies (Vidur), TP speedups (Helix + Vidur whole layers),
    the held-out all-reduce checks (Vidur's DGX curves, Helix with the L40S link) and pipeline
    sends (Vidur send_recv). The speedups, checks and sends use the *shipped* model
    (`RooflinePerf()`), so they check what plans use.

    Raises:
        CoralError: when a profile folder or file is missing.
    """
    model = builtin_model("llama-2-70b")
    points = load_helix_profiles(helix_folder, catalog)
    fitted, rows = calibrate(model, points)
    pcie = fit_pcie(model, points, fitted)
    shipped = RooflinePerf()
    speedups = helix_speedups(model, points, shipped)
    links: list[tuple[LinkFit, dict[str, float]]] = []
    if nccl_path is not None:
        fits = measured_links(nccl_path)
        for curve in load_nccl_allreduce(nccl_path):
            if curve.node in AIC_SYSTEMS:
                fit = fits[(AIC_SYSTEMS[curve.node], curve.gpus)]
                links.append((fit, allreduce_errors(fit, curve, LINK_FIT_SIZES)))
    allreduce: list[tuple[LinkFit, dict[str, float]]] = []
    gemm: dict[str, tuple[float, float, float, int]] = {}
    sends: list[dict[str, Any]] = []
    if vidur_folder is not None:
        speedups += vidur_speedups(vidur_folder, model, catalog, shipped)
        for curve in intra_node_curves(load_vidur_network(vidur_folder)):
            fit = fit_allreduce(curve, VIDUR_NODES[curve.node])
            shipped_fit = shipped.links[(fit.interconnect, fit.gpus)]
            allreduce.append((fit, {**allreduce_errors(shipped_fit, curve),
                                    **{f"heldout_{k}": v for k, v in
                                       allreduce_errors(shipped_fit, curve, VIDUR_HELDOUT_SIZES).items()}}))
        by_gpu: dict[str, list[OpMeasurement]] = {}
        for p in load_vidur_mlp(vidur_folder):
            by_gpu.setdefault(p.gpu, []).append(p)
        for g, pts in by_gpu.items():
            ef, eb, err = fit_gemm_efficiency(pts, catalog.gpu(g))
            gemm[g] = (ef, eb, err, len(pts))
        sends = send_check(vidur_folder, shipped, catalog)
    return CalibrationReport(fitted=fitted, layer_rows=rows, layer_summary=summarize(rows), pcie=pcie,
                             speedups=speedups, speedup_summary=summarize_speedups(speedups), links=links,
                             helix_heldout=helix_heldout(model, points, shipped), allreduce=allreduce,
                             gemm=gemm, sends=sends)
