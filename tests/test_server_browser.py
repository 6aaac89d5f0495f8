"""The web page of `sophos-lab serve` in a real browser: Debian's Chromium driven by Playwright.

The main test does what lesson 04 does with `curl`, as a person at the page: send a question,
watch the answer stream, SIGKILL the server mid-answer, start a new one on the same port and
database, reload, and press Resume in the banner that the reload shows. The other tests: Detach
stops following while the run goes on, Cancel (a secondary button beside Send) stops the run and
says so in the status line, a failed run shows its error banner, a payment waits at the approval
card until Approve or Reject, model and tool text with markup in it is shown as text, and a
server with a token works from `/?token=`.

Everything is real: the server processes (`lab.server()`), the scripted model, the MCP servers,
the SQLite file. Playwright's waits for selectors and text are the barriers; the scripted
model's pause point holds the answer half-way while the server is killed. Screenshots go to
`.lab/artifacts/` (git-ignored); the two the README shows also to `docs/`. Only the
distribution's Chromium is used; Playwright never downloads a browser here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, last_bullet, needs_chromium

from sophos_lab.lab.harness import Lab
from sophos_lab.lab.inspect import peek_runs

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".lab" / "artifacts"
DOCS = ROOT / "docs"
TIMEOUT_MS = 60_000
SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
BANNER = "The last run stopped before it finished. Its progress is saved."
PAY = "Please pay 30 to alice."
COMMITTED = "/ledger-committed"
"""Where the ledger server reports a committed payment, and waits for the answer (a lab may hold it)."""

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium with a temporary home (nothing written to $HOME)."""
    from playwright.sync_api import expect, sync_playwright

    home = tmp_path_factory.mktemp("browser-home")
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache")}
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS, env=env)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, request):
    """A new page; a full-page screenshot in `.lab/artifacts/` when the test fails."""
    context = browser.new_context(viewport={"width": 1200, "height": 760}, device_scale_factor=2,
                                  accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    failed_before = request.session.testsfailed
    yield page
    if request.session.testsfailed > failed_before:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=ARTIFACTS / f"web-page-failure-{request.node.name}.png", full_page=True)
    context.close()


def screenshot(page, name: str, docs: bool = False) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / name)
    if docs:
        DOCS.mkdir(exist_ok=True)
        (DOCS / name).write_bytes((ARTIFACTS / name).read_bytes())


def send(page, message: str) -> None:
    box = page.get_by_label("Message")
    box.fill(message)
    box.press("Enter")


def only_conversation(server) -> str:
    [conversation] = server.request("GET", "/api/conversations").json()["conversations"]
    return conversation["id"]


