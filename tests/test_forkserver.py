"""A child forked from the fork server is the same process `python -m` starts: its own pid,
session, environment, directory, argv, stdio and exit status, and it dies under a real SIGKILL.

Each test runs against both ways of starting a child: the fork server, and `subprocess.Popen`
(`SOPHOS_LAB_FORKSERVER=0`), so the two are shown to behave alike.
"""

import json
import os
import select
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from sophos_lab.lab.children import child_environment
from sophos_lab.lab.forkserver import ForkedProcess, ForkServer, launcher_command, start_child, wait_stopped

PROBES = Path(__file__).parent / "servers"
WAYS = {"forked": "1", "popen": "0"}


@pytest.fixture(params=list(WAYS))
def start(request, tmp_path):
    """Start the probe child (tests/servers/probe_child.py) the way the test is parametrised with."""
    started = []

    def start_probe(*args: str, **env: str):
        stderr = open(tmp_path / f"probe-{len(started)}.log", "ab")
        environment = child_environment({"SOPHOS_LAB_FORKSERVER": WAYS[request.param], **env})
        proc = start_child("probe_child", list(args), env=environment, cwd=PROBES, stderr=stderr)
        stderr.close()
        started.append(proc)
        proc.log = Path(stderr.name)
        return proc

    start_probe.way = request.param
    yield start_probe
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def process_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat (R, S, T, Z ...), or "gone".

    A process being reaped shows X (dead) for an instant before its entry goes: that is "gone" too.
    """
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before or while it was read
        return "gone"
    return "gone" if state == "X" else state


def ask(proc, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_the_child_has_its_own_pid_session_environment_directory_and_argv(start):
    proc = start("--flag", "value", PROBE_NAME="first")

    report = json.loads(ask(proc, "report"))

    assert isinstance(proc, ForkedProcess) is (start.way == "forked")
    assert report["pid"] == proc.pid != os.getpid()
    assert report["sid"] == proc.pid  # a session of its own, as start_new_session=True gives
    assert report["env"] == {"PROBE_NAME": "first"}
    assert report["cwd"] == str(PROBES) == report["path0"]
    assert report["argv"] == ["--flag", "value"]
    assert report["main"] == "__main__"
    assert report["stdio"] == [False, False, False, True]  # pipes, as a fresh interpreter sees them


def test_two_children_do_not_share_an_environment(start):
    first, second = start(PROBE_NAME="first"), start(PROBE_NAME="second", PROBE_ONLY="here")

    assert json.loads(ask(second, "report"))["env"] == {"PROBE_NAME": "second", "PROBE_ONLY": "here"}
    assert json.loads(ask(first, "report"))["env"] == {"PROBE_NAME": "first"}


@pytest.mark.parametrize(("command", "returncode"), [("exit 3", 3), ("exit 0", 0), ("raise", 1)])
def test_the_exit_status_is_the_childs(start, command, returncode):
    proc = start()

    assert ask(proc, command) == ""  # it exited: end of its stdout

    assert proc.wait(30) == returncode == proc.poll()
    if command == "raise":
        assert "RuntimeError: the probe was told to raise" in proc.log.read_text()


def test_the_end_of_its_stdin_ends_it(start):
    proc = start()
    proc.stdin.close()

    assert proc.wait(30) == 0


def test_sigkill_kills_it_for_real(start):
    proc = start()
    pid = json.loads(ask(proc, "report"))["pid"]

    os.killpg(pid, signal.SIGKILL)

    assert proc.wait(30) == -signal.SIGKILL
    assert process_state(pid) in ("gone", "Z")  # dead (a zombie at most, until its status is read)


def test_a_stop_is_seen_once_and_the_child_goes_on_when_continued(start):
    proc = start()
    proc.stdin.write("stop\n")
    proc.stdin.flush()

    wait_stopped(proc, 30)
    os.kill(proc.pid, signal.SIGCONT)

    assert proc.stdout.readline().strip() == "continued"
    proc.stdin.close()
    assert proc.wait(30) == 0


def test_waiting_on_a_child_that_runs_on_times_out(start):
    proc = start()

    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None


def test_interpreter_variables_of_the_child_hold(start):
    """`PYTHON*` variables act when the interpreter starts: a child that sets them other than the
    fork server did gets a fork server started with them."""
    seeded = [json.loads(ask(start(PYTHONHASHSEED=seed), "report"))["hash"] for seed in ("1", "2", "1")]

    assert seeded[0] == seeded[2] != seeded[1]


def test_a_closed_fork_server_exits_at_once_and_its_children_live_on(tmp_path):
    env = child_environment({})
    server = ForkServer(env)
    with open(tmp_path / "probe.log", "ab") as stderr:
        proc = server.start("probe_child", [], env=env, cwd=PROBES, stderr=stderr)

    server.close()

    assert server.proc.wait(10) == 0
    assert json.loads(ask(proc, "report"))["pid"] == proc.pid  # still serving
    proc.stdin.close()
    with pytest.raises(ChildProcessError, match="exit status is lost"):
        proc.wait(10)


# --- a launcher: a forked child for a program that starts processes itself (an MCP client) ----


def launch(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    command = launcher_command("probe_child", list(args))
    with open(tmp_path / "launched.log", "ab") as stderr:
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env=child_environment(env), cwd=PROBES, text=True, bufsize=1,
                                start_new_session=True)


def test_a_launched_child_is_forked_with_the_launchers_stdio_environment_and_directory(tmp_path):
    launcher = launch(tmp_path, "--flag", PROBE_NAME="launched")

    report = json.loads(ask(launcher, "report"))

    assert report["pid"] != launcher.pid and report["ppid"] != launcher.pid  # forked by the server
    assert report["env"] == {"PROBE_NAME": "launched"}
    assert report["cwd"] == str(PROBES) and report["argv"] == ["--flag"]
    launcher.stdin.close()  # the child's end of input: it exits, and so does the launcher
    assert launcher.wait(30) == 0
    assert launcher.stdout.read() == ""  # and the reader sees the end of the output


def test_a_launcher_exits_as_its_child_does_and_passes_sigterm_on(tmp_path):
    exiting = launch(tmp_path)
    assert ask(exiting, "exit 5") == ""
    assert exiting.wait(30) == 5

    terminated = launch(tmp_path)
    child = json.loads(ask(terminated, "report"))["pid"]
    terminated.terminate()
    assert terminated.wait(30) == -signal.SIGTERM
    assert process_state(child) in ("gone", "Z")  # the child got it

    killed = launch(tmp_path)
    child = json.loads(ask(killed, "report"))["pid"]
    os.kill(child, signal.SIGKILL)
    assert killed.wait(30) == -signal.SIGKILL


def test_a_pid_the_system_reuses_is_a_new_child_not_the_old_ones_exit(tmp_path):
    """The fork server reports by pid, and pids come round again (`pid_max` is often 32768): a
    child given an exited child's pid must not look exited. The test makes the system reuse one
    (`ns_last_pid`, root only) and retries if another process takes that pid first."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK):
        pytest.skip("choosing the next pid needs root and a writable /proc/sys/kernel/ns_last_pid")
    env = child_environment({})
    server = ForkServer(env)
    try:
        with open(tmp_path / "probe.log", "ab") as stderr:
            first = server.start("probe_child", [], env=env, cwd=PROBES, stderr=stderr)
            first.stdin.close()
            assert first.wait(30) == 0
            for _ in range(20):
                last_pid.write_text(str(first.pid - 1))
                again = server.start("probe_child", [], env=env, cwd=PROBES, stderr=stderr)
                if again.pid == first.pid:
                    break
                again.stdin.close()
                again.wait(30)
            else:
                pytest.skip("other processes kept taking the pid")
        assert again.poll() is None  # alive: not the first child's exit
        assert first.poll() == 0
        assert json.loads(ask(again, "report"))["pid"] == first.pid
        again.stdin.close()
        assert again.wait(30) == 0
    finally:
        server.close()


