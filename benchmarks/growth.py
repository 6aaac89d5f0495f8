"""How one thread grows: file size and time per turn, the kit's service against bare LangGraph.

One thread of 4 KB user turns with short answers (the scripted model, zero token delay, no MCP
servers), run side by side in the same process, turn by turn:

  kit      the kit's `AgentService` (its messages channel, run rows, events, outcome transaction)
  bare     bare LangGraph with the kit's storage choice, as `anchors.py` writes it: the same
           two-node graph, `DeltaChannel` with LangGraph's batch reducer (a snapshot every 100
           updates, the kit's cadence), `AsyncSqliteSaver`, durability "sync"
  default  the same, with LangGraph's default `add_messages` channel (`MessagesState`, the
           whole list in every checkpoint): a second, labelled anchor, what LangGraph does
           unless told otherwise; up to turn DEFAULT_TURNS only (its file grows with the square
           of the thread, 321 MB at 200 turns, and its rows make their point by turn 50)

At turns 10/25/50/100/200 it prints each file's size after a WAL checkpoint
(`PRAGMA wal_checkpoint(TRUNCATE)`: the kit's file holds its app tables too), the raw bytes of the
thread's messages (their text, UTF-8), the ratio of the two, the time per turn (the median of the
last 5 turns), the CPU time this process spent per turn (the same median: the runtime, LangGraph
and the ChatOllama client, not the model server, and not the waits that other load on the
machine adds), and how long the model request alone takes with the thread's prompt (the fastest
of 5, printed apart: it has no anchor, it is the floor under both). The whole thread runs ROUNDS
times, each on fresh files; times are the median over the rounds.

Targets for the kit: at 200 turns the file is at most 1.10x bare's, and a turn takes at most
1.10x bare's.

    python benchmarks/growth.py            # 200 turns, 3 rounds
    python benchmarks/growth.py --quick    # 50 turns, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_ollama import ChatOllama

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import DEFAULT, DELTA, PROMPT, bare_graph, sqlite_saver, thread  # noqa: E402
from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import start_scripted_model  # noqa: E402

MARKS = (10, 25, 50, 100, 200)
QUICK_MARKS = (10, 25, 50)
USER_BYTES = 4096
LAST_TURNS = 5
"""Time per turn at a mark is the median of this many turns, the mark's turn and those before it."""
ROUNDS = 3
DEFAULT_TURNS = 50
"""The default channel's thread stops here (see the module's doc)."""
BARE = ("the same thread with LangGraph alone: DeltaChannel with LangGraph's batch reducer "
        "(_messages_delta_reducer, a snapshot every 100 updates, as the kit), AsyncSqliteSaver, durability sync; "
        "rows marked 'bare = default channel' use LangGraph's default add_messages channel (MessagesState) instead")


