"""The recording proxy in front of a non-scripted Ollama-protocol server (`servers/ollama_like.py`).

The lab is set up with `ollama_host=` that server, so it starts its proxy and the agent talks to
the model through it: the request log and the pause points then work as with the scripted
model, and lesson 06d's kill point is as exact. (`conftest.py` clears `OLLAMA_HOST`, so the
host is always passed explicitly.)
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from conftest import OLLAMA_LIKE_MODEL as MODEL
from conftest import roles, statuses

from sophos_lab.standins._proc import stop_server
from sophos_lab.runtime.errors import MODEL_UNAVAILABLE, MODEL_UNREACHABLE
from sophos_lab.lab.harness import Lab
from sophos_lab.standins.model_proxy import ModelProxyControl, start_model_proxy

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
FETCH_TOOL = {"type": "function", "function": {
    "name": "fetch__fetch", "description": "Fetch a URL.",
    "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}}
TIMING = {"created_at", "total_duration", "load_duration", "prompt_eval_duration", "eval_duration"}


@pytest.fixture
def lab(request, lab_home, ollama_like):
    with Lab.setup(f"tests-proxy-{request.node.name}", ollama_host=ollama_like, ollama_model=MODEL,
                   quiet=True, fork_servers=True) as lab:
        yield lab


@pytest.fixture
def restart(lab, open_service):
    """`async with restart() as fresh:` a new runtime on the lab's database."""
    return lambda **env: open_service(DATABASE_PATH=str(lab.db_path), **env)


@pytest.fixture
def proxy(ollama_like):
    """A bare proxy (no lab) in front of ollama_like, and its control."""
    proc, url = start_model_proxy(ollama_like)
    yield url, ModelProxyControl(url, upstream=ollama_like)
    stop_server(proc)


def on_disk(lab, conversation) -> list[str]:
    return list(lab.peek_runs(conversation)["status"])


def entered(events) -> list[tuple[int, str]]:
    return [(e.data["step"], e.data["node"]) for e in events
            if e.event == "trace" and e.data["event"] == "enter"]


