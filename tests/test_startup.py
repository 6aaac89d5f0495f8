"""What an agent child loads before it is ready, in a real child interpreter."""

import json
import subprocess
import sys

from sophos_lab.lab.children import child_environment

LOAD_AND_REPORT = """
import gc, json, sys
from sophos_lab.lab.worker import ChildRuntime
before = {name for name in ("pandas", "langgraph", "langchain_ollama", "mcp") if name in sys.modules}
ChildRuntime()
print(json.dumps({
    "before": sorted(before),
    "loaded": sorted(name for name in ("pandas", "numpy", "langgraph", "langchain_ollama", "mcp") if name in sys.modules),
    "gc_enabled": gc.isenabled(),
    "frozen": gc.get_freeze_count(),
}))
"""


def child_report(tmp_path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=child_environment({}),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_child_loads_the_runtime_and_clients_but_not_pandas(tmp_path):
    report = child_report(tmp_path)

    assert report["before"] == []  # importing the worker module loads nothing heavy by itself
    assert report["loaded"] == ["langchain_ollama", "langgraph", "mcp"]  # ready for a first run


def test_a_child_collects_garbage_again_once_its_start_up_objects_are_frozen(tmp_path):
    report = child_report(tmp_path)

    assert report["gc_enabled"] is True
    assert report["frozen"] > 10_000  # the libraries' objects: out of every later collection
