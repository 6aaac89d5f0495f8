# ✏️ EXERCISE resume_after_cancelled_call: Stop a run while its tool call is in flight, resume it; return the steps the resume entered
# A known wrong answer: the Stop waits for the tool's result, so it lands in the answer's step,
# not during the call.
def resume_after_cancelled_call(lab, child):
    hold_half_way()
    c = child.chat_until_tool_call(MESSAGE, tool="fetch__fetch")
    child.wait_for("trace", event="result")   # the page has come back
    lab.model.wait_paused()
    child.cancel(c)
    lab.model.release()
    child.resume(c)
    child.wait_final()
    return entered(child)
