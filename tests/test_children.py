"""The children's small interface where it meets a refusal or a cancel: the refused command says
so at once, and a cancel ends the run the same way in a kernel child as in a worker."""

import uuid

import pytest

from sophos_lab.lab.children import ChildFailed
from sophos_lab.lab.harness import Lab
from sophos_lab.runtime.errors import CANCELLED, NOT_FOUND, RUN_NOT_ACTIVE


@pytest.fixture(scope="module")
def lab(lab_home):
    with Lab.setup("tests-children", quiet=True, fork_servers=True) as lab:
        yield lab


@pytest.mark.parametrize("kind", ["worker", "server"])
def test_the_conversation_of_a_refused_chat_raises_with_the_code(lab, kind):
    with getattr(lab, kind)() as child:
        child.chat("hello", str(uuid.uuid4()))  # no such conversation

        with pytest.raises(ChildFailed, match="NOT_FOUND"):
            child.conversation()
        assert child.wait_final()["event"] == "rejected"


# --- cancel: the same outcome in a kernel child as in a worker ----------------------------


def entered(child) -> list[tuple[int, str]]:
    return [(e["data"]["step"], e["data"]["node"]) for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


@pytest.mark.parametrize("kind", ["kernel", "worker"])
def test_a_cancel_mid_answer_is_recorded_keeps_the_tool_result_and_the_resume_completes(lab, kind):
    """The kernel's shell is busy with the chat's cell while the model's answer is held: the
    cancel still reaches the run, and everything after it is what a worker child shows."""
    page = "wal.html"
    fetches_before = lab.fetches(page)
    lab.model.arm("summary")
    with getattr(lab, kind)() as child:
        child.chat(f"Fetch {lab.page(page)} and summarize it in 12 detailed bullet points.")
        conversation = child.conversation()
        lab.model.wait_paused()  # after the tool result, half-way through the summary
        child.wait_for("token")
        final = child.cancel(conversation)
        lab.model.release()  # the client has hung up: nothing reads the rest
        own = child.wait_final()
        run = lab.runs(conversation).iloc[0]
        cancelled = lab.state(conversation)

        child.resume(conversation)
        resumed = child.wait_final()
        resume_entered = entered(child)

    assert (final["event"], final["data"]["code"], final["data"]["message"]) == (
        "chat-error", CANCELLED, "Cancelled by user")
    assert own == final  # the run's own stream ends with the same event
    assert (run.status, run.error_code, run.error_message) == ("cancelled", CANCELLED, "Cancelled by user")
    assert run.cancel_requested_at is not None
    # The fetch was saved; the half-streamed answer was not.
    assert cancelled["last_checkpoint"]["next"] == ["agent"]
    assert (cancelled["roles"], cancelled["resumable"]) == (["user", "assistant", "tool"], True)
    assert (resumed["event"], resumed["data"]["status"]) == ("end", "completed")
    assert resume_entered == [(3, "agent")]
    assert lab.fetches(page) - fetches_before == 1
    assert [s for s, _ in lab.state(conversation)["runs"]] == ["cancelled", "completed"]


@pytest.mark.parametrize("kind", ["kernel", "worker"])
def test_a_cancel_with_nothing_running_is_refused_and_changes_nothing(lab, kind):
    with getattr(lab, kind)() as child:
        child.chat("Hello there")
        conversation = child.conversation()
        done = child.wait_final()
        idle = child.cancel(conversation)
        unknown = child.cancel(str(uuid.uuid4()))
        alive = child.is_alive()
        run = lab.runs(conversation).iloc[0]

    assert done["event"] == "end"
    assert (idle["event"], idle["data"]["code"], idle["data"]["cmd"]) == ("rejected", RUN_NOT_ACTIVE, "cancel")
    assert (unknown["event"], unknown["data"]["code"]) == ("rejected", NOT_FOUND)
    assert alive  # a refused cancel leaves the child as it was
    assert (run.status, run.cancel_requested_at) == ("completed", None)


# --- a kernel child: forked from the fork server, and a real process ---------------------


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_kernel_child_is_its_own_process_and_a_sigkill_ends_it(lab, forked):
    """Forked (`sophos_lab/lab/kernels.py`) or, with SOPHOS_LAB_FORKSERVER=0, a fresh interpreter:
    either way a kernel of its own pid and session that runs the agent, and SIGKILL to that pid."""
    import os

    import psutil

    child = lab.kernel(**({} if forked else {"SOPHOS_LAB_FORKSERVER": "0"}))
    try:
        proc = psutil.Process(child.pid)
        parent = proc.parent()
        assert ("sophos_lab.lab.forkserver" in parent.cmdline()) is forked, parent.cmdline()
        assert (parent.pid == os.getpid()) is not forked
        assert os.getsid(child.pid) == child.pid  # a session of its own: its group is signalled, not ours
        child.chat("hello")
        assert child.wait_final()["data"]["status"] == "completed"
    finally:
        code = child.kill()
    assert code == -9
    try:
        assert proc.status() == psutil.STATUS_ZOMBIE  # dead, its status read, not yet reaped
    except psutil.NoSuchProcess:
        pass  # reaped


def test_a_kernel_child_that_stops_itself_after_a_write_is_waited_on_like_a_worker(lab):
    """`SOPHOS_LAB_STOP_AFTER_WRITE=1`: the kernel stops at its first commit; `wait_stopped`
    returns then (its `write-stop` event may still be on its way), and the run row is on disk."""
    child = lab.kernel(SOPHOS_LAB_STOP_AFTER_WRITE="1")
    try:
        child.chat("hello")
        child.wait_stopped(timeout=60)
        assert lab.peek_runs()["status"].tolist()[-1] == "running"
    finally:
        child.kill()


@pytest.mark.parametrize("kind", ["kernel", "worker"])
def test_a_child_shut_down_has_sent_every_event_it_wrote_before_it_exits(lab, kind):
    """A kernel child writes its events on ZeroMQ: exiting at once dropped the ones still queued
    (about half the time, its last one). Several shutdowns in a row, each with its `exited`."""
    last_events = []
    for _ in range(6):
        child = getattr(lab, kind)()
        child.conversations()
        child.wait_for("conversations")
        code = child.shutdown()
        assert code == 0, (code, child.log.events, child.log_path.read_text()[-3000:])
        last_events.append(child.log.events[-2]["event"])  # the one before the lab's own exit mark

    assert last_events == ["exited"] * 6, last_events
