"""Re-fit the shipped kernel efficiencies (`KERNEL_EFFICIENCY` in `src/coral/perf/roofline.py`) from the public data.

The fit rebuilds dense layers from the measured vLLM kernels in `src/coral/data/profiles/aiconfigurator_kernels/`
(`coral.perf.kernels.kernel_report`; docs/reference/perf.md). It prints the dictionary's lines to paste into roofline.py.

    python tools/fit_kernels.py            # print the fitted KERNEL_EFFICIENCY lines
    python tools/fit_kernels.py --check    # exit 1 when the shipped numbers differ from the fit
"""
from __future__ import annotations

import argparse
import sys

from coral.catalog import builtin_catalog
from coral.perf.kernels import KERNELS_DIR, kernel_report
from coral.perf.roofline import KERNEL_EFFICIENCY
from coral.workload.datasets import builtin_data_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped numbers instead of printing them")
    args = parser.parse_args(argv)
    fitted = kernel_report(builtin_data_dir() / "profiles" / KERNELS_DIR, builtin_catalog()).fitted
    if args.check:
        same = fitted == KERNEL_EFFICIENCY
        print(f"KERNEL_EFFICIENCY: {'matches the fit' if same else 'DIFFERS from the fit'}")
        return 0 if same else 1
    for gpu, e in fitted.items():
        print(f'    "{gpu}": Efficiency(flops={e.flops:.3f}, decode_flops={e.decode_flops:.3f}, '
              f'bandwidth={e.bandwidth:.3f}, layer_overhead_s={e.layer_overhead_s * 1e6:.1f}e-6),')
    return 0


if __name__ == "__main__":
    sys.exit(main())
