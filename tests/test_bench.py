"""`make bench`: one table from every benchmark module (run here as a quick smoke run; the
figures themselves are not checked, only that the table has its rows, each with its anchor)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"


def table(output: str) -> list[list[str]]:
    """The cells of each Markdown table row, the header first (the rule line left out)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith("|") and not line.startswith("|-")
    ]


def test_a_quick_run_prints_one_table_with_the_listing_rows():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "listing"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr

    header, *rows = table(done.stdout)
    assert header == ["benchmark", "measure", "kit", "bare LangGraph", "ratio", "unit"]
    assert [row[0] for row in rows] == ["listing"] * 3
    assert [row[1].split(",")[0] for row in rows] == [
        "first page of 50", "page 10 of 50 (kit: its cursor; bare: OFFSET)", "all conversations"]
    for _, _, kit, bare, ratio, unit in rows:
        assert float(kit) >= 0 and float(bare) > 0
        assert ratio.endswith("x") and unit == "ms"
    assert done.stdout.startswith("Machine: ")
    assert "listing: bare = the original's own summary query" in done.stdout


def test_an_unknown_benchmark_is_refused_by_name():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--only", "listing,nonsense"], capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "unknown benchmark nonsense" in done.stderr
    assert "|" not in done.stdout


def test_the_retries_rows_are_measured_on_both_sides_and_the_defaults_are_printed_apart():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "retries"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr

    _, *rows = table(done.stdout)
    assert {row[0] for row in rows} == {"retries"}
    assert not any(row[1].startswith("defaults: ") or "[computed]" in row[1] for row in rows)
    observed = [row for row in rows if "gap observed between the model requests" in row[1]]
    assert [row[1].split(":")[1].split(",")[0].strip() for row in observed] == [
        "retry 1 asked 0.05 s", "retry 2 asked 0.1 s", "retry 3 asked 0.2 s"]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 and row[5] == "s" for row in observed)
    assert any(row[1].startswith("a hung request, limit 0.5 s") for row in rows)
    # The computed waits are not a row: they are printed apart, after the table, labelled so.
    apart = done.stdout.split("Printed apart", 1)[1]
    assert "computed expectation, not measured" in apart and "1, 2, 4, 8, 16, 30, 30, 30 s" in apart


def test_a_row_without_an_anchor_or_with_too_few_repeats_stops_the_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_for_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    row = {"benchmark": "x", "measure": "y", "unit": "ms", "kit_runs": [1.0, 2.0, 3.0]}
    for broken in ({**row, "bare_runs": []}, {**row, "bare_runs": [1.0, 2.0]},
                   {**row, "kit_runs": [1.0], "bare_runs": [1.0]}):
        try:
            bench.check(broken)
        except ValueError:
            continue
        raise AssertionError(f"accepted {broken}")
    bench.check({**row, "bare_runs": [1.0, 1.0, 1.0]})
    bench.check({**row, "kit_runs": [1.0], "bare_runs": [1.0]}, quick=True)
