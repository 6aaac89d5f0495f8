"""The chat widget, headless: click its buttons, wait for the turn, read the view-model.

Real parts throughout: the scripted model, the MCP servers, SQLite files, worker processes.
Each test has a database of its own in `tmp_path`; the lab (model and web pages) is shared.
"""

import pytest

from sophos_lab.lab import inspect as views
from sophos_lab.ui.chat_model import CHILD_EXITED
from sophos_lab.lab.harness import dead_port_url
from sophos_lab.standins.scripted_model import tokenize
from sophos_lab.ui.widgets import ChatWidget

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."


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

        chat.resume_button.click()  # starts a fresh child first
        assert chat.join(60)
        assert vm.conversation_id == conversation and vm.error is None
        assert not chat.resume_visible
        assert kinds(chat) == ["user", "tool_call", "tool_result", "assistant"]
        assert vm.transcript[-1].text == vm.streamed_answer
        assert statuses(env["DATABASE_PATH"], conversation) == ["interrupted", "completed"]
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

        chat.resume_button.click()  # a fresh child (its first open relabels the dead run)
        assert chat.join(60)
        assert vm.error is None and not chat.resume_visible
        assert [(m.kind, m.status) for m in vm.transcript] == [("user", ""), ("assistant", "")]
        assert vm.transcript[0].text == "hello, keep me"
        assert statuses(env["DATABASE_PATH"], vm.conversation_id) == ["interrupted", "completed"]
    finally:
        chat.close()
        child.close()