def test_waiting_for_a_stop_of_a_child_that_exits_instead_keeps_its_exit_status(start):
    proc = start()
    assert ask(proc, "exit 3") == ""

    with pytest.raises(ChildProcessError, match="instead of stopping"):
        wait_stopped(proc, 30)
    assert proc.wait(30) == 3


def test_a_killed_launcher_takes_its_child_with_it(tmp_path):
    launcher = launch(tmp_path)
    child = json.loads(ask(launcher, "report"))["pid"]
    fd = os.pidfd_open(child)
    try:
        launcher.kill()  # SIGKILL: nothing to pass on; the fork server sees the connection end
        assert launcher.wait(30) == -signal.SIGKILL
        ready, _, _ = select.select([fd], [], [], 30)
        assert ready, "the launched child outlived its launcher"
    finally:
        os.close(fd)


def test_a_bad_request_is_refused_and_the_fork_server_goes_on(tmp_path):
    command = launcher_command("probe_child", [])
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    asker.connect(command[3])  # the fork server's socket, as a launcher connects to it
    asker.send(b'{"module": "probe_child"}')  # no file descriptors

    assert "3 file descriptors" in json.loads(asker.recv(65536))["error"]
    asker.close()
    launcher = launch(tmp_path)
    assert json.loads(ask(launcher, "report"))["pid"] != launcher.pid
    launcher.stdin.close()
    assert launcher.wait(30) == 0


