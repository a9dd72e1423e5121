"""`coral calibrate`: fit the performance model to measurements and print every fit's error."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from statistics import fmean
from typing import Any

import click
from rich.table import Table

from coral.catalog import builtin_catalog
from coral.catalog.catalog import builtin_links
from coral.cli.common import console, emit_json, json_opt


@click.command("calibrate")
@click.option("--profiles", type=click.Path(), default=None,
              help="Folder of Helix *_bs2time.csv files (default: profiles/helix_llama2_70b of the public data).")
@click.option("--data-dir", type=click.Path(), default=None, help="Public data folder holding profiles/ (default: $CORAL_DATA_DIR, else the copy shipped with Coral).")
@click.option("--all-points", is_flag=True, help="Print every point, not a summary per node and phase.")
@json_opt
def calibrate_cmd(profiles: str | None, data_dir: str | None, all_points: bool, as_json: bool) -> None:
    """Fit the performance model to measurements and print every fit's error, in-sample,
    leave-one-out and held out: per-GPU efficiencies (Helix), tensor-parallel speedups on PCIe
    (Helix 2xL4, 2xT4, 4xT4) and NVLink (Vidur 4x/8x H100, A100-80GB), the NCCL all-reduce fits
    per GPU (aiconfigurator's measurements) with their held-out checks (Vidur's DGX curves; Helix
    with the L40S link), GEMM fits and pipeline sends (Vidur), and the per-GPU efficiencies
    fitted to layers rebuilt from measured vLLM kernels (aiconfigurator) with their held-out
    models and the gpt-oss MoE check. `python tools/fit_links.py` and `python
    tools/fit_kernels.py` rewrite / check the shipped all-reduce rows and kernel efficiencies."""
    # lazy: the fits (numpy, scipy) load when the command runs, not when `coral` starts
    from coral.perf.calibrate import calibration_report
    from coral.perf.collectives import AIC_FILE
    from coral.workload_data import public_data_path

    folder = profiles or str(public_data_path("profiles/helix_llama2_70b", data_dir))
    vidur = public_data_path("profiles/vidur", data_dir) if (profiles is None or data_dir is not None) else None
    nccl = public_data_path(f"profiles/{AIC_FILE}", data_dir) if (profiles is None or data_dir is not None) else None
    rep = calibration_report(folder, vidur, builtin_catalog(), nccl)
    kernels = None
    if profiles is None or data_dir is not None:
        # lazy: the kernel tables' fit (numpy, scipy) loads only when they are read
        from coral.perf.kernels import KERNELS_DIR, kernel_report

        kernels = kernel_report(public_data_path(f"profiles/{KERNELS_DIR}", data_dir), builtin_catalog())
    if as_json:
        return emit_json(_report_json(rep, kernels))
    _print_layers(rep, all_points)
    _print_speedups(rep)
    _print_links(rep)
    if rep.allreduce:
        _print_vidur(rep)
    if kernels is not None:
        _print_kernels(kernels)


def _report_json(rep: Any, kernels: Any) -> dict[str, Any]:
    """The `--json` document of a `CalibrationReport` (and the kernel fit, when it was read)."""
    return {
        "fitted": {k: asdict(v) for k, v in rep.fitted.items()}, "summary": rep.layer_summary,
        "pcie": {str(n): asdict(f) for n, f in rep.pcie.items()},
        "tp_speedups": [{**asdict(r), "error": r.error, "loo_error": r.loo_error} for r in rep.speedups],
        "tp_summary": rep.speedup_summary,
        "links": [{**asdict(f), **e} for f, e in rep.links],
        "helix_heldout": [{**asdict(r), "error": r.error} for r in rep.helix_heldout],
        "allreduce_vidur_heldout": [{**asdict(f), **e} for f, e in rep.allreduce],
        "gemm": {g: {"eta_f": v[0], "eta_b": v[1], "median_abs_error": v[2], "points": v[3]} for g, v in rep.gemm.items()},
        "sends": rep.sends, "points": [asdict(r) for r in rep.layer_rows],
        **({} if kernels is None else {"kernels": _kernels_json(kernels)})}


def _print_layers(rep: Any, all_points: bool) -> None:
    """The fitted single-GPU efficiencies and the per-layer errors (per node and phase, or every point)."""
    t = Table(title="Fitted single-GPU efficiencies (η_F prefill, η_F decode, η_B, per-layer overhead)")
    for col in ("GPU", "η_F", "η_F decode", "η_B", "overhead µs"):
        t.add_column(col)
    for g, e in rep.fitted.items():
        t.add_row(g, f"{e.flops:.3f}", f"{e.decode_flops or e.flops:.3f}", f"{e.bandwidth:.3f}", f"{e.layer_overhead_s * 1e6:.0f}")
    console.print(t)
    t = Table(title="Predicted vs measured per-layer ms (points with >= 250 prompt tokens or decode batch >= 8)")
    for col in ("node", "phase", "tokens" if all_points else "points", "measured", "predicted", "error", "leave-one-GPU-out error"):
        t.add_column(col, justify="right")
    if all_points:
        for r in rep.layer_rows:
            t.add_row(r.config, r.phase, str(r.tokens), f"{r.measured_ms:.2f}", f"{r.predicted_ms:.2f}",
                      f"{r.error:+.1%}", f"{r.loo_error:+.1%}")
    else:
        groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for r in rep.layer_rows:
            if r.counted:
                groups[(r.config, r.phase)].append(r)
        for (cfg, ph), rs in groups.items():
            t.add_row(cfg, ph, str(len(rs)), f"{fmean(r.measured_ms for r in rs):.2f} (mean)",
                      f"{fmean(r.predicted_ms for r in rs):.2f} (mean)", f"{fmean(abs(r.error) for r in rs):.1%} (MAE)",
                      f"{fmean(abs(r.loo_error) for r in rs):.1%} (MAE)")
    console.print(t)
    summary = rep.layer_summary
    console.print(f"single GPU: median |error| {summary['single_gpu_median_abs_error']:.1%} over "
                  f"{summary['single_gpu_points']:.0f} points (leave-one-GPU-out {summary['single_gpu_loo_median_abs_error']:.1%}); "
                  f"all nodes: median {summary['median_abs_error']:.1%}, p90 {summary['p90_abs_error']:.1%} over "
                  f"{summary['counted_points']:.0f} points")


def _print_speedups(rep: Any) -> None:
    """The tensor-parallel speedups and the Helix points with the L40S link held out."""
    t = Table(title="Tensor-parallel speedup T(1 GPU)/T(n GPUs) (leave-one-out: PCIe without that node; NVLink: another GPU count's all-reduce fit)")
    for col in ("source", "node", "phase", "tokens", "measured", "predicted", "error", "leave-one-out error"):
        t.add_column(col, justify="right")
    for sp in rep.speedups:
        t.add_row(sp.source, sp.config, sp.phase, str(sp.tokens), f"{sp.measured:.2f}", f"{sp.predicted:.2f}",
                  f"{sp.error:+.1%}", f"{sp.loo_error:+.1%}")
    console.print(t)
    tp = rep.speedup_summary
    console.print(f"TP speedup: median |error| {tp['median_abs_error']:.1%}, worst {tp['worst_abs_error']:.1%} over "
                  f"{tp['points']:.0f} points (target <= 10 % / 20 %); leave-one-out median {tp['loo_median_abs_error']:.1%}, "
                  f"worst {tp['loo_worst_abs_error']:.1%}")
    t = Table(title="Held out: the Helix points with the L40S NCCL fit (pcie-l40s) in place of pcie-helix")
    for col in ("node", "phase", "tokens", "measured", "predicted", "error"):
        t.add_column(col, justify="right")
    for sp in rep.helix_heldout:
        t.add_row(sp.config, sp.phase, str(sp.tokens), f"{sp.measured:.2f}", f"{sp.predicted:.2f}", f"{sp.error:+.1%}")
    console.print(t)


def _print_links(rep: Any) -> None:
    """The pcie-helix fit and the NCCL fits to aiconfigurator's all-reduce."""
    t = Table(title="pcie-helix all-reduce fitted to Helix's multi-GPU nodes (shipped: interconnects.csv)")
    for col in ("GPUs", "latency µs", "bus GB/s", "from"):
        t.add_column(col)
    for n, f in rep.pcie.items():
        t.add_row(str(n), f"{f.latency_s * 1e6:.1f}", f"{f.bus_gb_per_s:.2f}", f.source)
    console.print(t)
    if rep.links:
        t = Table(title="NCCL all-reduce fits to aiconfigurator's measurements, 4 KiB - 256 MiB (shipped: interconnects.csv)")
        for col in ("link", "GPUs", "floor µs", "latency µs", "bus GB/s @32MiB", "size exp.", "median |error|", "worst |error|"):
            t.add_column(col, justify="right")
        for fit, errs in rep.links:
            t.add_row(fit.interconnect, str(fit.gpus), f"{fit.floor_s * 1e6:.1f}", f"{fit.latency_s * 1e6:.1f}",
                      f"{fit.bus_gb_per_s:g}", f"{fit.size_exponent:.3f}", f"{errs['median_binned_abs_error']:.1%}",
                      f"{errs['worst_binned_abs_error']:.1%}")
        console.print(t)


