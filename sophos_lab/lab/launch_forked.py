"""`python -S launch_forked.py SOCKET MODULE ARGS...`: run `python -m MODULE ARGS...` forked from
the fork server listening at SOCKET (see forkserver.py, `launcher_command`), as if it were this
process: the child gets this process's stdin, stdout, stderr, environment and directory; SIGTERM,
SIGINT and SIGHUP are passed on to it; this process exits as the child does (its status, or the
same signal). It lets go of stdin and stdout at once, so the child alone holds them: when the
child ends, whoever reads its output sees the end.

The standard library only, and run without `site`: it starts in a few milliseconds.
"""

import json
import os
import signal
import socket
import sys


def main() -> int:
    path, module, *args = sys.argv[1:]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.connect(path)
    except OSError as error:
        print(f"launch_forked: no fork server at {path}: {error}", file=sys.stderr)
        return 1
    request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    reply = server.recv(1 << 16)
    if not reply or "started" not in json.loads(reply):
        print(f"launch_forked: the fork server did not start {module}: {reply!r}", file=sys.stderr)
        return 1
    pid = json.loads(reply)["started"]

    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    while True:
        report = server.recv(1 << 16)
        if not report:
            print(f"launch_forked: the fork server went away; {module} ({pid}) is on its own", file=sys.stderr)
            return 1
        code = json.loads(report).get("exited")
        if code is None:
            continue
        if code < 0:  # ended by a signal: end by the same one
            if -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            return 128 - code  # a signal whose default is not to end a process
        return code


if __name__ == "__main__":
    sys.exit(main())
