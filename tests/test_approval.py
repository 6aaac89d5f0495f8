"""Approval gates: a tool call that needs a person's approval waits for it, durably.

The ledger's payment tools need approval (`config/extras/ledger.json`). A run that meets one
stops before any call of its turn runs, is recorded `waiting` with the calls it holds, and goes on
only with a decision: approved calls run, rejected ones give the model a tool result that says
so. The decision is written before the graph resumes, so no kill can make anyone decide twice,
and no second approval can pay twice.
"""

import json

import pytest

from sophos_lab.lab.harness import Lab
from sophos_lab.runtime.errors import (
    APPROVAL_MISMATCH, BAD_REQUEST, CONFIG_ERROR, GATE_DECIDED, NO_APPROVAL_PENDING, RUN_NOT_ACTIVE, RUN_WAITING,
    SophosError,
)
from sophos_lab.runtime.service import AgentService
from sophos_lab.runtime.tools import load_mcp_config

# The PostgreSQL side runs in `make test-matrix`: make test tries PostgreSQL through test_postgres
# (a gate decided by two processes among them), test_workers, test_ownership, test_users and the
# PostgreSQL crash matrices (see docs/testing.md).
pytestmark = pytest.mark.both_backends(postgres_full_matrix=True)

PAY = "Please pay 30 to alice."
PAY_ONCE = "Pay 30 to alice, exactly once."
COMMITTED = "/ledger-committed"


@pytest.fixture
def ledger_lab(request, lab_home, database):
    with Lab.setup(f"tests-approval-{request.node.name}", quiet=True, fork_servers=True, extra_servers=("ledger",),
                   database_url=database.get("DATABASE_URL")) as lab:
        yield lab


@pytest.fixture
def open_agent(ledger_lab):
    """`async with open_agent() as agent:` a fresh `AgentService` (a new process's view) on the lab."""
    import contextlib

    @contextlib.asynccontextmanager
    async def open_():
        agent = AgentService(ledger_lab.settings(), log_dir=ledger_lab.root / "logs")
        try:
            yield agent
        finally:
            await agent.aclose()

    return open_


async def until_gate(agent, message=PAY):
    run = await agent.chat(message)
    events = [event async for event in run.events()]
    return run.conversation, events


def payments(lab) -> list[tuple[str, int]]:
    return [tuple(row) for row in lab.ledger()[["to_account", "amount"]].itertuples(index=False)]


def tool_results(detail) -> list[dict]:
    return [m for m in detail.messages if m["role"] == "tool"]


# --- the gate ------------------------------------------------------------------------------


