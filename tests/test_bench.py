"""`make bench`: one table from every benchmark module (run here as a quick smoke run; the
figures themselves are not checked, only that the table has its rows)."""

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
        "first page of 50", "page 10 of 50 (cursor; bare: OFFSET)", "all conversations"]
    for _, _, kit, bare, ratio, unit in rows:
        assert float(kit) >= 0 and float(bare) > 0
        assert ratio.endswith("x") and unit == "ms"
    assert done.stdout.startswith("Machine: ")
    assert "listing: bare = schema version 2's listing query" in done.stdout


def test_an_unknown_benchmark_is_refused_by_name():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--only", "listing,nonsense"], capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "unknown benchmark nonsense" in done.stderr
    assert "|" not in done.stdout


def test_the_retries_rows_list_the_defaults_backoff_and_one_observed_gap_per_retry():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "retries"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr

    _, *rows = table(done.stdout)
    assert {row[0] for row in rows} == {"retries"}
    defaults = [row for row in rows if row[1].startswith("defaults: ")]
    assert [row[2] for row in defaults] == ["1.00", "2.00", "4.00", "8.00", "16.0", "30.0", "30.0", "30.0"]
    observed = [row for row in rows if "gap observed between the model requests" in row[1]]
    assert [row[1].split(":")[1].split(",")[0].strip() for row in observed] == [
        "retry 1 asked 0.05 s", "retry 2 asked 0.1 s", "retry 3 asked 0.2 s"]
    assert all(float(row[2]) > 0 and row[5] == "s" for row in observed)
    assert any(row[1].startswith("a hung request, limit 0.5 s") for row in rows)
