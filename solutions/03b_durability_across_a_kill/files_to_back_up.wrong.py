# ✏️ EXERCISE files_to_back_up: the files a backup must copy to bring back every conversation and the memory
# files_to_back_up(lab_root) gets the lab's folder (a pathlib.Path) and returns the files in it
# (a list of pathlib.Path) that a backup must copy now, while an agent process has the database
# open, so that the copy alone brings back every conversation, with all its messages, and the
# long-term memory.

from pathlib import Path


def files_to_back_up(lab_root):
    """The files of the lab in `lab_root` that a backup copies, as a list of pathlib.Path."""
    # The database is the file: copy it. (It forgets the commits still in sophos.db-wal, and the
    # memory server's memory.jsonl.)
    return [lab_root / "sophos.db"]
