# ✏️ EXERCISE forget_everywhere: remove `fact` from the memory file and from every conversation that holds it
# forget_everywhere(lab, fact) is the delete the kit does not have. Make it:
# - leave no line of the memory server's file (lab.env()["MEMORY_FILE_PATH"]) that holds `fact`:
#   delete the file, or write it again without those lines;
# - delete, with AgentService.delete_conversation, every conversation of lab.conversations()
#   whose messages (the "content" of lab.messages(c)) hold `fact`;
# - leave every other conversation as it is.
# AgentService is asynchronous: `service = lab.service()`, `await service.delete_conversation(c)`,
# and `await service.aclose()` when done. The check awaits your function (a plain def works too).


async def forget_everywhere(lab, fact: str) -> None:
    """Remove `fact` from long-term memory and from every conversation whose history holds it."""
    # Long-term memory: the file again, without the lines that hold the fact (a line is a whole
    # entity, or a relation). The memory server reads the file on every operation: no restart.
    memory = Path(lab.env()["MEMORY_FILE_PATH"])
    if memory.exists():
        kept = [line for line in memory.read_text(encoding="utf-8").splitlines() if fact not in line]
        memory.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    # Every conversation with a copy in its history (what the user typed, a tool's result, an
    # answer): deleted whole, with its checkpoints, writes and rows, one transaction each.
    service = lab.service()
    try:
        for conversation in lab.conversations()["id"]:
            if any(fact in (content or "") for content in lab.messages(conversation)["content"]):
                await service.delete_conversation(conversation)
    finally:
        await service.aclose()
