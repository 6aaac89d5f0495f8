# ✏️ EXERCISE run_of_each_message: the runs.id of the run that added each message of the final state
# run_of_each_message(checkpoints, runs) gets two frames as lab.checkpoints(c) and lab.peek_runs(c)
# return them (one row per checkpoint, oldest first; one row per run, in start order). Return a list
# of str: for each message of the conversation's final state, in order, the runs.id of the run that
# added it. A checkpoint holds the whole thread as it stood then, and its run_id is the run that
# wrote it: a message was added by the run of the FIRST checkpoint that holds it.


def run_of_each_message(checkpoints, runs):
    """For each message of the thread's latest state, the runs.id of the run that added it."""
    owners = []
    # A turn ends with the checkpoint after the model's answer: the question and its answer belong
    # to the run that wrote that checkpoint, the run that completed the turn.
    answers = checkpoints[(checkpoints["source"] == "loop") & (checkpoints["last_role"] == "assistant")]
    for answer in answers.itertuples():
        owners += [answer.run_id] * (answer.message_count - len(owners))
    return owners
