"""OLLAMA_THINK, as in the original: thinking streams as `reasoning`, is kept, and can be refused.

The greeting script (`data/scripts/70_plain_answer.json`) thinks "The user greets me." before it
answers; the scripted model streams that as `message.thinking` unless the request says
`think: false`, which is what ChatOllama sends when OLLAMA_THINK is not `true`.
"""

import pytest

from sophos_lab.standins._proc import stop_server
from sophos_lab.runtime.errors import THINKING_UNSUPPORTED
from sophos_lab.lab.harness import KIT_ROOT
from sophos_lab.standins.scripted_model import start_scripted_model
from sophos_lab.runtime.settings import Settings
from sophos_lab.ui.widgets import ChatWidget

THOUGHT = "The user greets me."
ANSWER = "Hello! I am the scripted model of sophos_lab."


@pytest.mark.parametrize(("raw", "thinks"), [("true", True), ("TRUE", True), ("1", False), ("", False), ("yes", False)])
def test_the_model_thinks_only_when_ollama_think_is_true(raw, thinks):
    assert Settings.from_env({"OLLAMA_THINK": raw}).ollama_think is thinks


def texts(events, name: str) -> str:
    return "".join(event.data for event in events if event.event == name)


async def test_with_ollama_think_reasoning_streams_apart_from_tokens_and_is_kept(open_service, config_dir):
    (config_dir / "mcp.json").write_text("{}")
    async with open_service(OLLAMA_THINK="true") as agent:
        run = await agent.chat("hello")
        events = [event async for event in run.events()]
        detail = await agent.get_conversation(run.conversation)

    assert texts(events, "reasoning") == THOUGHT
    assert texts(events, "token") == ANSWER
    assert detail.messages[-1]["reasoning"] == THOUGHT
    assert detail.messages[-1]["content"] == ANSWER


async def test_without_ollama_think_the_model_is_asked_not_to_think(open_service, config_dir):
    (config_dir / "mcp.json").write_text("{}")
    async with open_service() as agent:
        run = await agent.chat("hello")
        events = [event async for event in run.events()]
        detail = await agent.get_conversation(run.conversation)

    assert [event for event in events if event.event == "reasoning"] == []
    assert texts(events, "token") == ANSWER
    assert "reasoning" not in detail.messages[-1]


@pytest.fixture
def no_thinking_model():
    """A scripted model that, like many real ones, cannot think."""
    proc, url = start_scripted_model(KIT_ROOT / "data" / "scripts", thinking=False)
    yield url
    stop_server(proc)


async def test_a_model_that_cannot_think_is_a_clear_error_naming_it(open_service, config_dir, no_thinking_model):
    (config_dir / "mcp.json").write_text("{}")
    async with open_service(OLLAMA_HOST=no_thinking_model, OLLAMA_THINK="true") as agent:
        refused = await agent.ask("hello")
        [run] = await agent.list_runs(refused.data["conversation"])
    async with open_service(OLLAMA_HOST=no_thinking_model) as agent:
        fine = await agent.ask("hello")

    assert (refused.event, refused.data["code"]) == ("chat-error", THINKING_UNSUPPORTED)
    assert '"scripted"' in refused.data["message"] and "OLLAMA_THINK" in refused.data["message"]
    assert (run.status, run.error_code) == ("failed", THINKING_UNSUPPORTED)
    assert fine.data["status"] == "completed"


def test_the_widget_shows_the_reasoning_collapsed_before_the_answer(lab, config_dir, tmp_path):
    (config_dir / "mcp.json").write_text("{}")
    settings = lab.settings(
        DATABASE_PATH=str(tmp_path / "sophos.db"), CONFIG_DIR=str(config_dir), OLLAMA_THINK="true",
    )
    chat = ChatWidget.for_service(settings, log_dir=tmp_path / "logs")
    try:
        chat.input.value = "hello"
        chat.send_button.click()
        assert chat.join(60)
        assert [item.kind for item in chat.view_model.transcript] == ["user", "reasoning", "assistant"]
        assert f"<details class=\"sx-tool sx-reasoning\"><summary>💭 thinking · {len(THOUGHT)} chars" in chat.transcript.value
        assert "<details open" not in chat.transcript.value
    finally:
        chat.close()
