"""What every child of the lab shares: its event log (a barrier on what it emitted), the
commands a lab sends it, and the errors waiting on it raises (see `children`)."""

from __future__ import annotations

import abc
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..runtime.errors import SophosError
from .forkserver import child_environment

EXITED = "process-exited"
KERNEL_ERROR = "kernel-error"
CELL_DONE = "executed"   # the lab's own mark that a kernel cell finished; not one of the run's events
FATAL_EVENTS = (EXITED, KERNEL_ERROR)


FINAL_EVENTS = ("end", "chat-error", "rejected")


class ChildFailed(RuntimeError):
    """The child died, or its cell raised, while we were waiting for one of its events."""


class AnotherPath(RuntimeError):
    """The model kept answering without the tool call a lesson's kill point needs."""


class EventLog:
    """The events a child has emitted, with a way to wait for one."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.mark = 0
        """Where `wait_for` starts looking by default: the first event of the latest command."""
        self._changed = threading.Condition()

    def append(self, event: dict[str, Any]) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def append_once(self, event: dict[str, Any]) -> None:
        """Append `event` unless one of the same name is already there (e.g. the exit)."""
        with self._changed:
            if not any(e["event"] == event["event"] for e in self.events):
                self.events.append(event)
                self._changed.notify_all()

    def start_command(self) -> None:
        with self._changed:
            self.mark = len(self.events)

    def wait_for(
        self, names: str | tuple[str, ...], timeout: float = 60.0, since: int | None = None, **fields: Any
    ) -> dict[str, Any]:
        """The first event named `names` (one or several) whose data has `fields`, from `since`."""
        names = (names,) if isinstance(names, str) else names
        return self.wait_until(lambda event: _matches(event, names, fields), f"{names} {fields or ''}",
                               timeout, since, expected=names)

    def wait_until(
        self, match: Callable[[dict[str, Any]], bool], description: str, timeout: float = 60.0,
        since: int | None = None, expected: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """The first event that `match`es, from `since`; a child's death on the way raises."""
        deadline = time.monotonic() + timeout
        with self._changed:
            index = self.mark if since is None else since
            while True:
                for event in self.events[index:]:
                    if match(event):
                        return event
                    if event["event"] in FATAL_EVENTS and event["event"] not in expected:
                        raise ChildFailed(f"{event['event']} ({event['data']}) before {description}")
                index = len(self.events)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {description} event within {timeout} s")
                self._changed.wait(remaining)

    def of_command(self) -> list[dict[str, Any]]:
        """The events since the latest command started."""
        with self._changed:
            return list(self.events[self.mark:])

    def events_since(self, since: int, timeout: float = 0.0) -> list[dict[str, Any]]:
        """The events from index `since` on; when there are none yet, waits up to `timeout` s
        for one (an empty list if none came)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.events) > since, timeout)
            return self.events[since:]


def _matches(event: dict[str, Any], names: tuple[str, ...], fields: Mapping[str, Any]) -> bool:
    if event["event"] not in names:
        return False
    data = event.get("data")
    return all(isinstance(data, dict) and data.get(key) == value for key, value in fields.items())


class _Child(abc.ABC):
    """What both backends share: the event log and the commands."""

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path) -> None:
        self.env = child_environment(env)
        self.cwd = Path(cwd)
        self.log_path = Path(log_path)
        self.log = EventLog()

    def chat(self, message: str, conversation: str | None = None) -> None:
        """Start a chat turn in the child; returns at once (see `wait_for`)."""
        self.log.start_command()
        self._send("chat", message=message, conversation=conversation)

    def resume(self, conversation: str) -> None:
        """Start a resume of `conversation` in the child; returns at once."""
        self.log.start_command()
        self._send("resume", conversation=conversation)

    def approve(self, conversation: str, decisions: dict[str, Any] | None = None, gate: str | None = None) -> None:
        """Decide on `conversation`'s gate (`gate`, else the one waiting now; `decisions` None:
        approve every held call); returns at once, and the run that carries the decision on is
        the latest command's (`wait_final`)."""
        self.log.start_command()
        self._send("approve", conversation=conversation, decisions=decisions, gate=gate)

    def reject(self, conversation: str, reason: str | None = None, gate: str | None = None) -> None:
        """Reject every call held at `conversation`'s gate, with `reason` for the model."""
        self.log.start_command()
        self._send("reject", conversation=conversation, reason=reason, gate=gate)

    def cancel(self, conversation: str, timeout: float = 60.0) -> dict[str, Any]:
        """Cancel `conversation`'s active run in the child; the run's final event once it is
        recorded (`chat-error` `CANCELLED`, or `end` if the run finished first). A refusal
        (`RUN_NOT_ACTIVE`, ...) is returned as the `rejected` event. The latest command's events
        (`wait_final`) are still the run's."""
        since = len(self.log.events)
        self._send("cancel", conversation=conversation)
        answer = self.log.wait_until(
            lambda e: e["event"] == "cancel-answer" or _matches(e, ("rejected",), {"cmd": "cancel"}),
            "cancel answer", timeout, since)
        return answer["data"]["final"] if answer["event"] == "cancel-answer" else answer

    def conversations(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """List conversations in the child; its first database access runs recovery there. A
        refusal (`rejected`, e.g. `STORAGE_FULL`) is raised here as the `SophosError` it was."""
        self.log.start_command()
        self._send("conversations")
        answer = self.log.wait_until(
            lambda e: e["event"] == "conversations" or _matches(e, ("rejected",), {"cmd": "conversations"}),
            "conversations", timeout)
        if answer["event"] == "rejected":
            raise SophosError(answer["data"]["code"], answer["data"]["message"])
        return answer["data"]["conversations"]

    def wait_for(self, names: str | tuple[str, ...], timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Block until the latest command's stream shows the event (e.g. `"trace", event="result"`)."""
        return self.log.wait_for(names, timeout=timeout, **fields)

    def wait_final(self, timeout: float = 120.0) -> dict[str, Any]:
        """The latest command's final event: `end`, `chat-error` or `rejected`."""
        return self.log.wait_for(FINAL_EVENTS, timeout=timeout)

    def wait_for_tool_call(self, timeout: float = 60.0) -> dict[str, Any] | None:
        """The latest command's first tool `call` trace, or None if its run ended without one
        (a real model may answer in words instead)."""
        event = self.log.wait_until(
            lambda e: e["event"] in FINAL_EVENTS or _matches(e, ("trace",), {"event": "call"}),
            "tool call or final", timeout)
        return event if event["event"] == "trace" else None

    def chat_until_tool_call(self, message: str, tool: str | None = None, attempts: int = 3) -> str:
        """Send `message` in a new conversation until the model answers it with a tool call (of
        `tool`, when given); the conversation. A kill point that needs the tool step (a held
        page, the answer after the tool result) can then be waited for.

        The scripted model always calls the tool. A real model may answer in words instead: then
        this says so, asks again in a new conversation, and after `attempts` tries raises
        `AnotherPath` saying what to try.
        """
        for attempt in range(1, attempts + 1):
            self.chat(message)
            conversation = self.conversation()
            call = self.wait_for_tool_call()
            if call is not None:
                name = call["data"]["data"]["name"]
                if tool is None or name == tool:
                    return conversation
                raise AnotherPath(
                    f"The model called {name} instead of {tool}, so this lesson's kill point will "
                    f"not come. Run the cell again, or make the message name {tool} more plainly.")
            final = self.wait_final()
            answer = " ".join("".join(e["data"] for e in self.events() if e["event"] == "token").split())
            completed = final["event"] == "end" and final["data"].get("status", "completed") == "completed"
            outcome = (f"model answered without calling {tool or 'a tool'}" if completed else
                       f"run ended with {final['event']} {final['data'].get('code') or final['data'].get('status')}")
            print(f"Attempt {attempt} of {attempts}: the {outcome}"
                  + (f": “{answer[:160]}{'…' if len(answer) > 160 else ''}”" if answer else "."))
            if not completed:
                break
            if attempt < attempts:
                print("A real model may do that. Asking again, in a new conversation.")
        raise AnotherPath(
            f"The model did not call {tool or 'a tool'}, so this lesson cannot reach its kill point. "
            "Try a model that supports tools (`ollama show <model>` lists `tools` under "
            "Capabilities; qwen3 and llama3.1 do), or make the message name the tool more plainly.")

    def conversation(self) -> str:
        """The conversation of the latest command (from its `started` event); a refused command
        raises `ChildFailed` with the refusal's code at once."""
        event = self.wait_for(("started", "rejected"), timeout=60)
        if event["event"] == "rejected":
            raise ChildFailed(f"the child refused {event['data'].get('cmd', 'the command')}: "
                              f"{event['data'].get('code')} ({event['data'].get('message')})")
        return event["data"]["conversation"]

    def events(self) -> list[dict[str, Any]]:
        """The latest command's events, in the order they reached the lab. A kernel child's
        cell-finished marks are left out: when one lands before or after the final event is a
        race of two channels, and it is no event of the run."""
        return [e for e in self.log.of_command() if e["event"] != CELL_DONE]

    def freeze(self) -> None:
        """SIGSTOP: the child stops where it is, alive but unable to renew its lease."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: a frozen child carries on from where it stopped."""
        os.kill(self.pid, signal.SIGCONT)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _send(self, cmd: str, **args: Any) -> None:
        """Hand one command (`chat`, `resume`, `conversations`, `cancel`) to the child."""
