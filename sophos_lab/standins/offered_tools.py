"""Which tool a script's tool call names, among the tools a chat request offers.

The kit's runtime names an MCP tool `<server>__<tool>` (`fetch__fetch`); LangChain's MCP client
names it `<tool>` (`fetch`), or `<server>_<tool>` with its `tool_name_prefix`. A script names the
kit's form, and the scripted model calls the tool by the name the request offers it under, so a
learner's agent built from LangChain's parts (the grading labs) gets the same calls as the kit.

A script's call may also name alternatives, `"name": ["ledger__record_payment_once",
"ledger__record_payment"]`: the first that the request offers with the call's arguments filling
its required parameters. A tool that asks the model for an `idempotency_key` is not called
without one: the keyed payment is called where the agent fills the key in itself (the kit's
runtime hides that argument from the model), the plain one where it does not.

Nothing offered (or no name that fits) leaves the first name as the script wrote it.
"""

from __future__ import annotations

from typing import Any


def offered(tools: list[dict] | None) -> dict[str, list[str]]:
    """The tools of a chat request (Ollama's `tools`), by name: their required parameters."""
    found: dict[str, list[str]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            required = (function.get("parameters") or {}).get("required") or []
            found[function["name"]] = [name for name in required if isinstance(name, str)]
    return found


def spellings(name: str) -> list[str]:
    """`server__tool` as the kit names it, as LangChain's client with a prefix, and bare."""
    server, sep, tool = name.partition("__")
    return [name, f"{server}_{tool}", tool] if sep else [name]


def offered_call(call: dict[str, Any], tools: dict[str, list[str]]) -> dict[str, Any]:
    """`call` (`{"name": str or [str, ...], "arguments": {...}}`) named as the request offers it."""
    names = call["name"] if isinstance(call["name"], list) else [call["name"]]
    arguments = call.get("arguments", {})
    for name in names:
        for spelling in spellings(name):
            if spelling in tools and set(tools[spelling]) <= set(arguments):
                return {**call, "name": spelling}
    return {**call, "name": names[0]}
