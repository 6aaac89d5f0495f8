"""`sophos-lab` as a newcomer meets it: `lab` prints a URL that opens, `doctor` passes on the
normal set-up (no Ollama), the model check matches names as Ollama does, a missing model is
reported with its name and Ollama's words, and the small texts say what happened.

The commands run as child processes with a lab home of their own (`SOPHOS_LAB_HOME`), never the
repository's `.lab/`.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pandas as pd
import psutil
import pytest

from sophos_lab import cli
from sophos_lab.runtime.agent import ModelUnavailable, check_model, classify_error
from sophos_lab.runtime.errors import MODEL_UNAVAILABLE
from sophos_lab.standins.scripted_model import start_scripted_model, stop_server
from sophos_lab.runtime.settings import Settings

KIT_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = KIT_ROOT / "data" / "scripts"


def command_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a newcomer's shell: no OLLAMA_HOST, no Jupyter settings of the tests."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OLLAMA_HOST", "OLLAMA_MODEL", "JUPYTER_TOKEN") and not k.startswith("JUPYTER")}
    return {**env, "SOPHOS_LAB_HOME": str(home), **extra}


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[re.Match | None, str]:
    """Read the child's stdout until a line matches `pattern`, it exits, or `timeout` passes."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:  # it exited
            break
        seen += line
        if found := re.search(pattern, line):
            return found, seen
    return None, seen


