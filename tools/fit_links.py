"""Re-fit the shipped all-reduce rows (`src/coral/catalog/data/interconnects.csv`) from the public data.

The rows come from the measured NCCL all-reduce in `src/coral/data/profiles/nccl_allreduce_aiconfigurator.csv`
and Helix's layer profiles (`coral.perf.calibrate.link_table`; docs/reference/perf.md says which GPU uses which).

    python tools/fit_links.py            # rewrite interconnects.csv
    python tools/fit_links.py --check    # exit 1 when the shipped file differs from what this writes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coral.catalog import builtin_catalog
from coral.perf.calibrate import link_table, render_interconnects
from coral.perf.collectives import AIC_FILE
from coral.workload.datasets import builtin_data_dir

OUT = Path(__file__).resolve().parents[1] / "src" / "coral" / "catalog" / "data" / "interconnects.csv"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    data = builtin_data_dir() / "profiles"
    text = render_interconnects(link_table(data / AIC_FILE, data / "helix_llama2_70b", builtin_catalog()))
    if args.check:
        same = OUT.read_text() == text
        print(f"{OUT.name}: {'matches the fit' if same else 'DIFFERS from the fit'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
