# ✏️ EXERCISE files_to_back_up: the files a backup must copy to bring back every conversation and the memory
# files_to_back_up(lab_root) gets the lab's folder (a pathlib.Path) and returns the files in it
# (a list of pathlib.Path) that a backup must copy now, while an agent process has the database
# open, so that the copy alone brings back every conversation, with all its messages, and the
# long-term memory.

from pathlib import Path


def files_to_back_up(lab_root):
    """The files of the lab in `lab_root` that a backup copies, as a list of pathlib.Path."""
    # The database is sophos.db *and* its write-ahead log: with a process that has it open, the
    # latest commits may be in sophos.db-wal only. The -shm is not needed: it is an index of the
    # log in shared memory, rebuilt by the first process that opens the copy. The long-term
    # memory is not in SQLite at all: the memory server keeps it in memory.jsonl.
    files = [lab_root / "sophos.db", lab_root / "sophos.db-wal", lab_root / "memory.jsonl"]
    return [path for path in files if path.exists()]
