"""Command-line interface: parse -> load config -> call the core -> write outputs."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from coral import __version__
from coral.atomic import write_text
from coral.cli_support import (
    EXIT_INFEASIBLE,
    CoralGroup,
    check_output_path,
    err_console,
    progress_display,
    stdout_console,
)
from coral.errors import CoralError

console = stdout_console()
_Group = CoralGroup


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="coral")
def main() -> None:
    """Coral: plan, simulate and serve many LLMs on heterogeneous cloud GPUs at the lowest cost
    that meets every model's latency SLO.

    \b
    Start with:
      coral catalog configs            node shapes and their prices
      coral scenario show core         a built-in scenario, resolved
      coral perf --model qwen3-32b --node 1xL40S --phase decode --batch 8 --prompt-tokens 1000
      coral templates solve --model qwen3-32b --phase prefill --slo-ms 2500 --nodes 1xL40S,1xL40S,2xL4
      coral scenario init my.yaml      a commented starter scenario of your own

    \b
    Exit codes: 0 done; 2 bad input (one line naming the field, nothing written);
    4 `coral plan` found no plan that serves any demand (nothing written).
    """


# --- catalog ---------------------------------------------------------------------------------

@main.group(cls=_Group)
def catalog() -> None:
    """The built-in catalog: GPU types, node configurations, prices per region, model specs."""


def _catalog(prices: str | None) -> Any:
    from coral.catalog import builtin_catalog, load_prices_csv

    cat = builtin_catalog()
    return load_prices_csv(prices, cat) if prices else cat


_prices_opt = click.option("--prices", type=click.Path(dir_okay=False), default=None,
                           help="Use this price CSV (our format = gpu_nodes.csv columns, or a SkyPilot vms.csv).")
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@catalog.command("gpus")
@_json_opt
def catalog_gpus(as_json: bool) -> None:
    """GPU types and their datasheet figures."""
    cat = _catalog(None)
    rows = [asdict(g) for g in cat.gpus.values()]
    if as_json:
        return _emit_json(rows)
    t = Table(title="GPU types")
    for col in ("name", "memory GiB", "HBM GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "intra-node GB/s", "interconnect"):
        t.add_column(col, justify="right" if col not in ("name", "interconnect") else "left")
    for g in cat.gpus.values():
        t.add_row(g.name, f"{g.memory_gib:g}", f"{g.hbm_gb_per_s:g}", f"{g.bf16_tflops:g}",
                  f"{g.fp8_tflops:g}" if g.fp8_tflops else "-", f"{g.intra_node_gb_per_s:g}", g.interconnect)
    console.print(t)


@catalog.command("configs")
@_prices_opt
@_json_opt
def catalog_configs(prices: str | None, as_json: bool) -> None:
    """Node configurations `<n>x<GPU>` sold somewhere, with network and the regions selling them."""
    cat = _catalog(prices)
    rows = []
    for name, c in cat.configs.items():
        regions = sorted(r for (r, cfg) in cat.offers if cfg == name)
        rows.append({"config": name, "gpu": c.gpu.name, "gpus": c.count, "memory_gib": c.count * c.gpu.memory_gib,
                     "network_gbps": c.network_gbps, "regions": regions})
    if as_json:
        return _emit_json(rows)
    t = Table(title="Node configurations")
    for col in ("config", "GPU memory GiB", "network Gbps", "sold in"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["config"], f"{r['memory_gib']:g}", f"{r['network_gbps']:g}", ", ".join(r["regions"]))
    console.print(t)


@catalog.command("prices")
@click.option("--region", default=None, help="Only this region (e.g. aws:us-east-2).")
@_prices_opt
@_json_opt
def catalog_prices(region: str | None, prices: str | None, as_json: bool) -> None:
    """On-demand (and spot) $/h of every configuration in every region (cheapest instance type)."""
    cat = _catalog(prices)
    if region:
        cat.check_region(region)
    rows = [asdict(o) for (r, _), o in sorted(cat.offers.items()) if region in (None, r)]
    if as_json:
        return _emit_json(rows)
    t = Table(title="Prices ($/h per node)")
    for col in ("region", "config", "instance type", "on-demand", "spot", "network Gbps"):
        t.add_column(col)
    for o in rows:
        t.add_row(o["region"], o["config"], o["instance_type"],
                  f"{o['price_usd_per_h']:.3f}" + (" SUSPECT" if o["suspect"] else ""),
                  f"{o['spot_usd_per_h']:.3f}" if o["spot_usd_per_h"] is not None else "-", f"{o['network_gbps']:g}")
    console.print(t)
    if any(o["suspect"] for o in rows):
        console.print("SUSPECT: the data README tags this row's price as unreliable; `--json` has its note")


@catalog.command("models")
@click.option("--config-json", "config_json", type=click.Path(), default=None,
              help="Describe this Hugging Face config.json instead of the built-ins.")
@_json_opt
def catalog_models(config_json: str | None, as_json: bool) -> None:
    """Built-in model specs and their derived sizes (or one config.json of yours)."""
    from coral.catalog import builtin_model, builtin_model_names, load_hf_config

    specs = [load_hf_config(config_json)] if config_json else [builtin_model(n) for n in builtin_model_names()]
    rows: list[dict[str, Any]] = [{"name": m.name, "architecture": m.architecture, "layers": m.num_layers, "total_params_b": m.total_params / 1e9,
             "active_params_b": m.active_params / 1e9, "weights_gib": m.weights_bytes / 2**30,
             "layer_weight_gib": m.layer_weight_bytes / 2**30, "kv_bytes_per_token": m.kv_bytes_per_token,
             "experts": m.num_experts, "sliding_layers": m.sliding_layers} for m in specs]
    if as_json:
        return _emit_json(rows)
    t = Table(title="Models")
    for col in ("name", "arch", "layers", "params B (active)", "weights GiB", "GiB/layer", "KV B/token", "MoE", "sliding"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["architecture"].removesuffix("ForCausalLM"), str(r["layers"]),
                  f"{r['total_params_b']:.1f} ({r['active_params_b']:.1f})", f"{r['weights_gib']:.1f}",
                  f"{r['layer_weight_gib']:.2f}", f"{r['kv_bytes_per_token']:,.0f}",
                  f"{r['experts']}" if r["experts"] else "-", str(r["sliding_layers"] or "-"))
    console.print(t)


# --- perf --------------------------------------------------------------------------------------

@main.command("perf")
@click.option("--model", required=True, help="Built-in model name (see `coral catalog models`) or a config.json path.")
@click.option("--node", required=True, help="Node configuration, e.g. 1xA100-40GB (see `coral catalog configs`).")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), required=True)
@click.option("--batch", type=click.IntRange(min=1), required=True, help="Micro-batch size (requests).")
@click.option("--prompt-tokens", type=click.FloatRange(min=1), required=True, help="Mean prompt length.")
@click.option("--output-tokens", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Mean output length (decode attends over prompt + output/2).")
@click.option("--stages", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline depth (decode holds KV for this many micro-batches).")
@click.option("--profile", type=click.Path(), default=None,
              help="Time layers with this profile CSV (or Helix profile folder) instead of the roofline.")
@_json_opt
def perf_cmd(model: str, node: str, phase: str, batch: int, prompt_tokens: float, output_tokens: float,
             stages: int, profile: str | None, as_json: bool) -> None:
    """Per-layer time, one-node throughput and memory cap of MODEL on NODE (DESIGN §2)."""
    from coral.catalog import builtin_catalog, builtin_model, builtin_model_names, load_hf_config
    from coral.errors import unknown
    from coral.perf import Phase, RooflinePerf, Shape, load_profile_csv, profile_from_helix

    cat = builtin_catalog()
    cfg = cat.config(node)
    if model.endswith(".json") or "/" in model:
        spec = load_hf_config(model)
    elif model in builtin_model_names():
        spec = builtin_model(model)
    else:
        raise unknown("model", model, builtin_model_names())
    perf: Any = RooflinePerf()
    if profile:
        perf = profile_from_helix(profile, cat) if Path(profile).is_dir() else load_profile_csv(profile, cat, fallback=perf)
    shape = Shape(phase=Phase(phase), batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    layer_s = perf.layer_time_s(cfg, spec, shape)
    caps = {name: perf.max_layers(cfg, spec, shape, stages=stages, first=f, last=la)
            for name, f, la in (("middle", False, False), ("first", True, False), ("last", False, True), ("only", True, True))}
    whole_s = spec.num_layers * layer_s + perf.stage_extra_s(cfg, spec, shape, first=True, last=True)
    out = {
        "model": spec.name, "node": cfg.name, "phase": phase, "batch": batch, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens, "backend": perf.version,
        "layer_ms": layer_s * 1e3,
        "throughput_tok_per_s": shape.work_tokens / layer_s,
        "max_layers": caps["middle"], "max_layers_by_position": caps,
        "whole_model_ms": whole_s * 1e3, "whole_model_fits": caps["only"] >= spec.num_layers,
        "weights_gib_per_layer": spec.layer_weight_bytes / 2**30,
        "kv_transfer_ms_per_request": perf.kv_transfer_s(spec, prompt_tokens, cfg, cfg) * 1e3,
    }
    if isinstance(perf, RooflinePerf):
        flops, nbytes = perf.layer_flops_bytes(spec, shape)
        out.update(layer_gflops=flops / 1e9, layer_gbytes=nbytes / 1e9,
                   bound="compute" if flops / (cfg.gpu.bf16_tflops * 1e12 * perf.eff(cfg).flops) >
                   nbytes / (cfg.gpu.hbm_gb_per_s * 1e9 * perf.eff(cfg).bandwidth) else "memory")
    if as_json:
        return _emit_json(out)
    t = Table(title=f"{spec.name} {phase} on {cfg.name} (batch {batch}, prompt {prompt_tokens:g}, output {output_tokens:g})",
              show_header=False)
    t.add_row("per-layer time", f"{out['layer_ms']:.3f} ms" + (f"  ({out['bound']}-bound)" if "bound" in out else ""))
    t.add_row("one-layer throughput", f"{out['throughput_tok_per_s']:,.0f} tok/s")
    t.add_row("whole model on one node", f"{out['whole_model_ms']:.1f} ms" + ("" if out["whole_model_fits"] else "  (does not fit)"))
    t.add_row("memory cap (layers)", f"{caps['middle']} middle / {caps['first']} first / {caps['last']} last / {caps['only']} alone")
    t.add_row("KV transfer per request", f"{out['kv_transfer_ms_per_request']:.2f} ms")
    t.add_row("backend", perf.version)
    console.print(t)


# --- scenario ------------------------------------------------------------------------------------

@main.group(cls=_Group)
def scenario() -> None:
    """Scenarios: models + SLOs + workloads, configurations, regions, prices, planner knobs."""


@scenario.command("list")
def scenario_list() -> None:
    """Built-in scenario names."""
    from coral.scenario import builtin_scenario_names, load_scenario

    for name in builtin_scenario_names():
        click.echo(f"{name:10s} {load_scenario(name).description}")


def scenario_summary(s: Any) -> dict[str, Any]:
    from coral.allocator.demand import capacity_targets
    from coral.perf import Phase

    offered = _offered_demand(s)
    targets = capacity_targets(s)
    return {
        "name": s.name, "description": s.description,
        "models": [{"name": m.name, "spec": m.spec.name, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
                    "rate_per_s": m.rate_per_s, "dataset": m.workload.dataset,
                    "prompt_tokens_mean": m.prompt_tokens_mean, "output_tokens_mean": m.output_tokens_mean,
                    "slo_attainment": m.slo.attainment,
                    "demand_prefill_tok_per_s": offered[(m.name, Phase.PREFILL)],
                    "demand_decode_tok_per_s": offered[(m.name, Phase.DECODE)],
                    # the capacity the allocator plans for (queueing model on the traffic sample), as
                    # `allocator.build_inputs` computes it
                    "capacity_target_prefill_tok_per_s": targets[(m.name, Phase.PREFILL)].capacity_tok_per_s,
                    "capacity_target_decode_tok_per_s": targets[(m.name, Phase.DECODE)].capacity_tok_per_s,
                    "regions": list(m.regions) if m.regions else "all"} for m in s.models],
        "configs": [c.name for c in s.configs],
        "regions": [{"name": r, "offers": [{"config": c, "price_usd_per_h": s.prices[(r, c)],
                                            "available": s.availability[(r, c)], "derived": s.is_derived(r, c),
                                            **({"suspect": s.suspect[(r, c)]} if (r, c) in s.suspect else {})}
                                           for c in (cfg.name for cfg in s.configs) if (r, c) in s.prices]}
                    for r in s.regions],
        "warnings": s.warnings(),
        "perf": s.perf.version, "planner": s.planner.model_dump(),
    }


@scenario.command("show")
@click.argument("name")
@_json_opt
def scenario_show(name: str, as_json: bool) -> None:
    """Print scenario NAME (built-in name or YAML path) resolved: specs, demand, prices, availability."""
    from coral.scenario import load_scenario

    s = load_scenario(name)
    data = scenario_summary(s)
    for line in data["warnings"]:
        err_console.print(f"[yellow]warning:[/] {line}")
    if as_json:
        return _emit_json(data)
    console.print(f"[bold]{s.name}[/]: {s.description}")
    t = Table(title="Models")
    for col in ("model", "TTFT ms", "TPOT ms", "req/s", "dataset", "P̄ / D̄ tokens", "demand prefill / decode tok/s",
                "capacity target prefill / decode tok/s"):
        t.add_column(col)
    for m in data["models"]:
        t.add_row(m["name"], f"{m['ttft_ms']:g}", f"{m['tpot_ms']:g}", f"{m['rate_per_s']:g}", m["dataset"],
                  f"{m['prompt_tokens_mean']:.0f} / {m['output_tokens_mean']:.0f}",
                  f"{m['demand_prefill_tok_per_s']:,.0f} / {m['demand_decode_tok_per_s']:,.0f}",
                  f"{m['capacity_target_prefill_tok_per_s']:,.0f} / {m['capacity_target_decode_tok_per_s']:,.0f}")
    console.print(t)
    t = Table(title="Offers ($/h, available nodes)")
    t.add_column("config")
    for r in s.regions:
        t.add_column(r)
    for c in data["configs"]:
        cells = [f"{s.prices[(r, c)]:.2f} x{s.availability[(r, c)]}{' derived' if s.is_derived(r, c) else ''}"
                 f"{' SUSPECT' if (r, c) in s.suspect else ''}" if (r, c) in s.prices else "-" for r in s.regions]
        t.add_row(c, *cells)
    console.print(t)
    if s.derived:
        console.print("derived: a shape the region does not sell, priced per GPU from the nearest larger shape sold there "
                      "(derive_missing_prices)")
    console.print(f"perf model: {s.perf.version}; planner: {s.planner.model_dump()}")
    console.print("demand: the traffic (req/s x mean tokens); capacity target: what the plan provisions for it "
                  "(see `planner` in docs/scenarios.md)", highlight=False)


@scenario.command("init")
@click.argument("path", type=click.Path(dir_okay=False))
def scenario_init(path: str) -> None:
    """Write a commented starter scenario to PATH (never overwrites); edit it, then
    `coral scenario show PATH`. Every field is listed in docs/scenarios.md."""
    from coral.scenario.starter import STARTER_YAML

    p = check_output_path(path, "PATH", folder=False)
    if p.exists():
        raise CoralError(f"{p} already exists; give a new file name (coral scenario init never overwrites)")
    write_text(p, STARTER_YAML)
    console.print(f"wrote {p}; check it with `coral scenario show {p}`", highlight=False, soft_wrap=True)


# --- calibrate -------------------------------------------------------------------------------

@main.command("calibrate")
@click.option("--profiles", type=click.Path(), default=None,
              help="Folder of Helix *_bs2time.csv files (default: shared/data/profiles/helix_llama2_70b).")
@click.option("--data-dir", type=click.Path(), default=None, help="Copy of shared/data (default: $CORAL_DATA_DIR or ../shared/data).")
@click.option("--all-points", is_flag=True, help="Print every point, not a summary per node and phase.")
@_json_opt
def calibrate_cmd(profiles: str | None, data_dir: str | None, all_points: bool, as_json: bool) -> None:
    """Fit the performance model to measurements and print every fit's error, in-sample and
    leave-one-out: per-GPU efficiencies (Helix), tensor-parallel speedups on PCIe (Helix 2xL4,
    2xT4, 4xT4) and NVLink (Vidur 4x/8x H100, A100-80GB), NCCL all-reduce fits, GEMM fits and
    pipeline sends (Vidur)."""
    from collections import defaultdict
    from statistics import fmean

    from coral.catalog import builtin_catalog
    from coral.perf.calibrate import calibration_report
    from coral.workload_data import shared_data_dir

    folder = profiles or str(shared_data_dir(data_dir) / "profiles" / "helix_llama2_70b")
    vidur = shared_data_dir(data_dir) / "profiles" / "vidur" if (profiles is None or data_dir is not None) else None
    rep = calibration_report(folder, vidur, builtin_catalog())
    summary, tp = rep.layer_summary, rep.speedup_summary
    if as_json:
        return _emit_json({
            "fitted": {k: asdict(v) for k, v in rep.fitted.items()}, "summary": summary,
            "pcie": {str(n): asdict(f) for n, f in rep.pcie.items()},
            "tp_speedups": [{**asdict(r), "error": r.error, "loo_error": r.loo_error} for r in rep.speedups],
            "tp_summary": tp,
            "allreduce": [{**asdict(f), **e} for f, e in rep.allreduce],
            "gemm": {g: {"eta_f": v[0], "eta_b": v[1], "median_abs_error": v[2], "points": v[3]} for g, v in rep.gemm.items()},
            "sends": rep.sends, "points": [asdict(r) for r in rep.layer_rows]})
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
    console.print(f"single GPU: median |error| {summary['single_gpu_median_abs_error']:.1%} over "
                  f"{summary['single_gpu_points']:.0f} points (leave-one-GPU-out {summary['single_gpu_loo_median_abs_error']:.1%}); "
                  f"all nodes: median {summary['median_abs_error']:.1%}, p90 {summary['p90_abs_error']:.1%} over "
                  f"{summary['counted_points']:.0f} points")
    t = Table(title="Tensor-parallel speedup T(1 GPU)/T(n GPUs) (leave-one-out: PCIe without that node; NVLink: another GPU count's all-reduce fit)")
    for col in ("source", "node", "phase", "tokens", "measured", "predicted", "error", "leave-one-out error"):
        t.add_column(col, justify="right")
    for sp in rep.speedups:
        t.add_row(sp.source, sp.config, sp.phase, str(sp.tokens), f"{sp.measured:.2f}", f"{sp.predicted:.2f}",
                  f"{sp.error:+.1%}", f"{sp.loo_error:+.1%}")
    console.print(t)
    console.print(f"TP speedup: median |error| {tp['median_abs_error']:.1%}, worst {tp['worst_abs_error']:.1%} over "
                  f"{tp['points']:.0f} points (target <= 10 % / 20 %); leave-one-out median {tp['loo_median_abs_error']:.1%}, "
                  f"worst {tp['loo_worst_abs_error']:.1%}")
    t = Table(title="PCIe all-reduce fitted to Helix's multi-GPU nodes (shipped: interconnects.csv)")
    for col in ("GPUs", "latency µs", "bus GB/s", "from"):
        t.add_column(col)
    for n, f in rep.pcie.items():
        t.add_row(str(n), f"{f.latency_s * 1e6:.1f}", f"{f.bus_gb_per_s:.2f}", f.source)
    console.print(t)
    if rep.allreduce:
        t = Table(title="NCCL all-reduce fits to Vidur (error of the shipped fit at 1, 2, 4, ..., 64 MiB; target <= 15 %)")
        for col in ("link", "GPUs", "floor µs", "latency µs", "bus GB/s @32MiB", "size exp.", "worst |error|", "median raw |error|"):
            t.add_column(col, justify="right")
        for fit, errs in rep.allreduce:
            t.add_row(fit.interconnect, str(fit.gpus), f"{fit.floor_s * 1e6:.1f}", f"{fit.latency_s * 1e6:.1f}",
                      f"{fit.bus_gb_per_s:.1f}", f"{fit.size_exponent:.3f}", f"{errs['worst_binned_abs_error']:.1%}",
                      f"{errs['median_raw_abs_error']:.1%}")
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


# --- templates -------------------------------------------------------------------------------------

@main.group(cls=_Group)
def templates() -> None:
    """Serving templates: throughput-optimal placements of a model on node multisets (DESIGN §3)."""


def _placement_table(tmpl_dict: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    for col in ("stage", "nodes (data parallel)", "layers", "stage time ms", "stage tok/s"):
        t.add_column(col)
    start = 0
    for i, st in enumerate(tmpl_dict["stages"]):
        t.add_row(str(i), " + ".join(st["nodes"]), f"{start}-{start + st['layers'] - 1} ({st['layers']})",
                  f"{st['stage_time_ms']:.1f}", f"{st['throughput_tok_per_s']:,.0f}")
        start += st["layers"]
    return t


@templates.command("solve")
@click.option("--model", required=True, help="Built-in model name or config.json path.")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), required=True)
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), required=True, help=(
    "TTFT (prefill) or TPOT (decode) SLO; the placement is held to the budget the planner derives from it "
    "(prefill: ttft_headroom x SLO, 0.5 by default; decode: tpot_headroom x SLO, 0.9, with no KV transfer)."))
@click.option("--nodes", required=True, help="Comma-separated node multiset, e.g. 1xL4,1xL40S,1xL40S.")
@click.option("--prompt-tokens", type=click.FloatRange(min=1), default=1024.0, show_default=True)
@click.option("--output-tokens", type=click.FloatRange(min=0), default=256.0, show_default=True)
@click.option("--solver", type=click.Choice(["exact", "ilp"]), default="exact", show_default=True)
@click.option("--backend", type=click.Choice(["highs", "cpsat"]), default="highs", show_default=True, help="ILP backend (with --solver ilp).")
@click.option("--batches", default="1,2,4,8,16,32,64,128", show_default=True, help="Micro-batch sizes to try.")
@click.option("--n-max", type=click.IntRange(1, 8), default=6, show_default=True)
@_json_opt
def templates_solve(model: str, phase: str, slo_ms: float, nodes: str, prompt_tokens: float, output_tokens: float,
                    solver: str, backend: str, batches: str, n_max: int, as_json: bool) -> None:
    """Solve one template: the best placement of MODEL on a node multiset under an SLO."""
    from coral.catalog import builtin_catalog, builtin_model, builtin_model_names, load_hf_config
    from coral.errors import unknown
    from coral.perf import Phase, RooflinePerf
    from coral.scenario.schema import PlannerEntry
    from coral.slo import Slo
    from coral.templates.budget import latency_budget_ms
    from coral.templates.library import (
        TemplateSpec,
        _Timings,
        check_multiset,
        solve_multiset,
        template_to_dict,
    )
    from coral.templates.template import Template

    cat = builtin_catalog()
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    check_multiset(names, n_max)
    configs = tuple({c.name: c for c in (cat.config(n) for n in names)}.values())
    names = sorted(cat.config(n).name for n in names)
    if model.endswith(".json") or "/" in model:
        spec = load_hf_config(model)
    elif model in builtin_model_names():
        spec = builtin_model(model)
    else:
        raise unknown("model", model, builtin_model_names())
    try:
        grid = tuple(sorted({int(b) for b in batches.split(",") if b.strip()}))
    except ValueError:
        raise CoralError(f"--batches must be comma-separated integers, got {batches!r}") from None
    if not grid or grid[0] < 1:
        raise CoralError("--batches must list integers >= 1")
    ph = Phase(phase)
    if ph is Phase.PREFILL:
        grid = tuple(b for b in grid if b <= 8) or (1,)
    defaults = PlannerEntry()
    budget_ms = latency_budget_ms(Slo(ttft_ms=slo_ms, tpot_ms=slo_ms), ph, ttft_headroom=defaults.ttft_headroom,
                                  tpot_headroom=defaults.tpot_headroom)
    tspec = TemplateSpec(model=spec, phase=ph, slo_ms=slo_ms, budget_ms=budget_ms, prompt_tokens=prompt_tokens,
                         output_tokens=output_tokens, configs=configs, n_max=max(n_max, len(names)), rho=1e9, batches=grid)
    perf = RooflinePerf()
    timings = _Timings(perf, tspec)
    solve_fn = None
    if solver == "ilp":
        from coral.solver import SolveOptions
        from coral.templates.ilp import solve_placement_ilp

        opts = SolveOptions(backend="cpsat" if backend == "cpsat" else "highs", time_limit_s=120.0, mip_gap=1e-7)

        def solve_fn(problem: Any, floor: float) -> Any:
            placement, _ = solve_placement_ilp(problem, opts)
            return placement if placement is not None and placement.throughput_tok_per_s > floor else None

    t0 = time.perf_counter()
    placement = solve_multiset(timings, names, solver=solve_fn)
    wall = time.perf_counter() - t0
    if placement is None:
        reason = _infeasible_reason(perf, spec, ph, configs, names, tspec, timings)
        out = {"feasible": False, "reason": reason, "model": spec.name, "phase": phase, "slo_ms": slo_ms,
               "budget_ms": budget_ms, "nodes": names, "solve_s": wall}
        if as_json:
            return _emit_json(out)
        console.print(f"[bold red]infeasible:[/] {reason}")
        return
    tmpl = Template(model=spec.name, phase=ph, slo_ms=slo_ms, budget_ms=budget_ms, nodes=tuple(names),
                    placement=placement, prompt_tokens=prompt_tokens)
    d = template_to_dict(tmpl)
    out = {"feasible": True, **d, "solver": solver, "solve_s": wall,
           "latency_breakdown_ms": {"stages": [s["stage_time_ms"] for s in d["stages"]],
                                    "communication": placement.comm_s * 1e3 * (len(placement.stages) - 1)}}
    if as_json:
        return _emit_json(out)
    console.print(_placement_table(d, f"{spec.name} {phase} on {' + '.join(names)}  (SLO {slo_ms:g} ms, budget {budget_ms:g} ms)"))
    console.print(f"throughput [bold]{placement.throughput_tok_per_s:,.0f} tok/s[/], micro-batch {placement.micro_batch}, "
                  f"latency {placement.latency_s * 1e3:.1f} ms = stages {' + '.join(f'{s.time_s * 1e3:.1f}' for s in placement.stages)}"
                  f" + comm {placement.comm_s * 1e3 * (len(placement.stages) - 1):.1f}; solved in {wall:.2f} s ({solver})")


def _infeasible_reason(perf: Any, spec: Any, ph: Any, configs: Any, names: list[str], tspec: Any, timings: Any) -> str:
    """Say why a multiset has no placement: memory short, or the SLO below the fastest latency."""
    mem = sum(c.memory_bytes for c in (next(x for x in configs if x.name == n) for n in names)) * perf.system.memory_utilization
    if mem < spec.weights_bytes:
        return f"memory short by {(spec.weights_bytes - mem) / 2**30:.1f} GiB (weights {spec.weights_bytes / 2**30:.1f} GiB)"
    b = min(tspec.batches)
    t_min = min(timings.t[(n, b)] for n in names)
    lat = spec.num_layers * t_min
    if lat > tspec.budget_ms / 1e3:
        return (f"the latency budget {tspec.budget_ms:g} ms (SLO {tspec.slo_ms:g} ms) is below the minimum achievable "
                f"latency {lat * 1e3:.1f} ms (micro-batch {b})")
    return "no placement fits both memory (incl. KV cache) and the SLO at any pipeline depth and micro-batch"


def _cache_dir(cache_dir: str | None, no_cache: bool) -> Path | None:
    from coral.templates.library import default_cache_dir

    if no_cache:
        return None
    return Path(cache_dir) if cache_dir else default_cache_dir()


@templates.command("build")
@click.option("--scenario", "scenario_name", required=True, help="Built-in scenario name or YAML path.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--address", default=None, help="Ray cluster address (with --executor ray).")
@click.option("--n-max", type=click.IntRange(1, 8), default=None, help="Override the scenario's n_max.")
@click.option("--rho", type=click.FloatRange(min=1), default=None, help="Override the scenario's rho.")
@click.option("--model", "models", multiple=True, help="Only these models (repeatable).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Cache folder (default ~/.cache/coral/templates or $CORAL_CACHE_DIR).")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
@_json_opt
def templates_build(scenario_name: str, jobs: int, executor: str, address: str | None, n_max: int | None,
                    rho: float | None, models: tuple[str, ...], cache_dir: str | None, no_cache: bool, as_json: bool) -> None:
    """Build the template library of a scenario (cached: unchanged inputs are never solved twice)."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from coral.scenario import load_scenario
    from coral.templates.library import build_library, specs_for

    s = load_scenario(scenario_name)
    for m in models:
        s.model(m)
    units = len(specs_for(s, n_max, rho, models or None))
    t0 = time.perf_counter()
    with progress_display(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total} model-phases"), TimeElapsedColumn(),
                          console=err_console, disable=as_json) as bar:
        task = bar.add_task(f"building templates ({jobs} job{'s' if jobs > 1 else ''})", total=units)

        def progress(st: Any) -> None:
            bar.advance(task)
            rate = st.solved / st.wall_s if st.wall_s > 0 else 0
            bar.console.print(f"  {st.model} {st.phase.value}: {st.memory_ok} tried, {st.solved} solved, "
                              f"{st.feasible} feasible, {st.kept} kept in {st.wall_s:.1f} s"
                              + (" (cached)" if st.cached else f" ({rate:,.0f} multisets/s)"))

        lib = build_library(s, jobs=jobs, cache_dir=_cache_dir(cache_dir, no_cache), n_max=n_max, rho=rho,
                            models=models or None, progress=progress, executor=executor, address=address)
    wall = time.perf_counter() - t0
    rows = [{**asdict(st), "phase": st.phase.value} for st in lib.stats]
    if as_json:
        return _emit_json({"scenario": s.name, "wall_s": wall, "templates": len(lib.templates), "units": rows})
    t = Table(title=f"Template library of {s.name} ({wall:.1f} s)")
    for col in ("model", "phase", "multisets", "memory ok (tried)", "solved", "feasible", "kept", "s", "cached"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], r["phase"], str(r["multisets"]), str(r["memory_ok"]), str(r["solved"]), str(r["feasible"]),
                  str(r["kept"]), f"{r['wall_s']:.1f}", "yes" if r["cached"] else "")
    console.print(t)


