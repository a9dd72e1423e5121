"""Fit spot preemption and availability per AWS zone from SkyPilot's *Can't Be Late* traces.

Reads the run-length-encoded trace `spot_gpu_availability_aws_rle.csv.gz` (its columns and
provenance: `src/coral/data/README.md`, section `availability/spot_gpu_availability_aws_rle.csv.gz`)
and writes `src/coral/data/availability/spot_fit_aws_v100.csv`: a few statistics per series
(zone, instance type, 1-/4-/16-node), pooled per region and over every V100 series. Coral's spot
offers read the pooled rows (`coral.catalog.spot`). The trace itself has no licence and is not
shipped; fetch it from `skypilot-org/spot-traces` (the README names the commit) and run:

    python tools/fit_spot.py TRACE.csv.gz            # rewrite the fit
    python tools/fit_spot.py TRACE.csv.gz --check    # exit 1 when the shipped fit differs

What each column means (the value of a tick is how many of the requested spot instances were
held; a fall from one tick to the next is a loss of that many nodes, one *event*):

- `node_hours_held`: the integral of the value over time (node-hours held).
- `nodes_lost`, `loss_events`: nodes lost and the ticks at which any were lost.
- `preemption_per_node_h`: nodes_lost / node_hours_held, the rate of a Poisson process per node.
- `co_loss_share`: for a node that is lost, the share of the other nodes held at that moment that
  are lost at the same tick: sum over events of k(k-1) / sum of k(m-1), k nodes lost of m held.
  0 when nodes fall one at a time, 1 when they all fall together; empty for 1-node series.
  This is the correlation `rho` of the discount rule (docs/reference/allocator.md).
- `dispersion_index`: variance / mean of nodes lost per hour (1 for a Poisson process, above 1
  when losses bunch); empty for 1-node series and where nothing was lost.
- `multi_node_event_share`: of the loss events while two nodes or more were held, the share
  that took two or more (empty for 1-node series).
- `availability`: time-weighted mean of value / nodes requested (the share of the requested
  capacity held or obtainable).
- `recovery_mean_s`, `recovery_spells`: mean length of a spell below the requested count, from
  a loss until the count is back to full, over the spells that end inside the trace.

Both kinds of series are read alike: a fall in an `availability` series (instances obtained)
counts as a loss as one in a `preemption` series (instances still running) does. That is our
reading; upstream defines neither further (the data README says so). The ticks are 32-600 s apart, so two losses inside one tick count as one event of two nodes:
`co_loss_share` is an upper bound at the tick's resolution. Only V100 (and K80) are traced;
no public trace covers L4, A10G, L40S, A100, H100 or B200, and Coral uses the V100 pool as
their proxy.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "coral" / "data" / "availability" / "spot_fit_aws_v100.csv"
HOUR_S = 3600.0
COLUMNS = ("scope", "name", "kind", "region", "zone", "gpu", "instance_type", "nodes_requested", "gap_s",
           "span_h", "node_hours_held", "nodes_lost", "loss_events", "preemption_per_node_h", "co_loss_share",
           "dispersion_index", "multi_node_event_share", "availability", "recovery_mean_s", "recovery_spells")
HEADER = """\
# Spot preemption and availability fitted per series, region and pool from SkyPilot's "Can't Be Late"
# traces (skypilot-org/spot-traces at 221da1ab9bdfe7966da296265d7694d52dc0c5a6; Wu et al., NSDI'24)
# by tools/fit_spot.py, which defines every column. Summary statistics only: the trace is not shipped.
# scope: series (one trace), region (every V100 series of the region), pool (every V100 series).
# Only V100 and K80 are traced: NO public trace covers L4, A10G, L40S, A100, H100 or B200. Coral's spot
# offers use the region's V100 row as the proxy for every GPU, and the pool row where a region has no trace.
"""


@dataclass
class SeriesFit:
    """The sums one series (or a pool of them) contributes."""

    meta: dict[str, str]
    span_s: float = 0.0
    held_s: float = 0.0  # node-seconds held
    requested_s: float = 0.0  # node-seconds requested
    lost: int = 0
    events: list[tuple[int, int]] = field(default_factory=list)  # (nodes lost k, nodes held before m)
    hourly: list[int] = field(default_factory=list)  # nodes lost in each hour of the series
    spells_s: list[float] = field(default_factory=list)

    def add(self, other: SeriesFit) -> None:
        self.span_s += other.span_s
        self.held_s += other.held_s
        self.requested_s += other.requested_s
        self.lost += other.lost
        self.events += other.events
        self.spells_s += other.spells_s


def _read(path: Path) -> dict[str, list[dict[str, str]]]:
    with gzip.open(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        series[row["series_id"]].append(row)
    for runs in series.values():
        runs.sort(key=lambda r: int(r["start_tick"]))
        for a, b in zip(runs, runs[1:], strict=False):
            if a["end_tick"] != b["start_tick"]:
                raise SystemExit(f"{a['series_id']}: runs not contiguous at tick {a['end_tick']}")
    return series


def fit_series(runs: list[dict[str, str]]) -> SeriesFit:
    """The sums of one series' runs (sorted, contiguous)."""
    first = runs[0]
    n = int(first["nodes_requested"])
    fit = SeriesFit(meta={k: first[k] for k in ("series_id", "kind", "region", "zone", "gpu", "instance_type",
                                                 "nodes_requested", "gap_seconds")})
    end_s = float(runs[-1]["end_s"])
    fit.hourly = [0] * max(1, math.ceil(end_s / HOUR_S))
    spell_start: float | None = None
    prev: int | None = None
    for run in runs:
        start, end, value = float(run["start_s"]), float(run["end_s"]), int(run["value"])
        fit.span_s += end - start
        fit.held_s += value * (end - start)
        fit.requested_s += n * (end - start)
        if prev is not None and value < prev:
            k = prev - value
            fit.lost += k
            fit.events.append((k, prev))
            fit.hourly[min(int(start // HOUR_S), len(fit.hourly) - 1)] += k
            if prev == n:
                spell_start = start
        if value == n and spell_start is not None:
            fit.spells_s.append(start - spell_start)
            spell_start = None
        prev = value
    return fit


def _fmt(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}g}"


def _dispersion(hourly: list[int]) -> float | None:
    if len(hourly) < 2 or not any(hourly):
        return None
    mean = sum(hourly) / len(hourly)
    var = sum((x - mean) ** 2 for x in hourly) / (len(hourly) - 1)
    return var / mean


def render_row(scope: str, name: str, fit: SeriesFit, dispersion: float | None) -> dict[str, str]:
    """One CSV row of a fit."""
    pairs = sum(k * (m - 1) for k, m in fit.events)
    rho = sum(k * (k - 1) for k, _ in fit.events) / pairs if pairs else None
    shared = [(k, held) for k, held in fit.events if held >= 2]  # events where several nodes could fall
    m = fit.meta
    return {
        "scope": scope, "name": name, "kind": m.get("kind", ""), "region": m.get("region", ""),
        "zone": m.get("zone", ""), "gpu": m.get("gpu", ""), "instance_type": m.get("instance_type", ""),
        "nodes_requested": m.get("nodes_requested", ""), "gap_s": m.get("gap_seconds", ""),
        "span_h": _fmt(fit.span_s / HOUR_S), "node_hours_held": _fmt(fit.held_s / HOUR_S),
        "nodes_lost": str(fit.lost), "loss_events": str(len(fit.events)),
        "preemption_per_node_h": _fmt(fit.lost / (fit.held_s / HOUR_S) if fit.held_s else None),
        "co_loss_share": _fmt(rho),
        "dispersion_index": _fmt(dispersion),
        "multi_node_event_share": _fmt(sum(1 for k, _ in shared if k >= 2) / len(shared) if shared else None),
        "availability": _fmt(fit.held_s / fit.requested_s if fit.requested_s else None),
        "recovery_mean_s": _fmt(sum(fit.spells_s) / len(fit.spells_s) if fit.spells_s else None),
        "recovery_spells": str(len(fit.spells_s)),
    }


def _pooled_dispersion(fits: list[SeriesFit]) -> float | None:
    """Node-hour-weighted mean of the multi-node series' dispersion indices."""
    parts = [(f.held_s, d) for f in fits if int(f.meta["nodes_requested"]) > 1
             and (d := _dispersion(f.hourly)) is not None]
    weight = sum(w for w, _ in parts)
    return sum(w * d for w, d in parts) / weight if weight else None


def fit_table(path: Path) -> str:
    """The whole fit CSV (header comments included) from the trace at `path`."""
    fits = [fit_series(runs) for _, runs in sorted(_read(path).items())]
    rows = [render_row("series", f.meta["series_id"], f, _dispersion(f.hourly)
                       if int(f.meta["nodes_requested"]) > 1 else None) for f in fits]
    v100 = [f for f in fits if f.meta["gpu"] == "V100"]
    groups: dict[str, list[SeriesFit]] = defaultdict(list)
    for f in v100:
        groups[f"aws:{f.meta['region']}"].append(f)
    groups["pool"] = v100
    for name, members in sorted(groups.items(), key=lambda kv: (kv[0] == "pool", kv[0])):
        pooled = SeriesFit(meta={"gpu": "V100", "region": "" if name == "pool" else name.split(":", 1)[1]})
        for f in members:
            pooled.add(f)
        rows.append(render_row("pool" if name == "pool" else "region", name, pooled, _pooled_dispersion(members)))
    out = io.StringIO()
    out.write(HEADER)
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="spot_gpu_availability_aws_rle.csv.gz (the real trace, not the stand-in)")
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"error: trace {args.trace} does not exist; give the path of spot_gpu_availability_aws_rle.csv.gz",
              file=sys.stderr)
        return 2
    text = fit_table(args.trace)
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.name}: {'matches the fit' if same else 'DIFFERS from the fit'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
