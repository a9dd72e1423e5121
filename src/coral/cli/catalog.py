"""`coral catalog`: the built-in GPU types, node configurations, prices and model specs."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import click
from rich.table import Table

from coral.catalog import (
    builtin_catalog,
    builtin_model,
    builtin_model_names,
    load_hf_config,
    load_prices_csv,
)
from coral.cli.common import console, emit_json, json_opt
from coral.cli_support import CoralGroup


@click.group(cls=CoralGroup)
def catalog() -> None:
    """The built-in catalog: GPU types, node configurations, prices per region, model specs."""


def _catalog(prices: str | None) -> Any:
    cat = builtin_catalog()
    return load_prices_csv(prices, cat) if prices else cat


_prices_opt = click.option("--prices", type=click.Path(dir_okay=False), default=None,
                           help="Use this price CSV (our format = gpu_nodes.csv columns, or a SkyPilot vms.csv).")


@catalog.command("gpus")
@json_opt
def catalog_gpus(as_json: bool) -> None:
    """GPU types and their datasheet figures."""
    cat = _catalog(None)
    rows = [asdict(g) for g in cat.gpus.values()]
    if as_json:
        return emit_json(rows)
    t = Table(title="GPU types")
    for col in ("name", "memory GiB", "HBM GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "intra-node GB/s", "interconnect"):
        t.add_column(col, justify="right" if col not in ("name", "interconnect") else "left")
    for g in cat.gpus.values():
        t.add_row(g.name, f"{g.memory_gib:g}", f"{g.hbm_gb_per_s:g}", f"{g.bf16_tflops:g}",
                  f"{g.fp8_tflops:g}" if g.fp8_tflops else "-", f"{g.intra_node_gb_per_s:g}", g.interconnect)
    console.print(t)


@catalog.command("configs")
@_prices_opt
@json_opt
def catalog_configs(prices: str | None, as_json: bool) -> None:
    """Node configurations `<n>x<GPU>` sold somewhere, with network and the regions selling them."""
    cat = _catalog(prices)
    rows = []
    for name, c in cat.configs.items():
        regions = sorted(r for (r, cfg) in cat.offers if cfg == name)
        rows.append({"config": name, "gpu": c.gpu.name, "gpus": c.count, "memory_gib": c.count * c.gpu.memory_gib,
                     "network_gbps": c.network_gbps, "regions": regions})
    if as_json:
        return emit_json(rows)
    t = Table(title="Node configurations")
    for col in ("config", "GPU memory GiB", "network Gbps", "sold in"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["config"], f"{r['memory_gib']:g}", f"{r['network_gbps']:g}", ", ".join(r["regions"]))
    console.print(t)


@catalog.command("prices")
@click.option("--region", default=None, help="Only this region (e.g. aws:us-east-2).")
@_prices_opt
@json_opt
def catalog_prices(region: str | None, prices: str | None, as_json: bool) -> None:
    """On-demand (and spot) $/h of every configuration in every region (cheapest instance type)."""
    cat = _catalog(prices)
    if region:
        cat.check_region(region)
    rows = [asdict(o) for (r, _), o in sorted(cat.offers.items()) if region in (None, r)]
    if as_json:
        return emit_json(rows)
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
@json_opt
def catalog_models(config_json: str | None, as_json: bool) -> None:
    """Built-in model specs and their derived sizes (or one config.json of yours)."""
    specs = [load_hf_config(config_json)] if config_json else [builtin_model(n) for n in builtin_model_names()]
    rows: list[dict[str, Any]] = [{"name": m.name, "architecture": m.architecture, "layers": m.num_layers, "total_params_b": m.total_params / 1e9,
             "active_params_b": m.active_params / 1e9, "weights_gib": m.weights_bytes / 2**30,
             "layer_weight_gib": m.layer_weight_bytes / 2**30, "kv_bytes_per_token": m.kv_bytes_per_token,
             "experts": m.num_experts, "sliding_layers": m.sliding_layers} for m in specs]
    if as_json:
        return emit_json(rows)
    t = Table(title="Models")
    for col in ("name", "arch", "layers", "params B (active)", "weights GiB", "GiB/layer", "KV B/token", "MoE", "sliding"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["architecture"].removesuffix("ForCausalLM"), str(r["layers"]),
                  f"{r['total_params_b']:.1f} ({r['active_params_b']:.1f})", f"{r['weights_gib']:.1f}",
                  f"{r['layer_weight_gib']:.2f}", f"{r['kv_bytes_per_token']:,.0f}",
                  f"{r['experts']}" if r["experts"] else "-", str(r["sliding_layers"] or "-"))
    console.print(t)
