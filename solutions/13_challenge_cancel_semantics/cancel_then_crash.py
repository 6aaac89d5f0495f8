# ✏️ EXERCISE cancel_then_crash: Stop a streaming run, SIGKILL its process the instant it has accepted the Stop, reopen the database; return the run's status
# The reference answer.
def cancel_then_crash(lab):
    crashing = start_child(stop_after_cancel_request=True)
    hold_half_way()
    c = crashing.chat_until_tool_call(MESSAGE, tool="fetch__fetch")
    lab.model.wait_paused()
    crashing.wait_for("token")        # the answer is streaming
    press_stop(crashing, c)
    crashing.wait_for("cancel-stop")  # the request is committed, and the child frozen right after it
    crashing.kill()                   # SIGKILL: before the run is stopped, before any outcome
    lab.model.release()
    looker = start_child()            # a new process: its first look opens the database
    return next(conversation["status"] for conversation in looker.conversations() if conversation["id"] == c)
