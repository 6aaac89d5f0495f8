"""Every benchmark of the kit, one table: `make bench` (`--quick` for a fast smoke run).

Each module of this folder named in BENCHMARKS exposes `rows(quick: bool = False) -> list[dict]`
with the keys `benchmark`, `measure`, `unit` and the figures of each repeat: `kit_runs` and
`bare_runs` (lists of floats, the same length, one pair per repeat run side by side). The anchor
(the "bare" column) is the strongest thing a user could pick instead of the kit doing the same
work; the module's `BARE` names it, and a row whose anchor differs says so in its measure. The
table shows the median of each side, the ratio of the medians (kit / bare) and, after each
measure, the spread: `[n=7: kit min-max, bare min-max, ratio min-max]`, the ratio's over the
pairs. Every row of the table is measured, both sides, with n >= 3 (`--quick` aside).

What has no anchor or is not measured (a computed expectation, the size of an input) is not a
row: a module returns it as `note(benchmark, text)`, printed apart after the table under its
own heading. A module that is missing is skipped with a note; one that fails stops the run.

    python benchmarks/bench.py [--quick] [--only listing,startup]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BENCHMARKS = ("steps", "growth", "listing", "startup", "sse", "retries", "postgres", "workers")
COLUMNS = ("benchmark", "measure", "kit", "bare LangGraph", "ratio", "unit")


def note(benchmark: str, text: str) -> dict:
    """A line printed apart from the table (no anchor, or not measured): see the module's doc."""
    return {"benchmark": benchmark, "note": text}


def spread_of(values: list[float], unit: str = "") -> str:
    """`median unit (n=..., min-max)` of a list of figures, for a note."""
    median = statistics.median(values)
    low, high = min(values), max(values)
    return f"{figure(median)}{unit} (n={len(values)}: {figure(low)}-{figure(high)}{unit})"


def complete(row: dict) -> dict:
    """The row with `kit` and `bare` set to the medians of its runs (where it has runs)."""
    row = dict(row)
    for side in ("kit", "bare"):
        runs = row.get(f"{side}_runs") or []
        if runs:
            row[side] = statistics.median(runs)
        else:
            row.setdefault(side, None)
    if row["kit"] is None:
        raise ValueError(f"{row['benchmark']}: {row['measure']!r} has no figure")
    return row


MIN_REPEATS = 3


def check(row: dict, quick: bool = False) -> None:
    """A row of the table is measured on both sides, in pairs, n >= MIN_REPEATS (not in a quick
    run, whose figures are a smoke test); anything else is a module's mistake."""
    kit, bare = row.get("kit_runs") or [], row.get("bare_runs") or []
    where = f"{row['benchmark']}: {row['measure']!r}"
    if not kit or not bare:
        raise ValueError(f"{where} has no anchor: a row needs both sides' runs (or make it a note)")
    if len(kit) != len(bare):
        raise ValueError(f"{where}: {len(kit)} kit runs against {len(bare)} bare runs (they go in pairs)")
    if not quick and len(kit) < MIN_REPEATS:
        raise ValueError(f"{where}: n={len(kit)}, fewer than {MIN_REPEATS}")


def ratio(row: dict) -> float | None:
    kit, bare = row.get("kit"), row.get("bare")
    if kit is None or not bare:
        return None
    return kit / bare


def spread(row: dict) -> str:
    """What follows the measure: the number of repeats and the min-max of each side (and of the
    ratio, over the pairs)."""
    kit, bare = row.get("kit_runs") or [], row.get("bare_runs") or []
    if not kit:
        return ""
    def span(values: list[float], text=figure) -> str:
        return text(values[0]) if len(values) == 1 else f"{text(min(values))}-{text(max(values))}"

    parts = [f"kit {span(kit)}"]
    if bare:
        parts.append(f"bare {span(bare)}")
    if bare and len(bare) == len(kit) and all(bare):
        parts.append(f"ratio {span([k / b for k, b in zip(kit, bare)], ratio_text)}")
    n = f"n={len(kit)}" if not bare or len(bare) == len(kit) else f"n={len(kit)} kit, {len(bare)} bare"
    return f" [{n}: {', '.join(parts)}]"


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
    """The rows as a Markdown table (it reads as text too, and pastes into the README): medians,
    the ratio of the medians, and the spread after each measure (see `spread`)."""
    rows = [complete(row) for row in rows]
    cells = [
        [row["benchmark"], row["measure"] + spread(row), figure(row.get("kit")), figure(row.get("bare")),
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


def load() -> str:
    """The 1-minute load average: other work on the machine shows in every figure."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


LEGEND = ("Each figure is the median of n repeats; [n=...: min-max of each side, and of the ratio "
          "kit / bare over the repeats run side by side] follows each measure.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions: a smoke run")
    parser.add_argument("--only", default="", help=f"comma-separated benchmarks to run (of {', '.join(BENCHMARKS)})")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)} (known: {', '.join(BENCHMARKS)})")

    rows, notes, apart = [], [], []
    load_before = load()
    for name in chosen:
        if not (HERE / f"{name}.py").exists():
            notes.append(f"{name}: skipped (benchmarks/{name}.py is not there)")
            continue
        print(f"running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        module = importlib.import_module(name)
        for row in module.rows(quick=args.quick):
            if "note" in row:
                apart.append(row)
            else:
                check(row, args.quick)
                rows.append(row)
        print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if getattr(module, "BARE", None):
            notes.append(f"{name}: bare = {module.BARE}")

    print(f"Machine: {machine()}{' (quick run: smoke figures, not for comparison)' if args.quick else ''}")
    print(f"Load average (1 min): {load_before} at the start, {load()} at the end")
    print(LEGEND)
    print()
    print(format_table(rows))
    if notes:
        print()
        print("\n".join(notes))
    if apart:
        print()
        print("Printed apart (not rows: no anchor, or not measured):")
        print("\n".join(f"- {row['benchmark']}: {row['note']}" for row in apart))
    return 0


if __name__ == "__main__":
    sys.exit(main())
