"""The grader: your agent module, an uninterrupted run, then one killed run per point, judged.

    result = grade("agent_e.py", stage="E")
    result.table        # point × lost, re-run, extra payment, wrong status, stuck
    result.picture()    # the points along the run's timeline, coloured by verdict
    print(result.summary)   # "your agent: 41 of 41 points recover, 0 lost, 0 re-run, 1 payment"

The scenario is fixed: three turns in one conversation, a fetch and summarise (the fetch tool,
then the model's summary), a follow-up (the model alone), a payment (the ledger's tool). The
reference run plays it in one process and lists the kill points (`points`). For each point:

1. a fresh world (your database and the ledger emptied); the point armed (a request held at the
   model or the web server, or your N-th write made the process stop itself);
2. a process plays the scenario until the point is reached (a barrier: the held request, the
   stop), and is killed there with SIGKILL;
3. a new process calls `recover`, `read`, `resume`, `read`, plays the turns left and `read`s;
4. the verdicts, against the reference run:
   - **lost**: a message of the scenario missing from the conversation at the end;
   - **re-run**: a model request for a step that had been answered before the kill, or a page
     fetched again that had been fetched before it (the one step in flight may run again);
   - **extra payment**: the ledger holds more payments than after the reference run;
   - **wrong status**: after `recover` the killed run is not `interrupted` (or `completed`, when
     it had recorded its end), after `resume` the latest run is not `completed` (it may stay
     `interrupted` when the killed run had done all its work and only its end was unrecorded),
     or a run is left `running`; no runs table at all is a wrong status too;
   - **stuck**: a command of the new process raised or did not end within the bound, a message
     was left without an answer, or the point was never reached (the run went another way).

With a model other than the scripted one (`OLLAMA_HOST`), the same runs and checks: what the
model writes is never graded, only what survived, what ran again and what was paid.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import driver
from .driver import Child, Lane, epoch
from .points import Point, points_of, sample
from .result import TURNS, Graded, Outcome, Reference

CONVERSATION = "conversation-1"
DEFAULT_BOUND = 30.0
"""Seconds one command (a turn, a recovery, a resume, a read) may take before it counts as stuck."""


def scenario(page_url: str) -> list[str]:
    """The three messages of the scenario (the page is the lab's own)."""
    return [f"Fetch {page_url} and summarise it in 3 bullets.",
            "Which of the 3 bullets matters most after a crash?",
            "Pay 30 to dave for the summary."]


def turn_commands(messages: list[str], first: int = 1) -> list[dict[str, Any]]:
    return [{"cmd": "turn", "turn": n, "message": messages[n - 1]} for n in range(first, len(messages) + 1)]


def answered(messages: list[dict[str, Any]], text: str) -> bool:
    """Whether the last time `text` was said, an answer without tool calls followed it (before the next user message)."""
    said = [i for i, m in enumerate(messages) if m["role"] == "user" and m["text"] == text]
    if not said:
        return False
    for message in messages[said[-1] + 1:]:
        if message["role"] == "user":
            return False
        if message["role"] == "assistant" and not message["calls"]:
            return True
    return False


def run_reference(lane: Lane, module: Path, bound: float) -> Reference:
    """Play the scenario once, uninterrupted, listing every write; the reference and its points."""
    messages = scenario(lane.page_url)
    lane.fresh_world()
    model_mark, web_mark = lane.marks()
    started = time.time()
    child = Child.start(lane, module, CONVERSATION, [*turn_commands(messages), {"cmd": "read"}],
                        SOPHOS_GRADER_TRACE_WRITES="1", SOPHOS_GRADER_BOUND=str(bound))
    ended = child.wait_end(bound * 4 + driver.BARRIER_TIMEOUT)
    if not ended:
        child.kill()
    reference = Reference(seconds=round(time.time() - started, 2))
    trouble = child.events("module-error") + child.events("failed")
    if not ended:
        reference.error = f"the uninterrupted run did not end within {bound * 4:g} s"
    elif trouble:
        first = trouble[0]
        where = f"{first.get('cmd', 'importing')} {first.get('turn', '') or ''}".strip()
        reference.error = f"the uninterrupted run failed ({where}): {first['error']}"
        reference.not_done = bool(first.get("not_done"))
    reads = [r["result"] for r in child.events("done") if r.get("cmd") == "read"]
    if reads:
        reference.messages, reference.runs = reads[-1]["messages"], reads[-1]["runs"]
    if reference.error is None:
        missing = [n for n, text in enumerate(messages, 1) if not answered(reference.messages, text)]
        if missing:
            reference.error = (f"in the uninterrupted run, turn {missing[0]} ({TURNS[missing[0] - 1]}) did not end "
                               "with the model's answer: read() should show each message followed by its answer")
    model = [{**r, "time": epoch(r["time"])} for r in lane.model_requests(model_mark) if r.get("status") == 200]
    web = [{**e, "time": epoch(e["time"])} for e in lane.web_requests(web_mark)]
    starts = [r["time"] for r in child.events("start") if r.get("cmd") == "turn"]
    reference.points = points_of(started, starts, model, web, child.events("write"), driver.PAGE, driver.NOTIFY)
    reference.model_requests = len(model)
    reference.fetches = sum(1 for e in web if e["path"] == "/" + driver.PAGE)
    reference.payments = lane.payments()
    return reference


def arm(lane: Lane, point: Point) -> dict[str, str]:
    """Set the point's trap; the environment the first process needs for it."""
    if point.trigger == "model":
        lane.lab.model.hold_request(point.n, point.hold)
    elif point.trigger == "fetch":
        lane.lab.web.hold("/" + driver.PAGE)
    elif point.trigger == "payment":
        lane.lab.web.hold(driver.NOTIFY)
    elif point.trigger == "write":
        return {"SOPHOS_GRADER_STOP_AFTER_WRITE": str(point.n)}
    return {}


def reached(lane: Lane, child: Child, point: Point) -> bool:
    """Block until the first process is at the point (held there, or stopped): a barrier."""
    if point.trigger == "write":
        return child.wait_stopped(driver.BARRIER_TIMEOUT)
    return driver.wait_held(lane, "model" if point.trigger == "model" else "web", child)


def grade_point(lane: Lane, module: Path, point: Point, reference: Reference, bound: float) -> Outcome:
    """Kill the scenario at `point`, recover and resume in a new process, and judge what is left."""
    began = time.monotonic()
    messages = scenario(lane.page_url)
    outcome = Outcome(point)
    lane.fresh_world()
    model_mark, web_mark = lane.marks()
    fetched_before = lane.lab.web.hits("/" + driver.PAGE)
    first = Child.start(lane, module, CONVERSATION, turn_commands(messages), SOPHOS_GRADER_BOUND=str(bound),
                        **arm(lane, point))
    if not reached(lane, first, point):
        first.kill()
        lane.reset()
        outcome.stuck = True
        outcome.notes.append("the point was not reached: this run went another way than the uninterrupted one")
        return outcome
    killed_at = time.time()
    below = first.kill()
    lane.lab.model.release()
    lane.lab.web.release()
    driver.wait_gone(below)
    if point.trigger == "fetch":  # the held fetch is logged once it is let go: count it in its run
        lane.lab.web.wait_logged("/" + driver.PAGE, fetched_before + 1)
    turn = max([r["turn"] for r in first.events("start") if r.get("cmd") == "turn"], default=1)
    model_split, web_split = lane.marks()
    commands = [{"cmd": "recover"}, {"cmd": "read"}, {"cmd": "resume"}, {"cmd": "read"},
                *turn_commands(messages, turn + 1), {"cmd": "read"}]
    second = Child.start(lane, module, CONVERSATION, commands, SOPHOS_GRADER_BOUND=str(bound))
    if not second.wait_end(bound * len(commands) + driver.BARRIER_TIMEOUT):
        second.kill()
        outcome.notes.append("the new process did not end")
    judge(outcome, second, messages, turn)
    count_reruns(outcome, lane, point, (model_mark, model_split), (web_mark, web_split), killed_at, reference)
    outcome.payments = lane.payments()
    outcome.extra_payment = max(0, outcome.payments - reference.payments)
    outcome.seconds = round(time.monotonic() - began, 2)
    return outcome


def judge(outcome: Outcome, second: Child, messages: list[str], turn: int) -> None:
    """Lost, wrong status and stuck, from the new process's reports."""
    for failure in second.events("module-error") + second.events("failed"):
        outcome.stuck = True
        outcome.notes.append(f"{failure.get('cmd', 'import')}: {failure['error']}")
    reads: dict[int, dict[str, Any]] = {r["index"]: r["result"] for r in second.events("done") if r.get("cmd") == "read"}
    after_recover, after_resume, final = reads.get(1), reads.get(3), reads.get(4 + len(messages) - turn)
    if final is None:
        outcome.lost, outcome.stuck = len(messages), True
        outcome.wrong_status = True
        return
    said = Counter(m["text"] for m in final["messages"] if m["role"] == "user")
    outcome.lost = sum(1 for text in messages if not said[text])
    doubled = [n for n, text in enumerate(messages, 1) if said[text] > 1]
    if doubled:
        outcome.notes.append(f"message {', '.join(map(str, doubled))} is in the thread twice")
    unanswered = [n for n, text in enumerate(messages, 1) if said[text] and not answered(final["messages"], text)]
    if unanswered:
        outcome.stuck = True
        outcome.notes.append(f"message {', '.join(map(str, unanswered))} left without an answer")
    problems = status_problems(after_recover, after_resume, final, messages[turn - 1])
    outcome.wrong_status = bool(problems)
    outcome.notes += problems


def status_problems(after_recover: dict | None, after_resume: dict | None, final: dict, killed: str) -> list[str]:
    """What is wrong with the runs' statuses after the recovery, the resume and at the end."""
    if after_recover is None or after_resume is None:
        return ["read() failed after the recovery or the resume"]
    if not after_recover["runs"]:
        return ["no runs recorded: nothing says the killed run was cut short"]
    problems = []
    last = after_recover["runs"][-1]
    done = answered(after_recover["messages"], killed)  # the killed run had done its work, unrecorded
    if "running" in after_recover["runs"]:
        problems.append("a run still `running` after recover()")
    elif last != "interrupted" and not (last == "completed" and done):
        problems.append(f"the killed run is `{last}` after recover()")
    resumed = (after_resume["runs"] or ["none"])[-1]
    if resumed != "completed" and not (done and resumed == "interrupted"):  # nothing left to resume
        problems.append(f"after resume() the latest run is `{resumed}`")
    if "running" in final["runs"]:
        problems.append("a run left `running` at the end")
    return problems


def count_reruns(outcome: Outcome, lane: Lane, point: Point, model_marks: tuple[int, int],
                 web_marks: tuple[int, int], killed_at: float, reference: Reference) -> None:
    """Model steps answered before the kill and asked again; pages fetched before it and again."""
    requests = lane.lab.model.requests()
    before = [r for r in requests[model_marks[0]:model_marks[1]] if r["path"] == "/api/chat"]
    after = [r for r in requests[model_marks[1]:] if r["path"] == "/api/chat"]
    in_flight = point.n - 1 if point.trigger == "model" else None
    answered_steps = {(r.get("prompt"), r.get("turn")) for i, r in enumerate(before)
                      if i != in_flight and r.get("status") == 200}
    asked_again = sum(1 for r in after if (r.get("prompt"), r.get("turn")) in answered_steps)
    page = "/" + driver.PAGE
    web = lane.lab.web.entries()
    fetched = [e for e in web[web_marks[0]:web_marks[1]]
               if e["path"] == page and e["status"] == 200 and epoch(e["time"]) < killed_at]
    again = sum(1 for e in web[web_marks[1]:] if e["path"] == page)
    fetched_again = again if fetched else max(0, again - reference.fetches)
    outcome.rerun = asked_again + fetched_again
    if asked_again:
        outcome.notes.append(f"{asked_again} model step(s) answered before the kill asked again")
    if fetched_again:
        outcome.notes.append(f"the page fetched again ({fetched_again}×)")


def run_matrix(lanes: list[Lane], module: Path, points: list[Point], reference: Reference,
               bound: float) -> list[Outcome]:
    """Every point, shared out over the lanes (each runs its points one after another)."""
    work: queue.Queue[tuple[int, Point]] = queue.Queue()
    for item in enumerate(points):
        work.put(item)
    outcomes: dict[int, Outcome] = {}
    errors: list[BaseException] = []

    def lane_worker(lane: Lane) -> None:
        while not errors:
            try:
                index, point = work.get_nowait()
            except queue.Empty:
                return
            try:
                outcomes[index] = grade_point(lane, module, point, reference, bound)
            except BaseException as error:  # the grader's own failure: stop, and say so
                errors.append(error)

    threads = [threading.Thread(target=lane_worker, args=(lane,), daemon=True) for lane in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [outcomes[i] for i in range(len(points))]


def open_lanes(name: str, count: int, ollama_host: str | None = None, ollama_model: str | None = None) -> list[Lane]:
    """`count` lanes, set up side by side: labs `<name>-1`, `<name>-2`, ... (`.lab/<name>-<n>/`)."""
    opened: list[Lane] = []
    failed: list[BaseException] = []

    def open_lane(number: int) -> None:
        try:
            opened.append(Lane(f"{name}-{number}", ollama_host, ollama_model))
        except BaseException as error:  # said below, once every lane has started or failed
            failed.append(error)

    setups = [threading.Thread(target=open_lane, args=(i,)) for i in range(1, max(1, count) + 1)]
    for thread in setups:
        thread.start()
    for thread in setups:
        thread.join()
    if failed:
        for lane in opened:
            lane.close()
        raise failed[0]
    return sorted(opened, key=lambda lane: lane.name)


def grade_on(lanes: list[Lane], module_path: str | Path, stage: str | None = None, *, every_point: bool = True,
             bound: float = DEFAULT_BOUND):
    """Grade the module at `module_path` in lanes that are already open (see `grade`)."""
    module = Path(module_path).resolve()
    if not module.is_file():
        raise FileNotFoundError(f"no agent module at {module}")
    began = time.monotonic()
    reference = run_reference(lanes[0], module, bound)
    chosen = reference.points if every_point else sample(reference.points)
    outcomes = [] if reference.error else run_matrix(lanes, module, chosen, reference, bound)
    return Graded(module=module, stage=stage, reference=reference, outcomes=outcomes,
                  seconds=round(time.monotonic() - began, 1), every_point=every_point, scripted=lanes[0].lab.scripted)


def grade(module_path: str | Path, stage: str | None = None, *, every_point: bool = True, lanes: int = 2,
          bound: float = DEFAULT_BOUND, name: str = "grading", ollama_host: str | None = None,
          ollama_model: str | None = None):
    """Grade the agent module at `module_path` (see `contract`): a `Graded` result.

    `stage` ("A" to "E", or "kit") names what the module should achieve: `result.check()` then
    says whether it does, point by point (see `stages`). `every_point=False` grades a sample: the
    first point of each kind and the last. `lanes` labs grade points side by side (each its own
    model, web server and ledger, in `.lab/<name>-<n>/`), set up for this grading and closed after
    it. The model is the scripted one unless `ollama_host` or `OLLAMA_HOST` names another
    Ollama-protocol server."""
    if not Path(module_path).is_file():
        raise FileNotFoundError(f"no agent module at {Path(module_path).resolve()}")
    opened = open_lanes(name, lanes, ollama_host, ollama_model)
    try:
        return grade_on(opened, module_path, stage, every_point=every_point, bound=bound)
    finally:
        for lane in opened:
            lane.close()
