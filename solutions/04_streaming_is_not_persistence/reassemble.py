# ✏️ EXERCISE reassemble: rebuild the answer's text, each piece once, from the frames of both connections
# reassemble(frames) gets the frames a client received, in the order it received them: the first
# connection's (cut mid-answer), then the second's (opened with Last-Event-ID). A frame is a dict
# {"id": an int, or None, "event": "token", "reasoning", "trace", "end", ..., "data": ...}; the data
# of a `token` frame is a piece of the answer's text. Return the answer's text. Use the ids: an id
# is one event of the run, and a frame with an id you have already seen is that event again.

def reassemble(frames):
    """The answer's text from the SSE frames of one run, received over several connections."""
    events = {}
    for frame in frames:
        if frame["id"] is not None:
            events.setdefault(frame["id"], frame)   # one event per id, however often it came
    return "".join(events[i]["data"] for i in sorted(events) if events[i]["event"] == "token")
