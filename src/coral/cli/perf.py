"""`coral perf`: one model on one node under the performance model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from coral.catalog import builtin_catalog, resolve_model_spec
from coral.cli.common import console, emit_json, json_opt


@click.command("perf")
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
@json_opt
def perf_cmd(model: str, node: str, phase: str, batch: int, prompt_tokens: float, output_tokens: float,
             stages: int, profile: str | None, as_json: bool) -> None:
    """Per-layer time, one-node throughput and memory cap of MODEL on NODE (DESIGN §2)."""
    # lazy: the core (numpy) loads when the command runs, not when `coral` starts
    from coral.perf import Phase, RooflinePerf, Shape, load_profile_csv, profile_from_helix

    cat = builtin_catalog()
    cfg = cat.config(node)
    spec = resolve_model_spec(model)
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
        out.update(layer_gflops=flops / 1e9, layer_gbytes=nbytes / 1e9, bound=perf.bound(cfg, spec, shape))
    if as_json:
        return emit_json(out)
    t = Table(title=f"{spec.name} {phase} on {cfg.name} (batch {batch}, prompt {prompt_tokens:g}, output {output_tokens:g})",
              show_header=False)
    t.add_row("per-layer time", f"{out['layer_ms']:.3f} ms" + (f"  ({out['bound']}-bound)" if "bound" in out else ""))
    t.add_row("one-layer throughput", f"{out['throughput_tok_per_s']:,.0f} tok/s")
    t.add_row("whole model on one node", f"{out['whole_model_ms']:.1f} ms" + ("" if out["whole_model_fits"] else "  (does not fit)"))
    t.add_row("memory cap (layers)", f"{caps['middle']} middle / {caps['first']} first / {caps['last']} last / {caps['only']} alone")
    t.add_row("KV transfer per request", f"{out['kv_transfer_ms_per_request']:.2f} ms")
    t.add_row("backend", perf.version)
    console.print(t)
