"""Commit, kill, replay: a paying tool across a crash of the agent, as a sequence picture.

Drawn from what a lesson observed (lessons 07 and 15): the thread's checkpoints (step, `next`, the
run that wrote each), the payments the tool server committed with the key stored with each, the
killed agent's exit code, the steps the resume entered, the key each call to the tool carried and
the receipt the resumed agent got. Three lanes, time flowing down:

- the agent process: run 1 (killed) and run 2 (the resume, in a new process);
- the tool server (the ledger, the bank): each call it got, and what it committed or answered;
- the checkpoint store: the checkpoints each run wrote, and the one the kill left missing.

`replay_picture(replays)` draws one panel per experiment (lesson 07 shows the payment without a
key beside the one with the runtime's key) and returns a `Picture` whose elements name, in words
that do not depend on timing or ids, the commit, the kill, the missing checkpoint, the replay and
what the key made of it ("key: the replay sent the same key: one payment").
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from . import Picture, picture

TITLE = "commit, kill, replay"

NUMBERS = {0: "no", 1: "one", 2: "two", 3: "three", 4: "four"}


@dataclass
class Checkpoint:
    """One checkpoint of the thread: its step, its `next`, and the run that wrote it (1, 2, ...)."""

    step: int
    next: tuple[str, ...]
    run: int


@dataclass
class Payment:
    """One payment the tool server committed for the request."""

    receipt: str
    """How the tool names it, e.g. "payment 1"."""
    key: str | None
    """The idempotency key stored with it (None: the payment has no key)."""
    run: int
    """The run whose call committed it: 1, the killed run; 2, the resume."""


@dataclass
class Replay:
    """One experiment: a payment, a kill, a resume."""

    label: str
    """The panel's heading, e.g. "record_payment, no key"."""
    server: str
    """The tool server's name, e.g. "ledger"."""
    checkpoints: list[Checkpoint]
    payments: list[Payment]
    """The payments made for this request, oldest first."""
    agent_exit: int | None
    """The killed agent's exit code (-9: SIGKILL); None: it was not killed."""
    replayed: list[tuple[int, str]]
    """(step, node) of each step the resume entered."""
    keys: list[str | None] = field(default_factory=list)
    """The key each call to the tool carried, in order (None: no key)."""
    replay_result: str | None = None
    """What the replayed call answered the resumed agent (None: nothing, or an error)."""


def _count(n: int) -> str:
    return NUMBERS.get(n, str(n))


def _plural(n: int, word: str) -> str:
    return f"{_count(n)} {word}{'' if n == 1 else 's'}"


def _last_before_kill(replay: Replay) -> Checkpoint | None:
    first = [c for c in replay.checkpoints if c.run == 1]
    return first[-1] if first else None


def _missing_step(replay: Replay) -> int | None:
    """The step the killed run entered and never checkpointed (the one its `next` names)."""
    last = _last_before_kill(replay)
    return None if last is None or not last.next else last.step + 1


def key_outcome(replay: Replay) -> str:
    """What the key made of the replay, in words: the same key or none, and how many payments."""
    paid = len(replay.payments)
    payments = _plural(paid, "payment")
    if len(replay.keys) < 2:
        return f"key: no replayed call reached the {replay.server}: {payments}"
    first, again = replay.keys[0], replay.keys[-1]
    if first is None and again is None:
        return f"key: none was sent, so the replay paid again: {payments}"
    if first != again:
        return f"key: the replay sent another key: {payments}"
    if paid == 1:
        return "key: the replay sent the same key: one payment"
    if paid == 0:
        return "key: the replay sent the same key: no payment at all"
    keyed = [p for p in replay.payments if p.run == 1 and p.key == first]
    why = "" if keyed else " (the first payment was on disk without its key)"
    return f"key: the replay sent the same key, yet paid again{why}: {payments}"


def elements(replays: list[Replay]) -> list[str]:
    """What the pictures show, named in words that depend on what happened, not on timing or ids."""
    servers = list(dict.fromkeys(r.server for r in replays))
    found = [f"lanes: the agent process, the {' / '.join(servers)} (tool server), the checkpoint store"]
    for replay in replays:
        prefix = f"{replay.label}: " if len(replays) > 1 else ""
        last = _last_before_kill(replay)
        if last is not None:
            found.append(f"{prefix}checkpoint: run 1 saved step {last.step}, next = {list(last.next)}")
        first = [p for p in replay.payments if p.run == 1]
        if first:
            keyed = "with its key" if first[0].key is not None else "without a key"
            found.append(f"{prefix}commit: the first call's payment, {keyed}")
        else:
            found.append(f"{prefix}commit: none by the first call")
        if replay.agent_exit == -9:
            found.append(f"{prefix}kill: SIGKILL of the agent process before the receipt came back")
        elif replay.agent_exit is not None:
            found.append(f"{prefix}kill: the agent process ended with exit code {replay.agent_exit}")
        missing = _missing_step(replay)
        if missing is not None and not any(c.step == missing and c.run == 1 for c in replay.checkpoints):
            found.append(f"{prefix}missing checkpoint: step {missing} ({', '.join(last.next)}) of the killed run")
        nodes = [node for _, node in replay.replayed]
        if nodes[:1] == ["tools"]:
            found.append(f"{prefix}replay: run 2 ran the tools step again, then {' and '.join(nodes[1:]) or 'nothing'}")
        elif nodes:
            found.append(f"{prefix}replay: none, run 2 started at the {nodes[0]} step")
        found.append(prefix + key_outcome(replay))
    return found


def _short_key(key: str | None, names: dict[str, str]) -> str:
    if key is None:
        return "no key"
    return f"key {names.setdefault(key, 'K' + str(len(names) + 1))}"


