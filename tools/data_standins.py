"""Write the labelled stand-ins for the two public data files Coral may not redistribute.

`src/coral/data/README.md` says why (the SkyPilot spot traces carry no licence; the Alibaba
inventory is for "research or study purpose" only) and how to get the real files. The
stand-ins keep each file's columns, series and sizes, so code written against them reads the
real file unchanged; their values are random (seeded) and every row says it is a stand-in.

    python tools/data_standins.py            # rewrite both files in src/coral/data/availability/
    python tools/data_standins.py --check    # exit 1 when the shipped files differ from what this writes
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "coral" / "data" / "availability"
SPOT_FILE = "standin_spot_gpu_availability_aws_rle.csv.gz"
INVENTORY_FILE = "standin_alibaba_gfs2026_node_inventory.csv.gz"
SEED = 20260101
K80_1 = "p2.2xlarge (as written in upstream README; AWS 1xK80 type is p2.xlarge)"

# The upstream series (skypilot-org/spot-traces @ 221da1a): id, kind, nodes requested, zone, GPU,
# GPUs per instance, instance type, start date, seconds per tick, ticks. These describe the
# files (their README and lengths); the values of the stand-in are not theirs.
SPOT_SERIES: tuple[tuple[str, str, int, str, str, int, str, str, int, int], ...] = (
    *((f"availability/1-node/aws-02-15-2023/{z}_v100_1", "availability", 1, z, "V100", 1, "p3.2xlarge",
       "2023-02-15", 195, 20158)
      for z in ("us-east-1a", "us-east-1c", "us-east-1d", "us-east-1f", "us-east-2a", "us-east-2b",
                "us-west-2a", "us-west-2b", "us-west-2c")),
    *((f"availability/1-node/aws-10-26-2022/{z}_{g.lower()}_{n}", "availability", 1, z, g, n, t,
       "2022-10-26", 600, 3895)
      for z in ("us-west-2a", "us-west-2b")
      for g, n, t in (("K80", 1, K80_1), ("K80", 8, "p2.16xlarge"), ("V100", 1, "p3.2xlarge"),
                      ("V100", 8, "p3.16xlarge"))),
    *((f"availability/16-node/aws-08-27-2023/{z}_v100_1", "availability", 16, z, "V100", 1, "p3.2xlarge",
       "2023-08-27", 300, ticks)
      for z, ticks in (("us-east-2b", 3247), ("us-west-2a", 4736), ("us-west-2c", 4736))),
    *((f"preemption/1-node/aws-04-22-2023/{z}_v100_1", "preemption", 1, z, "V100", 1, "p3.2xlarge",
       "2023-04-22", 32, 19961)
      for z in ("us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c")),
    *((f"preemption/4-node/aws-08-03-2023/{z}_v100_1", "preemption", 4, z, "V100", 1, "p3.2xlarge",
       "2023-08-03", 300, ticks)
      for z, ticks in (("us-east-1f", 3664), ("us-east-2a", 5131), ("us-west-2c", 5131))),
)
SPOT_COLUMNS = ("series_id", "kind", "nodes_requested", "cloud", "region", "zone", "gpu", "gpus_per_instance",
                "instance_type", "trace_start_date", "gap_seconds", "start_tick", "end_tick", "start_s", "end_s",
                "value")
MEAN_RUN_TICKS = 60

# The inventory's composition, as the data README's table gives it (GPU model, GPUs per node, CPUs
# per node, nodes): 4,278 nodes. Node names and order are the stand-in's own.
INVENTORY: tuple[tuple[str, int, int, int], ...] = (
    ("A10", 1, 126, 2), ("A10", 1, 128, 2492), ("A100-SXM4-80GB", 8, 128, 432), ("A800-SXM4-80GB", 8, 128, 22),
    ("GPU-series-1", 1, 128, 1), ("GPU-series-1", 1, 192, 901), ("GPU-series-1", 4, 192, 10),
    ("GPU-series-1", 8, 192, 77), ("GPU-series-2", 8, 192, 122), ("H800", 8, 192, 219),
)
INVENTORY_COLUMNS = ("gpu_model", "gpu_capacity_num", "cpu_num", "node_name")


def _gzip_csv(columns: tuple[str, ...], rows: list[tuple[object, ...]]) -> bytes:
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(columns)
    w.writerows(rows)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as f:  # byte-for-byte reproducible
        f.write(text.getvalue().encode())
    return buf.getvalue()


def spot_standin() -> bytes:
    """Random runs (mean 60 ticks) of 0..nodes-requested per upstream series, ids prefixed `STANDIN/`."""
    rng = random.Random(SEED)
    rows: list[tuple[object, ...]] = []
    for sid, kind, nodes, zone, gpu, per, itype, start, gap, ticks in SPOT_SERIES:
        tick, value = 0, 0
        while tick < ticks:
            end = min(ticks, tick + 1 + int(rng.random() * 2 * MEAN_RUN_TICKS))
            rows.append((f"STANDIN/{sid}", kind, nodes, "aws", zone[:-1], zone, gpu, per, itype, start, gap,
                         tick, end, tick * gap, end * gap, value))
            nxt = value
            while nxt == value:  # a run ends where the value changes
                nxt = int(rng.random() * (nodes + 1))
            tick, value = end, nxt
    return _gzip_csv(SPOT_COLUMNS, rows)


def inventory_standin() -> bytes:
    """The inventory's published composition in a seeded order, nodes named `standin-<n>`."""
    nodes = [(gpu, n, cpus) for gpu, n, cpus, count in INVENTORY for _ in range(count)]
    keyed = sorted((random.Random(f"{SEED}-{i}").random(), i) for i in range(len(nodes)))
    return _gzip_csv(INVENTORY_COLUMNS, [(*nodes[i], f"standin-{k}") for k, (_, i) in enumerate(keyed)])


def standins() -> dict[str, bytes]:
    """File name -> the bytes this script writes."""
    return {SPOT_FILE: spot_standin(), INVENTORY_FILE: inventory_standin()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    args = ap.parse_args()
    for name, data in standins().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_bytes() != data:
                print(f"{path} differs from what tools/data_standins.py writes", file=sys.stderr)
                return 1
        else:
            path.write_bytes(data)
            print(f"wrote {path} ({len(data):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
