# ✏️ EXERCISE cancel_then_crash: Stop a streaming run, SIGKILL its process the instant it has accepted the Stop, reopen the database; return the run's status
# A known wrong answer: the experiment is right, but the status is read from the file right after
# the kill, before any process has opened it again.
def cancel_then_crash(lab):
    crashing = start_child(stop_after_cancel_request=True)
    hold_half_way()
    c = crashing.chat_until_tool_call(MESSAGE, tool="fetch__fetch")
    lab.model.wait_paused()
    crashing.wait_for("token")
    press_stop(crashing, c)
    crashing.wait_for("cancel-stop")
    crashing.kill()
    lab.model.release()
    return lab.peek_runs(c)["status"].iloc[-1]   # what the file says now