def get(url: str, **headers: str) -> tuple[int, str, str]:
    """GET a URL (following redirects): status, the URL it ended at, body."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        return response.status, response.geturl(), response.read().decode()


# --- 1. `sophos-lab lab` prints a URL that opens JupyterLab ----------------------------------


def test_lab_prints_a_tokened_url_that_opens_jupyterlab_with_its_state_under_the_lab_home(tmp_path):
    home = tmp_path / "lab-home"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sophos_lab.cli", "lab", "--port", "0"],
        env=command_env(home), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, start_new_session=True,
    )
    try:
        lines, url_line = [], threading.Event()

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if "http://" in line:
                    url_line.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert url_line.wait(60), lines
        found = re.search(r"(http://127\.0\.0\.1:(\d+)/lab/tree/00_start_here\.ipynb\?token=([\w\-]+))\s*$", lines[-1])
        assert found, f"no URL with a token on stdout:\n{lines}"
        url, port, token = found.groups()
        assert "".join(lines).count("http://") == 1, lines  # one URL only: Jupyter's own log is in its file
        assert "Jupyter Server" in (home / "jupyter" / "lab.log").read_text()

        status, landed, body = get(url)
        assert status == 200 and "/login" not in landed, landed
        assert "<title>JupyterLab" in body and "Password or token" not in body

        # Without the token it is the login page: the token in the URL is what opens it.
        _, landed, _ = get(f"http://127.0.0.1:{port}/lab")
        assert "/login" in landed

        # The news pop-up is switched off, and JupyterLab's state lives under the lab home.
        _, _, settings = get(f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification",
                             Authorization=f"token {token}")
        assert json.loads(settings)["settings"]["fetchNews"] == "false"
        [info] = [json.loads(f.read_text()) for f in (home / "jupyter" / "runtime").glob("jpserver-*.json")]
        assert (info["port"], info["token"]) == (int(port), token)
        assert (home / "jupyter" / "lab" / "user-settings").is_dir()

        # A kernel, as a lesson starts one; then SIGTERM stops the lab and everything it started.
        started = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=b"{}", method="POST",
                                         headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(started, timeout=60) as response:
            assert response.status == 201
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 3, started  # the scripted model, JupyterLab, the kernel
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, alive
        reader.join(10)
        assert re.search(r"/lab/tree/00_start_here\.ipynb\?token=", lines[-1]), lines  # still the last line
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def test_the_lab_environment_keeps_jupyter_settings_workspaces_and_runtime_under_the_lab_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SOPHOS_LAB_HOME", str(tmp_path))
    env = cli.lab_environment({"JUPYTER_RUNTIME_DIR": "/elsewhere", "HOME": "/home/someone"})
    for name in ("JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR"):
        assert Path(env[name]).is_relative_to(tmp_path / "jupyter"), (name, env[name])
    command = cli.lab_command(8888, [])
    assert "--no-browser" in command and "--ip=127.0.0.1" in command
    assert not any("token" in part for part in command), "the token must not be visible in ps"


# --- 2. `sophos-lab doctor` ---------------------------------------------------------------


def test_doctor_without_ollama_host_checks_the_scripted_model_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sophos_lab.cli", "doctor"], env=command_env(tmp_path / "lab-home"),
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^model\s+scripted model .*: ok$", done.stdout, re.MULTILINE), done.stdout
    assert "Knowledge Graph MCP Server running on stdio" not in done.stderr  # the servers' chatter
    assert (tmp_path / "lab-home" / "doctor" / "mcp-memory.log").exists()


def test_doctor_with_an_ollama_host_where_nothing_answers_exits_1(tmp_path):
    from sophos_lab.lab.harness import dead_port_url

    done = subprocess.run(
        [sys.executable, "-m", "sophos_lab.cli", "doctor"],
        env=command_env(tmp_path / "lab-home", OLLAMA_HOST=dead_port_url()),
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1 and "Failed to connect to Ollama" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def ollama_with():
    """`ollama_with(name)`: the URL of a scripted model server whose /api/tags lists `name`."""
    servers = {}

    def start(name: str) -> str:
        if name not in servers:
            servers[name] = start_scripted_model(SCRIPTS, model=name)
        return servers[name][1]

    yield start
    for server, _ in servers.values():
        stop_server(server)


@pytest.mark.parametrize(("listed", "wanted", "ok"), [
    ("qwen3:latest", "qwen3", True),          # no tag means :latest
    ("qwen3:latest", "qwen3:latest", True),
    ("qwen3:latest", "qwen", False),          # a prefix is another model
    ("qwen3:latest", "qwen3:8b", False),
    ("qwen3:8b", "qwen3:8b", True),
    ("qwen3:8b", "qwen3", False),             # qwen3 is qwen3:latest, which is not there
    ("qwen3:8b", "wen3:8b", False),
])
def test_check_model_matches_model_names_as_ollama_does(ollama_with, listed, wanted, ok):
    readiness = check_model(Settings(ollama_host=ollama_with(listed), ollama_model=wanted))
    assert readiness.ok is ok, readiness
    assert readiness.models == (listed,)


# --- 3. MODEL_UNAVAILABLE names the model, the server and Ollama's words --------------------


@pytest.mark.parametrize("said", [
    "model 'qwen9' not found (status code: 404)",                        # Ollama until 2025
    'model "qwen9" not found, try pulling it first (status code: 404)',  # newer Ollama
])
def test_model_unavailable_keeps_the_model_name_and_ollamas_words(said):
    missing = ModelUnavailable.from_error(RuntimeError(said), "configured", "http://127.0.0.1:11434")
    code, message = classify_error(missing)
    assert code == MODEL_UNAVAILABLE
    assert message.startswith('The model "qwen9" is not available from OLLAMA_HOST (http://127.0.0.1:11434): ')
    assert message.endswith(said.removesuffix(" (status code: 404)"))


async def test_an_unknown_model_is_recorded_with_its_name_and_ollamas_words(open_service, lab):
    async with open_service(OLLAMA_MODEL="does-not-exist") as agent:
        error = await agent.ask("hello")
        [run] = await agent.list_runs(error.data["conversation"])

    expected = (f'The model "does-not-exist" is not available from OLLAMA_HOST ({lab.settings().ollama_host}): '
                "model 'does-not-exist' not found")
    assert (error.data["code"], error.data["message"]) == (MODEL_UNAVAILABLE, expected)
    assert (run.error_code, run.error_message) == (MODEL_UNAVAILABLE, expected)


# --- 4. the small texts -------------------------------------------------------------------


def test_help_lists_only_commands_that_exist_and_serve_model_port_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "run notebooks" not in text
    commands = set(re.search(r"\{([\w,-]+)\}", text).group(1).split(","))
    assert commands == {"lab", "doctor", "serve-model", "serve", "reset", "agent-child", "worker", "worker-pool", "delete", "prune", "vacuum",
                        "migrate-to-postgres", "user", "grade"}

    with pytest.raises(SystemExit):
        cli.main(["serve-model", "--help"])
    port_line = re.search(r"^\s*--port PORT(.*)$", capsys.readouterr().out, re.MULTILINE)
    assert port_line and port_line.group(1).strip(), "serve-model --port has no help text"


def test_reset_says_nothing_to_remove_when_nothing_is_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SOPHOS_LAB_HOME", str(tmp_path / "never-made"))
    cli.main(["reset"])
    assert capsys.readouterr().out.startswith("nothing to remove")

    (tmp_path / "made" / "x").mkdir(parents=True)
    monkeypatch.setenv("SOPHOS_LAB_HOME", str(tmp_path / "made"))
    cli.main(["reset"])
    assert capsys.readouterr().out.startswith("removed") and not (tmp_path / "made").exists()


def test_messages_display_keeps_line_breaks_and_shows_missing_values_empty(fetched):
    from sophos_lab.lab.inspect import messages

    frame = messages(fetched.db_path, fetched.conversation)
    tool = frame[frame["role"] == "tool"]["content"].iloc[0]
    assert "\n" in tool  # the values are unchanged …
    html = frame._repr_html_()
    assert "\\n" not in html and "NaN" not in html and "None" not in html  # … the display reads
    assert "pre-wrap" in html
    assert "None" not in frame[["role", "name"]]._repr_html_()  # a selection displays the same way
    assert isinstance(frame, pd.DataFrame) and frame["name"].iloc[0] is None


def test_the_lab_opens_the_learners_copies_and_never_overwrites_one(tmp_path, monkeypatch):
    """JupyterLab saves outputs into the notebooks it opens: it opens copies under the lab home,
    made once, so the committed lessons stay without answers and a learner's edits stay theirs."""
    monkeypatch.setenv("SOPHOS_LAB_HOME", str(tmp_path))
    committed = {p.name: p.read_bytes() for p in (cli.KIT_ROOT / "notebooks").glob("*.ipynb")}

    assert sorted(cli.copy_lessons()) == sorted(Path(name).stem for name in committed)
    copies = tmp_path / "notebooks"
    assert f"--ServerApp.root_dir={copies}" in cli.lab_command(8888, [])
    (copies / "00_start_here.ipynb").write_text("my own notes")

    assert cli.copy_lessons() == []
    assert (copies / "00_start_here.ipynb").read_text() == "my own notes"
    assert {p.name: p.read_bytes() for p in (cli.KIT_ROOT / "notebooks").glob("*.ipynb")} == committed


def test_reset_of_one_lesson_starts_it_over_and_leaves_the_others(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SOPHOS_LAB_HOME", str(tmp_path))
    cli.copy_lessons()
    copies = tmp_path / "notebooks"
    lesson, other = sorted(p.stem for p in copies.glob("*.ipynb"))[:2]
    for name in (lesson, other):
        (copies / f"{name}.ipynb").write_text("edited")
        (tmp_path / name).mkdir()
        (tmp_path / name / "sophos.db").write_text("state")

    cli.main(["reset", lesson])

    assert "started over" in capsys.readouterr().out
    assert (copies / f"{lesson}.ipynb").read_bytes() == (cli.KIT_ROOT / "notebooks" / f"{lesson}.ipynb").read_bytes()
    assert not (tmp_path / lesson).exists()
    assert (copies / f"{other}.ipynb").read_text() == "edited" and (tmp_path / other / "sophos.db").exists()

    with pytest.raises(SystemExit, match="no lesson 99_nothing"):
        cli.main(["reset", "99_nothing"])
    assert (copies / f"{other}.ipynb").read_text() == "edited"
