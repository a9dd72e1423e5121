"""What the component benches share: printing their `{bench, value, unit, goal}` rows."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def main_for(run: Callable[[bool], list[dict[str, Any]]], doc: str | None) -> None:
    """Parse `--quick`, run the bench and print its rows as a table."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--quick", action="store_true")
    rows = run(ap.parse_args().quick)
    w = max(len(r["bench"]) for r in rows)
    print(f"{'benchmark':<{w}}  {'value':>10}  unit    goal")
    for r in rows:
        print(f"{r['bench']:<{w}}  {r['value']:>10.3f}  {r['unit']:<6}  {r['goal']}")
