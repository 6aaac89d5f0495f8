"""Every benchmark of the kit, one table: `make bench` (`--quick` for a fast smoke run).

Each module of this folder named in BENCHMARKS exposes `rows(quick: bool = False) -> list[dict]`
with the keys `benchmark`, `measure`, `kit`, `bare` (a float, or None where bare LangGraph has
no counterpart) and `unit`; the ratio kit / bare is computed here, from figures measured in the
same run. A module that is missing is skipped with a note; one that fails stops the run.

    python benchmarks/bench.py [--quick] [--only listing,startup]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BENCHMARKS = ("steps", "growth", "listing", "startup", "sse", "retries")
COLUMNS = ("benchmark", "measure", "kit", "bare LangGraph", "ratio", "unit")


def ratio(row: dict) -> float | None:
    kit, bare = row.get("kit"), row.get("bare")
    if kit is None or not bare:
        return None
    return kit / bare


def ratio_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.1g}x"


def figure(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (it reads as text too, and pastes into the README)."""
    cells = [
        [row["benchmark"], row["measure"], figure(row.get("kit")), figure(row.get("bare")),
         ratio_text(ratio(row)), row["unit"]]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]
    numeric = {2, 3, 4}

    def line(values: list[str]) -> str:
        return "| " + " | ".join(
            value.rjust(width) if i in numeric else value.ljust(width)
            for i, (value, width) in enumerate(zip(values, widths))
        ) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(list(COLUMNS)), rule, *map(line, cells)])


def machine() -> str:
    """The CPU and Python the figures came from (no host name, no paths)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} x {model}, Python {platform.python_version()}, {platform.system()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions: a smoke run")
    parser.add_argument("--only", default="", help=f"comma-separated benchmarks to run (of {', '.join(BENCHMARKS)})")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)} (known: {', '.join(BENCHMARKS)})")

    rows, notes = [], []
    for name in chosen:
        if not (HERE / f"{name}.py").exists():
            notes.append(f"{name}: skipped (benchmarks/{name}.py is not there)")
            continue
        print(f"running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        module = importlib.import_module(name)
        rows += module.rows(quick=args.quick)
        if getattr(module, "BARE", None):
            notes.append(f"{name}: bare = {module.BARE}")

    print(f"Machine: {machine()}{' (quick run: smoke figures, not for comparison)' if args.quick else ''}")
    print()
    print(format_table(rows))
    if notes:
        print()
        print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
