"""The chat widget in a real browser: JupyterLab on loopback, Debian's Chromium driven by Playwright.

The first test opens `notebooks/06f_chat_and_resume.ipynb` as committed (`CLICK_RESUME = False`, the
default), so that Run All kills the agent mid-answer and then stops with the Resume button showing. Then it does
what a learner does: presses Resume in the rendered widget and waits for the completed answer.
Finally it switches JupyterLab to its dark theme (Settings → Theme → JupyterLab Dark) and checks
that the widget follows: its colours come from JupyterLab's CSS variables, not hard-coded ones.
The second opens a small test notebook (`tests/notebooks/approval_widget.ipynb`) whose payment
waits at an approval gate, presses Approve on the widget's approval card, and checks that the run
completes and the ledger holds one payment. Everything is real: the JupyterLab frontend and the ipywidgets extension, the notebook kernel,
the agent's child kernel, the scripted model, the MCP servers and the SQLite file.

Nothing is written to $HOME: JupyterLab's config, data and runtime directories, IPython's
directory, the lab directories (`SOPHOS_LAB_HOME`) and the browser's home are temporary. The
screenshots go to `.lab/artifacts/` (git-ignored); the two the README shows (the crashed state with
its Resume button, and the finished answer) are also written to `docs/`. Only the distribution's
Chromium is used; Playwright never downloads a browser here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import contextlib
from collections.abc import Iterator

from conftest import CHROMIUM, CHROMIUM_ARGS, last_bullet, needs_chromium

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "06f_chat_and_resume.ipynb"
APPROVAL_NOTEBOOK = ROOT / "tests" / "notebooks" / "approval_widget.ipynb"
ARTIFACTS = ROOT / ".lab" / "artifacts"
DOCS = ROOT / "docs"
TIMEOUT_MS = 120_000
"""Playwright's timeout for every wait: the whole notebook (two kernels, MCP servers) runs within it."""

pytestmark = needs_chromium


# --- JupyterLab on loopback ---------------------------------------------------------------


