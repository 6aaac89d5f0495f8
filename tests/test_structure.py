"""The package's shape: no import circle, no module longer than a reader takes in one sitting.

Imports are read from the source, those inside functions included: a function-level import
hides a circle from Python's start-up, not from a reader who follows it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sophos_lab"
MAX_LINES = 600



def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    found.add(f"{target}.{alias.name}")  # a module imported from its package
                elif target in known:
                    found.add(target)
    return found - {name}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_package_imports_itself_back() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle_through_a_function_level_import(tmp_path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    known = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p": tmp_path / "__init__.py"}
    (tmp_path / "__init__.py").write_text("")
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert circles(graph) == [{"p.a", "p.b"}]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_a_module_reads_in_one_sitting(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} is {lines} lines, over {MAX_LINES}"



def test_no_two_places_in_the_package_share_identical_lines() -> None:
    """`duplicates` (a developer's tool, where it is installed) finds no pair of places sharing
    six or more identical lines; pairs alike only in shape (other names and values) may stay."""
    import shutil
    import subprocess

    if shutil.which("duplicates") is None:
        pytest.skip("the duplicates tool is not installed here")
    report = subprocess.run(["duplicates", "--repo", str(PACKAGE), "--most", "200", "--seconds", "120"],
                            capture_output=True, text=True, timeout=180).stdout
    assert "incomplete:" not in report, report
    identical = [line for line in report.splitlines() if line.startswith("D") and " shape" not in line]
    assert identical == [], "\n".join(identical)
