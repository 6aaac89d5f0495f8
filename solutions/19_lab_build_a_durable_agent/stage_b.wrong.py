# ✏️ EXERCISE stage_b: checkpoints: a saver, durability "sync", a resume by astream(None)
def thread(conversation):
    return {"configurable": {"thread_id": conversation}}


async def run_graph(world, conversation, input):
    """Run the conversation's graph, checkpointed by `world.saver()` with durability "sync", from
    `input`; None carries on from the latest checkpoint (when there is one)."""
    async with world.saver() as saver:
        if input is None and await saver.aget_tuple(thread(conversation)) is None:
            return
        graph = build_graph(world.model(), await load_tools(world), saver)
        async for _ in graph.astream(input, thread(conversation), durability="exit"):
            pass  # wrong: "exit" saves the run's checkpoints only when the run ends


async def run_turn(world, conversation, message):
    await run_graph(world, conversation, {"messages": [("user", message)]})


async def resume(world, conversation):
    await run_graph(world, conversation, None)


async def thread_messages(world, conversation):
    """The thread's messages, as its latest checkpoint holds them."""
    async with world.saver() as saver:
        state = await build_graph(world.model(), [], saver).aget_state(thread(conversation))
    return state.values.get("messages", [])


async def read(world, conversation):
    return {"messages": await thread_messages(world, conversation), "runs": []}