@dataclass
class Server:
    url: str
    token: str
    root_dir: Path
    runtime_dir: Path
    proc: subprocess.Popen

    def api(self, method: str, path: str, body: dict | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_user_settings(config_dir: Path) -> None:
    """No news or update checks (no network, no toasts); every cell attached to the DOM."""
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab"
    files = {
        "apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True,
        },
        "notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for name, values in files.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def prepare_notebook(root_dir: Path) -> Path:
    """The lesson as committed (it must default to `CLICK_RESUME = False`), in JupyterLab's root."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert re.search(r"(?m)^CLICK_RESUME = False\b", cell.source), (
        f"Run All must stop before Resume: no `CLICK_RESUME = False` line in the parameters cell:\n{cell.source}"
    )
    path = root_dir / NOTEBOOK.name
    nbformat.write(notebook, path)
    return path


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on 127.0.0.1 with a random token, every directory of its own temporary."""
    dirs = {name: tmp_path / name for name in ("root", "config", "data", "runtime", "ipython", "labs")}
    for path in dirs.values():
        path.mkdir()
    write_user_settings(dirs["config"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    for name in ("OLLAMA_HOST", "OLLAMA_MODEL", "JUPYTER_PATH", "JUPYTER_PLATFORM_DIRS"):
        env.pop(name, None)
    env.update({
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        # Only the user's data directory moves: the venv's share/jupyter (the kernelspec and the
        # ipywidgets lab extension) stays on the data path.
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "IPYTHONDIR": str(dirs["ipython"]),
        "SOPHOS_LAB_HOME": str(dirs["labs"]),
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    })
    port, token = free_port(), secrets.token_hex(16)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser",
            "--allow-root", f"--ServerApp.token={token}", f"--ServerApp.root_dir={dirs['root']}",
            "--ServerApp.port_retries=0", "--NotebookNotary.db_file=:memory:",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            # no language-server detection: it runs `npm prefix -g`, which writes to ~/.npm/_logs
            "--LanguageServerManager.autodetect=False",
        ],
        env=env, cwd=dirs["root"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", token, dirs["root"], dirs["runtime"], proc)
    listening = threading.Event()
    log_path = tmp_path / "jupyterlab.log"
    threading.Thread(target=copy_log, args=(proc, log_path, f"127.0.0.1:{port}/lab", listening), daemon=True).start()
    try:
        wait_ready(server, listening, log_path)
        yield server
    finally:
        stop_server(server)


def copy_log(proc: subprocess.Popen, log_path: Path, marker: str, listening: threading.Event) -> None:
    """Copy JupyterLab's output to a log; set `listening` once it prints its URL (or exits)."""
    with open(log_path, "wb") as log:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if marker.encode() in line:
                listening.set()
    listening.set()


def wait_ready(server: Server, listening: threading.Event, log_path: Path, timeout: float = 90.0) -> None:
    """Until JupyterLab answers `/api/status`.

    It prints its URL (the barrier) a moment before it binds the port (the bind is a callback on
    its event loop), so a short, bounded readiness probe covers that last gap.
    """
    deadline = time.monotonic() + timeout
    if not listening.wait(timeout) or server.proc.poll() is not None:
        pytest.fail(f"JupyterLab is not serving after {timeout} s:\n{log_path.read_text()[-3000:]}")
    while True:
        try:
            server.api("GET", "/api/status")
            return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within {timeout} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)  # readiness probe of a third-party server, not a test step


def stop_server(server: Server) -> None:
    """Shut down every kernel, then JupyterLab; SIGKILL its process group if it hangs."""
    if server.proc.poll() is None:
        try:
            for kernel in server.api("GET", "/api/kernels"):
                server.api("DELETE", f"/api/kernels/{kernel['id']}")
            server.api("POST", "/api/shutdown")
            server.proc.wait(30)
        except (OSError, urllib.error.URLError, subprocess.TimeoutExpired):
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


# --- the notebook's kernel, from outside the browser -------------------------------------


def notebook_kernel_client(server: Server, name: str = NOTEBOOK.name):
    """A second client of the kernel of the notebook `name` (through its connection file), or None."""
    from jupyter_client import BlockingKernelClient

    sessions = [s for s in server.api("GET", "/api/sessions") if s["path"].endswith(name)]
    if not sessions:
        return None
    client = BlockingKernelClient(connection_file=str(server.runtime_dir / f"kernel-{sessions[0]['kernel']['id']}.json"))
    client.load_connection_file()
    client.start_channels()
    return client


def evaluate(client, code: str, **expressions: str) -> dict[str, object]:
    """Run `code` in the notebook's kernel, then evaluate `expressions` there (Python literals)."""
    reply = client.execute(code, user_expressions=expressions, reply=True, timeout=60)
    content = reply["content"]
    assert content["status"] == "ok", f"{content.get('ename')}: {content.get('evalue')}"
    values = {}
    for name, result in content["user_expressions"].items():
        assert result["status"] == "ok", f"{name}: {result.get('ename')}: {result.get('evalue')}"
        values[name] = ast.literal_eval(result["data"]["text/plain"])
    return values


def close_lab(server: Server, name: str = NOTEBOOK.name) -> None:
    """What the learner does at the end: `lab.close()` (kills the child, stops the servers)."""
    client = notebook_kernel_client(server, name)
    if client is None:
        return
    try:
        evaluate(client, "if 'lab' in globals():\n    lab.close()")
    finally:
        client.stop_channels()


# --- the test -------------------------------------------------------------------------------


def wait_for_kernel(page, server: Server, name: str = NOTEBOOK.name, timeout: float = 120.0) -> None:
    """Until the notebook's kernel is idle and the page is connected to it.

    Run All before then opens JupyterLab's "Select Kernel" dialog instead of running anything
    (the toolbar's execution indicator says `idle` even before there is a kernel)."""
    from playwright.sync_api import expect

    expect(page.locator(".jp-StatusBar-Widget")).to_contain_text("Python 3 (ipykernel) | Idle")
    page.wait_for_function(
        """async ([name, token]) => {
            const response = await fetch(`/api/sessions?token=${token}`);
            const sessions = await response.json();
            return sessions.some(s => s.path === name && s.kernel.execution_state === "idle"
                                      && s.kernel.connections > 0);
        }""",
        arg=[name, server.token], polling=200, timeout=timeout * 1000,
    )
    expect(page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator")).to_have_attribute("data-status", "idle")


def run_all_cells(page) -> None:
    """Menu Run → Run All Cells, as a person would."""
    page.locator("#jp-menu-panel .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu .lm-Menu-item", has_text=re.compile(r"^Run All Cells")).click()


WIDGET_COLOURS = """chat => {
    const style = selector => getComputedStyle(chat.querySelector(selector));
    const answer = style(".sx-msg.sx-assistant:not(.sx-live)");
    return {
        transcript_text: answer.color,
        transcript_background: answer.backgroundColor,
        role_label: style(".sx-msg.sx-assistant .sx-role").color,
        status_text: style(".sx-status").color,
    };
}"""
"""The computed colours of the widget's transcript (its last answer) and status line."""


def switch_to_dark_theme(page) -> None:
    """Menu Settings → Theme → JupyterLab Dark; returns once the dark theme's CSS is in effect.

    Waits for `<body data-jp-theme-light="false" data-jp-theme-name="JupyterLab Dark">` and for
    the page's `--jp-layout-color0` to change, so that nothing is read from a half-applied theme."""
    from playwright.sync_api import expect

    light_background = page.evaluate("getComputedStyle(document.body).getPropertyValue('--jp-layout-color0')")
    page.locator("#jp-menu-panel .lm-MenuBar-item", has_text=re.compile(r"^Settings$")).click()
    page.locator(".lm-Menu .lm-Menu-item", has_text=re.compile(r"^Theme$")).click()  # opens the submenu
    page.locator(".lm-Menu .lm-Menu-item", has_text=re.compile(r"^JupyterLab Dark$")).click()
    body = page.locator("body")
    expect(body).to_have_attribute("data-jp-theme-light", "false")
    expect(body).to_have_attribute("data-jp-theme-name", "JupyterLab Dark")
    page.wait_for_function(
        "light => getComputedStyle(document.body).getPropertyValue('--jp-layout-color0') !== light",
        arg=light_background,
    )
    expect(page.locator(".lm-Menu")).to_have_count(0)  # the menu closed after the click


def screenshot(locator, name: str, docs: str | None = None) -> None:
    """A screenshot of `locator` in `.lab/artifacts/<name>` and, for the README, in `docs/<docs>`."""
    locator.screenshot(path=ARTIFACTS / name)
    if docs:
        DOCS.mkdir(exist_ok=True)
        (DOCS / docs).write_bytes((ARTIFACTS / name).read_bytes())


@contextlib.contextmanager
def notebook_page(server: Server, tmp_path: Path, name: str, failure: str) -> Iterator[object]:
    """Chromium on the notebook `name` (already in JupyterLab's root), its kernel idle and
    connected: the page. A failure leaves a full-page screenshot `failure` in `.lab/artifacts/`;
    at the end the notebook's lab is closed and the browser too."""
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser_home = tmp_path / "browser-home"
    browser_home.mkdir()
    browser_env = {**os.environ, "HOME": str(browser_home), "XDG_CONFIG_HOME": str(browser_home / ".config"),
                   "XDG_CACHE_HOME": str(browser_home / ".cache")}
    expect.set_options(timeout=TIMEOUT_MS)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS, env=browser_env,
        )
        page = browser.new_page(viewport={"width": 1280, "height": 1100}, device_scale_factor=2)
        page.set_default_timeout(TIMEOUT_MS)
        try:
            page.goto(f"{server.url}/lab/tree/{name}?token={server.token}")
            expect(page.locator(".jp-NotebookPanel .jp-Cell").first).to_be_visible()
            wait_for_kernel(page, server, name)
            yield page
        except Exception:
            page.screenshot(path=ARTIFACTS / failure, full_page=True)
            raise
        finally:
            close_lab(server, name)
            browser.close()


def test_resume_button_finishes_the_answer_in_a_real_browser(jupyterlab, tmp_path):
    from playwright.sync_api import expect

    server = jupyterlab
    prepare_notebook(server.root_dir)
    with notebook_page(server, tmp_path, NOTEBOOK.name, "chat-widget-failure.png") as page:
        run_all_cells(page)

        # The notebook kills the agent mid-answer, reloads the widget and leaves Resume to us.
        expect(page.get_by_text("Your turn: press Resume in the widget above.")).to_be_visible()
        chat = page.locator(".sophos-chat").last  # the widget shown again in section 3
        resume = chat.get_by_role("button", name="Resume")
        expect(resume).to_be_visible()
        expect(chat.locator(".sx-status")).to_contain_text("the process that ran it is gone")
        # The list counts the three saved messages shown below it, as the recovery to come will.
        expect(chat.locator("select option:checked")).to_contain_text(" · running · 3 msgs")
        chat.scroll_into_view_if_needed()
        screenshot(chat, "chat-widget-before-resume.png", docs="chat-widget-crashed.png")

        resume.click()
        answer = chat.locator(".sx-msg.sx-assistant:not(.sx-live)", has_text=last_bullet())
        expect(answer).to_be_visible()
        expect(chat.locator(".sx-status")).to_have_text("Last run completed · 4 messages.")
        expect(resume).to_be_hidden()
        expect(chat.locator(".sx-banner")).to_have_count(0)
        expect(chat.locator(".sx-chip")).to_have_count(1)
        chat.scroll_into_view_if_needed()
        screenshot(chat, "chat-widget.png", docs="chat-widget.png")
        light = chat.evaluate(WIDGET_COLOURS)

        # What the kernel says about the same moment.
        client = notebook_kernel_client(server)
        assert client is not None, "no session for the notebook"
        try:
            found = evaluate(
                client, "widget.join(60)",
                runs='lab.peek_runs(widget.view_model.conversation_id)["status"].tolist()',
                fetches='lab.fetches("wal.html")',
                resume_visible="widget.resume_visible",
                bullets='sum(line.startswith("- ") for line in widget.view_model.transcript[-1].text.splitlines())',
            )
        finally:
            client.stop_channels()
        assert found == {"runs": ["interrupted", "completed"], "fetches": 1, "resume_visible": False, "bullets": 12}

        # The same widget in JupyterLab's dark theme: its colours must follow the theme.
        switch_to_dark_theme(page)
        chat.scroll_into_view_if_needed()
        chat.screenshot(path=ARTIFACTS / "chat-widget-dark.png")
        dark = chat.evaluate(WIDGET_COLOURS)
        same = {name: value for name, value in dark.items() if light[name] == value}
        assert not same, f"the widget keeps its light-theme colours in the dark theme: {same}\nlight: {light}\ndark: {dark}"


@pytest.mark.full_matrix  # the web page's approval card (test_server_browser.py) stays in make test
def test_approve_on_the_approval_card_pays_once_in_a_real_browser(jupyterlab, tmp_path):
    from playwright.sync_api import expect

    server = jupyterlab
    name = APPROVAL_NOTEBOOK.name
    (server.root_dir / name).write_bytes(APPROVAL_NOTEBOOK.read_bytes())
    with notebook_page(server, tmp_path, name, "approval-card-failure.png") as page:
        run_all_cells(page)

        # The payment waits at its gate: the card lists the held call, as text.
        expect(page.get_by_text("Your turn: press Approve in the widget above.")).to_be_visible()
        chat = page.locator(".sophos-chat")
        card = chat.locator(".sx-approval")
        expect(card).to_be_visible()
        expect(card.locator(".sx-approval-call")).to_have_count(1)
        expect(card.locator(".sx-call-name")).to_have_text("ledger__record_payment")
        expect(card.locator(".sx-call-args")).to_have_text('{"to": "alice", "amount": 30}')
        expect(chat.locator(".sx-status")).to_contain_text("waits for your decision on 1 tool call")
        expect(chat.get_by_role("button", name="Resume")).to_be_hidden()
        expect(chat.get_by_role("button", name="Send")).to_be_disabled()
        chat.scroll_into_view_if_needed()
        screenshot(chat, "chat-widget-approval.png")

        card.get_by_role("button", name="Approve").click()
        expect(chat.locator(".sx-msg.sx-assistant:not(.sx-live)", has_text="Paid 30 to alice.")).to_be_visible()
        expect(chat.locator(".sx-status")).to_have_text("Last run completed · 4 messages.")
        expect(card).to_be_hidden()
        expect(chat.locator(".sx-banner")).to_have_count(0)

        client = notebook_kernel_client(server, name)
        assert client is not None, "no session for the notebook"
        try:
            found = evaluate(
                client, "widget.join(60)",
                runs='lab.runs()["status"].tolist()',
                payments='[tuple(row) for row in lab.ledger()[["to_account", "amount"]].itertuples(index=False)]',
            )
        finally:
            client.stop_channels()
        assert found == {"runs": ["waiting", "completed"], "payments": [("alice", 30)]}
