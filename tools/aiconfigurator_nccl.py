"""Extract the measured NCCL all-reduce latencies shipped in the aiconfigurator-core wheel into one CSV.

aiconfigurator-core (NVIDIA, Apache-2.0, on PyPI) ships `nccl_perf.parquet` tables measured with
NCCL on 2, 4 and 8 GPUs of one node per system. This tool reads only those measurements (facts;
none of the package's code is used or copied) and writes the 16-bit all-reduce rows of the
folder each system's own YAML names (`misc.nccl_version`) as `gpu,gpus,bytes,us,source`:

- `gpu`: aiconfigurator's system name (`l40s`, `h100_sxm`, ...); `coral.perf.collectives` maps it
  to a Coral GPU type;
- `bytes`: the message size in bytes. The tables count elements (`message_size`), so bytes =
  2 x elements for `half`; the `int8` rows at twice the element count take the same time, which
  confirms the unit;
- `us`: the median latency over the table's repeated rows (some tables hold 2-3 copies of each
  point), in microseconds (the tables are in ms).

    pip download aiconfigurator-core==0.12.0 --no-deps -d /tmp/aic
    python tools/aiconfigurator_nccl.py /tmp/aic/aiconfigurator_core-0.12.0-*.whl   # rewrite the CSV
    python tools/aiconfigurator_nccl.py WHEEL --check    # exit 1 when the shipped CSV differs
"""
from __future__ import annotations

import argparse
import io
import re
import statistics
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import yaml

OUT = Path(__file__).resolve().parents[1] / "src" / "coral" / "data" / "profiles" / "nccl_allreduce_aiconfigurator.csv"
_WHEEL = re.compile(r"aiconfigurator_core-([0-9][^-]*)-")
_SYSTEM_YAML = re.compile(r"^aiconfigurator_core/systems/([a-z0-9_]+)\.yaml$")
BYTES_PER_ELEMENT = {"half": 2}


def _tables(wheel: zipfile.ZipFile) -> dict[str, str]:
    """System name -> path in the wheel of the NCCL table its YAML's `nccl_version` names."""
    names = set(wheel.namelist())
    out = {}
    for name in sorted(names):
        match = _SYSTEM_YAML.match(name)
        if not match:
            continue
        system = match.group(1)
        spec = yaml.safe_load(wheel.read(name)) or {}
        version = (spec.get("misc") or {}).get("nccl_version")
        path = f"aiconfigurator_core/systems/data/{system}/comm/nccl/{version}/nccl_perf.parquet"
        if version is not None and path in names:
            out[system] = path
    return out


def render(wheel_path: Path) -> str:
    """The CSV text for the wheel at `wheel_path` (header comments say where every row comes from)."""
    match = _WHEEL.search(wheel_path.name)
    if not match:
        raise SystemExit(f"{wheel_path.name} is not an aiconfigurator_core wheel (aiconfigurator_core-<version>-...whl)")
    version = match.group(1)
    rows: list[tuple[str, int, int, float, str]] = []
    with zipfile.ZipFile(wheel_path) as wheel:
        tables = _tables(wheel)
        for system, path in tables.items():
            table = pq.read_table(io.BytesIO(wheel.read(path))).to_pylist()
            points: dict[tuple[int, int], list[float]] = {}
            for r in table:
                width = BYTES_PER_ELEMENT.get(r["nccl_dtype"])
                if r["op_name"] != "all_reduce" or width is None:
                    continue
                points.setdefault((int(r["num_gpus"]), int(r["message_size"]) * width), []).append(float(r["latency"]))
            source = f"aiconfigurator-core=={version}:{path.removeprefix('aiconfigurator_core/')}"
            for (n, nbytes), ms in sorted(points.items()):
                rows.append((system, n, nbytes, round(statistics.median(ms) * 1e3, 3), source))
    head = [
        f"# Measured NCCL all-reduce (16-bit, one node) from aiconfigurator-core {version} (NVIDIA, Apache-2.0, PyPI):",
        "#   the nccl_perf.parquet named in `source` (inside the wheel), the folder each system's YAML names as",
        "#   misc.nccl_version. bytes = 2 x the table's element count; us = median of the table's repeated rows.",
        "#   Written by tools/aiconfigurator_nccl.py; measurements only, no code of the package.",
        "gpu,gpus,bytes,us,source",
    ]
    return "\n".join(head + [f"{s},{n},{b},{us:g},{src}" for s, n, b, us, src in rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the aiconfigurator_core-<version>-*.whl that pip downloaded")
    parser.add_argument("--check", action="store_true", help="compare with the shipped CSV instead of writing it")
    args = parser.parse_args(argv)
    text = render(args.wheel)
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.name}: {'matches' if same else 'DIFFERS from'} {args.wheel.name}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({text.count(chr(10)) - 5} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
