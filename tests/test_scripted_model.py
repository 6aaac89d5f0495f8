"""The scripted model, driven by the real ChatOllama and ollama clients."""

import http.client
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import ollama
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama

from sophos_lab.standins.scripted_model import (
    Script,
    ScriptedModelControl,
    Turn,
    choose_turn,
    load_scripts,
    start_scripted_model,
    stop_server,
    tokenize,
)

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"
PAGE = "http://127.0.0.1:8000/wal.html"
SUMMARISE = f"Fetch {PAGE} and summarize it for me."


@tool
def fetch__fetch(url: str) -> str:
    """Fetch a URL and return its text."""
    return "unused: the scripted model only needs the schema"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_file = tmp_path_factory.mktemp("scripted") / "requests.jsonl"
    proc, url = start_scripted_model(SCRIPTS, log_file=log_file)
    yield url, log_file
    stop_server(proc)


@pytest.fixture
def control(server):
    return ScriptedModelControl(server[0])


@pytest.fixture
def llm(server):
    return ChatOllama(model="scripted", base_url=server[0])


def summary_history(llm):
    """The conversation up to the summary turn: request, tool call, tool result."""
    request = HumanMessage(SUMMARISE)
    call = llm.bind_tools([fetch__fetch]).invoke([request])
    result = ToolMessage("An article on write-ahead logging.", tool_call_id=call.tool_calls[0]["id"])
    return [request, call, result]


def bullets(text):
    return [line for line in text.splitlines() if line.startswith("- ")]


# --- against the running server ---------------------------------------------


def test_tags_and_version_label_the_model_as_scripted(server):
    url, _ = server
    assert [m.model for m in ollama.Client(host=url).list().models] == ["scripted:latest"]
    with urllib.request.urlopen(f"{url}/api/version") as response:
        assert json.load(response) == {"version": "0.0.0-scripted"}
    assert "scripted" in ollama.Client(host=url).show("scripted:latest").modelfile


def test_plain_answer(llm):
    assert llm.invoke("hello").content == "Hello! I am the scripted model of sophos_lab."


def test_thinking_is_returned_as_reasoning(server):
    reply = ChatOllama(model="scripted", base_url=server[0], reasoning=True).invoke("Hi there")
    assert reply.additional_kwargs["reasoning_content"] == "The user greets me."


def test_unmatched_message_gets_the_plain_fallback(llm, control):
    reply = llm.invoke("What is the capital of France?")
    assert reply.content.startswith("This is the scripted model. I have no script")
    assert control.chat_requests(script="plain")[-1]["status"] == 200


def test_fetch_script_calls_the_tool_with_the_templated_url(llm, control):
    reply = llm.bind_tools([fetch__fetch]).invoke(SUMMARISE)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("fetch__fetch", {"url": PAGE})]
    last = control.chat_requests()[-1]
    assert (last["script"], last["turn"], last["tools"]) == ("fetch-and-summarise", 0, ["fetch__fetch"])


def test_second_turn_answers_with_twelve_bullets(llm):
    reply = llm.invoke(summary_history(llm))
    assert len(bullets(reply.content)) == 12
    assert not reply.tool_calls


def test_stream_yields_several_chunks(llm):
    chunks = list(llm.stream("hello"))
    assert len(chunks) > 5
    assert "".join(c.content for c in chunks) == "Hello! I am the scripted model of sophos_lab."


def test_stream_false_returns_one_object(server):
    reply = ollama.Client(host=server[0]).chat(
        "scripted", [{"role": "user", "content": "hello"}], stream=False
    )
    assert reply.done and reply.message.content.startswith("Hello!")
    assert reply.message.thinking == "The user greets me."


def test_unknown_model_is_a_404_response_error(server):
    with pytest.raises(ollama.ResponseError) as caught:
        ChatOllama(model="nope", base_url=server[0]).invoke("hello")
    assert caught.value.status_code == 404
    assert "model 'nope' not found" in str(caught.value)


