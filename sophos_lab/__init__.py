"""sophos_lab: a Jupyter teaching lab for durable LLM agents.

The runtime (`AgentService`) is a LangGraph agent checkpointed to one SQLite file; the lab
(`Lab`) runs it in a child you can kill and shows what happened as DataFrames.
"""

from importlib import import_module

# Imported on first use, so a child process that needs only the runtime does not load pandas.
_EXPORTS = {
    "ActiveRun": "runtime.active",
    "AgentService": "runtime.service",
    "ConversationDetail": "runtime.reading",
    "Lab": "lab.harness",
    "Settings": "runtime.settings",
    "SophosError": "runtime.errors",
    "check": "lab.checks",
    "check_exercise": "lab.exercises",
    "dead_port_url": "lab.harness",
    "reveal": "lab.predictions",
    "score": "lab.predictions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sophos_lab' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