def after_tool_result(url: str = "http://127.0.0.1:9/wal.html") -> list[dict]:
    """A history whose next answer is the one that follows a tool result."""
    return [
        {"role": "user", "content": f"Fetch {url} and summarize it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "fetch__fetch", "arguments": {"url": url}}}]},
        {"role": "tool", "content": "Write-ahead logging records every change before the data "
                                    "pages are written, so a crash loses nothing committed.",
         "tool_name": "fetch__fetch"},
    ]


def chat_lines(base: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{base}/api/chat", json={"model": MODEL, **body}, timeout=30) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def untimed(lines: list[dict]) -> list[dict]:
    """The chunks without their clock readings (which differ between two requests)."""
    def strip(chunk: dict) -> dict:
        out = json.loads(json.dumps({k: v for k, v in chunk.items() if k not in TIMING}))
        for call in out.get("message", {}).get("tool_calls", []):
            call.pop("id")  # a fresh id per reply, as Ollama's
        return out
    return [strip(chunk) for chunk in lines]


# --- the lab picks the proxy -------------------------------------------------------------


def test_a_lab_on_a_real_model_runs_a_proxy_and_stops_it_on_close(lab_home, ollama_like):
    lab = Lab.setup("tests-proxy-lifecycle", ollama_host=ollama_like, ollama_model=MODEL, quiet=True, fork_servers=True)
    servers = list(lab._servers)
    try:
        assert not lab.scripted
        assert isinstance(lab.model, ModelProxyControl)
        assert lab.ollama_host == lab.model.url != ollama_like
        assert lab.readiness().ok  # /api/tags through the proxy lists the model
        description = lab.describe()
        assert "real model" in description and ollama_like in description and lab.ollama_host in description
        assert lab.env()["OLLAMA_HOST"] == lab.model.url
    finally:
        lab.close()
    assert len(servers) == 2 and all(proc.poll() is not None for proc in servers)


# --- (a) the request log ------------------------------------------------------------------


async def test_the_proxy_logs_each_model_call_of_a_run_that_fetches_a_page(lab, restart):
    async with restart() as agent:
        end = await agent.ask(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = end.data["conversation"]
        detail = await agent.get_conversation(conversation)

    assert (end.event, end.data["status"]) == ("end", "completed")
    assert roles(detail) == ["user", "assistant", "tool", "assistant"]
    answer = detail.messages[-1]["content"]
    assert answer.startswith("- ") and answer.count("\n- ") == 11  # as asked: 12 bullet points
    assert lab.fetches("wal.html") == 1
    assert lab.model_calls() == 2
    first, second = lab.model.chat_requests()
    assert [(r["turn"], r["last_role"], r["status"]) for r in (first, second)] == [(0, "user", 200), (1, "tool", 200)]
    assert (first["n_messages"], second["n_messages"]) == (1 + 1, 1 + 3)  # the system prompt, then the history
    assert "fetch__fetch" in first["tools"] and "url" in first["tool_args"]["fetch__fetch"]
    assert first["model"] == MODEL and first["script"] is None
    logged = [json.loads(line) for line in (lab.root / "logs" / "model-requests.jsonl").read_text().splitlines()]
    assert [r for r in logged if r["path"] == "/api/chat"] == [first, second]


# --- (b) lesson 06d's kill point, with a model that is not scripted ------------------------


async def test_a_kill_held_at_the_summary_resumes_at_the_agent_step_without_a_second_fetch(lab, restart):
    lab.model.arm("summary")
    with lab.worker() as child:
        child.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = child.conversation()
        child.wait_for("trace", event="result")
        assert lab.model.wait_paused() == "summary"
        assert child.kill() == -9

    assert on_disk(lab, conversation) == ["running"]
    async with restart() as fresh:
        [summary] = await fresh.list_conversations()
        assert fresh.store.recovered_runs == 1
        assert summary.status == "interrupted"
        detail = await fresh.get_conversation(conversation)
        assert (detail.next, detail.resumable) == (("agent",), True)
        assert roles(detail) == ["user", "assistant", "tool"]  # the partial summary is gone

        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        assert (await statuses(fresh, conversation)) == ["interrupted", "completed"]
        after = await fresh.get_conversation(conversation)

    assert end.data["status"] == "completed"
    assert entered(resumed.buffer) == [(3, "agent")]
    assert lab.fetches("wal.html") == 1
    assert [r["turn"] for r in lab.model.chat_requests()] == [0, 1, 1]
    assert roles(after) == ["user", "assistant", "tool", "assistant"]


# --- (c) the newer 404 wording --------------------------------------------------------------


async def test_an_unknown_model_behind_the_proxy_is_model_unavailable(lab, restart):
    async with restart(OLLAMA_MODEL="does-not-exist") as agent:
        error = await agent.ask("hello")
        [run] = await agent.list_runs(error.data["conversation"])

    assert error.data["code"] == MODEL_UNAVAILABLE
    assert (run.status, run.error_code) == ("failed", MODEL_UNAVAILABLE)
    [request] = lab.model.chat_requests()
    assert (request["model"], request["status"]) == ("does-not-exist", 404)


# --- (d) faults the proxy injects, as the scripted model's -----------------------------------


async def test_two_failures_from_the_proxy_are_retried_and_the_third_request_reaches_the_model(lab, restart):
    lab.model.fail_next(2, status=500)
    async with restart(SOPHOS_LAB_MODEL_ATTEMPTS="3", SOPHOS_LAB_RETRY_BASE_SECONDS="0.01") as agent:
        run = await agent.chat("hello")
        events = [event async for event in run.events()]

    retries = [e.data["data"] for e in events if e.event == "trace" and e.data["event"] == "retry"]
    assert events[-1].event == "end"
    assert [(r["attempt"], r["wait"], r["code"]) for r in retries] == [
        (2, 0.01, MODEL_UNREACHABLE), (3, 0.02, MODEL_UNREACHABLE)]
    assert "model proxy: injected failure (HTTP 500)" in retries[0]["error"]
    assert [(r["status"], r["fault"]) for r in lab.model.chat_requests()] == [(500, "error"), (500, "error"), (200, None)]


async def test_more_failures_than_attempts_end_with_model_unreachable_behind_the_proxy(lab, restart):
    lab.model.fail_next(2, status=503, message="upstream overloaded")
    async with restart(SOPHOS_LAB_MODEL_ATTEMPTS="2", SOPHOS_LAB_RETRY_BASE_SECONDS="0.01") as agent:
        error = await agent.ask("hello")

    assert error.data["code"] == MODEL_UNREACHABLE
    assert error.data["message"].startswith("The model answered HTTP 503 to all 2 attempts (SOPHOS_LAB_MODEL_ATTEMPTS=2)")
    assert "upstream overloaded" in error.data["message"]
    assert lab.model_calls() == 2


def test_hang_next_holds_a_chat_request_unanswered_until_released_and_answers_the_next(proxy):
    url, control = proxy
    control.hang_next(1)
    outcome = {}

    def ask() -> None:
        try:
            httpx.post(f"{url}/api/chat", timeout=30,
                       json={"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "hi"}]})
        except httpx.HTTPError as error:
            outcome["error"] = type(error).__name__

    asking = threading.Thread(target=ask)
    asking.start()
    assert control.wait_paused() == "(hang)"
    assert control.release() == 1
    asking.join(30)

    assert outcome == {"error": "RemoteProtocolError"}  # no answer at all, not even headers
    assert chat_lines(url, messages=[{"role": "user", "content": "hi"}])[-1]["done"]
    assert [(r["status"], r["fault"]) for r in control.chat_requests()] == [(0, "hang"), (200, None)]


def test_a_fault_that_is_no_http_error_is_refused(proxy):
    _, control = proxy
    with pytest.raises(ValueError, match="status"):
        control.fail_next(1, status=200)
    with pytest.raises(ValueError, match="n"):
        control.hang_next(0)


# --- the proxy on its own: bytes through unchanged, exact holds --------------------------------


def test_the_stream_comes_through_unchanged_with_thinking_tool_call_ids_and_timings(proxy, ollama_like):
    url, _ = proxy
    ask = {"think": True, "tools": [FETCH_TOOL],
           "messages": [{"role": "user", "content": "Fetch http://127.0.0.1:9/a.html please"}]}
    direct, proxied = chat_lines(ollama_like, **ask), chat_lines(url, **ask)
    assert untimed(proxied) == untimed(direct)
    assert proxied[0]["message"]["thinking"] and not proxied[0]["message"]["content"]
    [call] = proxied[-2]["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {
        "index": 0, "name": "fetch__fetch", "arguments": {"url": "http://127.0.0.1:9/a.html"}}
    done = proxied[-1]
    assert done["done"] is True and done["done_reason"] == "stop"
    assert TIMING - {"created_at"} <= set(done) and {"prompt_eval_count", "eval_count"} <= set(done)


def test_summary_holds_the_answer_after_the_tool_result_after_n_content_chunks(proxy):
    url, control = proxy
    control.arm("summary", after_chunks=2)
    seen: list[dict] = []
    with httpx.stream("POST", f"{url}/api/chat", timeout=30,
                      json={"model": MODEL, "think": True, "messages": after_tool_result()}) as r:
        lines = r.iter_lines()
        while sum(1 for chunk in seen if chunk["message"].get("content")) < 2:
            seen.append(json.loads(next(lines)))
        assert control.wait_paused() == "summary"
        assert control.release() == 1
        seen += [json.loads(line) for line in lines if line]
    contents = [c["message"]["content"] for c in seen if c["message"].get("content")]
    assert seen[0]["message"].get("thinking") and len(contents) > 2 and seen[-1]["done"]
    assert "".join(contents).startswith("Here is a summary of")


def test_first_chunk_holds_a_stream_before_its_first_line(proxy):
    url, control = proxy
    control.arm("first-chunk")
    with httpx.stream("POST", f"{url}/api/chat", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200  # the headers are through; the body waits
        assert control.wait_paused() == "first-chunk"
        assert control.release() == 1
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and "".join(c["message"]["content"] for c in lines).startswith("Hello!")


def test_summary_is_not_used_up_by_a_stream_that_follows_no_tool_result(proxy):
    url, control = proxy
    control.arm("summary")
    plain = chat_lines(url, messages=[{"role": "user", "content": "hi"}])  # not held: no tool result
    assert plain[-1]["done"]
    with httpx.stream("POST", f"{url}/api/chat", timeout=30,
                      json={"model": MODEL, "messages": after_tool_result()}) as r:
        assert control.wait_paused() == "summary"
        control.release()
        assert json.loads(list(r.iter_lines())[-1])["done"]


def test_arming_an_unknown_pause_point_is_refused(proxy):
    _, control = proxy
    with pytest.raises(ValueError, match="first-chunk"):
        control.arm("essay")