def test_error_script_fails_with_status_500(llm):
    with pytest.raises(ollama.ResponseError) as caught:
        llm.invoke("Please trigger a model error.")
    assert caught.value.status_code == 500
    assert caught.value.error == "scripted failure"


def test_armed_pause_holds_the_stream_until_release(server, llm, control):
    history = summary_history(llm)
    seen = len(control.chat_requests(script="fetch-and-summarise"))
    control.arm("summary")
    finished = threading.Event()
    replies = []

    def ask():
        try:
            replies.append(llm.invoke(history))
        finally:
            finished.set()

    threading.Thread(target=ask, daemon=True).start()
    try:
        assert control.wait_paused(timeout=10) == "summary"
        assert not finished.is_set()
        assert control.release() == 1
    finally:
        control.release()
    assert finished.wait(timeout=10)
    assert len(bullets(replies[0].content)) == 12

    requests = control.chat_requests(script="fetch-and-summarise")[seen:]
    assert [(r["turn"], r["status"], r["last_role"]) for r in requests] == [(1, 200, "tool")]
    logged = server[1].read_text().splitlines()
    assert json.loads(logged[-1]) == requests[-1]

    # The pause point was used up: the same turn now comes back straight away
    # (stream=False skips the token delay; a hold would hit the client timeout).
    raw = [
        {"role": "user", "content": SUMMARISE},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "fetch__fetch", "arguments": {"url": PAGE}}}]},
        {"role": "tool", "content": "An article on write-ahead logging."},
    ]
    again = ollama.Client(host=server[0], timeout=5).chat("scripted", raw, stream=False)
    assert len(bullets(again.message.content)) == 12


