# ✏️ EXERCISE decide: bring a conversation past its approval gate, paid exactly once, from the database
# decide(lab, child, conversation): `child` is a new agent process that has never seen this
# conversation; everything it can know is in the database (lab.gates, lab.runs). Make it:
# - when the gate the conversation stopped at is undecided: approve that gate, naming it;
# - when that gate is decided but the run that carried the decision never finished: carry it on;
# - when there is nothing left to do: do nothing (a second call is a retry, and must change nothing);
# - wait for each run it starts to end, and return the id of the gate (its `gate` column).

def decide(lab, child, conversation):
    """Approve the gate `conversation` stopped at, in `child`, exactly once; the gate's id."""
    # A plausible mistake: "approve" is the answer to every gate. It works where the gate waits,
    # but where the approval was written before a kill it only replays the interrupted run.
    child.approve(conversation)
    child.wait_final()
    return lab.gates(conversation)["gate"].iloc[-1]
