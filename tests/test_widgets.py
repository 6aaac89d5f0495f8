"""The chat widget, headless: click its buttons, wait for the turn, read the view-model.

Real parts throughout: the scripted model, the MCP servers, SQLite files, worker processes.
Each test has a database of its own in `tmp_path`; the lab (model and web pages) is shared.
"""

import re
import threading

import pytest

from sophos_lab.lab import inspect as views
from sophos_lab.ui.chat_model import CHILD_EXITED, ChatViewModel
from sophos_lab.lab.harness import Lab, dead_port_url
from sophos_lab.standins.scripts import tokenize
from sophos_lab.ui.widgets import ChatWidget

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
ESSAY = "Write an essay on durable execution."
PAY = "Please pay 30 to alice."


@pytest.fixture
def env(tmp_path, config_dir):
    """Settings overrides that give a test its own database, memory file and configuration."""
    return {
        "DATABASE_PATH": str(tmp_path / "sophos.db"),
        "CONFIG_DIR": str(config_dir),
        "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl"),
    }


def send(chat: ChatWidget, text: str) -> None:
    """Type a message and click Send."""
    chat.input.value = text
    chat.send_button.click()
    assert chat.input.value == ""


def kinds(chat: ChatWidget) -> list[str]:
    return [item.kind for item in chat.view_model.transcript]


def statuses(db_path: str, conversation: str) -> list[str]:
    return list(views.peek_runs(db_path, conversation)["status"])


def until(vm: ChatViewModel, predicate, timeout: float = 60.0) -> None:
    """Block until `predicate()` holds, re-checked each time the view-model tells of a change."""
    changed = threading.Condition()

    def listener(_: str) -> None:
        with changed:
            changed.notify_all()

    vm.subscribe(listener)
    with changed:
        assert changed.wait_for(predicate, timeout), "the view-model never got there"


def payments(lab: Lab) -> list[tuple[str, int]]:
    return [tuple(row) for row in lab.ledger()[["to_account", "amount"]].itertuples(index=False)]