def test_a_burst_of_connections_is_answered_in_full(server):
    """64 clients connect at the same instant, as a cold service starting many runs does.

    With socketserver's default listen backlog (5) the kernel reset some of them.
    """
    clients = 64
    address = urlsplit(server[0])
    body = json.dumps({"model": "scripted", "messages": [user("hello")], "stream": False})
    start = threading.Barrier(clients)

    def ask(_: int) -> int:
        start.wait()
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        try:
            connection.request("POST", "/api/chat", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()

    with ThreadPoolExecutor(clients) as pool:
        assert list(pool.map(ask, range(clients))) == [200] * clients


def test_wait_paused_times_out_when_nothing_is_held(control):
    with pytest.raises(TimeoutError, match="no stream reached an armed pause point"):
        control.wait_paused(timeout=0.1)


def test_scripts_endpoint_lists_every_script(control):
    scripts = control.scripts()
    assert [s["name"] for s in scripts] == [s.name for s in load_scripts(SCRIPTS)]
    assert all(s["description"] for s in scripts)


# --- reply selection, in process ---------------------------------------------


def user(text):
    return {"role": "user", "content": text}


ASSISTANT = {"role": "assistant", "content": ""}
TOOL = {"role": "tool", "content": "ok"}


def test_turn_index_counts_assistant_messages_after_the_last_user_message():
    scripts = load_scripts(SCRIPTS)
    ask = user('Please add the observation "likes tea" to the entity named "Ada".')
    history = [user("hello"), ASSISTANT, ask]
    first = choose_turn(scripts, history)
    assert (first.script, first.index) == ("missing-entity", 0)
    assert first.turn.tool_calls[0]["arguments"] == {
        "observations": [{"entityName": "Ada", "contents": ["likes tea"]}]
    }
    last = choose_turn(scripts, [*history, ASSISTANT, TOOL, ASSISTANT, TOOL])
    assert last.index == 2
    assert last.turn.text == 'The entity Ada did not exist, so I created it with the observation "likes tea".'


def test_fetch_page_wins_only_without_a_summary_request():
    scripts = load_scripts(SCRIPTS)
    assert choose_turn(scripts, [user(SUMMARISE)]).script == "fetch-and-summarise"
    plain_fetch = choose_turn(scripts, [user(f"Fetch {PAGE}, please."), ASSISTANT, TOOL])
    assert plain_fetch.script == "fetch-page"
    assert plain_fetch.turn.text.startswith(f"The page at {PAGE} ")


FAILED_FETCH = f"Failed to fetch {PAGE} - status code 404"  # what the fetch server says (a ToolMessage with status "error")


def fetch_page_answer(llm, result: ToolMessage) -> str:
    """The fetch-page script's answer, through the real ChatOllama, to `result` of its tool call."""
    request = HumanMessage(f"Fetch {PAGE}")
    call = llm.bind_tools([fetch__fetch]).invoke([request])
    result.tool_call_id = call.tool_calls[0]["id"]
    return llm.bind_tools([fetch__fetch]).invoke([request, call, result]).content


def test_a_failed_fetch_gets_an_honest_answer_and_a_successful_one_the_normal_text(llm, control):
    failed = fetch_page_answer(llm, ToolMessage(FAILED_FETCH, tool_call_id="", status="error"))
    assert failed.startswith(f"The fetch failed: {FAILED_FETCH}. I have not read the page at {PAGE}")
    assert "loaded fine" not in failed
    assert control.chat_requests("fetch-page")[-1]["branch"] == "on_tool_error"

    fine = fetch_page_answer(llm, ToolMessage("Contents of the page: Example Domain", tool_call_id=""))
    assert fine == f"The page at {PAGE} loaded fine, and its text is now in the conversation for any follow-up questions."
    assert control.chat_requests("fetch-page")[-1]["branch"] is None


@pytest.mark.parametrize("content", [
    FAILED_FETCH,
    f"Failed to fetch robots.txt {PAGE} due to a connection issue",
    "The sites robots.txt (http://127.0.0.1:8000/robots.txt), specifies that autonomous fetching of this page is not allowed",
    "Error: fetch__fetch is not a valid tool, try one of [memory__read_graph].",  # LangGraph's ToolNode
    "Error executing tool fetch: boom",
])
def test_the_fetch_scripts_branch_on_every_kind_of_failed_result(content):
    scripts = load_scripts(SCRIPTS)
    failed = {"role": "tool", "content": content}
    page = choose_turn(scripts, [user(f"Fetch {PAGE}"), ASSISTANT, failed])
    assert (page.script, page.branch) == ("fetch-page", "on_tool_error")
    assert page.turn.text.startswith(f"The fetch failed: {content}")
    summary = choose_turn(scripts, [user(SUMMARISE), ASSISTANT, failed])
    assert (summary.script, summary.branch) == ("fetch-and-summarise", "on_tool_error")
    assert summary.turn.text.startswith("The fetch failed:") and summary.turn.pause is None
    second = f"Fetch {PAGE} then http://127.0.0.1:8000/index.html"
    assert choose_turn(scripts, [user(second), ASSISTANT, failed]).turn.text.startswith(f"The fetch of {PAGE} failed")


@pytest.mark.parametrize("message", ["Pay 30 to alice.", "Pay 30 to alice, exactly once."])
def test_a_payment_that_failed_is_not_confirmed(message):
    # e.g. in a lab without the ledger server, where LangGraph's ToolNode answers the call
    missing = {"role": "tool", "content": "Error: ledger__record_payment is not a valid tool, try one of [fetch__fetch]."}
    scripts = load_scripts(SCRIPTS)
    assert choose_turn(scripts, [user(message), ASSISTANT, missing]).turn.text.startswith(
        "The payment to alice failed: Error: ledger__record_payment is not a valid tool")
    assert choose_turn(scripts, [user(message), ASSISTANT, TOOL]).turn.text == "Paid 30 to alice."


def test_only_the_results_the_reply_follows_count_and_a_page_about_errors_is_no_error():
    scripts = load_scripts(SCRIPTS)
    earlier_failure = [user("hello"), ASSISTANT, {"role": "tool", "content": FAILED_FETCH}, ASSISTANT]
    fine = choose_turn(scripts, [*earlier_failure, user(f"Fetch {PAGE}"), ASSISTANT, TOOL])
    assert fine.branch is None and "loaded fine" in fine.turn.text
    about_errors = {"role": "tool", "content": "Contents of the page:\nError handling: Failed to fetch means ..."}
    assert choose_turn(scripts, [user(f"Fetch {PAGE}"), ASSISTANT, about_errors]).branch is None
    # of several results of one turn, a failed one anywhere selects the branch
    both = [user(f"Fetch {PAGE}"), ASSISTANT, TOOL, {"role": "tool", "content": FAILED_FETCH}]
    assert choose_turn(scripts, both).branch == "on_tool_error"


def test_a_script_can_name_its_own_tool_error_pattern():
    script = Script.from_dict({
        "match": "remember",
        "tool_error_match": r"\bnot found$",
        "turns": [{"tool_calls": [{"name": "memory__add_observations"}]},
                  {"text": "Noted.", "on_tool_error": {"text": "That did not work: {tool_error}"}}],
    }, default_name="memory")
    failed = {"role": "tool", "content": "Entity with name Ada not found"}
    assert choose_turn([script], [user("remember"), ASSISTANT, failed]).turn.text == (
        "That did not work: Entity with name Ada not found")
    assert choose_turn([script], [user("remember"), ASSISTANT, TOOL]).turn.text == "Noted."


def test_an_error_branch_is_a_turn_without_a_branch_of_its_own():
    assert Turn.from_dict({"text": "a", "on_tool_error": {"text": "b"}}).on_tool_error == Turn(text="b")
    with pytest.raises(ValueError, match="unknown turn keys"):
        Turn.from_dict({"text": "a", "on_tool_error": {"txet": "b"}})
    with pytest.raises(ValueError, match="without an \"on_tool_error\" of its own"):
        Turn.from_dict({"on_tool_error": {"on_tool_error": {"text": "c"}}})


def test_turns_run_out_unless_the_last_one_repeats():
    scripts = load_scripts(SCRIPTS)
    done = choose_turn(scripts, [user(f"Fetch {PAGE}"), *[ASSISTANT, TOOL] * 3])
    assert done.turn.text == "(scripted: no more turns)"
    looping = choose_turn(scripts, [user("loop forever"), *[ASSISTANT, TOOL] * 30])
    assert looping.turn.tool_calls == ({"name": "memory__read_graph", "arguments": {}},)


def test_placeholders_leave_other_braces_alone():
    script = Script.from_dict(
        {"match": r"go (?P<where>\w+)", "turns": [{"text": 'to {where}: {"a": {b}} {}'}]},
        default_name="braces",
    )
    assert choose_turn([script], [user("go home")]).turn.text == 'to home: {"a": {b}} {}'


def test_tokens_join_back_to_the_text():
    text = "  Two  spaces,\nnew lines\n\n- and bullets "
    assert "".join(tokenize(text)) == text


def test_each_example_is_answered_by_its_own_script_and_the_fallback_lists_them():
    """A learner who types something unscripted is told what the scripted model answers."""
    from sophos_lab.standins.scripted_model import choose_turn, load_scripts

    scripts = load_scripts(SCRIPTS)
    examples = {script.name: script.example for script in scripts if script.example}
    assert {"fetch-and-summarise", "long-essay", "plain-answer"} <= set(examples)
    for name, example in examples.items():
        chosen = choose_turn(scripts, [{"role": "user", "content": example.split(" (")[0]}])
        assert chosen.script == name, (example, chosen.script)

    fallback = choose_turn(scripts, [{"role": "user", "content": "What is the weather like?"}])

    assert fallback.script == "plain"
    assert all(f"- {example}" in fallback.turn.text for example in examples.values()), fallback.turn.text
