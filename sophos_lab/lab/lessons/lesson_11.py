"""Lesson 11 · The approval gate: what the lesson uses besides the lesson itself.

The agent's process (`start_child`), small views of what it streamed (`entered`, `tool_results`,
`refused`) and of the lab's records (`mcp_config`, `payments`), and the picture of each gate's life
(`gate_picture`, with `now` for the moment of a kill). Read any of them with `??`, e.g.
`lesson.entered??`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..pictures.gates import gate_lives

if TYPE_CHECKING:
    import pandas as pd

    from ..children import LabKernel, LabWorker
    from ..harness import Lab
    from ..pictures import Picture


def start_child(lab: Lab, kind: str) -> LabKernel | LabWorker:
    """A fresh agent process (a "restart"): a child Jupyter kernel when `kind` is `"kernel"`, else
    a plain subprocess (`"worker"`). Either way a process of its own, which the lesson can kill."""
    return lab.kernel() if kind == "kernel" else lab.worker()


def mcp_config(lab: Lab) -> dict[str, Any]:
    """The lab's copy of `mcp.json`, as it is now."""
    return json.loads((lab.config_dir / "mcp.json").read_text())


def entered(child: LabKernel | LabWorker) -> list[tuple[int, str]]:
    """`(step, node)` of every step the child's latest run entered, in order (its `enter` traces)."""
    return [(e["data"]["step"], e["data"]["node"]) for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def tool_results(child: LabKernel | LabWorker) -> list[dict[str, Any]]:
    """The tool results of the child's latest run, as its `result` traces carry them: each a dict
    with `name`, `tool_call_id`, `result` (the text the model reads) and `status`."""
    return [e["data"]["data"] for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "result"]


def payments(lab: Lab) -> pd.DataFrame:
    """The ledger's payments (read-only), without their time: id, payee, amount and key."""
    return lab.ledger()[["id", "to_account", "amount", "idempotency_key"]]


def now() -> str:
    """The time now, as the runtime writes its times (ISO 8601, UTC): for a moment the lesson
    itself sees, such as a kill, which no table records."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def gate_picture(lab: Lab, names: Mapping[str, str] | None = None, marks: Mapping[str, str] | None = None) -> Picture:
    """Each gate of the lab (`lab.gates()`) from the moment it was made to its decision, and the
    ledger's payments, in the order they happened; `marks` adds moments the lesson saw (label ->
    ISO time, e.g. `{"kill -9": killed_at}`), `names` a name per conversation id."""
    return gate_lives(lab.gates(), {"ledger": lab.ledger()}, names=names, marks=marks)


def refused(answer: dict[str, Any], code: str) -> bool:
    """Whether a command's final event is a refusal (`rejected`) with the error code `code`."""
    return (answer["event"], answer["data"].get("code")) == ("rejected", code)
