# ✏️ EXERCISE outbound_endpoints: every remote (address, port) a process and all the processes under it are connected to
# outbound_endpoints(pid) gets a process id and returns a set of (address, port) tuples, e.g.
# {("127.0.0.1", 11434)}: the far end of every connection that this process, or any process it
# started (and they started, and so on), opened itself and has open at this moment. Read it with
# psutil (psutil.Process(pid), .children(recursive=True), .net_connections("inet")). A listening
# socket is not a connection out, and neither is a connection a client made to one of the
# process's listening ports.


def outbound_endpoints(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every remote end the process tree of `pid` has an outbound connection to."""
    # What `lsof -i -a -p PID` shows: the process's own sockets, without the listener and its clients.
    # (It looks at the top process only: what its children connect to is not in it.)
    proc = psutil.Process(pid)
    connections = proc.net_connections("inet")
    listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    return {(c.raddr.ip, c.raddr.port) for c in connections if c.raddr and c.laddr.port not in listening}