@templates.command("show")
@click.option("--scenario", "scenario_name", required=True)
@click.option("--model", default=None)
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default=None)
@click.option("--region", default=None, help="Price templates in this region (default: the scenario's first).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--n-max", type=click.IntRange(1, 8), default=None)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@_json_opt
def templates_show(scenario_name: str, model: str | None, phase: str | None, region: str | None, top: int,
                   n_max: int | None, cache_dir: str | None, as_json: bool) -> None:
    """The best templates by throughput per $ (homogeneous vs heterogeneous marked)."""
    from coral.perf import Phase
    from coral.scenario import load_scenario
    from coral.templates.library import build_library, template_to_dict
    from coral.templates.table import rank_by_value

    s = load_scenario(scenario_name)
    region = region or s.regions[0]
    if region not in s.regions:
        from coral.errors import unknown

        raise unknown("region", region, s.regions)
    models = [s.model(model).name] if model else None
    lib = build_library(s, cache_dir=_cache_dir(cache_dir, False), n_max=n_max, models=models)
    prices = {c: p for (r, c), p in s.prices.items() if r == region}
    out = []
    for m in s.models:
        if models and m.name not in models:
            continue
        for ph in ([Phase(phase)] if phase else list(Phase)):
            for per_usd, cost, t in rank_by_value(lib.of(m.name, ph), prices, top):  # makes only the top ones
                out.append({**template_to_dict(t), "region": region, "cost_usd_per_h": cost,
                            "tok_per_s_per_usd_h": per_usd, "homogeneous": t.is_homogeneous})
    if as_json:
        return _emit_json(out)
    table = Table(title=f"Best templates by throughput per $ in {region}")
    for col in ("model", "phase", "nodes", "kind", "stages (layers)", "b", "tok/s", "$/h", "tok/s per $/h", "latency ms"):
        table.add_column(col)
    for r in out:
        table.add_row(r["model"], r["phase"], " + ".join(r["nodes"]), "homo" if r["homogeneous"] else "[bold]hetero[/]",
                  " | ".join(f"{'+'.join(st['nodes'])}:{st['layers']}" for st in r["stages"]), str(r["micro_batch"]),
                  f"{r['throughput_tok_per_s']:,.0f}", f"{r['cost_usd_per_h']:.2f}", f"{r['tok_per_s_per_usd_h']:,.0f}",
                  f"{r['latency_ms']:.0f}")
    console.print(table)