@pytest.fixture
def ledger_lab(request, lab_home):
    """A lab of this test's own whose `mcp.json` has the ledger, whose payments need approval."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)
    with Lab.setup(f"tests-widgets-{name}", quiet=True, fork_servers=True, extra_servers=("ledger",)) as lab:
        yield lab


def chat_on(where: str, lab: Lab, **env: str) -> tuple[ChatWidget, object | None]:
    """A widget over an in-process service (`"service"`) or a worker child (`"worker"`, also returned)."""
    if where == "service":
        return ChatWidget.for_service(lab.settings(**env), log_dir=lab.root / "logs"), None
    child = lab.worker(**env)
    return ChatWidget.for_child(child), child


def test_a_turn_streams_tool_chips_and_the_answer(lab, env, tmp_path):
    chat = ChatWidget.for_service(lab.settings(**env), log_dir=tmp_path / "logs")
    live_renders = []
    chat.live.observe(lambda change: live_renders.append(change["new"]), names="value")
    vm = chat.view_model
    try:
        assert vm.conversations == [] and vm.conversation_id is None
        assert not chat.resume_visible and not vm.resume()
        assert not vm.send("   ")

        url = lab.page("wal.html")
        send(chat, SUMMARISE.format(url=url))
        assert chat.join(60)

        assert kinds(chat) == ["user", "tool_call", "tool_result", "assistant"]
        call, result, answer = vm.transcript[1:]
        assert (call.name, call.arguments) == ("fetch__fetch", {"url": url})
        assert (result.name, result.status) == ("fetch__fetch", "success")
        assert answer.text == vm.streamed_answer and answer.text.count("\n- ") == 11
        # Throttled: far fewer renders of the streamed answer than tokens, and none left over.
        assert 0 < len(live_renders) < len(tokenize(answer.text)) / 2
        assert chat.live.value == ""
        assert vm.error is None and chat.banner.value == ""
        assert not vm.busy and not chat.send_button.disabled and not chat.resume_visible
        assert [(c.id, c.status, c.message_count) for c in vm.conversations] == [(vm.conversation_id, "completed", 4)]
        assert chat.conversation_list.value == vm.conversation_id
        assert f"🔧 fetch__fetch {{&quot;url&quot;: &quot;{url}&quot;}}" in chat.transcript.value

        # A second turn in the same conversation; model and user text are escaped.
        send(chat, "hello <b>agent</b>")
        assert chat.join(60)
        assert kinds(chat)[4:] == ["user", "assistant"]
        assert "hello &lt;b&gt;agent&lt;/b&gt;" in chat.transcript.value
        assert "<b>agent" not in chat.transcript.value
        assert [c.message_count for c in vm.conversations] == [6]

        conversation = vm.conversation_id
        chat.new_button.click()
        assert vm.conversation_id is None and vm.transcript == [] and chat.conversation_list.value == ""
        chat.conversation_list.value = conversation
        assert vm.conversation_id == conversation and len(vm.transcript) == 6
    finally:
        chat.close()


def test_a_failed_run_shows_its_error_and_resume(lab, env, config_dir):
    # Tools are irrelevant when the model is unreachable; no MCP servers keeps this test fast.
    (config_dir / "mcp.json").write_text("{}")
    chat = ChatWidget.for_service(lab.settings(**env, OLLAMA_HOST=dead_port_url()))
    vm = chat.view_model
    try:
        send(chat, "hello")
        assert chat.join(60)
        assert vm.error is not None and vm.error.code == "AGENT_FAILURE"
        assert "AGENT_FAILURE" in chat.banner.value
        assert chat.resume_visible and not chat.send_button.disabled
        assert kinds(chat) == ["user"]

        # The model is still down: the resume fails the same way, and is offered again.
        chat.resume_button.click()
        assert chat.join(60)
        assert vm.error.code == "AGENT_FAILURE" and chat.resume_visible
        assert statuses(env["DATABASE_PATH"], vm.conversation_id) == ["failed", "failed"]
    finally:
        chat.close()


def test_a_killed_child_leaves_a_conversation_that_resume_finishes(lab, env):
    child = lab.worker(**env)
    chat = ChatWidget.for_child(child)
    vm = chat.view_model
    fetched_before = lab.fetches("wal.html")
    try:
        lab.model.arm("summary")
        send(chat, SUMMARISE.format(url=lab.page("wal.html")))
        lab.model.wait_paused(timeout=60)
        assert vm.busy and chat.send_button.disabled and not chat.resume_visible
        assert child.kill() == -9
        assert chat.join(30)
        conversation = vm.conversation_id
        assert vm.error.code == CHILD_EXITED

        # A dead process cannot record its own death: the row still says `running` ...
        chat.reload_button.click()
        assert statuses(env["DATABASE_PATH"], conversation) == ["running"]
        # ... but nothing runs it any more, so the widget offers Resume for the same conversation.
        assert vm.conversation_id == conversation and vm.detail.orphaned
        assert chat.resume_visible and kinds(chat) == ["user", "tool_call", "tool_result"]
        # The list counts what the conversation shows (user, tool call, tool result), as the
        # recovery that the next child's first open makes will write it; the file still holds
        # what the run's row wrote (its one message).
        assert [c.message_count for c in vm.conversations] == [len(vm.detail.messages)] == [3]
        assert chat.conversation_list.label.endswith(" · running · 3 msgs")
        assert list(views.conversations(env["DATABASE_PATH"])["message_count"]) == [1]

        chat.resume_button.click()  # starts a fresh child first
        assert chat.join(60)
        assert vm.conversation_id == conversation and vm.error is None
        assert not chat.resume_visible
        assert kinds(chat) == ["user", "tool_call", "tool_result", "assistant"]
        assert vm.transcript[-1].text == vm.streamed_answer
        assert statuses(env["DATABASE_PATH"], conversation) == ["interrupted", "completed"]
        assert [c.message_count for c in vm.conversations] == [4]
        assert lab.fetches("wal.html") == fetched_before + 1
        assert child.is_alive()
    finally:
        chat.close()
        child.close()


def test_a_child_killed_right_after_started_offers_resume_and_answers_that_message(lab, env):
    """The child stops itself right after writing `started`, then dies: the message it accepted
    is shown (pending), Resume is offered, and the resume answers that very message."""
    child = lab.worker(**env, SOPHOS_LAB_STOP_AFTER_EVENT="1")
    chat = ChatWidget.for_child(child)
    vm = chat.view_model
    try:
        send(chat, "hello, keep me")
        child.wait_for("started")
        assert child.kill() == -9
        assert chat.join(30)
        del child.env["SOPHOS_LAB_STOP_AFTER_EVENT"]  # the child Resume starts runs to the end

        chat.reload_button.click()
        assert [(m.kind, m.text, m.status) for m in vm.transcript] == [("user", "hello, keep me", "pending")]
        assert "not answered yet" in chat.transcript.value
        assert chat.resume_visible
        assert [c.message_count for c in vm.conversations] == [1]  # the message it accepted

        chat.resume_button.click()  # a fresh child (its first open relabels the dead run)
        assert chat.join(60)
        assert vm.error is None and not chat.resume_visible
        assert [(m.kind, m.status) for m in vm.transcript] == [("user", ""), ("assistant", "")]
        assert vm.transcript[0].text == "hello, keep me"
        assert statuses(env["DATABASE_PATH"], vm.conversation_id) == ["interrupted", "completed"]
    finally:
        chat.close()
        child.close()


@pytest.mark.parametrize("where", ["service", "worker"])
def test_cancel_mid_answer_shows_cancelled_and_offers_resume(lab, env, where):
    lab.model.arm("essay")
    chat, child = chat_on(where, lab, **env)
    vm = chat.view_model
    try:
        assert not chat.cancel_visible
        send(chat, ESSAY)
        lab.model.wait_paused(timeout=60)  # half the essay is out; the model holds the rest
        until(vm, lambda: vm.can_cancel)  # the run's `started` has reached the view-model
        assert chat.cancel_visible and not chat.resume_visible and chat.send_button.disabled

        chat.cancel_button.click()
        assert not chat.cancel_visible  # asked once; the run's final event ends the turn
        assert chat.join(60)
        lab.model.release()  # nobody reads that stream any more

        conversation = vm.conversation_id
        # Asked for, so not an error: no banner; the status line says it, and Resume is offered.
        assert vm.error is None and chat.banner.value == ""
        assert vm.status == "The last run was cancelled. Its progress is saved: Resume continues with `agent`."
        assert "was cancelled" in chat.status.value
        assert chat.resume_visible and not chat.cancel_visible and not chat.send_button.disabled
        assert kinds(chat) == ["user"]  # the half-streamed answer was never saved
        assert statuses(env["DATABASE_PATH"], conversation) == ["cancelled"]

        # Read again from durable state: the same status line, no banner, and Resume.
        chat.reload_button.click()
        assert vm.error is None and chat.banner.value == "" and chat.resume_visible
        assert "was cancelled" in vm.status and "`agent`" in vm.status
        assert not vm.cancel()  # nothing runs here
    finally:
        lab.model.release()
        chat.close()
        if child is not None:
            child.close()


@pytest.mark.parametrize("where", ["service", "worker"])
def test_a_payment_waits_at_the_approval_card_and_approve_pays_once(ledger_lab, where):
    chat, child = chat_on(where, ledger_lab)
    vm = chat.view_model
    try:
        assert not chat.approval_visible
        send(chat, PAY)
        assert chat.join(60)

        conversation = vm.conversation_id
        assert chat.approval_shown == [("ledger__record_payment", '{"to": "alice", "amount": 30}')]
        assert chat.approval_visible and vm.error is None
        assert [(c.name, c.arguments) for c in vm.approval.calls] == [("ledger__record_payment", {"to": "alice", "amount": 30})]
        assert "waits for your decision on 1 tool call" in vm.status
        # While it waits: no Send there (the runtime would refuse it), no Resume, nothing to cancel.
        assert chat.send_button.disabled and not vm.send("Never mind.")
        assert not chat.resume_visible and not vm.resume() and not chat.cancel_visible
        assert kinds(chat) == ["user", "tool_call"]
        assert statuses(ledger_lab.db_path, conversation) == ["waiting"] and payments(ledger_lab) == []

        # Away and back: the card comes from durable state (for a child, the read-only views).
        chat.new_button.click()
        assert vm.approval is None and not chat.approval_visible and not chat.send_button.disabled
        chat.conversation_list.value = conversation
        chat.reload_button.click()
        assert chat.approval_visible and chat.approval_shown == [("ledger__record_payment", '{"to": "alice", "amount": 30}')]

        chat.approve_button.click()
        assert not chat.approval_visible  # the decision is a turn of its own
        assert chat.join(60)
        assert vm.error is None and vm.approval is None and not chat.approval_visible
        assert kinds(chat) == ["user", "tool_call", "tool_result", "assistant"]
        assert (vm.transcript[2].name, vm.transcript[2].status) == ("ledger__record_payment", "success")
        assert vm.transcript[-1].text == "Paid 30 to alice."
        assert not chat.send_button.disabled and not chat.resume_visible
        assert statuses(ledger_lab.db_path, conversation) == ["waiting", "completed"]
        assert payments(ledger_lab) == [("alice", 30)]
        assert not vm.approve()  # nothing waits any more
    finally:
        chat.close()
        if child is not None:
            child.close()


def test_reject_with_a_reason_pays_nothing_and_the_transcript_shows_the_rejection(ledger_lab):
    chat, _ = chat_on("service", ledger_lab)
    vm = chat.view_model
    try:
        send(chat, PAY)
        assert chat.join(60)
        assert chat.approval_visible

        # A view-model opened afresh on the same database shows the same gate.
        assert ChatViewModel(vm.backend).approval == vm.approval

        chat.reject_reason.value = "Alice was paid <b>yesterday</b>."
        chat.reject_button.click()
        assert chat.reject_reason.value == ""
        assert chat.join(60)

        assert payments(ledger_lab) == []
        assert vm.error is None and vm.approval is None and not chat.approval_visible
        assert kinds(chat) == ["user", "tool_call", "tool_result", "assistant"]
        rejection = vm.transcript[2]
        assert (rejection.name, rejection.status) == ("ledger__record_payment", "error")
        assert "rejected" in rejection.text and "Alice was paid <b>yesterday</b>." in rejection.text
        assert "Alice was paid &lt;b&gt;yesterday&lt;/b&gt;." in chat.transcript.value
        assert vm.transcript[-1].text.startswith("The payment to alice failed")
        assert statuses(ledger_lab.db_path, vm.conversation_id) == ["waiting", "completed"]
    finally:
        chat.close()
