"""Extract the measured vLLM kernel timings Coral's efficiency fit reads from the aiconfigurator-core wheel.

aiconfigurator-core (NVIDIA, Apache-2.0, on PyPI) ships per-GPU kernel tables measured under vLLM
(`systems/data/<system>/{gemm,attention,moe}/vllm/<vLLM version>/*.parquet`). This tool reads only
those measurements (facts; none of the package's code is used or copied) for the systems Coral has
(`coral.perf.kernels.AIC_GPUS`), from the newest vLLM version folder holding each table, and keeps
the rows the fit and its checks use (`coral.perf.kernels`):

- `gemm.csv.gz` (`gpu,m,n,k,ms,kernel,source`): bf16 GEMMs at m = 1, 2, 4, ..., 16384 and the (n, k)
  grid points around every GEMM of the fit's, the held-out and the gpt-oss layers;
- `attention.csv.gz` (`gpu,phase,batch,tokens,heads,kv_heads,head_dim,window,ms,kernel,source`):
  bf16-KV attention of those models' head layouts; `phase` context (prefill: `batch` prompts of
  `tokens`) or generation (decode: `batch` sequences with `tokens` cached, the table's `step`);
- `moe.csv.gz` (`gpu,tokens,hidden,inter,topk,experts,dtype,ms,kernel,source`): the gpt-oss fused
  MoE (MXFP4 weights, one GPU, balanced routing).

`ms` is the median over a table's repeated rows (the tables are in ms). Where a table holds several
kernels for the selected rows, the one with the most rows is kept (B200's context table also has a
decode kernel's rows). `source` is the parquet's path inside the wheel.

    pip download aiconfigurator-core==0.12.0 --no-deps -d /tmp/aic
    python tools/aiconfigurator_kernels.py /tmp/aic/aiconfigurator_core-0.12.0-*.whl   # rewrite the files
    python tools/aiconfigurator_kernels.py WHEEL --check    # exit 1 when a shipped file differs
"""
from __future__ import annotations

import argparse
import gzip
import io
import re
import statistics
import sys
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from packaging.version import Version

from coral.catalog.models import builtin_model
from coral.perf.kernels import (
    AIC_GPUS,
    DECODE_BATCHES,
    DECODE_CONTEXTS,
    FIT_MODELS,
    GEMM_M,
    HELDOUT_MODELS,
    KERNELS_DIR,
    MOE_MODELS,
    PREFILL_BATCHES,
    PREFILL_PROMPTS,
    attention_layouts,
    grid_neighbours,
    layer_gemms,
)

OUT = Path(__file__).resolve().parents[1] / "src" / "coral" / "data" / "profiles" / KERNELS_DIR
_WHEEL = re.compile(r"aiconfigurator_core-([0-9][^-]*)-")
MODELS = (*FIT_MODELS, *HELDOUT_MODELS, *(builtin_model(n) for n in MOE_MODELS))
MOE_DTYPE = "w4a16_mxfp4"


def _newest(wheel: zipfile.ZipFile, system: str, op: str, table: str) -> str | None:
    pat = re.compile(rf"^aiconfigurator_core/systems/data/{system}/{op}/vllm/([^/]+)/{table}\.parquet$")
    found = [(Version(m.group(1)), n) for n in wheel.namelist() if (m := pat.match(n))]
    return max(found)[1] if found else None


def _read(wheel: zipfile.ZipFile, path: str) -> list[dict[str, Any]]:
    return pq.read_table(io.BytesIO(wheel.read(path))).to_pylist()


