"""`coral profile`: measure the runtime engine's per-layer latency and this host's message costs into a profile table."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from coral.catalog import builtin_catalog
from coral.errors import CoralError

__all__ = ["profile", "run_profile"]

DEFAULT_BATCHES = "1,2,4"
DEFAULT_PROMPTS = "16,64,128,256,384"
DEFAULT_DECODE_BATCHES = "1,4,16"
DEFAULT_CONTEXTS = "32,128,384"


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise CoralError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise CoralError(f"{what} must list integers >= 1, got {text!r}")
    return vals


def _device(device: str) -> str:
    # lazy: torch (runtime extra; processes without layers never load it)
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CoralError(f"device {device} asked for, but CUDA is not available here")
    return device


def run_profile(model: str, node: str, out: str | Path, *, name: str | None = None, batches: str = DEFAULT_BATCHES,
                prompt_tokens: str = DEFAULT_PROMPTS, decode_batches: str = DEFAULT_DECODE_BATCHES,
                contexts: str = DEFAULT_CONTEXTS, device: str = "auto", dtype: str = "float32", threads: int = 1,
                reps: int = 3, links: bool = True, flush_mib: int = 64, progress: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """Profile `model` on this host and write `out` (CSV) and `out.host.json`.

    Args:
        model: a runtime built-in config name (`fid-llama`, `tiny-llama`, `small-llama`, ...) or a config.json path.
        node: the catalog node configuration the rows are keyed by (a label on a CPU host).
        out: the CSV path.
        name: the model name in the CSV (default: the built-in name or the config's folder name).
        batches, prompt_tokens: prefill grid, comma-separated.
        decode_batches, contexts: decode grid, comma-separated.
        device: cpu, cuda, cuda:N or auto.
        dtype: float32, float16 or bfloat16 (as in the cluster file).
        threads: torch threads (the cluster file's `torch_threads`).
        reps: timed repetitions per grid point.
        flush_mib: MiB touched before each timed run to evict the CPU caches (0: warm-cache timing).
        links: also measure the ZeroMQ loopback (else the host file gets the fit of one empty point).
        progress: told one line per grid point.

    Returns:
        (CSV path, host JSON path).

    Raises:
        CoralError: an unknown node or model, a bad grid.
    """
    # lazy: torch (runtime extra; processes without layers never load it)
    import torch

    # lazy: torch (runtime extra)
    from coral.experiments.fidelity_profile import (
        HostProfile,
        LinkFit,
        measure_layers,
        measure_links,
        resolve_runtime_model,
        write_profile,
    )

    cfg_name = builtin_catalog().config(node).name
    model_name, config = resolve_runtime_model(model)
    model_name = name or model_name
    dev = _device(device)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    rows = measure_layers(config, node=cfg_name, model=model_name, batches=_ints(batches, "--batches"),
                          prompt_tokens=_ints(prompt_tokens, "--prompt-tokens"),
                          decode_batches=_ints(decode_batches, "--decode-batches"), contexts=_ints(contexts, "--contexts"),
                          device=dev, dtype=dtype, reps=reps, flush_bytes=flush_mib * 2**20 if dev == "cpu" else 0,
                          progress=progress)
    if links:
        act, kv = measure_links(config)
        if progress:
            progress(f"loopback activations: {act.latency_s * 1e6:.0f} us + {act.bytes_per_s / 1e9:.2f} GB/s; "
                     f"KV: {kv.latency_s * 1e6:.0f} us + {kv.bytes_per_s / 1e9:.2f} GB/s")
    else:
        act = kv = LinkFit(latency_s=0.0, bytes_per_s=float("inf"), points=())
    host = HostProfile(node=cfg_name, model=model_name, device=dev, torch_threads=threads, dtype=dtype,
                       model_config=config, activation=act, kv=kv, wall_s=time.perf_counter() - t0)
    return write_profile(rows, host, out)


@click.command("profile")
@click.option("--model", required=True, help="Runtime model: fid-llama, tiny-llama, tiny-qwen3, small-llama, ... or a config.json path.")
@click.option("--node", required=True, help="Catalog node configuration the rows are keyed by, e.g. 1xL4. On a CPU-only host "
              "it is a label: the scenario that reads the CSV must use the same name for its (CPU) nodes.")
@click.option("--name", default=None, help="Model name in the CSV (default: the built-in name or the config's folder name).")
@click.option("--batches", default=DEFAULT_BATCHES, show_default=True, help="Prefill micro-batch sizes (requests).")
@click.option("--prompt-tokens", default=DEFAULT_PROMPTS, show_default=True, help="Prefill prompt lengths.")
@click.option("--decode-batches", default=DEFAULT_DECODE_BATCHES, show_default=True, help="Decode micro-batch sizes (sequences).")
@click.option("--contexts", default=DEFAULT_CONTEXTS, show_default=True, help="Decode context lengths.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto (CUDA when present).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch threads (as the cluster's torch_threads).")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True, help="Timed repetitions per point (median).")
@click.option("--flush-mib", type=click.IntRange(min=0), default=64, show_default=True,
              help="On CPU, MiB touched before every timed run so the weights come from memory, as in a runtime whose "
              "engines share cores (0 = warm-cache timing; use >= 2x the last-level cache).")
@click.option("--no-links", is_flag=True, help="Skip the ZeroMQ loopback measurement.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Profile CSV to write (plus <out>.host.json).")
def profile(model: str, node: str, name: str | None, batches: str, prompt_tokens: str, decode_batches: str, contexts: str,
            device: str, dtype: str, threads: int, reps: int, flush_mib: int, no_links: bool, out: str) -> None:
    """Measure per-layer prefill and decode latency of the runtime's layer-range module on this device, and the
    ZeroMQ/msgpack cost of activations and KV caches between processes, into a profile CSV
    (`config,model,phase,tokens,layer_ms`; `perf: {backend: profile, profile: OUT}` in a scenario)."""
    csv_path, host_path = run_profile(model, node, out, name=name, batches=batches, prompt_tokens=prompt_tokens,
                                      decode_batches=decode_batches, contexts=contexts, device=device, dtype=dtype,
                                      threads=threads, reps=reps, links=not no_links, flush_mib=flush_mib,
                                      progress=click.echo)
    click.echo(f"wrote {csv_path} and {host_path}")
