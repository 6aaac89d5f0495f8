# ✏️ EXERCISE stage_d: the accepted message is durable: stored with its run, entered again by the resume
import json
import uuid

from langchain_core.messages import HumanMessage


def runs_table(world):
    db = world.connect()
    db.execute("CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, conversation TEXT NOT NULL,"
               " status TEXT NOT NULL, input TEXT)")
    return db


async def tracked(world, conversation, message=None):
    """One run: its row and its message (`input`: the message's id and text), in one commit; then
    the graph with that message (None: carry on from the latest checkpoint); then its outcome."""
    stored = None if message is None else json.dumps({"id": message.id, "text": message.content})
    db = runs_table(world)
    run = db.execute("INSERT INTO runs (conversation, status, input) VALUES (?, 'running', ?)",
                     (conversation, stored)).lastrowid
    db.commit()  # the message is on disk, with its run, before the graph starts
    status = "failed"
    try:
        await run_graph(world, conversation, None if message is None else {"messages": [message]})
        status = "completed"
    finally:
        db.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run))
        db.commit()
        db.close()


async def run_turn(world, conversation, message):
    await tracked(world, conversation, HumanMessage(message, id=str(uuid.uuid4())))


async def resume(world, conversation):
    """The latest accepted message, entered again with its id if it never reached the thread;
    else carry on."""
    db = runs_table(world)
    row = db.execute("SELECT input FROM runs WHERE conversation = ? AND input IS NOT NULL"
                     " ORDER BY id DESC LIMIT 1", (conversation,)).fetchone()
    db.close()
    accepted = json.loads(row[0]) if row else None
    in_thread = {message.id for message in await thread_messages(world, conversation)}
    if accepted and accepted["id"] not in in_thread:
        await tracked(world, conversation, HumanMessage(accepted["text"], id=accepted["id"]))
    else:
        await tracked(world, conversation)