def user_message(turn: int) -> str:
    """A 4 KB user turn that no script matches (the scripted model gives its short plain answer)."""
    head = f"Growth benchmark, turn {turn}. "
    filler = "a line of notes for the thread to keep; "
    text = head + filler * (USER_BYTES // len(filler) + 1)
    return text[:USER_BYTES]


def file_bytes(db_path: Path) -> int:
    """The database's size once its WAL is folded into it and truncated."""
    conn = sqlite3.connect(db_path)
    try:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()
    if busy:
        raise RuntimeError(f"the WAL checkpoint of {db_path} could not complete (a reader held it)")
    wal = db_path.with_name(db_path.name + "-wal")
    return db_path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


class KitThread:
    """One conversation through the kit's `AgentService`."""

    def __init__(self, url: str, folder: Path) -> None:
        config = folder / "config"
        config.mkdir()
        (config / "mcp.json").write_text("{}")
        (config / "system.md").write_text(PROMPT)
        self.db_path = folder / "kit.db"
        self.service = AgentService(Settings.from_env({
            "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_PATH": str(self.db_path),
            "CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(folder / "memory.jsonl"),
        }))
        self.conversation: str | None = None

    async def open(self) -> None:
        await self.service.open()

    async def turn(self, text: str) -> str:
        """Send one message and read every event of its run; the answer's text."""
        run = await self.service.chat(text, self.conversation)
        self.conversation = run.conversation
        tokens = [event.data async for event in run.events() if event.event == "token"]
        final = run.buffer[-1]
        if final.event != "end":
            raise RuntimeError(f"the kit's run ended with {final.event}: {final.data}")
        return "".join(tokens)

    async def close(self) -> None:
        await self.service.aclose()


class BareThread:
    """One thread of bare LangGraph (`anchors.bare_graph`) with the messages channel of `state`."""

    def __init__(self, url: str, folder: Path, state: type = DELTA, name: str = "bare") -> None:
        self.url = url
        self.state = state
        self.db_path = folder / f"{name}.db"
        self.config = thread()
        self._saver_context = sqlite_saver(str(self.db_path))

    async def open(self) -> None:
        self.graph = bare_graph(self.url, await self._saver_context.__aenter__(), self.state)

    async def turn(self, text: str) -> str:
        chunks = []
        async for message, _ in self.graph.astream(
            {"messages": [HumanMessage(text)]}, self.config, stream_mode="messages", durability="sync"
        ):
            chunks.append(message.content)
        return "".join(chunks)

    async def model_request(self) -> float:
        """Seconds of one model request with this thread's prompt, on its own (no graph, no saver)."""
        messages = (await self.graph.aget_state(self.config)).values["messages"]
        model = ChatOllama(model="scripted", base_url=self.url)
        start = time.perf_counter()
        async for _ in model.astream([SystemMessage(PROMPT), *messages]):
            pass
        return time.perf_counter() - start

    async def close(self) -> None:
        await self._saver_context.__aexit__(None, None, None)


@dataclass
class Mark:
    turn: int
    file_bytes: int
    raw_bytes: int
    ms_per_turn: float
    cpu_ms_per_turn: float
    model_ms: float
    """The model request alone with the thread's prompt (the same prompt for both threads)."""

    @property
    def ratio(self) -> float:
        return self.file_bytes / self.raw_bytes


async def grow(marks: tuple[int, ...]) -> dict[str, list[Mark]]:
    """Both threads, turn by turn up to the last mark, on fresh files; the figures at each mark."""
    server, url = start_scripted_model(ROOT / "data" / "scripts")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            threads = {"kit": KitThread(url, Path(tmp)), "bare": BareThread(url, Path(tmp)),
                       "default": BareThread(url, Path(tmp), DEFAULT, "default")}
            for thread in threads.values():
                await thread.open()
            try:
                return await _grow(threads, marks)
            finally:
                for thread in threads.values():
                    await thread.close()
    finally:
        stop_server(server)


async def _grow(threads: dict, marks: tuple[int, ...]) -> dict[str, list[Mark]]:
    raw = {name: 0 for name in threads}
    wall: dict[str, list[float]] = {name: [] for name in threads}
    cpu: dict[str, list[float]] = {name: [] for name in threads}
    found: dict[str, list[Mark]] = {name: [] for name in threads}
    for turn in range(1, marks[-1] + 1):
        text = user_message(turn)
        # Rotate who goes first, so drift on the machine hits all alike.
        names = list(threads)
        order = names[turn % len(names):] + names[:turn % len(names)]
        for name in order:
            if name == "default" and turn > DEFAULT_TURNS:
                continue
            started, started_cpu = time.perf_counter(), time.process_time()
            answer = await threads[name].turn(text)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
            raw[name] += len(text.encode()) + len(answer.encode())
        if turn in marks:
            model = min([await threads["bare"].model_request() for _ in range(LAST_TURNS)])
            for name, thread in threads.items():
                if name == "default" and turn > DEFAULT_TURNS:
                    continue
                found[name].append(Mark(
                    turn, file_bytes(thread.db_path), raw[name],
                    statistics.median(wall[name][-LAST_TURNS:]) * 1000,
                    statistics.median(cpu[name][-LAST_TURNS:]) * 1000, model * 1000,
                ))
    return found


def measure(marks: tuple[int, ...], rounds: int) -> list[dict[str, list[Mark]]]:
    """`grow` `rounds` times, each on fresh files: every round's figures."""
    return [asyncio.run(grow(marks)) for _ in range(rounds)]


def medians(runs: list[dict[str, list[Mark]]]) -> dict[str, list[Mark]]:
    """One Mark per mark and side: sizes from the last round (they are the same every time),
    times the median over the rounds."""
    return {
        name: [
            Mark(
                turn=last.turn, file_bytes=last.file_bytes, raw_bytes=last.raw_bytes,
                ms_per_turn=statistics.median(run[name][at].ms_per_turn for run in runs),
                cpu_ms_per_turn=statistics.median(run[name][at].cpu_ms_per_turn for run in runs),
                model_ms=statistics.median(run[name][at].model_ms for run in runs),
            )
            for at, last in enumerate(runs[-1][name])
        ]
        for name in runs[-1]
    }


def table_rows(runs: list[dict[str, list[Mark]]]) -> list[dict]:
    """The rows of `make bench`'s table, each with every round's figure per side (a ratio of two
    turns is taken within each round); and, printed apart, what has no anchor (the input's size,
    the model request alone)."""
    from bench import note, spread_of

    rows: list[dict] = []

    def add(measure: str, figure, unit: str, anchor: str = "bare") -> None:
        rows.append({"benchmark": "growth", "measure": measure, "unit": unit,
                     "kit_runs": [figure(run["kit"]) for run in runs],
                     "bare_runs": [figure(run[anchor]) for run in runs]})

    turns = [mark.turn for mark in runs[0]["kit"]]
    for at, turn in enumerate(turns):
        add(f"{turn} turns: database MB", lambda marks, at=at: marks[at].file_bytes / 1e6, "MB")
        add(f"{turn} turns: database / raw message bytes", lambda marks, at=at: marks[at].ratio, "x")
        add(f"{turn} turns: time per turn (last {LAST_TURNS})", lambda marks, at=at: marks[at].ms_per_turn, "ms")
        add(f"{turn} turns: CPU time per turn (this process)", lambda marks, at=at: marks[at].cpu_ms_per_turn, "ms")
    first, last = turns[0], turns[-1]
    add(f"time per turn, turn {last} / turn {first}", lambda marks: marks[-1].ms_per_turn / marks[0].ms_per_turn, "x")
    add(f"CPU time per turn, turn {last} / turn {first}",
        lambda marks: marks[-1].cpu_ms_per_turn / marks[0].cpu_ms_per_turn, "x")
    default = "bare = LangGraph's default add_messages channel, a weaker anchor"
    at = len(runs[0]["default"]) - 1  # the default channel's last mark (DEFAULT_TURNS)
    shown = turns[at]
    add(f"{shown} turns: database MB ({default})", lambda marks: marks[at].file_bytes / 1e6, "MB", "default")
    add(f"{shown} turns: time per turn (last {LAST_TURNS}) ({default})", lambda marks: marks[at].ms_per_turn, "ms",
        "default")
    add(f"time per turn, turn {shown} / turn {first} ({default})",
        lambda marks: marks[at].ms_per_turn / marks[0].ms_per_turn, "x", "default")
    raw = runs[-1]["kit"][-1].raw_bytes / 1e6
    rows.append(note("growth", f"the input: {last} turns hold {raw:.2f} MB of message text on every side "
                               "(a property of the thread, not measured)"))
    model = [run["kit"][-1].model_ms / run["kit"][0].model_ms for run in runs]
    rows.append(note("growth", f"the model request alone (no graph, no saver; the same prompt for every side), "
                               f"turn {last} / turn {first}: {spread_of(model, 'x')}; no anchor, it is the floor "
                               "under every side's time per turn"))
    return rows


def rows(quick: bool = False) -> list[dict]:
    """The growth figures as rows of `make bench`'s table (see `table_rows`)."""
    return table_rows(measure(QUICK_MARKS, 1) if quick else measure(MARKS, ROUNDS))


def print_table(found: dict[str, list[Mark]], rounds: int) -> None:
    print(f"One thread of {USER_BYTES // 1024} KB user turns with short answers, scripted model (zero token delay),"
          f" {rounds} round(s)")
    print("kit = the kit's AgentService; bare = LangGraph alone with DeltaChannel (LangGraph's batch reducer),"
          " default = LangGraph's default add_messages channel; AsyncSqliteSaver, durability sync")
    print(f"ms = time per turn, cpu = CPU time of this process per turn (both the median of the last {LAST_TURNS}"
          f" turns); model = the model request alone with the same prompt")
    print()
    header = (f"{'turn':>4} | {'raw MB':>6} | {'model':>5} | "
              + " | ".join(f"{name + ' MB':>10} {'ratio':>6} {'ms':>5} {'cpu':>5}" for name in found)
              + f" | {'kit/bare MB':>11} {'ms':>5} {'cpu':>5}")
    print(header)
    print("-" * len(header))
    for at, kit in enumerate(found["kit"]):
        bare = found["bare"][at]
        sides = " | ".join(
            f"{marks[at].file_bytes / 1e6:>10.2f} {marks[at].ratio:>5.1f}x {marks[at].ms_per_turn:>5.1f} "
            f"{marks[at].cpu_ms_per_turn:>5.1f}" if at < len(marks) else f"{'-':>10} {'-':>6} {'-':>5} {'-':>5}"
            for marks in found.values())
        print(f"{kit.turn:>4} | {kit.raw_bytes / 1e6:>6.2f} | {kit.model_ms:>5.1f} | {sides} | "
              f"{kit.file_bytes / bare.file_bytes:>11.3f} {kit.ms_per_turn / bare.ms_per_turn:>5.2f} "
              f"{kit.cpu_ms_per_turn / bare.cpu_ms_per_turn:>5.2f}")
    print()
    for name, marks in found.items():
        first, last = marks[0], marks[-1]
        print(f"{name + ':':<8} file / raw at {last.turn} turns = {last.ratio:.1f}x; time per turn "
              f"{last.turn} / {first.turn} = {last.ms_per_turn / first.ms_per_turn:.2f}x, CPU "
              f"{last.cpu_ms_per_turn / first.cpu_ms_per_turn:.2f}x")
    kit, bare = found["kit"][-1], found["bare"][-1]
    print(f"kit / bare at {kit.turn} turns: file {kit.file_bytes / bare.file_bytes:.2f}x, time per turn "
          f"{kit.ms_per_turn / bare.ms_per_turn:.2f}x (targets <= 1.10x)")
    kit_marks = found["kit"]
    print(f"the model request alone: {kit_marks[-1].model_ms / kit_marks[0].model_ms:.2f}x "
          f"({kit_marks[0].model_ms:.1f} -> {kit_marks[-1].model_ms:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"stop at turn {QUICK_MARKS[-1]}, one round")
    args = parser.parse_args()
    rounds = 1 if args.quick else ROUNDS
    from bench import machine

    print(f"Machine: {machine()}")
    print_table(medians(measure(QUICK_MARKS if args.quick else MARKS, rounds)), rounds)


if __name__ == "__main__":
    main()
