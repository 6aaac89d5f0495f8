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
    # A plausible mistake: "resumable" as "it has a run that did not complete", read from the runs alone.
    runs = lab.peek_runs()
    return set(runs.loc[runs["status"].isin(["failed", "interrupted"]), "conversation_id"])