async def test_a_call_that_needs_approval_waits_with_nothing_run_and_says_so(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, events = await until_gate(agent)
        gate = await agent.pending_approval(conversation)
        detail = await agent.get_conversation(conversation)
        [run] = await agent.list_runs(conversation)

    final, waiting = events[-1], events[-2]
    [call] = gate.calls
    assert (call["name"], call["args"]) == ("ledger__record_payment", {"to": "alice", "amount": 30})
    assert final.event == "end" and final.data["status"] == "waiting"
    assert final.data["approval"] == {"gate": gate.id, "calls": gate.calls}
    assert (waiting.data["event"], waiting.data["node"], waiting.data["data"]["calls"]) == ("waiting", "tools", gate.calls)
    assert (run.status, run.error_code, detail.conversation.status) == ("waiting", None, "waiting")
    assert (detail.next, detail.resumable, detail.approval) == (("tools",), False, gate)
    assert payments(ledger_lab) == []  # nothing ran before the decision
    assert not gate.decided


async def test_an_approval_runs_the_call_once_and_the_same_approval_again_is_a_no_op(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
        [call] = (await agent.pending_approval(conversation)).calls
        approved = await agent.approve(conversation, {call["id"]: "approve"})
        final = await approved.wait()
        again = await agent.approve(conversation, {call["id"]: "approve"})
        all_again = await agent.approve(conversation)  # "approve every call": the same decision
        with pytest.raises(SophosError) as changed:
            await agent.reject(conversation, "I changed my mind")
        [gate] = await agent.store.gates(conversation)
        runs = await agent.list_runs(conversation)

    assert final.event == "end" and final.data["status"] == "completed"
    assert payments(ledger_lab) == [("alice", 30)]
    assert (again.replayed, again.id, (await again.wait()).data["status"]) == (True, approved.id, "completed")
    assert (all_again.replayed, all_again.id) == (True, approved.id)
    assert changed.value.code == GATE_DECIDED and '"approve"' in changed.value.message
    assert (gate.decisions, gate.decided_run_id) == ({call["id"]: {"decision": "approve"}}, approved.id)
    assert [r.status for r in runs] == ["waiting", "completed"]


async def test_a_rejection_gives_the_model_the_reason_as_the_tool_result_and_runs_nothing(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
        final = await (await agent.reject(conversation, "Alice was paid yesterday.")).wait()
        detail = await agent.get_conversation(conversation)

    [result] = tool_results(detail)
    assert final.data["status"] == "completed"
    assert payments(ledger_lab) == []
    assert "rejected" in result["content"] and "Alice was paid yesterday." in result["content"]
    # The model read the rejection as a failed call (the scripted model by its text, "Not run: ...").
    assert detail.messages[-1]["role"] == "assistant"
    assert detail.messages[-1]["content"] == f"The payment to alice failed: {result['content']}"


async def test_decisions_that_do_not_fit_the_gate_are_refused_and_decide_nothing(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
        [call] = (await agent.pending_approval(conversation)).calls
        refusals = {}
        for label, decisions in {
            "unknown id": {call["id"]: "approve", "call-that-is-not-there": "approve"},
            "only another id": {"call-that-is-not-there": "approve"},
            "changed args": {call["id"]: {"decision": "approve", "args": {"to": "mallory", "amount": 30}}},
            "not a decision": {call["id"]: "maybe"},
            "empty": {},
            "not a mapping": ["approve"],
            "unknown key": {call["id"]: {"decision": "approve", "amount": 1}},
            "bad reason": {call["id"]: {"decision": "reject", "reason": 42}},
        }.items():
            with pytest.raises(SophosError) as refused:
                await agent.approve(conversation, decisions)
            refusals[label] = refused.value.code
        same_args = await agent.approve(conversation, {call["id"]: {"decision": "approve", "args": call["args"]}})
        await same_args.wait()

    assert refusals == {
        "unknown id": APPROVAL_MISMATCH, "only another id": APPROVAL_MISMATCH, "changed args": APPROVAL_MISMATCH,
        "not a decision": BAD_REQUEST, "empty": BAD_REQUEST, "not a mapping": BAD_REQUEST,
        "unknown key": BAD_REQUEST, "bad reason": BAD_REQUEST,
    }
    assert payments(ledger_lab) == [("alice", 30)]  # the refusals decided nothing; the fitting one paid


async def test_resume_and_new_messages_are_refused_while_waiting_and_approval_without_a_gate(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
        refused = {}
        for label, attempt in {
            "resume": lambda: agent.resume(conversation),
            "new message": lambda: agent.chat("Never mind.", conversation),
            "cancel": lambda: agent.cancel(conversation),
        }.items():
            with pytest.raises(SophosError) as error:
                await attempt()
            refused[label] = (error.value.code, error.value.message)
        plain = await agent.ask("Hello there")
        with pytest.raises(SophosError) as nothing_waits:
            await agent.approve(plain.data["conversation"])
        runs = await agent.list_runs(conversation)

    assert refused["resume"][0] == refused["new message"][0] == RUN_WAITING
    assert "approve" in refused["resume"][1] and "ledger__record_payment" in refused["resume"][1]
    assert refused["cancel"][0] == RUN_NOT_ACTIVE
    assert nothing_waits.value.code == NO_APPROVAL_PENDING
    assert [r.status for r in runs] == ["waiting"]  # the refusals wrote nothing


async def test_a_rejected_call_stays_rejected_when_the_rule_is_dropped_while_it_waits(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
    ledger_lab.without_approvals()  # the configuration changes while the gate waits
    async with open_agent() as agent:
        final = await (await agent.reject(conversation, "Do not pay alice.")).wait()
        detail = await agent.get_conversation(conversation)

    [result] = tool_results(detail)
    assert final.data["status"] == "completed"
    assert payments(ledger_lab) == []  # the decision holds, not the rule of the moment
    assert "Do not pay alice." in result["content"]


async def test_a_retried_approval_answers_for_its_own_gate_while_a_later_one_waits(ledger_lab, open_agent):
    async with open_agent() as agent:
        conversation, _ = await until_gate(agent)
        first = await agent.pending_approval(conversation)
        approved = await agent.approve(conversation, gate=first.id)
        await approved.wait()
        second_run = await agent.chat("Now please pay 30 to alice.", conversation)
        await second_run.wait()
        second = await agent.pending_approval(conversation)
        by_gate = await agent.approve(conversation, gate=first.id)  # the retry of the first approval
        by_calls = await agent.approve(conversation, {first.calls[0]["id"]: "approve"})
        with pytest.raises(SophosError) as changed:
            await agent.reject(conversation, gate=first.id)
        still_waiting = await agent.pending_approval(conversation)

    assert second is not None and second.id != first.id
    assert (by_gate.replayed, by_gate.id) == (by_calls.replayed, by_calls.id) == (True, approved.id)
    assert changed.value.code == GATE_DECIDED
    assert still_waiting == second  # nobody decided the later gate
    assert payments(ledger_lab) == [("alice", 30)]


def test_approval_rules_come_from_mcp_json_per_server_or_per_tool(tmp_path):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({
        "bank": {"command": "bank", "approval": True},
        "memory": {"command": "mem", "approval": ["delete_entities"]},
        "fetch": {"command": "fetch"},
    }))
    servers = {server.name: server for server in load_mcp_config(config, {})}
    assert servers["bank"].needs_approval("anything")
    assert servers["memory"].needs_approval("delete_entities") and not servers["memory"].needs_approval("read_graph")
    assert not servers["fetch"].needs_approval("fetch")
    for bad in ("yes", ["delete_entities", 3], [""], {"tools": []}):
        config.write_text(json.dumps({"memory": {"command": "mem", "approval": bad}}))
        with pytest.raises(SophosError) as error:
            load_mcp_config(config, {})
        assert error.value.code == CONFIG_ERROR and "approval" in error.value.message


# --- across processes and kills ------------------------------------------------------------


def test_the_gate_survives_kill_9_and_an_approval_in_a_new_process_finishes_the_run(ledger_lab):
    """The engine's two-minute durability test: pause at a gate, kill the process outright,
    start a new one, approve; the run finishes and the payment is made exactly once."""
    with ledger_lab.worker() as child:
        child.chat(PAY)
        conversation = child.conversation()
        waiting = child.wait_final()
        assert child.kill() == -9
    with ledger_lab.worker() as child:
        child.conversations()  # the new process opens the file: recovery runs, and leaves it alone
        status_after_restart = ledger_lab.runs()["status"].tolist()
        paid_before = payments(ledger_lab)
        gate_before = ledger_lab.gates(conversation)
        resumable_while_waiting = ledger_lab.state(conversation)["resumable"]
        child.approve(conversation)
        approved = child.wait_final()
        child.approve(conversation)
        again = child.wait_final()
        gate_after = ledger_lab.gates()

    [call] = waiting["data"]["approval"]["calls"]
    assert waiting["data"]["status"] == "waiting"
    assert (status_after_restart, paid_before, resumable_while_waiting) == (["waiting"], [], False)
    assert gate_before[["gate", "run_id", "call_id", "tool", "args", "decision", "decided_run_id"]].to_dict("records") == [{
        "gate": waiting["data"]["approval"]["gate"], "run_id": waiting["data"]["run"], "call_id": call["id"],
        "tool": "ledger__record_payment", "args": {"to": "alice", "amount": 30}, "decision": None,
        "decided_run_id": None}]
    assert approved["event"] == "end" and approved["data"]["status"] == "completed"
    assert again["data"]["run"] == approved["data"]["run"]
    assert gate_after[["call_id", "decision", "reason", "decided_run_id"]].to_dict("records") == [{
        "call_id": call["id"], "decision": "approve", "reason": None, "decided_run_id": approved["data"]["run"]}]
    assert payments(ledger_lab) == [("alice", 30)]


def test_a_kill_after_the_decision_is_recorded_asks_nobody_again(ledger_lab):
    """Killed once the decision is written and before the graph ran anything with it (the
    worker stops itself right after the approval run's `started`): the new process's resume
    carries the recorded decision on, without a gate, and pays once."""
    with ledger_lab.worker() as child:
        child.chat(PAY)
        conversation = child.conversation()
        child.wait_final()
    with ledger_lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT="1") as child:
        child.approve(conversation)
        child.wait_for("started")
        paid_at_kill = payments(ledger_lab)
        assert child.kill() == -9
    with ledger_lab.worker() as child:
        child.conversations()
        statuses = ledger_lab.runs()["status"].tolist()
        child.approve(conversation)  # a repeat: answers with the run the decision started
        repeat = child.wait_final()
        child.chat("Never mind the payment.", conversation)  # would leave the held call unanswered
        new_message = child.wait_final()
        child.resume(conversation)
        resumed = child.wait_final()
        entered = [e["data"]["event"] for e in child.events() if e["event"] == "trace"]

    assert paid_at_kill == []
    assert statuses == ["waiting", "interrupted"]
    assert repeat["data"]["status"] == "interrupted"
    assert (new_message["event"], new_message["data"]["code"]) == ("rejected", RUN_WAITING)
    assert resumed["data"]["status"] == "completed" and "waiting" not in entered
    assert payments(ledger_lab) == [("alice", 30)]


@pytest.mark.parametrize(("stop_after", "last"), [(4, {"node": "agent", "event": "leave"}),
                                                 (5, {"node": "tools", "event": "enter"})],
                         ids=["agent-left", "tools-entered"])
def test_a_kill_between_the_call_and_its_gate_refuses_a_new_message_as_the_gate_would(ledger_lab, stop_after, last):
    """Killed after the model asked for the payment and before the tools step saved its gate: no
    gate is recorded, yet the thread holds a call that needs approval. A new message is refused
    as it is at a recorded gate (it would drop the call unasked); the resume reaches the gate,
    and the approval pays once."""
    with ledger_lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT=str(stop_after)) as child:
        child.chat(PAY)
        conversation = child.conversation()
        child.wait_for("trace", **last)
        assert child.kill() == -9
    assert ledger_lab.gates(conversation).empty
    with ledger_lab.worker() as child:
        child.chat("Never mind the payment.", conversation)
        new_message = child.wait_final()
        child.resume(conversation)
        resumed = child.wait_final()
        child.approve(conversation)
        approved = child.wait_final()

    assert (new_message["event"], new_message["data"]["code"]) == ("rejected", RUN_WAITING)
    assert "ledger__record_payment" in new_message["data"]["message"]
    assert resumed["data"]["status"] == "waiting"
    assert approved["data"]["status"] == "completed"
    assert payments(ledger_lab) == [("alice", 30)]
    assert ledger_lab.runs()["status"].tolist() == ["interrupted", "waiting", "completed"]


def test_a_kill_mid_payment_after_approval_resumes_with_the_decision_and_the_keyed_tool_pays_once(ledger_lab):
    """Approved, the payment committed on the ledger's side, killed before the tools step is
    saved: the resume runs the step again with the recorded decision (no new gate), and the
    keyed tool's idempotency key makes the ledger take the repeat as the same payment."""
    with ledger_lab.worker() as child:
        child.chat(PAY_ONCE)
        conversation = child.conversation()
        child.wait_final()
        ledger_lab.web.hold(COMMITTED)
        child.approve(conversation)
        assert ledger_lab.web.wait_held() == COMMITTED
        assert child.kill() == -9
    assert ledger_lab.web.release() == 1
    with ledger_lab.worker() as child:
        child.resume(conversation)
        resumed = child.wait_final()
        traces = [e["data"]["event"] for e in child.events() if e["event"] == "trace"]

    assert resumed["data"]["status"] == "completed" and "waiting" not in traces
    assert payments(ledger_lab) == [("alice", 30)]
    assert ledger_lab.runs()["status"].tolist() == ["waiting", "interrupted", "completed"]


def test_two_processes_approving_the_same_gate_make_one_run(ledger_lab):
    """Both write the decision in the transaction that starts their run: one wins; the other
    answers with the winner's run (its outcome, or that it runs in the other process)."""
    with ledger_lab.worker() as first:
        first.chat(PAY)
        conversation = first.conversation()
        first.wait_final()
        with ledger_lab.worker() as second:
            first.approve(conversation)
            second.approve(conversation)
            answers = [first.wait_final(), second.wait_final()]

    runs = ledger_lab.runs()
    [approval_run] = runs[runs["status"] != "waiting"]["id"].tolist()
    assert runs["status"].tolist() == ["waiting", "completed"], answers
    for answer in answers:
        assert (answer["data"].get("run") == approval_run
                or answer["data"].get("code") == "SESSION_IN_PROGRESS"), answers
    assert payments(ledger_lab) == [("alice", 30)]


def test_the_http_api_shows_the_gate_and_takes_approvals_that_name_it(ledger_lab):
    """`sophos-lab serve`: the conversation's `approval`, `POST .../approve` (a repeat is the first
    run, marked replayed), a changed decision refused, a bad body refused, nothing written."""
    with ledger_lab.server() as server:
        server.chat(PAY)
        waiting = server.wait_final()
        conversation = waiting["data"]["conversation"]
        shown = server.request("GET", f"/api/conversations/{conversation}").json()
        gate = shown["approval"]["gate"]
        resumed = server.request("POST", "/api/chat", json={"resume": True, "conversation": conversation})
        bad = server.request("POST", f"/api/conversations/{conversation}/approve", json={"decision": "yes"})
        mismatch = server.request("POST", f"/api/conversations/{conversation}/approve",
                                  json={"decisions": {"not-a-call": "approve"}})
        paid_before = payments(ledger_lab)
        server.approve(conversation, gate=gate)
        approved = server.wait_final()
        again = server.request("POST", f"/api/conversations/{conversation}/approve", json={"gate": gate})
        changed = server.request("POST", f"/api/conversations/{conversation}/reject", json={"gate": gate})
        after = server.request("GET", f"/api/conversations/{conversation}").json()

    assert (waiting["data"]["status"], shown["resumable"], shown["next"]) == ("waiting", False, ["tools"])
    assert shown["approval"]["calls"][0]["args"] == {"to": "alice", "amount": 30}
    assert (resumed.status_code, resumed.json()["error"]["code"]) == (409, RUN_WAITING)
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, BAD_REQUEST)
    assert (mismatch.status_code, mismatch.json()["error"]["code"]) == (422, APPROVAL_MISMATCH)
    assert paid_before == []
    assert approved["data"]["status"] == "completed"
    assert (again.status_code, again.json()["run"], again.headers.get("idempotent-replayed")) == (
        200, approved["data"]["run"], "true")
    assert (changed.status_code, changed.json()["error"]["code"]) == (409, GATE_DECIDED)
    assert after["approval"] is None and payments(ledger_lab) == [("alice", 30)]