def _print_vidur(rep: Any) -> None:
    """Vidur's held-out checks: DGX all-reduce, GEMM timings and pipeline sends."""
    t = Table(title="Held out: the shipped NCCL fit against Vidur's DGX all-reduce (Vidur's own fit for comparison)")
    for col in ("link", "GPUs", "Vidur bus GB/s @32MiB", "shipped bus GB/s", "worst |error| 1-64 MiB",
                "worst |error| 8-64 MiB"):
        t.add_column(col, justify="right")
    for fit, errs in rep.allreduce:
        ship = f"{builtin_links()[(fit.interconnect, fit.gpus)].bus_gb_per_s:g}"
        t.add_row(fit.interconnect, str(fit.gpus), f"{fit.bus_gb_per_s:.1f}", ship,
                  f"{errs['worst_binned_abs_error']:.1%}", f"{errs['heldout_worst_binned_abs_error']:.1%}")
    console.print(t)
    t = Table(title="Vidur per-operator GEMM timings (a layer's four projections, TP 1-8)")
    for col in ("GPU", "points", "η_F", "η_B", "median |error|"):
        t.add_column(col)
    for g, (ef, eb, err, n_pts) in rep.gemm.items():
        t.add_row(g, str(n_pts), f"{ef:.3f}", f"{eb:.3f}", f"{err:.1%}")
    console.print(t)
    t = Table(title="Pipeline send: Vidur cross-node send_recv (one GPU per node) vs the model's inter-stage send")
    for col in ("node", "MiB", "measured ms", "measured GB/s", "model ms (8-GPU AWS node network)"):
        t.add_column(col, justify="right")
    for row in rep.sends:
        t.add_row(row["node"], f"{row['size_mib']:g}", f"{row['measured_ms']:.3f}", f"{row['measured_gb_per_s']:.1f}",
                  f"{row['model_ms']:.3f} ({row['node_network_gbps']:g} Gbps)")
    console.print(t)