def test_the_page_resumes_an_answer_whose_server_was_killed(lab, page, db_path):
    from playwright.sync_api import expect

    lab.model.arm("summary")
    first = lab.server(DATABASE_PATH=str(db_path))
    page.goto(first.url + "/")
    expect(page.get_by_role("heading", name="New conversation")).to_be_visible()
    send(page, SUMMARISE.format(url=lab.page("wal.html")))

    # The answer streams into a live bubble, after the tool call's chip and the tool's result.
    live = page.locator("#transcript .msg.assistant.live .text")
    expect(live).not_to_be_empty()
    assert lab.model.wait_paused() == "summary"  # held half-way through its tokens
    expect(page.locator("#transcript .chip")).to_have_text([f'Tool call: fetch__fetch {{"url":"{lab.page("wal.html")}"}}'])
    expect(page.locator("#transcript .msg.tool summary")).to_have_text(["Tool result: fetch__fetch"])
    expect(page.get_by_role("button", name="Detach")).to_be_visible()
    shown = live.text_content()
    assert shown.startswith("- A write-ahead log records every change")

    assert first.kill() == -9
    lab.model.release()
    second = lab.server(port=first.port, DATABASE_PATH=str(db_path))
    try:
        assert second.url == first.url
        page.reload()
        banner = page.locator("#resume-banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text(BANNER)
        expect(page.locator("#status")).to_have_text("Last run interrupted · 3 messages")
        # The list counts what the conversation shows: recovery counted the dead run's thread.
        expect(page.locator("#conversations .conversation-status")).to_have_text(["Last run interrupted · 3 messages"])
        # The tokens the page showed were never saved; the tool's result was.
        expect(page.locator("#transcript .msg.live")).to_have_count(0)
        assert all(shown not in text for text in page.locator("#transcript .msg.assistant").all_text_contents())
        expect(page.locator("#transcript .msg.tool")).to_have_count(1)
        screenshot(page, "web-page-crashed.png", docs=True)

        page.get_by_role("button", name="Resume").click()
        answer = page.locator("#transcript .msg.assistant:not(.live)", has_text=last_bullet())
        expect(answer).to_be_visible()  # reloaded from durable state once the run ended
        expect(banner).to_be_hidden()
        expect(page.get_by_role("button", name="Send")).to_be_visible()
        expect(page.locator("#status")).to_have_text("Last run completed · 4 messages")
        expect(page.locator("#conversations .conversation-status")).to_have_text(["Last run completed · 4 messages"])
        conversation = only_conversation(second)
        expect(page.get_by_role("link", name="Export (Markdown)")).to_have_attribute(
            "href", f"api/conversations/{conversation}/export?format=md")
        screenshot(page, "web-page.png", docs=True)
        bullets = [line for line in answer.locator(".text").text_content().splitlines() if line.startswith("- ")]
    finally:
        second.close()

    assert len(bullets) == 12
    assert list(peek_runs(db_path, conversation)["status"]) == ["interrupted", "completed"]


def test_detach_stops_following_and_the_run_goes_on(lab, page, db_path):
    from playwright.sync_api import expect

    lab.model.arm("essay")
    with lab.server(DATABASE_PATH=str(db_path)) as server:
        page.goto(server.url + "/")
        send(page, "Write an essay on durable execution.")
        expect(page.locator("#transcript .msg.assistant.live .text")).not_to_be_empty()
        lab.model.wait_paused()
        page.get_by_role("button", name="Detach").click()

        expect(page.get_by_role("button", name="Send")).to_be_visible()
        expect(page.locator("#status")).to_have_text(
            "Detached: the run goes on on the server. Open the conversation again to follow it.")
        expect(page.locator("#transcript .msg.assistant")).to_have_count(0)  # nothing of it is saved yet
        conversation = only_conversation(server)
        server.follow(conversation)
        lab.model.release()
        server.wait_for("end")  # the run finished without the page

        page.locator("#conversations button").first.click()
        expect(page.locator("#status")).to_have_text("Last run completed · 2 messages")
        expect(page.locator("#transcript .msg.assistant")).to_contain_text("Durable execution is the idea")


def test_cancel_stops_the_run_on_the_server_and_offers_resume(lab, page, db_path):
    from playwright.sync_api import expect

    lab.model.arm("summary")
    with lab.server(DATABASE_PATH=str(db_path)) as server:
        page.goto(server.url + "/")
        send(page, f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points.")
        expect(page.locator("#transcript .msg.assistant.live .text")).not_to_be_empty()
        lab.model.wait_paused()  # half-way through the summary
        cancel = page.get_by_role("button", name="Cancel", exact=True)
        detach = page.get_by_role("button", name="Detach")
        # A secondary button in the row of Send (now Detach), beside the text box, not a bar under it.
        box, beside, text_box = cancel.bounding_box(), detach.bounding_box(), page.get_by_label("Message").bounding_box()
        assert abs(box["y"] - beside["y"]) < 1 and box["height"] == beside["height"], (box, beside)
        assert box["x"] >= beside["x"] + beside["width"] and box["x"] >= text_box["x"] + text_box["width"], (box, text_box)
        assert box["width"] < 2 * beside["width"], (box, beside)
        style = "button => [getComputedStyle(button).backgroundColor, getComputedStyle(button).color]"
        assert cancel.evaluate(style) == detach.evaluate(style)  # Detach's look, not Send's filled one
        screenshot(page, "web-page-running.png")
        cancel.click()

        # Asked for, so not an error: the status line says so, and Resume is offered.
        expect(page.locator("#status")).to_have_text("Cancelled. Resume to continue.")
        expect(page.locator("#error-banner")).to_be_hidden()
        expect(page.locator("#resume-banner")).to_be_visible()  # the summary step is still to do
        expect(cancel).to_be_hidden()
        expect(page.get_by_role("button", name="Send")).to_be_visible()
        lab.model.release()
        page.reload()
        expect(page.locator("#status")).to_have_text("Last run cancelled · 3 messages")
        expect(page.locator("#conversations .conversation-status")).to_have_text(["Last run cancelled · 3 messages"])
        expect(page.locator("#resume-banner")).to_be_visible()
        expect(page.locator("#error-banner")).to_be_hidden()
        runs = list(peek_runs(db_path, only_conversation(server))["status"])

    assert runs == ["cancelled"]


def test_a_failed_run_shows_its_error_banner_live_and_after_a_reload(lab, page, db_path):
    from playwright.sync_api import expect

    with lab.server(DATABASE_PATH=str(db_path)) as server:
        page.goto(server.url + "/")
        send(page, "Please trigger a model error.")
        error = page.get_by_role("alert")
        expect(error).to_contain_text("scripted failure")
        expect(page.locator("#status")).to_have_text("Last run failed · 1 message")
        code = error.locator(".code").text_content()
        page.reload()
        expect(error).to_contain_text("scripted failure")
        expect(error.locator(".code")).to_have_text(code)
        expect(page.locator("#resume-banner")).to_be_visible()  # the model call can be tried again

    assert code == "AGENT_FAILURE"


@pytest.fixture
def ledger_lab(request, lab_home):
    """A lab of this test's own whose `mcp.json` has the ledger, whose payments need approval
    (`config/extras/ledger.json`)."""
    with Lab.setup(f"tests-page-{request.node.name}", quiet=True, fork_servers=True, extra_servers=("ledger",)) as lab:
        yield lab


def payments(lab) -> list[tuple[str, int]]:
    return [tuple(row) for row in lab.ledger()[["to_account", "amount"]].itertuples(index=False)]


def wait_at_the_gate(page, server) -> object:
    """Send the payment; once the run stops at its gate, the approval card (checked)."""
    from playwright.sync_api import expect

    page.goto(server.url + "/")
    send(page, PAY)
    card = page.locator("#approval-card")
    expect(card).to_be_visible()
    expect(card).to_contain_text("Approval needed. The run holds these tool calls; none has run yet.")
    expect(card.locator("li .call-name")).to_have_text(["ledger__record_payment"])
    expect(card.locator("li .call-args")).to_have_text(['{"to":"alice","amount":30}'])
    expect(page.locator("#status")).to_have_text("Last run waiting · 2 messages")
    # While it waits: no new message (the server would refuse it), no Resume, nothing to cancel.
    expect(page.get_by_role("button", name="Send")).to_be_disabled()
    expect(page.locator("#resume-banner")).to_be_hidden()
    expect(page.get_by_role("button", name="Cancel", exact=True)).to_be_hidden()
    expect(page.locator("#error-banner")).to_be_hidden()
    return card


def test_a_payment_waits_at_the_approval_card_and_approve_follows_the_run_that_pays(ledger_lab, page, tmp_path):
    from playwright.sync_api import expect

    lab = ledger_lab
    with lab.server(DATABASE_PATH=str(tmp_path / "sophos.db")) as server:
        card = wait_at_the_gate(page, server)
        conversation = only_conversation(server)
        assert payments(lab) == []
        page.reload()  # the card comes from durable state
        expect(card.locator("li .call-args")).to_have_text(['{"to":"alice","amount":30}'])
        screenshot(page, "web-page-approval.png")

        lab.web.hold(COMMITTED)  # the payment is committed, its tool call not answered yet
        card.get_by_role("button", name="Approve").click()
        lab.web.wait_held()
        # The page follows the run that carries the decision on, as after Resume.
        expect(card).to_be_hidden()
        expect(page.get_by_role("button", name="Detach")).to_be_visible()
        expect(page.get_by_role("button", name="Cancel", exact=True)).to_be_visible()
        expect(page.locator("#status")).to_have_text("Running…")
        assert payments(lab) == [("alice", 30)]
        lab.web.release()

        answer = page.locator("#transcript .msg.assistant:not(.live)", has_text="Paid 30 to alice.")
        expect(answer).to_be_visible()
        expect(page.locator("#transcript .msg.tool summary")).to_have_text(["Tool result: ledger__record_payment"])
        expect(page.locator("#status")).to_have_text("Last run completed · 4 messages")
        expect(page.get_by_role("button", name="Send")).to_be_enabled()
        expect(card).to_be_hidden()
        expect(page.locator("#error-banner")).to_be_hidden()
        runs = list(peek_runs(server.env["DATABASE_PATH"], conversation)["status"])

    assert runs == ["waiting", "completed"]
    assert payments(lab) == [("alice", 30)]


def test_reject_with_a_reason_pays_nothing_and_the_model_reads_the_reason(ledger_lab, page, tmp_path):
    from playwright.sync_api import expect

    lab = ledger_lab
    reason = "Alice was paid <b>yesterday</b>."
    with lab.server(DATABASE_PATH=str(tmp_path / "sophos.db")) as server:
        card = wait_at_the_gate(page, server)
        page.get_by_label("Reason for rejecting").fill(reason)
        card.get_by_role("button", name="Reject").click()

        answer = page.locator("#transcript .msg.assistant:not(.live)", has_text="The payment to alice failed")
        expect(answer).to_be_visible()
        rejected = page.locator("#transcript .msg.tool")
        expect(rejected.locator("summary")).to_have_text(["Tool result: ledger__record_payment (error)"])
        expect(rejected.locator("pre")).to_contain_text(f"Reason: {reason}")  # as text, not markup
        expect(page.locator("#status")).to_have_text("Last run completed · 4 messages")
        expect(card).to_be_hidden()
        expect(page.get_by_label("Reason for rejecting")).to_have_value("")
        runs = list(peek_runs(server.env["DATABASE_PATH"], only_conversation(server))["status"])

    assert runs == ["waiting", "completed"]
    assert payments(lab) == []


NO_MARKUP = """() => {
    window.markup = [];
    new MutationObserver(records => {
        for (const record of records) for (const node of record.addedNodes) {
            if (node.nodeType !== Node.ELEMENT_NODE) continue;
            for (const found of [node, ...node.querySelectorAll("*")]) {
                if (["IMG", "SCRIPT", "B"].includes(found.tagName) && found.closest("main, nav")) {
                    window.markup.push(found.outerHTML);
                }
            }
        }
    }).observe(document, {childList: true, subtree: true});
}"""
"""Records every <img>, <script> or <b> ever added to the page's content, live or on a reload."""


def test_markup_in_model_and_tool_text_is_shown_as_text(lab, page, db_path):
    from playwright.sync_api import expect

    hostile = "<img src=x onerror=window.pwned=1><script>window.pwned=2</script>"
    entity = f"<b>Eve {uuid.uuid4().hex[:8]}</b>"
    page.add_init_script(script=f"({NO_MARKUP})()")
    with lab.server(DATABASE_PATH=str(db_path)) as server:
        page.goto(server.url + "/")
        send(page, f'Add the observation "{hostile}" to the entity named "{entity}".')
        answer = page.locator("#transcript .msg.assistant:not(.live)", has_text="did not exist, so I created it")
        expect(answer).to_be_visible()
        page.locator("#transcript details").first.click()  # open a tool result too

        expect(answer).to_contain_text(f'The entity {entity} did not exist, so I created it with the observation "{hostile}".')
        expect(page.locator("#transcript .msg.user")).to_contain_text(hostile)
        expect(page.locator("#transcript .chip").first).to_contain_text("<img src=x onerror=window.pwned=1>")
        expect(page.locator("#transcript .msg.tool pre").first).to_contain_text(entity)
        expect(page.locator("#conversations")).to_contain_text("<img src=x")
        screenshot(page, "web-page-markup-as-text.png")
        assert page.evaluate("() => [window.pwned, window.markup]") == [None, []]


def test_a_server_with_a_token_works_from_a_link_with_the_token(lab, page, db_path):
    from playwright.sync_api import expect

    token = f"secret-{uuid.uuid4().hex}"
    with lab.server(DATABASE_PATH=str(db_path), SOPHOS_LAB_TOKEN=token) as server:
        page.goto(f"{server.url}/?token={token}")
        assert page.url == f"{server.url}/"  # out of the address bar (the tab keeps it)
        send(page, "Hello there")
        answer = page.locator("#transcript .msg.assistant:not(.live)")
        expect(answer).to_contain_text("Hello! I am the scripted model of sophos_lab.")  # the stream got through
        with page.expect_download() as download:
            page.get_by_role("link", name="Export (Markdown)").click()
        exported = Path(download.value.path()).read_text()
        page.reload()
        expect(answer).to_contain_text("Hello! I am the scripted model of sophos_lab.")

    assert download.value.suggested_filename == f"{only_conversation_of(db_path)}.md"
    assert exported.startswith("# Hello there\n")


def only_conversation_of(db_path) -> str:
    from sophos_lab.lab.inspect import conversations

    [conversation] = conversations(db_path)["id"].tolist()
    return conversation


def test_on_a_server_with_users_the_page_asks_for_the_token_and_shows_only_that_user_s_conversations(lab, page, db_path):
    from playwright.sync_api import expect

    ada, bea = lab.add_user("ada", DATABASE_PATH=str(db_path)), lab.add_user("bea", DATABASE_PATH=str(db_path))
    with lab.server(DATABASE_PATH=str(db_path)) as server:
        theirs = httpx.post(f"{server.url}/api/chat", json={"message": "Hello from bea"},
                            headers={"Authorization": f"Bearer {bea}"}).json()["conversation"]
        with httpx.stream("GET", f"{server.url}/api/chat", params={"conversation": theirs},
                          headers={"Authorization": f"Bearer {bea}"}, timeout=60) as stream:
            assert any(line == "event: end" for line in stream.iter_lines())  # bea's run has ended
        page.goto(f"{server.url}/")
        dialog = page.locator("#token-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#token-why")).to_contain_text("This server has users")
        page.fill("#token-input", "a-wrong-token")
        page.click("#token-submit")
        expect(page.locator("#token-why")).to_contain_text("is not this server's")  # asked again, with why
        page.fill("#token-input", ada)
        page.click("#token-submit")
        expect(dialog).to_be_hidden()
        send(page, "Hello there")
        answer = page.locator("#transcript .msg.assistant:not(.live)")
        expect(answer).to_contain_text("Hello! I am the scripted model of sophos_lab.")  # the stream took the token
        page.reload()  # the tab keeps the token: no dialog
        expect(answer).to_contain_text("Hello! I am the scripted model of sophos_lab.")
        expect(dialog).to_be_hidden()
        listed = page.locator("#conversations li")
        expect(listed).to_have_count(1)
        expect(listed).not_to_contain_text("Hello from bea")
