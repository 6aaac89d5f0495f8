"""`python -S launch_forked.py SOCKET MODULE ARGS...`: run `python -m MODULE ARGS...` forked from
the fork server listening at SOCKET (see forkserver.py, `launcher_command`), as if it were this
process: the child gets this process's stdin, stdout, stderr, environment and directory; SIGTERM,
SIGINT and SIGHUP are passed on to it; this process exits as the child does (its status, or the
same signal). It lets go of stdin and stdout at once, so the child alone holds them: when the
child ends, whoever reads its output sees the end. If this process is killed (SIGKILL), the fork
server sees its connection end and kills the child: the program goes with the process that stood
for it. With no fork server at SOCKET (its lab has gone), it runs `python -m MODULE` itself.

The standard library only, and run without `site`: it starts in a few milliseconds.
"""

import json
import os
import signal
import socket
import sys


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main() -> int:
    path, module, *args = sys.argv[1:]
    pid = None
    signals: list[int] = []

    def pass_on(signum: int, _frame: object) -> None:
        if pid is None:
            signals.append(signum)  # before the child exists: sent once it does
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, pass_on)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.connect(path)
    except OSError:  # no fork server (its lab has gone): start the module the ordinary way
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
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
    for signum in signals:
        pass_on(signum, None)
    while True:
        report = server.recv(1 << 16)
        if not report:
            print(f"launch_forked: the fork server went away; {module} ({pid}) is on its own", file=sys.stderr)
            return 1
        code = json.loads(report).get("exited")
        if code is None:
            continue
        if code < 0:  # ended by a signal: end by the same one
            try:
                signal.signal(-code, signal.SIG_DFL)  # SIGPIPE and SIGXFSZ too: Python ignores them
            except (OSError, ValueError):
                pass  # SIGKILL, SIGSTOP: their default cannot be changed, nor needs to be
            os.kill(os.getpid(), -code)
            return 128 - code  # a signal whose default is not to end a process
        return code


if __name__ == "__main__":
    sys.exit(main())
