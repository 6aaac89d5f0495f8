# ✏️ EXERCISE resume_after_cancelled_call: Stop a run while its tool call is in flight, resume it; return the steps the resume entered
# The reference answer.
def resume_after_cancelled_call(lab, child):
    lab.web.hold(PAGE)           # the fetch server's request for the page will wait
    c = child.chat_until_tool_call(MESSAGE, tool="fetch__fetch")
    lab.web.wait_held()          # the call is in flight: the fetch server waits for the page
    child.cancel(c)              # Stop; returns the run's final event (chat-error CANCELLED)
    lab.web.release()            # the page goes to a call nobody waits for any more
    child.resume(c)
    child.wait_final()
    return entered(child)
