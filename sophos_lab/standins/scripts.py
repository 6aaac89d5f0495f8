"""The scripted model's scripts: turns matched to the conversation so far (see `scripted_model`,
which serves them over Ollama's API), loaded from `data/scripts/`, and how a failed tool result
reads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
TOOL_ERROR = re.compile(r"^\s*(?:Error\b|Failed to\b|The sites? robots\.txt\b|Not run:)")
"""How a failed tool result reads (the request has no status to tell): see the module docstring."""


@dataclass(frozen=True)
class Turn:
    """One scripted reply."""

    text: str = ""
    thinking: str = ""
    tool_calls: tuple[dict, ...] = ()
    token_delay: float = 0.0
    pause: str | None = None
    error: dict | None = None
    on_tool_error: Turn | None = None
    """Sent instead of this turn when a tool result it answers is an error (`TOOL_ERROR`)."""

    @classmethod
    def from_dict(cls, data: dict) -> Turn:
        """Build a turn from its JSON form, rejecting unknown keys."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown turn keys: {sorted(unknown)}")
        calls = tuple(
            {"name": c["name"], "arguments": c.get("arguments", {})}
            for c in data.get("tool_calls", ())
        )
        branch = data.get("on_tool_error")
        if branch is not None:
            if not isinstance(branch, dict) or "on_tool_error" in branch:
                raise ValueError('"on_tool_error" must be a turn object (without an "on_tool_error" of its own)')
            branch = cls.from_dict(branch)
        return cls(**{**data, "tool_calls": calls, "on_tool_error": branch})

    def fill(self, values: dict[str, str]) -> Turn:
        """This turn with ``{name}`` placeholders replaced from ``values``."""
        return replace(
            self,
            text=_fill(self.text, values),
            thinking=_fill(self.thinking, values),
            tool_calls=_fill(self.tool_calls, values),
            error=_fill(self.error, values),
            on_tool_error=self.on_tool_error and self.on_tool_error.fill(values),
        )


@dataclass(frozen=True)
class Script:
    """A named conversation: a regex that selects it and its turns."""

    name: str
    turns: tuple[Turn, ...]
    match: re.Pattern[str] | None = None
    description: str = ""
    example: str = ""
    """A message this script answers, for the fallback's list of what to try ("" for a lesson's own)."""
    repeat_last: bool = False
    tool_error_match: re.Pattern[str] = TOOL_ERROR

    @classmethod
    def from_dict(cls, data: dict, default_name: str) -> Script:
        """Build a script from its JSON form."""
        if not isinstance(data.get("match"), str):
            raise ValueError('a script needs a "match" regex string')
        if not data.get("turns"):
            raise ValueError('a script needs a non-empty "turns" list')
        return cls(
            name=data.get("name", default_name),
            description=data.get("description", ""),
            example=data.get("example", ""),
            match=re.compile(data["match"]),
            turns=tuple(Turn.from_dict(t) for t in data["turns"]),
            repeat_last=bool(data.get("repeat_last", False)),
            tool_error_match=re.compile(data["tool_error_match"]) if "tool_error_match" in data else TOOL_ERROR,
        )


@dataclass(frozen=True)
class Choice:
    """The reply picked for one request: which script, which turn, and the turn."""

    script: str
    index: int
    turn: Turn
    branch: str | None = None
    """`"on_tool_error"` when the turn's error branch was sent, else None."""


PLAIN = Script(
    name="plain",
    description="Fallback when no script matches: a short plain answer.",
    turns=(
        Turn(
            text="This is the scripted model. I have no script for that message, "
            "so here is a plain answer."
        ),
    ),
)
NO_MORE_TURNS = Turn(text="(scripted: no more turns)")


def _fallback(scripts: list[Script]) -> Script:
    """PLAIN, with the messages the loaded scripts answer, so that a learner who typed something
    else learns what to try (the scripted model is not a language model)."""
    examples = [script.example for script in scripts if script.example]
    if not examples:
        return PLAIN
    tries = "\n".join(f"- {example}" for example in examples)
    return Script(name=PLAIN.name, description=PLAIN.description,
                  turns=(Turn(text=f"{PLAIN.turns[0].text} I answer messages like these:\n{tries}"),))


def load_scripts(directory: str | Path) -> list[Script]:
    """Every ``*.json`` script in ``directory``, sorted by file name."""
    scripts = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            scripts.append(Script.from_dict(data, default_name=path.stem))
        except (ValueError, KeyError, TypeError, re.error) as err:
            raise ValueError(f"bad script {path.name}: {err}") from err
    return scripts


def choose_turn(scripts: list[Script], messages: list[dict]) -> Choice:
    """Pick the script and turn that answer ``messages`` (an Ollama history)."""
    last_user = max(
        (i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1
    )
    prompt = _text(messages[last_user].get("content")) if last_user >= 0 else ""
    index = sum(1 for m in messages[last_user + 1 :] if m.get("role") == "assistant")
    for script in scripts:
        found = script.match.search(prompt) if script.match else None
        if found:
            values = found.groupdict(default="")
            break
    else:
        script, values = _fallback(scripts), {}
    if index < len(script.turns):
        turn = script.turns[index]
    elif script.repeat_last:
        turn = script.turns[-1]
    else:
        turn = NO_MORE_TURNS
    if turn.on_tool_error is not None:
        failed = failed_tool_result(messages, script.tool_error_match)
        if failed is not None:
            return Choice(script.name, index, turn.on_tool_error.fill({**values, "tool_error": failed}), "on_tool_error")
    return Choice(script.name, index, turn.fill(values))


def failed_tool_result(messages: list[dict], pattern: re.Pattern[str] = TOOL_ERROR) -> str | None:
    """The text of the first failed tool result since the last assistant message, else None.

    Those results answer the assistant's last tool calls: the ones this reply follows."""
    last_assistant = max(
        (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1
    )
    for message in messages[last_assistant + 1 :]:
        if message.get("role") == "tool":
            text = _text(message.get("content"))
            if pattern.search(text):
                return text.strip()
    return None


def tokenize(text: str) -> list[str]:
    """Split text into word-sized stream chunks that join back to ``text``."""
    return re.findall(r"\S+\s*|\s+", text)


def _text(content: Any) -> str:
    """Message content as plain text (multi-part content keeps its text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _fill(value: Any, values: dict[str, str]) -> Any:
    """Replace ``{name}`` in every string inside ``value``; other braces stay."""
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: values.get(m[1], m[0]), value)
    if isinstance(value, dict):
        return {k: _fill(v, values) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, values) for v in value)
    return value
