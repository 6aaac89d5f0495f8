"""A child for tests/test_forkserver.py: says what process it is, then does what its stdin says.

`report` prints one JSON line (pid, session, parent, working directory, argv, the variables named
`PROBE_*`, hash of "x"); `exit N` exits with N; `raise` raises; `stop` stops itself (SIGSTOP),
then, once continued, prints `continued`; end of input exits 0.
"""

import json
import os
import signal
import sys

for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command == "report":
        print(json.dumps({
            "pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(), "cwd": os.getcwd(),
            "argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
            "hash": hash("x"), "main": __name__, "path0": sys.path[0],
            "stdio": [sys.stdin.seekable(), sys.stdout.seekable(), sys.stderr.line_buffering, sys.stderr.write_through],
        }), flush=True)
    elif command == "exit":
        sys.exit(int(argument))
    elif command == "raise":
        raise RuntimeError("the probe was told to raise")
    elif command == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        print("continued", flush=True)