def _kernels_json(rep: Any) -> dict[str, Any]:
    return {"fitted": {g: asdict(e) for g, e in rep.fitted.items()},
            "summary": [{"gpu": g, "phase": ph, "held_out": held, **s} for (g, ph, held), s in rep.summary().items()],
            "moe_summary": [{"gpu": g, "phase": ph, **s} for (g, ph, _), s in rep.summary(rep.moe_rows).items()],
            "points": [{**asdict(r), "error": r.error} for r in rep.rows + rep.moe_rows]}


def _print_kernels(rep: Any) -> None:
    """The kernel fit (coral.perf.kernels): efficiencies, then errors per GPU and phase, fit / held out / MoE."""
    t = Table(title="Efficiencies fitted to layers rebuilt from measured vLLM kernels (aiconfigurator; shipped: "
                    "KERNEL_EFFICIENCY)")
    for col in ("GPU", "η_F", "η_F decode", "η_B", "overhead µs"):
        t.add_column(col)
    for g, e in rep.fitted.items():
        t.add_row(g, f"{e.flops:.3f}", f"{e.decode_flops:.3f}", f"{e.bandwidth:.3f}", f"{e.layer_overhead_s * 1e6:.1f}")
    console.print(t)
    t = Table(title="Rebuilt layers vs the roofline: fit (Qwen3-32B, Llama-3-70B, Llama-3.2-3B), held out (Llama-3.1-8B, "
                    "Qwen3-14B, Qwen3-1.7B), MoE (gpt-oss-20b/120b, signed)")
    for col in ("GPU", "phase", "set", "points", "median |error|", "worst |error|"):
        t.add_column(col, justify="right")
    for (g, ph, held), s in sorted(rep.summary().items()):
        t.add_row(g, ph, "held out" if held else "fit", f"{s['points']:.0f}", f"{s['median_abs_error']:.1%}",
                  f"{s['worst_abs_error']:.1%}")
    moe: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rep.moe_rows:
        moe[(r.gpu, r.phase)].append(r.error)
    for (g, ph), errs in sorted(moe.items()):
        errs.sort()
        t.add_row(g, ph, "MoE", str(len(errs)), f"{errs[len(errs) // 2]:+.1%} (median)", f"{errs[0]:+.1%} .. {errs[-1]:+.1%}")
    console.print(t)
