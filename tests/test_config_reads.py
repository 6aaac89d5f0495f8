"""`mcp.json` and `system.md` are read once per change, not on every read of a turn.

Observed with Python's audit hook for `open` (the interpreter's own event, not a patched client):
what the runtime opens is what it reads from the disk.
"""

import os
import sys
import time

from sophos_lab.runtime.tools import RECENT_CHANGE_NS, read_config_file

_opened: list[str] = []
sys.addaudithook(lambda event, args: _opened.append(str(args[0])) if event == "open" and args else None)


def opens_of(path, read) -> int:
    before = len(_opened)
    read()
    return sum(1 for name in _opened[before:] if name == str(path))


def age(path, seconds: float) -> None:
    """Date the file back (its mtime; its ctime is now, so wait out the recent-change window)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_unchanged_file_is_read_from_disk_once(tmp_path) -> None:
    path = tmp_path / "system.md"
    path.write_text("You are a careful agent.", encoding="utf-8")
    age(path, 10)
    time.sleep(RECENT_CHANGE_NS / 1e9)  # the ctime the utime set must be older than the window
    assert opens_of(path, lambda: read_config_file(path, "System prompt")) == 1
    assert opens_of(path, lambda: read_config_file(path, "System prompt")) == 0


def test_a_change_is_read_at_once_even_with_the_same_size(tmp_path) -> None:
    path = tmp_path / "system.md"
    path.write_text("You are agent A.", encoding="utf-8")
    assert read_config_file(path, "System prompt") == "You are agent A."
    path.write_text("You are agent B.", encoding="utf-8")  # same size, within the same timestamp tick
    assert read_config_file(path, "System prompt") == "You are agent B."
    os.replace(tmp_path / "system.md", tmp_path / "old.md")
    (tmp_path / "system.md").write_text("You are agent C.", encoding="utf-8")
    assert read_config_file(path, "System prompt") == "You are agent C."
