"""The grader's parts, each against real pieces: the model servers' request holds, the scripted
model's tool names, the world's reporting connection and saver, the points of a reference run, the
child's reading of a module, the verdicts, the lab notebook's modules and `sophos-lab grade`.

The grader run end to end, on the lab's solutions and the kit, is `test_grading_matrix.py`.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import urllib.request
from pathlib import Path

import pytest
from conftest import sophos_lab_cli

from sophos_lab.grading import contract
from sophos_lab.grading.child import load_module, normalise_read
from sophos_lab.grading.grader import Outcome, Reference, answered, status_problems
from sophos_lab.grading.points import Point, points_of, sample
from sophos_lab.grading.result import Graded
from sophos_lab.grading.stages import expected
from sophos_lab.grading.track import Track, assemble
from sophos_lab.lab.children import child_environment
from sophos_lab.standins._httpkit import prompt_digest
from sophos_lab.standins.model_proxy import ModelProxyControl, start_model_proxy, stop_server
from sophos_lab.standins.offered_tools import offered, offered_call

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions" / "19_lab_build_a_durable_agent"


# --- the model servers: the n-th request held, received or after its first chunk --------------


def chat(url: str, text: str, lines: list[bytes], first: threading.Event) -> None:
    """POST one streamed chat request, keeping its lines; `first` is set at the first line."""
    body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(f"{url}/api/chat", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            lines.append(line)
            first.set()


def start_chat(url: str, text: str) -> tuple[threading.Thread, list[bytes], threading.Event]:
    lines: list[bytes] = []
    first = threading.Event()
    thread = threading.Thread(target=chat, args=(url, text, lines, first), daemon=True)
    thread.start()
    return thread, lines, first


@pytest.mark.parametrize("through", ["scripted", "proxy"])
def test_the_nth_chat_request_is_held_when_received_or_after_its_first_chunk(lab, through):
    proxy = None
    if through == "proxy":
        proxy_proc, proxy_url = start_model_proxy(lab.ollama_host)
        proxy = ModelProxyControl(proxy_url)
    control, url = (proxy, proxy.url) if proxy else (lab.model, lab.ollama_host)
    try:
        control.hold_request(2, "received")
        done, lines, _ = start_chat(url, "Hello!")
        done.join(60)
        assert not done.is_alive() and b'"done": true' in lines[-1]  # the first is answered at once
        held, lines, first = start_chat(url, "Hello!")
        assert control.wait_paused(60) == "(request received)"
        assert not first.is_set()  # no answer yet: not a byte
        assert control.release() == 1
        held.join(60)
        assert b'"done": true' in lines[-1]

        control.hold_request(1, "first-chunk")
        held, lines, first = start_chat(url, "Hello!")
        assert control.wait_paused(60) == "(request first-chunk)"
        assert first.wait(60) and len(lines) == 1  # the first chunk is out, and only it
        control.release()
        held.join(60)
        assert b'"done": true' in lines[-1] and len(lines) > 2
    finally:
        control.release()
        if proxy:
            stop_server(proxy_proc)


def test_a_request_log_names_the_user_message_each_request_answers(lab):
    before = len(lab.model.chat_requests())
    done, _, _ = start_chat(lab.ollama_host, "Hello!")
    done.join(60)
    (logged,) = lab.model.chat_requests()[before:]
    assert logged["prompt"] == prompt_digest([{"role": "user", "content": "Hello!"}]) and logged["turn"] == 0
    assert prompt_digest([{"role": "user", "content": "Hello"}]) != logged["prompt"]


def test_the_web_server_says_when_a_released_request_is_in_its_log(lab):
    before = lab.fetches("wal.html")
    lab.web.hold("/wal.html")
    fetch = threading.Thread(target=lambda: urllib.request.urlopen(lab.page("wal.html"), timeout=60).read(), daemon=True)
    fetch.start()
    assert lab.web.wait_held(60) == "/wal.html"
    assert lab.fetches("wal.html") == before  # held: not logged yet
    lab.web.release()
    assert lab.web.wait_logged("/wal.html", before + 1) == before + 1  # a barrier, not a sleep
    fetch.join(60)
    with pytest.raises(TimeoutError):
        lab.web.wait_logged("/wal.html", before + 2, timeout=0.2)


# --- the scripted model: a tool call by the name the request offers ------------------------


def tools(**required: list[str]) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": {"required": params}}}
            for name, params in required.items()]


def test_a_scripted_call_takes_the_kit_s_name_langchain_s_name_or_the_bare_one():
    call = {"name": "fetch__fetch", "arguments": {"url": "u"}}
    assert offered_call(call, offered(tools(fetch__fetch=["url"])))["name"] == "fetch__fetch"
    assert offered_call(call, offered(tools(fetch_fetch=["url"])))["name"] == "fetch_fetch"
    assert offered_call(call, offered(tools(fetch=["url"], memory=[])))["name"] == "fetch"
    assert offered_call(call, offered(tools(other=[])))["name"] == "fetch__fetch"  # nothing fits: as written
    assert offered_call(call, {})["name"] == "fetch__fetch"


def test_a_keyed_payment_is_called_only_where_the_agent_fills_the_key_in_itself():
    call = {"name": ["ledger__record_payment_once", "ledger__record_payment"], "arguments": {"to": "dave", "amount": 30}}
    kit = tools(ledger__record_payment=["to", "amount"], ledger__record_payment_once=["to", "amount"])
    raw = tools(record_payment=["to", "amount"], record_payment_once=["to", "amount", "idempotency_key"])
    keyed = tools(fetch=["url"], record_payment=["to", "amount"])
    assert offered_call(call, offered(kit))["name"] == "ledger__record_payment_once"
    assert offered_call(call, offered(raw))["name"] == "record_payment"  # the model has no key to give
    assert offered_call(call, offered(keyed))["name"] == "record_payment"


# --- the world: each durable write reported once it is committed ----------------------------


@pytest.fixture
def writes():
    seen: list[str] = []
    contract.watch_writes(seen.append)
    yield seen
    contract.watch_writes(None)


def test_the_world_s_connection_reports_each_commit_that_wrote_and_what_it_wrote(tmp_path, writes):
    world = contract.World(db=tmp_path / "agent.db", ollama_host="", ollama_model="", env={})
    db = world.connect()
    assert isinstance(db, contract.ReportingConnection)
    db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, status TEXT)")
    db.commit()  # DDL: sqlite3 opens no transaction for it, so there is nothing to report
    db.execute("INSERT INTO runs (status) VALUES ('running')")
    db.execute("UPDATE runs SET status = 'completed'")
    db.commit()
    db.commit()  # nothing pending: no point
    with db:
        db.execute("DELETE FROM runs")
    db.close()
    assert writes == ["commit: INSERT INTO runs, UPDATE runs", "commit: DELETE FROM runs"]


def test_the_world_s_saver_reports_each_checkpoint_and_each_task_s_writes(tmp_path, writes):
    from langgraph.graph import START, MessagesState, StateGraph

    world = contract.World(db=tmp_path / "agent.db", ollama_host="", ollama_model="", env={})
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [("ai", "hi")]})
    graph.add_edge(START, "agent")

    async def run() -> list[str]:
        async with world.saver() as saver:
            app = graph.compile(checkpointer=saver)
            await app.ainvoke({"messages": [("user", "hello")]}, {"configurable": {"thread_id": "t"}},
                              durability="sync")
            state = await app.aget_state({"configurable": {"thread_id": "t"}})
        return [m.content for m in state.values["messages"]]

    assert asyncio.run(run()) == ["hello", "hi"]
    assert writes == ["checkpoint step -1", "writes __start__", "checkpoint step 0", "writes agent",
                      "checkpoint step 1"]
    with sqlite3.connect(tmp_path / "agent.db") as db:
        assert db.execute("SELECT count(*) FROM checkpoints").fetchone()[0] == 3


def test_the_world_names_the_lab_s_servers_for_langchain_s_mcp_client(lab):
    world = contract.World.from_env(child_environment(lab.env()))
    connections = world.mcp_connections()
    assert sorted(connections) == ["fetch", "memory"]
    assert connections["fetch"]["transport"] == "stdio" and "mcp_server_fetch" in connections["fetch"]["args"]
    assert world.db == lab.db_path and world.model().base_url == lab.ollama_host


# --- the child: a module read through the contract ----------------------------------------


def test_a_module_without_the_contract_is_refused_naming_what_it_misses(tmp_path):
    path = tmp_path / "half.py"
    path.write_text("async def run_turn(world, conversation, message): pass\ndef read(world, c): pass\n")
    with pytest.raises(TypeError, match="no `async def` recover, resume, read"):
        load_module(path)


def test_read_s_answer_is_normalised_to_roles_texts_calls_and_statuses():
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    messages = [SystemMessage("rules"), HumanMessage("hi"),
                AIMessage("", tool_calls=[{"name": "fetch", "args": {}, "id": "1"}]),
                ToolMessage([{"type": "text", "text": "page"}], tool_call_id="1"), ("assistant", "done"),
                {"role": "user", "content": "more"}]
    read = normalise_read({"messages": messages, "runs": ["completed", {"status": "interrupted"}]})
    assert read == {"messages": [{"role": "user", "text": "hi", "calls": 0},
                                 {"role": "assistant", "text": "", "calls": 1},
                                 {"role": "tool", "text": "page", "calls": 0},
                                 {"role": "assistant", "text": "done", "calls": 0},
                                 {"role": "user", "text": "more", "calls": 0}],
                    "runs": ["completed", "interrupted"]}


# --- points and verdicts ------------------------------------------------------------------


def test_the_points_of_a_reference_run_in_time_order_with_their_turn_and_whether_the_input_is_in():
    writes = [{"n": 1, "what": "commit: INSERT INTO runs", "time": 10.1},
              {"n": 2, "what": "checkpoint step -1", "time": 10.2},
              {"n": 3, "what": "commit: INSERT INTO runs", "time": 12.1},
              {"n": 4, "what": "checkpoint step 4", "time": 12.2}]
    model = [{"time": 10.3}, {"time": 12.3}]
    web = [{"path": "/robots.txt", "time": 10.35}, {"path": "/wal.html", "time": 10.4},
           {"path": "/ledger-committed", "time": 12.4}]
    points = points_of(10.0, [10.05, 12.05], model, web, writes, "wal.html", "/ledger-committed")
    assert [(p.name, p.turn, p.before_input) for p in points] == [
        ("write 1: commit: INSERT INTO runs", 1, True), ("write 2: checkpoint step -1", 1, False),
        ("model 1 received", 1, False), ("model 1 first chunk", 1, False), ("fetch received", 1, False),
        ("write 3: commit: INSERT INTO runs", 2, True), ("write 4: checkpoint step 4", 2, False),
        ("model 2 received", 2, False), ("model 2 first chunk", 2, False), ("payment committed", 2, False)]
    assert points[6].kind == "write: checkpoint step N" and points[7].hold == "received" and points[7].n == 2
    assert [p.name for p in sample(points)] == [
        "write 1: commit: INSERT INTO runs", "write 2: checkpoint step -1", "model 1 received",
        "model 1 first chunk", "fetch received", "payment committed"]


def test_a_message_is_answered_by_an_assistant_message_without_tool_calls_before_the_next_user():
    said = [{"role": "user", "text": "a", "calls": 0}, {"role": "assistant", "text": "", "calls": 1},
            {"role": "tool", "text": "page", "calls": 0}, {"role": "user", "text": "b", "calls": 0},
            {"role": "assistant", "text": "ok", "calls": 0}]
    assert not answered(said, "a") and answered(said, "b") and not answered(said, "c")


def test_the_statuses_after_recovery_and_resume():
    def read(runs, answer=True):
        messages = [{"role": "user", "text": "m", "calls": 0}]
        return {"messages": messages + ([{"role": "assistant", "text": "x", "calls": 0}] if answer else []),
                "runs": runs}

    assert status_problems(read(["interrupted"], False), read(["interrupted", "completed"]), read(["completed"]), "m") == []
    assert status_problems(read([]), read([]), read([]), "m") == ["no runs recorded: nothing says the killed run was cut short"]
    assert status_problems(read(["running"], False), read(["running", "completed"]), read(["running", "completed"]), "m") == [
        "a run still `running` after recover()", "a run left `running` at the end"]
    assert status_problems(read(["completed"], False), read(["completed"]), read(["completed"]), "m") == [
        "the killed run is `completed` after recover()"]
    # Its work all done and only its end unrecorded: `interrupted`, and nothing left to resume.
    assert status_problems(read(["interrupted"]), read(["interrupted"]), read(["interrupted"]), "m") == []


def test_each_stage_expects_its_verdicts_and_a_result_says_where_it_differs(tmp_path):
    row = Point("write 1: commit: INSERT INTO runs", "write: commit: INSERT INTO runs", 1, 0.1, 1, "", True)
    paid = Point("payment committed", "payment committed", 3, 1.0)
    assert expected("A", paid) == {"lost", "wrong status"}
    assert expected("B", paid) == {"wrong status", "extra payment"} and expected("B", row) == {"wrong status"}
    assert expected("C", row) == {"lost"} and expected("D", row) == set() and expected("E", paid) == set()
    result = Graded(tmp_path / "agent.py", "E", Reference(payments=1),
                    [Outcome(row), Outcome(paid, extra_payment=1, payments=2, notes=["a note"])])
    assert result.summary == "your agent: 1 of 2 points recover, 0 lost, 0 re-run, 1 payment (2 at 1 point)"
    assert result.problems() == ["at `payment committed` (turn 3): found extra payment (a note)"]
    with pytest.raises(AssertionError, match="stage E"):
        result.check()
    stub = Graded(tmp_path / "agent.py", "A", Reference(error="the uninterrupted run failed", not_done=True))
    with pytest.raises(NotImplementedError):
        stub.check()


# --- the lab notebook's modules, and the command ---------------------------------------------


def test_the_notebook_writes_the_stage_cells_up_to_a_stage_as_one_module(lab, tmp_path):
    cells = {stage: (SOLUTIONS / f"stage_{stage.lower()}.py").read_text() for stage in "ABCDE"}
    track = Track(lab)
    path = track.module("C", cells)
    text = path.read_text()
    assert path == lab.root / "agent_c.py" and "stage_c" in text and "stage_d" not in text
    assert text.index("# ✏️ EXERCISE stage_a") < text.index("# ✏️ EXERCISE stage_b") < text.index("# ✏️ EXERCISE stage_c")
    module = load_module(path)  # importable, and the last definition of each function wins
    last = max(n for n, line in enumerate(text.splitlines(), 1) if line.startswith("async def run_turn"))
    assert module.run_turn.__code__.co_firstlineno == last
    with pytest.raises(LookupError, match="stage B first"):
        track.module("C", {"A": cells["A"]})
    assert assemble(cells, "a").count("# ✏️ EXERCISE") == 1


def test_sophos_lab_grade_says_a_stub_is_not_graded_and_fails(tmp_path):
    stub = tmp_path / "agent.py"
    stub.write_text((SOLUTIONS / "stage_a.py").read_text().replace(
        "    graph = build_graph(", "    raise NotImplementedError\n    graph = build_graph("))
    env = child_environment({"SOPHOS_LAB_HOME": str(tmp_path / "home")})
    done = sophos_lab_cli("grade", str(stub), "--stage", "A", "--lanes", "1", env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "your agent: not graded, the uninterrupted run failed (turn 1): NotImplementedError" in done.stdout