def _one_kernel(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not rows:
        return rows
    kernel = Counter(r["kernel_source"] for r in rows).most_common(1)[0][0]
    return [r for r in rows if r["kernel_source"] == kernel]


def _medians(rows: list[dict[str, Any]], key: Any) -> dict[tuple[Any, ...], tuple[float, str]]:
    groups: dict[tuple[Any, ...], list[float]] = {}
    kernels: dict[tuple[Any, ...], str] = {}
    for r in rows:
        k = key(r)
        groups.setdefault(k, []).append(float(r["latency"]))
        kernels[k] = r["kernel_source"]
    return {k: (statistics.median(v), kernels[k]) for k, v in sorted(groups.items())}


def _gemm(wheel: zipfile.ZipFile, system: str, path: str, src: str) -> list[str]:
    rows = [r for r in _read(wheel, path) if r["gemm_dtype"] == "bfloat16"]
    ns, ks = {int(r["n"]) for r in rows}, {int(r["k"]) for r in rows}
    wanted = {(n2, k2) for model in MODELS for n, k in layer_gemms(model)
              for n2, _ in grid_neighbours(n, ns) for k2, _ in grid_neighbours(k, ks)}
    rows = _one_kernel([r for r in rows if int(r["m"]) in GEMM_M and (int(r["n"]), int(r["k"])) in wanted])
    med = _medians(rows, lambda r: (int(r["m"]), int(r["n"]), int(r["k"])))
    return [f"{system},{m},{n},{k},{ms:.6g},{kern},{src}" for (m, n, k), (ms, kern) in med.items()]


def _attention(wheel: zipfile.ZipFile, system: str, path: str, src: str, phase: str) -> list[str]:
    layouts = {lay for model in MODELS for lay in attention_layouts(model)}
    if phase == "context":
        lengths, batches, field = set(PREFILL_PROMPTS), set(PREFILL_BATCHES), "isl"
    else:
        lengths, batches, field = {c - 1 for c in DECODE_CONTEXTS}, set(DECODE_BATCHES), "step"
    rows = [r for r in _read(wheel, path)
            if r["kv_cache_dtype"] == "bfloat16" and int(r["batch_size"]) in batches and int(r[field]) in lengths
            and (int(r["num_heads"]), int(r["num_key_value_heads"]), int(r["head_dim"]), int(r.get("window_size") or 0))
            in layouts]
    med = _medians(_one_kernel(rows), lambda r: (int(r["batch_size"]), int(r[field]), int(r["num_heads"]),
                                                 int(r["num_key_value_heads"]), int(r["head_dim"]),
                                                 int(r.get("window_size") or 0)))
    return [f"{system},{phase},{b},{t},{h},{kv},{d},{w},{ms:.6g},{kern},{src}"
            for (b, t, h, kv, d, w), (ms, kern) in med.items()]


def _moe(wheel: zipfile.ZipFile, system: str, path: str, src: str) -> list[str]:
    shapes = {(m.hidden_size, m.expert_intermediate_size, m.experts_per_token, m.num_experts)
              for m in MODELS if m.is_moe}
    rows = [r for r in _read(wheel, path)
            if r["moe_dtype"] == MOE_DTYPE and int(r["moe_tp_size"]) == 1 and int(r["moe_ep_size"]) == 1
            and r["distribution"] == "balanced"
            and (int(r["hidden_size"]), int(r["inter_size"]), int(r["topk"]), int(r["num_experts"])) in shapes]
    med = _medians(_one_kernel(rows), lambda r: (int(r["num_tokens"]), int(r["hidden_size"]), int(r["inter_size"]),
                                                 int(r["topk"]), int(r["num_experts"])))
    return [f"{system},{t},{h},{i},{k},{e},{MOE_DTYPE},{ms:.6g},{kern},{src}"
            for (t, h, i, k, e), (ms, kern) in med.items()]


HEADERS = {
    "gemm": "gpu,m,n,k,ms,kernel,source",
    "attention": "gpu,phase,batch,tokens,heads,kv_heads,head_dim,window,ms,kernel,source",
    "moe": "gpu,tokens,hidden,inter,topk,experts,dtype,ms,kernel,source",
}


def render(wheel_path: Path) -> dict[str, bytes]:
    """The gzipped CSV bytes of each file (gzip without a timestamp, so the bytes are reproducible)."""
    match = _WHEEL.search(wheel_path.name)
    if not match:
        raise SystemExit(f"{wheel_path.name} is not an aiconfigurator_core wheel (aiconfigurator_core-<version>-...whl)")
    version = match.group(1)
    lines: dict[str, list[str]] = {name: [] for name in HEADERS}
    with zipfile.ZipFile(wheel_path) as wheel:
        for system in AIC_GPUS:
            for name, op, table in (("gemm", "gemm", "gemm_perf"), ("context", "attention", "context_attention_perf"),
                                    ("generation", "attention", "generation_attention_perf"), ("moe", "moe", "moe_perf")):
                path = _newest(wheel, system, op, table)
                if path is None:
                    continue
                src = f"aiconfigurator-core=={version}:{path.removeprefix('aiconfigurator_core/')}"
                if name == "gemm":
                    lines["gemm"] += _gemm(wheel, system, path, src)
                elif name == "moe":
                    lines["moe"] += _moe(wheel, system, path, src)
                else:
                    lines["attention"] += _attention(wheel, system, path, src, name)
    head = (f"# Measured vLLM kernel times (ms) from aiconfigurator-core {version} (NVIDIA, Apache-2.0, PyPI), the parquet"
            " named in `source` (inside the wheel).\n# Written by tools/aiconfigurator_kernels.py; measurements only,"
            " no code of the package.\n")
    out = {}
    for name, header in HEADERS.items():
        text = head + header + "\n" + "".join(f"{line}\n" for line in lines[name])
        out[f"{name}.csv.gz"] = gzip.compress(text.encode(), mtime=0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the aiconfigurator_core-<version>-*.whl that pip downloaded")
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing them")
    args = parser.parse_args(argv)
    files = render(args.wheel)
    if args.check:
        differ = [n for n, data in files.items() if not (OUT / n).exists() or (OUT / n).read_bytes() != data]
        print(f"{KERNELS_DIR}/: {'matches' if not differ else 'DIFFERS from'} {args.wheel.name}"
              + (f" ({', '.join(differ)})" if differ else ""))
        return 1 if differ else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (OUT / name).write_bytes(data)
        rows = gzip.decompress(data).decode().count("\n") - 3
        print(f"wrote {OUT / name} ({rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