def test_a_lab_with_fork_servers_runs_its_python_stdio_servers_forked(lab, lab_home):
    """`Lab.setup(fork_servers=True)` (the tests' labs): the worker's `fetch` is the launcher, the
    server it stands for fetches the page, and the config stays forked through `add_mcp_server`
    and `restore_mcp_config`. A lab without it starts the server the config names."""
    import psutil

    from sophos_lab import Lab

    def fetch_children(any_lab) -> list[list[str]]:
        worker = any_lab.worker()
        try:
            worker.chat(f"Fetch {any_lab.page('index.html')} and summarize it in one sentence.")
            assert worker.wait_final()["data"]["status"] == "completed"
            return [p.cmdline() for p in psutil.Process(worker.pid).children()
                    if "mcp_server_fetch" in p.cmdline()]
        finally:
            worker.close()

    fetched = lab.fetches("index.html")
    (forked,) = fetch_children(lab)
    assert Path(forked[2]).name == "launch_forked.py" and forked[4:] == ["mcp_server_fetch", "--allow-private-ips"], forked
    assert lab.fetches("index.html") == fetched + 1
    lab.add_mcp_server("ledger")
    lab.restore_mcp_config()
    config = json.loads((lab.config_dir / "mcp.json").read_text())
    assert {name: Path(entry["args"][1]).name for name, entry in config.items() if name != "memory"} == {
        "fetch": "launch_forked.py", "ledger": "launch_forked.py"}, config
    lab.extra_servers.remove("ledger")
    lab.restore_mcp_config()

    with Lab.setup("tests-fork-servers-off", quiet=True) as plain:
        (fresh,) = fetch_children(plain)
    assert fresh[1:] == ["-m", "mcp_server_fetch", "--allow-private-ips"], fresh


def test_a_descendant_forks_its_children_from_the_fork_server_its_ancestor_shared(tmp_path):
    """`share(env)` (the tests share theirs with the lesson kernels): a process that inherits the
    variable and starts a child for the same `PYTHON*` variables gets it forked from that server,
    reported to itself; without the variable it starts a fork server of its own."""
    import sys

    from sophos_lab.lab import forkserver

    env = child_environment({})
    forkserver.share(env)
    # The shared server's pid: the parent of a child it forks for this process. (Under xdist this
    # worker may itself be attached to the server its controller shared.)
    with open(os.devnull, "w") as devnull:
        mine = start_child("probe_child", [], env=env, cwd=PROBES, stderr=devnull)
    mine.stdin.write("report\n")
    mine.stdin.flush()
    server_pid = json.loads(mine.stdout.readline())["ppid"]
    mine.stdin.close()
    assert mine.wait(10) == 0
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from sophos_lab.lab.children import child_environment\n"
        "from sophos_lab.lab.forkserver import start_child\n"
        f"proc = start_child('probe_child', [], env=child_environment({{}}), cwd=Path({str(PROBES)!r}), stderr=sys.stderr)\n"
        "proc.stdin.write('report\\n'); proc.stdin.flush()\n"
        "print(json.dumps({'child_parent': json.loads(proc.stdout.readline())['ppid'], 'me': os.getpid()}))\n"
        "proc.stdin.close(); print(json.dumps({'exit': proc.wait(10)}))\n"
    )
    for inherit, expected in ((True, server_pid), (False, None)):
        child_env = dict(env) if inherit else {k: v for k, v in env.items() if k != forkserver.SHARED}
        done = subprocess.run([sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        found, ended = (json.loads(line) for line in done.stdout.splitlines())
        if expected is not None:
            assert found["child_parent"] == expected
        else:
            assert found["child_parent"] not in (server_pid, found["me"])  # a fork server of its own
        assert ended == {"exit": 0}
