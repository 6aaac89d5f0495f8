# ✏️ EXERCISE stage_c: runs and recovery: a runs table written before the graph and after it
def runs_table(world):
    db = world.connect()
    db.execute("CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, conversation TEXT NOT NULL,"
               " status TEXT NOT NULL)")
    return db


async def tracked(world, conversation, input):
    """One run: its row first (`running`, committed), then `run_graph`, then its outcome."""
    db = runs_table(world)
    run = db.execute("INSERT INTO runs (conversation, status) VALUES (?, 'running')", (conversation,)).lastrowid
    db.commit()  # the run is on disk before the graph starts
    status = "failed"
    try:
        await run_graph(world, conversation, input)
        status = "completed"
    finally:
        db.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run))
        db.commit()
        db.close()


async def run_turn(world, conversation, message):
    await tracked(world, conversation, {"messages": [("user", message)]})


async def recover(world):
    """A new process: every run still `running` belonged to a process that died."""
    db = runs_table(world)
    db.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
    db.commit()
    db.close()


async def resume(world, conversation):
    await tracked(world, conversation, None)  # a resume is a new run


async def read(world, conversation):
    """The thread's messages, and the statuses of the conversation's runs, oldest first."""
    db = runs_table(world)
    runs = [status for (status,) in db.execute(
        "SELECT status FROM runs WHERE conversation = ? ORDER BY id", (conversation,))]
    db.close()
    return {"messages": await thread_messages(world, conversation), "runs": runs}
