# ✏️ EXERCISE run_of_each_message: the runs.id of the run that added each message of the final state
# run_of_each_message(checkpoints, runs) gets two frames as lab.checkpoints(c) and lab.peek_runs(c)
# return them (one row per checkpoint, oldest first; one row per run, in start order). Return a list
# of str: for each message of the conversation's final state, in order, the runs.id of the run that
# added it. A checkpoint holds the whole thread as it stood then, and its run_id is the run that
# wrote it: a message was added by the run of the FIRST checkpoint that holds it.


def run_of_each_message(checkpoints, runs):
    """For each message of the thread's latest state, the runs.id of the run that added it."""
    final_count = int(checkpoints["message_count"].iloc[-1])
    # Message i (counting from 0) is in every checkpoint holding more than i messages (a thread only
    # grows); the first of them is where it appeared, and its run_id is a runs.id (the join).
    return [checkpoints.loc[checkpoints["message_count"] > i, "run_id"].iloc[0] for i in range(final_count)]
