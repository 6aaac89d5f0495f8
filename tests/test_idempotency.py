"""Side effects across a crash: a payment committed by a tool server, then a kill before the
tools step's checkpoint, then a resume (lesson 07).

The kill is placed by a barrier: the ledger server reports each committed payment to the lab's
web fixture server, which holds that report (`lab.web.hold`) until the worker is killed. MCP
clients start stdio servers in a session of their own, so the kill does not reach the ledger
server: released after the kill, it answers into a closed pipe and exits.
"""

import json

import pytest
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from sophos_lab.standins import ledger_server
from sophos_lab.lab.harness import KIT_ROOT, Lab
from sophos_lab.runtime.tools import IDEMPOTENCY_KEY, model_facing, with_idempotency_key

pytestmark = pytest.mark.both_backends

COMMITTED = "/ledger-committed"


@pytest.fixture
def lab(request, lab_home, database):
    with Lab.setup(f"tests-idempotency-{request.node.name}", quiet=True, fork_servers=True, extra_servers=("ledger",),
                   database_url=database.get("DATABASE_URL")) as lab:
        lab.without_approvals()  # a crash mid-payment with no gate before it (the gate: test_approval)
        yield lab


def test_only_a_lab_that_asks_for_the_ledger_offers_it(lab, lab_home):
    kit = json.loads((KIT_ROOT / "config" / "mcp.json").read_text())
    assert sorted(kit) == ["fetch", "memory"]  # `make lab` and the other lessons: no payment tools
    assert sorted(json.loads((lab.config_dir / "mcp.json").read_text())) == ["fetch", "ledger", "memory"]
    assert not (lab.config_dir / "extras").exists()  # nothing else in the lab's config can name it
    lab.edit_mcp_config(lambda config: config.pop("fetch"))
    lab.restore_mcp_config()  # the kit's file back, with this lab's extra server
    assert sorted(json.loads((lab.config_dir / "mcp.json").read_text())) == ["fetch", "ledger", "memory"]
    with Lab.setup("tests-idempotency-plain", quiet=True) as plain:
        assert sorted(json.loads((plain.config_dir / "mcp.json").read_text())) == ["fetch", "memory"]
        plain.add_mcp_server("ledger")
        assert json.loads((plain.config_dir / "mcp.json").read_text())["ledger"]["args"] == ["-m", "sophos_lab.standins.ledger_server"]
    with pytest.raises(ValueError, match="no extra MCP server 'bank'"):
        Lab.setup("tests-idempotency-unknown", quiet=True, extra_servers=("bank",))


def crash_after_commit(lab, message):
    """Chat `message`, kill the worker once the payment is committed; (conversation, tool call)."""
    lab.web.hold(COMMITTED)
    with lab.worker() as child:
        child.chat(message)
        conversation = child.conversation()
        call = child.wait_for("trace", event="call")["data"]["data"]
        assert lab.web.wait_held() == COMMITTED  # committed in the ledger; no checkpoint yet
        assert child.kill() == -9
    assert lab.web.release() == 1
    return conversation, call


def resume(lab, conversation):
    """Resume in a fresh worker (its first database open relabels the killed run)."""
    with lab.worker() as child:
        child.resume(conversation)
        final = child.wait_final()
        results = [e["data"]["data"] for e in child.events() if e["event"] == "trace" and e["data"]["event"] == "result"]
    assert (final["event"], final["data"]["status"]) == ("end", "completed"), final
    return results


def test_a_tools_step_replayed_after_the_commit_pays_twice(lab):
    conversation, call = crash_after_commit(lab, "Pay 30 to alice.")
    assert call["name"] == "ledger__record_payment"
    assert lab.state(conversation)["last_checkpoint"]["next"] == ["tools"]
    assert len(lab.ledger()) == 1  # the effect outlived the process that caused it

    [result] = resume(lab, conversation)
    ledger = lab.ledger()
    assert ledger["to_account"].tolist() == ["alice", "alice"], ledger
    assert ledger["idempotency_key"].tolist() == [None, None]
    assert result["result"] == "payment 2: 30 to alice"  # the agent sees only the second payment
    assert lab.web.hits(COMMITTED) == 2
    assert list(lab.peek_runs(conversation)["status"]) == ["interrupted", "completed"]


def test_a_runtime_key_makes_the_replayed_payment_a_no_op(lab):
    conversation, call = crash_after_commit(lab, "Pay 30 to bob, exactly once.")
    assert call["name"] == "ledger__record_payment_once"
    assert IDEMPOTENCY_KEY not in call["arguments"]  # the model did not supply it
    shown = lab.model.chat_requests("pay-once")[0]["tool_args"]
    assert shown["ledger__record_payment_once"] == ["to", "amount"]  # nor was it shown the argument
    assert lab.state(conversation)["last_checkpoint"]["next"] == ["tools"]

    [result] = resume(lab, conversation)
    ledger = lab.ledger()
    assert ledger["to_account"].tolist() == ["bob"], ledger
    assert ledger["idempotency_key"].tolist() == [f"{conversation}:{call['tool_call_id']}"]
    assert result["result"] == "payment 1: 30 to bob"  # the first call's result, returned again
    assert lab.web.hits(COMMITTED) == 2  # the server was called twice; it paid once
    assert list(lab.peek_runs(conversation)["status"]) == ["interrupted", "completed"]


def keyed_tool():
    schema = {
        "type": "object",
        "properties": {"to": {"type": "string"}, "amount": {"type": "integer"}, IDEMPOTENCY_KEY: {"type": "string"}},
        "required": ["to", "amount", IDEMPOTENCY_KEY],
    }
    return StructuredTool(name="ledger__pay", description="Pay.", args_schema=schema, func=lambda **kw: kw)


def test_the_model_is_not_shown_the_idempotency_key_and_the_runtime_fills_it():
    tool = keyed_tool()
    [shown] = model_facing([tool])
    parameters = convert_to_openai_tool(shown)["function"]["parameters"]
    assert set(parameters["properties"]) == {"to", "amount"}
    assert parameters["required"] == ["to", "amount"]
    assert IDEMPOTENCY_KEY in tool.args_schema["properties"]  # the tool itself still takes it

    call = {"name": "ledger__pay", "args": {"to": "bob", "amount": 30, IDEMPOTENCY_KEY: "made-up"}, "id": "call-1"}
    keyed = with_idempotency_key(call, tool, "thread-1")
    assert keyed["args"][IDEMPOTENCY_KEY] == "thread-1:call-1"  # the model's guess is overwritten
    assert IDEMPOTENCY_KEY not in with_idempotency_key({**call, "args": {}}, model_facing([tool])[0], "t")["args"]


def test_the_ledger_pays_once_per_key_and_refuses_a_key_reused_for_another_payment(tmp_path, monkeypatch):
    monkeypatch.setenv("LEDGER_PATH", str(tmp_path / "ledger.db"))
    monkeypatch.delenv("LEDGER_NOTIFY_URL", raising=False)
    assert ledger_server.record_payment("alice", 30) == "payment 1: 30 to alice"
    assert ledger_server.record_payment("alice", 30) == "payment 2: 30 to alice"
    assert ledger_server.record_payment_once("bob", 30, "t:c") == "payment 3: 30 to bob"
    assert ledger_server.record_payment_once("bob", 30, "t:c") == "payment 3: 30 to bob"
    with pytest.raises(ValueError, match="used for another payment"):
        ledger_server.record_payment_once("bob", 31, "t:c")
    assert ledger_server.record_payment_once("bob", 30, "t:d") == "payment 4: 30 to bob"