def _beats(replay: Replay) -> list[tuple[str, object]]:
    """The rows of one panel, top to bottom: (kind, what), from the experiment's records."""
    names: dict[str, str] = {}
    beats: list[tuple[str, object]] = [("run", "run 1")]
    before = [c for c in replay.checkpoints if c.run == 1]
    if before:
        steps = ", ".join(str(c.step) for c in before)
        beats.append(("save", f"checkpoints {steps}; next = {', '.join(before[-1].next) or '-'}"))
    first_key = replay.keys[0] if replay.keys else None
    beats.append(("call", f"call ({_short_key(first_key, names)})"))
    for payment in (p for p in replay.payments if p.run == 1):
        beats.append(("commit", f"commit {payment.receipt} ({_short_key(payment.key, names)})"))
    if not any(p.run == 1 for p in replay.payments):
        beats.append(("note", "nothing committed"))
    if replay.agent_exit is not None:
        beats.append(("kill", "SIGKILL" if replay.agent_exit == -9 else f"exit {replay.agent_exit}"))
    missing = _missing_step(replay)
    if missing is not None:
        beats.append(("missing", f"no checkpoint of step {missing}"))
    beats.append(("run", "run 2: resume (new process)"))
    if len(replay.keys) > 1:
        beats.append(("call", f"replay: same call ({_short_key(replay.keys[-1], names)})"))
        later = [p for p in replay.payments if p.run != 1]
        for payment in later:
            beats.append(("commit", f"commit {payment.receipt} ({_short_key(payment.key, names)})"))
        if not later:
            beats.append(("note", "key found: no new payment"))
        beats.append(("answer", replay.replay_result or "no receipt"))
    after = [c for c in replay.checkpoints if c.run != 1]
    if after:
        beats.append(("save", f"checkpoints {', '.join(str(c.step) for c in after)}"))
    return beats


def _panel(axes, replay: Replay) -> None:
    beats = _beats(replay)
    x = {"agent": 0.0, "server": 1.0, "store": 2.0}
    bottom = len(beats) + 0.5
    for name, lane in zip(("agent\nprocess", f"{replay.server}\n(tool server)", "checkpoint\nstore"), x.values()):
        axes.plot([lane, lane], [0.4, bottom], color="lightgrey", linewidth=1.5, zorder=0)
        axes.text(lane, 0.0, name, ha="center", va="center", fontsize=8, weight="bold")
    arrow = {"arrowstyle": "->", "linewidth": 1.0}
    for row, (kind, text) in enumerate(beats, start=1):
        if kind == "run":
            axes.text(x["agent"], row, str(text), ha="center", va="center", fontsize=7.5,
                      bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "black"})
        elif kind == "save":
            axes.annotate("", (x["store"], row), xytext=(x["agent"], row), arrowprops={**arrow, "color": "tab:green"})
            axes.text(x["store"], row, str(text), ha="center", va="center", fontsize=7, color="tab:green",
                      bbox={"facecolor": "white", "edgecolor": "tab:green"})
        elif kind == "call":
            axes.annotate("", (x["server"], row), xytext=(x["agent"], row), arrowprops={**arrow, "color": "black"})
            axes.text((x["agent"] + x["server"]) / 2, row - 0.18, str(text), ha="center", va="bottom", fontsize=7)
        elif kind == "commit":
            axes.text(x["server"], row, str(text), ha="center", va="center", fontsize=7, color="tab:blue",
                      bbox={"facecolor": "white", "edgecolor": "tab:blue"})
        elif kind == "note":
            axes.text(x["server"], row, str(text), ha="center", va="center", fontsize=7, color="dimgrey",
                      bbox={"facecolor": "white", "edgecolor": "none"})
        elif kind == "kill":
            axes.scatter([x["agent"]], [row], marker="X", s=110, color="tab:red", zorder=3)
            axes.text(x["agent"] - 0.12, row, f"kill ({text})", ha="right", va="center", fontsize=7.5, color="tab:red")
            axes.annotate("", (x["agent"] + 0.08, row), xytext=(x["server"], row),
                          arrowprops={**arrow, "color": "tab:red", "linestyle": "--"})
            axes.text((x["agent"] + x["server"]) / 2, row - 0.18, "receipt lost", ha="center", va="bottom",
                      fontsize=7, color="tab:red")
        elif kind == "missing":
            axes.text(x["store"], row, str(text), ha="center", va="center", fontsize=7, color="tab:red",
                      bbox={"facecolor": "white", "edgecolor": "tab:red", "linestyle": "--"})
        elif kind == "answer":
            axes.annotate("", (x["agent"], row), xytext=(x["server"], row), arrowprops={**arrow, "color": "black"})
            axes.text((x["agent"] + x["server"]) / 2, row - 0.18, f"receipt: {text}", ha="center", va="bottom",
                      fontsize=7)
    axes.text(1.0, bottom + 0.45, textwrap.fill(key_outcome(replay), 60), ha="center", va="top", fontsize=8,
              style="italic")
    axes.set_xlim(-0.75, 2.75)
    axes.set_ylim(bottom + 1.4, -0.6)
    axes.axis("off")
    axes.set_title(replay.label, fontsize=9)


def replay_picture(replays: list[Replay]) -> Picture:
    """One sequence panel per experiment of `replays`, side by side, as a `Picture`."""
    import matplotlib.pyplot as plt

    rows = max(len(_beats(replay)) for replay in replays)
    figure, panes = plt.subplots(1, len(replays), figsize=(5.2 * len(replays), 1.2 + 0.42 * rows), squeeze=False)
    for axes, replay in zip(panes[0], replays):
        _panel(axes, replay)
    figure.suptitle(TITLE, fontsize=11)
    figure.tight_layout()
    return picture(figure, TITLE, elements(replays))
