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
    # The memory is the memory server's file: delete it, as section 7 did.
    Path(lab.env()["MEMORY_FILE_PATH"]).unlink(missing_ok=True)
