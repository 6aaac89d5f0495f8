# ✏️ EXERCISE decide: bring a conversation past its approval gate, paid exactly once, from the database
# decide(lab, child, conversation): `child` is a new agent process that has never seen this
# conversation; everything it can know is in the database (lab.gates, lab.runs). Make it:
# - when the gate the conversation stopped at is undecided: approve that gate, naming it;
# - when that gate is decided but the run that carried the decision never finished: carry it on;
# - when there is nothing left to do: do nothing (a second call is a retry, and must change nothing);
# - wait for each run it starts to end, and return the id of the gate (its `gate` column).

def decide(lab, child, conversation):
    """Approve the gate `conversation` stopped at, in `child`, exactly once; the gate's id."""
    gate = lab.gates(conversation).iloc[-1]          # the gate it stopped at: the latest one
    if gate["decision"] is None:
        # Undecided: decide it, by its id (a retry then answers for this gate, never a later one).
        child.approve(conversation, gate=gate["gate"])
        child.wait_final()
    elif lab.runs(conversation)["status"].iloc[-1] == "interrupted":
        # Decided, but the run that carried the decision died: the decision is on disk, and a
        # resume hands it to the gate's interrupt() again. Approving again would only replay.
        child.resume(conversation)
        child.wait_final()
    return gate["gate"]
