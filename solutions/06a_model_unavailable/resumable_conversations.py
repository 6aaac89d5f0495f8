# ✏️ EXERCISE resumable_conversations: the conversations a resume would move on, from the read-only views alone
# resumable_conversations(lab) -> a set of conversation ids. Use only lab.conversations() (column `id`),
# lab.peek_runs(c) (`id`, `status`, `input`: the messages the run brought, None for a resume),
# lab.checkpoints(c) (oldest first: `next`, `run_id` of the run that wrote it), lab.writes(c).
# A resume moves a conversation on when
# - the thread has work left: its latest checkpoint's `next` is not empty, or
# - the latest run's accepted message never reached the thread: that run has an `input`, and the
#   latest checkpoint is not that run's (or there is no checkpoint at all);
# - and no run holds it: none is `running`, and the latest is not `waiting` (a gate waits for a decision).

def resumable_conversations(lab):
    """The ids of the conversations that a resume would carry on."""
    resumable = set()
    for conversation in lab.conversations()["id"]:
        runs = lab.peek_runs(conversation)
        checkpoints = lab.checkpoints(conversation)
        checkpoints = checkpoints[checkpoints["checkpoint_id"].notna()]  # not the rows that say what was pruned
        held = (runs["status"] == "running").any() or (len(runs) > 0 and runs["status"].iloc[-1] == "waiting")
        work_left = len(checkpoints) > 0 and len(checkpoints["next"].iloc[-1]) > 0
        latest = runs.iloc[-1] if len(runs) else None
        never_reached = latest is not None and bool(latest["input"]) and (
            len(checkpoints) == 0 or checkpoints["run_id"].iloc[-1] != latest["id"])
        if (work_left or never_reached) and not held:
            resumable.add(conversation)
    return resumable