@templates.command("figure")
@click.option("--scenario", "scenario_name", default="extended", show_default=True)
@click.option("--model", default="qwen3-235b-a22b", show_default=True)
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default="prefill", show_default=True)
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), default=1800.0, show_default=True)
@click.option("--region", default=None, help="Price templates in this region (default: the scenario's first).")
@click.option("--n-max", type=click.IntRange(1, 8), default=None, help="Override the scenario's n_max.")
@click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@click.option("--out", type=click.Path(file_okay=False), default="runs/fig1", show_default=True)
@_json_opt
def templates_figure(scenario_name: str, model: str, phase: str, slo_ms: float, region: str | None, n_max: int | None,
                     jobs: int, cache_dir: str | None, out: str, as_json: bool) -> None:
    """The paper's Fig. 1: best heterogeneous template vs homogeneous H100 ones (throughput per $),
    and the throughput spectrum of homogeneous vs heterogeneous templates (PNG + Markdown)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from coral.experiments.motivation import motivation

    check_output_path(out, "--out", folder=True)
    with progress_display(TextColumn("templates"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err_console, disable=as_json, transient=True) as bar:
        task = bar.add_task(f"templates {model} {phase}", total=None)
        result = motivation(scenario=scenario_name, model=model, phase=phase, slo_ms=slo_ms, region=region, n_max=n_max,
                            jobs=jobs, cache_dir=_cache_dir(cache_dir, False), out=Path(out),
                            step=lambda spec, done, total: bar.update(task, completed=done, total=total))
    if as_json:
        return _emit_json({k: v for k, v in result.items() if k != "spectrum"})
    console.print((Path(out) / "figure.md").read_text())
    console.print(f"figures written to {out}/")


# --- plan / simulate ----------------------------------------------------------------------------

_scenario_opt = click.option("--scenario", "scenario_name", required=True, help="Built-in scenario name or YAML path.")
_method_opt = click.option("--method", type=click.Choice(["coral", "homo", "cauchy", "template-greedy"]), default="coral",
                           show_default=True, help="Allocation method (the baselines use the same templates and catalog).")
_avail_opt = click.option("--availability", type=click.Choice(["abundant", "tight"]), default="abundant", show_default=True,
                          help="abundant: the scenario's availability. tight: only the (region, config) pairs Coral's "
                               "own abundant plan rents, each capped at that count + 25 % (75 % for extended), every "
                               "other pair 0. Coral's plan at the same demand always fits it, so `coral plan` is "
                               "unchanged; it limits the baselines and the simulator's re-plans.")
_scale_opt = click.option("--demand-scale", type=float, default=1.0, show_default=True, help="Multiply every model's rate.")
_jobs_opt = click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True, help="Processes for a library build.")
_cache_opt = click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Template cache folder.")
_nmax_opt = click.option("--n-max", type=click.IntRange(1, 8), default=None,
                         help="Override the scenario's n_max (most nodes per template) for the library.")


def _offered_demand(s: Any) -> dict[tuple[str, Any], float]:
    """The traffic itself per (model, phase), tok/s: rate x mean prompt (prefill) or output (decode)
    tokens, with no capacity headroom (the plan's demand lines carry the capacity target)."""
    from coral.perf import Phase

    return {(m.name, ph): m.rate_per_s * (m.prompt_tokens_mean if ph is Phase.PREFILL else m.output_tokens_mean)
            for m in s.models for ph in Phase}


def _prepare_with_progress(scenario_name: str, demand_scale: float, availability: str, jobs: int,
                           cache_dir: str | None, quiet: bool, n_max: int | None = None) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from coral.experiments.pipeline import prepare, scaled_scenario

    scenario = scaled_scenario(scenario_name, demand_scale)
    with progress_display(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("multisets"),
                          TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, disable=quiet,
                          transient=True) as bar:
        tasks: dict[Any, Any] = {}

        def step(spec: Any, done: int, total: int) -> None:
            key = (spec.model.name, spec.phase)
            if key not in tasks:
                tasks[key] = bar.add_task(f"templates {spec.model.name} {spec.phase.value}", total=total)
            bar.update(tasks[key], completed=done)

        return prepare(scenario, availability=availability, jobs=jobs, n_max=n_max,
                       cache_dir=Path(cache_dir) if cache_dir else None, step=step)


def _mark_derived(data: dict[str, Any], scenario: Any) -> dict[str, Any]:
    """Add `"derived": true/false` to a plan's node and instance entries: a derived shape is one the
    region does not sell, priced by the scenario's `derive_missing_prices`."""
    for n in data.get("nodes", []):
        n["derived"] = scenario.is_derived(n["region"], n["config"])
    for i in data.get("instances", []):
        i["derived"] = any(scenario.is_derived(i["region"], c) for c in i["nodes"])
    return data


@main.command("plan")
@_scenario_opt
@_method_opt
@_avail_opt
@_scale_opt
@_jobs_opt
@_cache_opt
@_nmax_opt
@click.option("--time-limit-s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True)
@click.option("--gap", type=click.FloatRange(min=0), default=1e-4, show_default=True, help="Relative MIP gap.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the plan as JSON here.")
@click.option("--verify", is_flag=True, help=(
    "Simulate the plan for one epoch of the scenario's traffic and print each (model, phase)'s predicted "
    "attainment next to its target. Exit code 3 when a model is predicted below its target."))
@click.option("--calibrate", is_flag=True, help=(
    "Verify, then raise the capacity of the (model, phase) pairs that miss and re-solve, printing each step, "
    "up to --iterations times. Exit code 3 when it does not converge."))
@click.option("--iterations", type=click.IntRange(min=0), default=4, show_default=True,
              help="Most re-solves of --calibrate.")
@click.option("--attainment", "attainment_list", default=None, help=(
    "Comma-separated attainment targets, e.g. 0.5,0.9,0.95,0.99: print the plan's $/h at each (a table; "
    "with --plot, a PNG) instead of one plan."))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="With --attainment: write the cost-of-attainment plot (PNG) here.")
@click.option("--engine", type=click.Choice(["coral", "vllm"]), default="coral", show_default=True, help=(
    "vllm: only templates vLLM can run (one node per stage, one TP degree); prints the cost of that "
    "restriction next to the unrestricted plan."))
@click.option("--running", "running_path", type=click.Path(dir_okay=False), default=None, help=(
    "Advisory mode: the plan file the fleet runs now. Plans from it (starting instances costs their "
    "init_s), prints the instances to start and drain and the $/h delta, and changes nothing."))
@_json_opt
def plan_cmd(scenario_name: str, method: str, availability: str, demand_scale: float, jobs: int, cache_dir: str | None,
             n_max: int | None, time_limit_s: float, gap: float, out: str | None, verify: bool, calibrate: bool,
             iterations: int, attainment_list: str | None, plot_path: str | None, engine: str,
             running_path: str | None, as_json: bool) -> None:
    """Which nodes to rent where, and how to split each model across them (DESIGN §4).

    Capacity per (model, phase) is sized so that the model's slo_attainment share of its requests
    meets both SLOs on its traffic (docs/allocator.md). Exit codes: 0 plan written, 2 bad input,
    3 --verify / --calibrate predict a model below its attainment target, 4 the plan serves none of
    the demand (nothing written).
    """
    from coral.allocator import render_plan
    from coral.experiments.pipeline import plan
    from coral.solver import SolveOptions

    options = SolveOptions(backend="highs", time_limit_s=time_limit_s, mip_gap=gap)
    if attainment_list is not None:
        return _attainment_sweep(scenario_name, attainment_list, method, demand_scale, availability, jobs, cache_dir,
                                 options, plot_path, out, as_json)
    if plot_path:
        raise CoralError("--plot goes with --attainment (the cost-of-attainment plot)")
    if out:
        check_output_path(out, "--out", folder=False)
    setup = _prepare_with_progress(scenario_name, demand_scale, availability, jobs, cache_dir, as_json, n_max)
    setup, deploy = _plan_deploy_setup(setup, scenario_name, method, options, engine, running_path)
    steps: list[Any] = []
    if calibrate:
        from coral.experiments.verify import calibrate_plan

        def show(step: Any) -> None:
            if not as_json:
                _print_verdicts(step.verdicts, f"calibration step {step.iteration}: plan {step.cost_usd_per_h:.2f} $/h"
                                + (f", capacity x{', x'.join(f'{k:.3g} {m}/{ph.value}' for (m, ph), k in step.boost.items())}"
                                   if step.boost else ""))

        result, steps = calibrate_plan(setup, method, iterations=iterations, options=options, on_step=show)
    else:
        result = plan(setup, method, options=options, prev=deploy.get("prev"), demand=deploy.get("demand"))
        if verify:
            from coral.experiments.verify import CalibrationStep, verify_plan

            steps = [CalibrationStep(iteration=0, cost_usd_per_h=result.cost_usd_per_h, boost={},
                                     verdicts=tuple(verify_plan(setup, result)))]
            if not as_json:
                _print_verdicts(steps[0].verdicts, f"verification: plan {result.cost_usd_per_h:.2f} $/h, one epoch simulated")
    offered = _offered_demand(setup.scenario)
    data = _mark_derived({"scenario": setup.scenario.name, "availability": availability, "demand_scale": demand_scale,
                          "offered_tok_per_s": [{"model": m, "phase": ph.value, "tok_per_s": v}
                                                for (m, ph), v in offered.items()],
                          **result.to_json()}, setup.scenario)
    if result.alpha <= 0 and any(d.demand_tok_per_s > 0 for d in result.demand):
        why = "; ".join(result.notes) or "no template fits the available nodes"
        if as_json:
            _emit_json({**data, "feasible": False})
        err_console.print(f"[bold red]infeasible:[/] the {method} plan serves none of the demand (alpha 0): {why}. "
                          "Allow more nodes (availability), other shapes (configs) or looser SLOs; nothing written.",
                          highlight=False, soft_wrap=True)
        sys.exit(EXIT_INFEASIBLE)
    if steps:
        data["verification"] = [{"iteration": st.iteration, "cost_usd_per_h": st.cost_usd_per_h, "ok": st.ok,
                                 "boost": {f"{m}/{ph.value}": k for (m, ph), k in st.boost.items()},
                                 "pairs": [{"model": v.model, "phase": v.phase.value, "attainment": v.attainment,
                                            "phase_target": v.phase_target, "model_attainment": v.model_attainment,
                                            "model_target": v.model_target} for v in st.verdicts]} for st in steps]
    data.update(_plan_deploy_fields(deploy, result, data, setup))
    if out:
        write_text(Path(out), json.dumps(data, indent=2, default=str))
    if as_json:
        _emit_json(data)
    else:
        render_plan(result, console, offered, derived=setup.scenario.derived)
        _print_deploy_fields(data)
        if out:
            console.print(f"plan written to {out}")
    if steps and not steps[-1].ok:
        missing = sorted({f"{v.model} ({v.model_attainment:.1%} < {v.model_target:.0%})" for v in steps[-1].verdicts if not v.ok})
        err_console.print(("calibration did not converge in " f"{iterations} iterations: " if calibrate else
                           "predicted below target: ") + ", ".join(missing))
        raise SystemExit(3)


def _plan_deploy_setup(setup: Any, scenario_name: str, method: str, options: Any, engine: str,
                       running_path: str | None) -> tuple[Any, dict[str, Any]]:
    """`coral plan --engine` / `--running`: restrict the library, plan the unrestricted baseline, read the
    running plan (docs/deploy.md). Returns the setup to plan with and what `_plan_deploy_fields` reports."""
    from coral.experiments.pipeline import plan
    from coral.runtime.deploy.advisory import running_counts
    from coral.runtime.deploy.cli import load_running, restrict_setup

    deploy: dict[str, Any] = {"engine": engine, "scenario_source": scenario_name}
    if running_path:
        deploy["running"] = load_running(running_path, setup.scenario)
        deploy["prev"] = running_counts(deploy["running"])
    if engine != "coral":
        deploy["full"] = plan(setup, method, options=options, prev=deploy.get("prev"))
        # the restricted plan serves the same capacity target (sized with the full library), so the
        # two costs compare the templates alone
        deploy["demand"] = {(d.model, d.phase): d.demand_tok_per_s for d in deploy["full"].demand}
        setup, deploy["facts"] = restrict_setup(setup, engine)
    return setup, deploy


def _plan_deploy_fields(deploy: dict[str, Any], result: Any, data: dict[str, Any], setup: Any) -> dict[str, Any]:
    """The plan JSON's deployment fields: scenario source, engine restriction cost, advisory diff."""
    from coral.runtime.deploy.cli import advise, engine_report

    src = deploy["scenario_source"]
    out: dict[str, Any] = {"scenario_source": str(Path(src).resolve()) if Path(src).is_file() else src}
    if "full" in deploy:
        out["engine_restriction"] = engine_report(deploy["engine"], deploy["full"], result, deploy["facts"])
    if "running" in deploy:
        out["advisory"] = advise(deploy["running"], {**data, **out}, setup.scenario)
    return out


def _print_deploy_fields(data: dict[str, Any]) -> None:
    """After the plan's tables: the engine restriction's cost and the advisory diff, when asked for."""
    from coral.runtime.deploy.cli import print_advice, print_engine_report

    if "engine_restriction" in data:
        print_engine_report(data["engine_restriction"])
    if "advisory" in data:
        print_advice(data["advisory"])


def _print_verdicts(verdicts: Any, title: str) -> None:
    table = Table(title=title)
    for col in ("model", "phase", "SLO", "predicted", "phase target", "model (both SLOs)", "model target", ""):
        table.add_column(col, justify="left" if col in ("model", "phase", "") else "right")
    for v in verdicts:
        slo = "TTFT" if v.phase.value == "prefill" else "TPOT"
        table.add_row(v.model, v.phase.value, slo, f"{v.attainment:.1%}", f"{v.phase_target:.1%}",
                      f"{v.model_attainment:.1%}", f"{v.model_target:.0%}", "ok" if v.ok else "MISS")
    console.print(table)


def _attainment_sweep(scenario_name: str, attainment_list: str, method: str, demand_scale: float, availability: str,
                      jobs: int, cache_dir: str | None, options: Any, plot_path: str | None, out: str | None,
                      as_json: bool) -> None:
    from coral.experiments.verify import attainment_costs, plot_attainment_costs

    try:
        targets = [float(x) for x in attainment_list.split(",") if x.strip()]
    except ValueError:
        raise CoralError(f"--attainment must be comma-separated numbers in (0, 1), got {attainment_list!r}") from None
    if not targets:
        raise CoralError("--attainment needs at least one target, e.g. 0.9,0.95")
    for a in targets:
        if not 0 < a < 1:
            raise CoralError(f"--attainment values must be in (0, 1), got {a:g}")

    def note(a: float, p: Any) -> None:
        if not as_json:
            err_console.print(f"attainment {a:.0%}: " + (f"{p.cost_usd_per_h:,.2f} $/h" if not isinstance(p, str)
                                                          else "unreachable"))

    if out:
        check_output_path(out, "--out", folder=False)
    if plot_path:
        check_output_path(plot_path, "--plot", folder=False)
    rows = attainment_costs(scenario_name, targets, method=method, demand_scale=demand_scale, availability=availability,
                            jobs=jobs, cache_dir=Path(cache_dir) if cache_dir else None, options=options, on_target=note)
    solved = [(a, p) for a, p in rows if not isinstance(p, str)]
    if not solved:
        raise CoralError("no attainment target is reachable: " + "; ".join(f"{a:g}: {p}" for a, p in rows))
    models = list(dict.fromkeys(d.model for _, p in solved for d in p.demand))
    per_model = {a: {m: sum(c for (mm, _), c in p.cost_by_model_phase().items() if mm == m) for m in models}
                 for a, p in solved}
    data: dict[str, Any] = {
        "scenario": scenario_name, "method": method, "availability": availability, "demand_scale": demand_scale,
        "rows": [{"attainment": a, "reachable": False, "reason": p} if isinstance(p, str) else
                 {"attainment": a, "reachable": True, "cost_usd_per_h": p.cost_usd_per_h, "status": p.status.value,
                  "cost_by_model": per_model[a]} for a, p in rows]}
    if plot_path:
        plot_attainment_costs([(a, p.cost_usd_per_h) for a, p in solved], plot_path,
                              f"{scenario_name} ({method}): the cost of attainment")
    if out:
        write_text(Path(out), json.dumps(data, indent=2))
    if as_json:
        return _emit_json(data)
    base = solved[0][1].cost_usd_per_h
    table = Table(title=f"Cost of attainment ({scenario_name}, {method})")
    for col in ("target", "$/h", f"x {solved[0][0]:.0%}", *(f"{m} $/h" for m in models)):
        table.add_column(col, justify="right")
    for a, p in rows:
        if isinstance(p, str):
            table.add_row(f"{a:.1%}", "unreachable", "-", *("-" for _ in models))
            continue
        table.add_row(f"{a:.1%}", f"{p.cost_usd_per_h:,.2f}", f"{p.cost_usd_per_h / base:.2f}" if base else "-",
                      *(f"{c:,.2f}" for c in per_model[a].values()))
    console.print(table)
    for a, p in rows:
        if isinstance(p, str):
            console.print(f"{a:.1%} is unreachable: {p}", highlight=False)
    if plot_path:
        console.print(f"plot written to {plot_path}")


@main.command("simulate")
@_scenario_opt
@_method_opt
@_avail_opt
@_scale_opt
@click.option("--duration-s", type=click.FloatRange(min=0, min_open=True), default=1800.0, show_default=True)
@click.option("--epoch-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Re-planning period (default: the scenario's, 360 s).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Copy of shared/data holding the traces (default: $CORAL_DATA_DIR or ../shared/data).")
@_jobs_opt
@_cache_opt
@_nmax_opt
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write summary.json, requests.csv and plots here.")
@_json_opt
def simulate_cmd(scenario_name: str, method: str, availability: str, demand_scale: float, duration_s: float,
                 epoch_s: float | None, seed: int, data_dir: str | None, jobs: int, cache_dir: str | None,
                 n_max: int | None, out: str | None, as_json: bool) -> None:
    """Serve the scenario's real traces on METHOD's plans in the discrete-event simulator,
    re-planning every epoch."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from coral.experiments.pipeline import run_simulation

    if out:
        check_output_path(out, "--out", folder=True)
    setup = _prepare_with_progress(scenario_name, demand_scale, availability, jobs, cache_dir, as_json, n_max)
    t0 = time.perf_counter()
    with progress_display(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                          TimeElapsedColumn(), console=err_console, disable=as_json, transient=True) as bar:
        task = bar.add_task("simulating (simulated s)", total=duration_s)
        run = run_simulation(setup, method, duration_s=duration_s, epoch_s=epoch_s, seed=seed, data_dir=data_dir,
                             progress=lambda now, total: bar.update(task, completed=now))
    summary = run.result.summary()
    summary["wall_s"] = time.perf_counter() - t0
    summary["method"] = method
    summary["availability"] = availability
    summary["solve_s"] = [p.solve_s for p in run.plans]
    if out:
        run.result.write(Path(out))
        write_text(Path(out) / "plans.json", json.dumps([p.to_json() for p in run.plans], indent=2, default=str))
    if as_json:
        return _emit_json(summary)
    t = Table(title=f"{setup.scenario.name} / {method} / {availability}: {duration_s:g} s simulated in {summary['wall_s']:.1f} s")
    for col in ("model", "requests", "TTFT p50 / p99 s", "TPOT p50 / p99 ms", "SLO attainment", "goodput tok/s", "$/h"):
        t.add_column(col)
    for name, m in summary["per_model"].items():
        pre, dec = m["prefill"], m["decode"]
        t.add_row(name, str(m.get("requests", {}).get("arrived", "")),
                  f"{pre['ttft_s'].get('p50', float('nan')):.2f} / {pre['ttft_s'].get('p99', float('nan')):.2f}",
                  f"{dec['tpot_s'].get('p50', float('nan')) * 1e3:.0f} / {dec['tpot_s'].get('p99', float('nan')) * 1e3:.0f}",
                  f"{m.get('slo_attainment', float('nan')):.1%}", f"{m.get('goodput_tok_per_s', float('nan')):,.0f}",
                  f"{pre['cost_usd_per_h'] + dec['cost_usd_per_h']:.2f}")
    console.print(t)
    r = summary["requests"]
    console.print(f"requests: {r['arrived']} arrived, {r['finished']} finished, {r['failed']} failed, {r['in_flight']} in flight; "
                  f"cost {summary['cost_usd_per_h']:.2f} $/h, goodput {summary['goodput_tok_per_s']:,.0f} tok/s, "
                  f"SLO attainment {summary['slo_attainment']:.1%}")
    if out:
        console.print(f"results written to {out}")


# --- demo ------------------------------------------------------------------------------------------

@main.command("demo")
def demo() -> None:
    """A one-minute tour on the `core` scenario: catalog, scenario, one perf figure, one template.

    (`make demo` runs the main job instead: `coral experiment cost --setup core`.)
    """
    ctx = click.get_current_context()
    console.rule("coral catalog configs")
    ctx.invoke(catalog_configs, prices=None, as_json=False)
    console.rule("coral scenario show core")
    ctx.invoke(scenario_show, name="core", as_json=False)
    console.rule("coral perf --model llama-2-70b --node 1xA100-40GB --phase prefill --batch 1 --prompt-tokens 1000")
    ctx.invoke(perf_cmd, model="llama-2-70b", node="1xA100-40GB", phase="prefill", batch=1, prompt_tokens=1000.0,
               output_tokens=0.0, stages=1, profile=None, as_json=False)
    console.rule("coral templates solve --model qwen3-32b --phase prefill --slo-ms 2500 --nodes 1xL4,1xL40S,1xL40S,2xL40S")
    ctx.invoke(templates_solve, model="qwen3-32b", phase="prefill", slo_ms=2500.0, nodes="1xL4,1xL40S,1xL40S,2xL40S",
               prompt_tokens=2047.8, output_tokens=27.9, solver="exact", backend="highs", batches="1,2,4,8", n_max=6,
               as_json=False)


def _register_experiments() -> None:
    from coral.experiments.cli import experiment

    main.add_command(experiment)


_register_experiments()


def _register_optional() -> None:
    """Commands whose modules need the runtime extra (torch, zmq) are added only when importable;
    their heavy imports happen when they run."""
    try:
        from coral.runtime.cli import keys, serve
        from coral.runtime.loadgen import bench_serve
    except ImportError:
        return
    main.add_command(serve)
    main.add_command(keys)
    main.add_command(bench_serve)
    try:
        from coral.experiments.profile_cmd import profile
    except ImportError:
        return
    main.add_command(profile)


_register_optional()


def _register_deploy() -> None:
    """`coral export` (plan -> SkyPilot / vLLM files) needs no runtime extra."""
    from coral.runtime.deploy.cli import export_cmd

    main.add_command(export_cmd)


_register_deploy()

if __name__ == "__main__":
    main()
