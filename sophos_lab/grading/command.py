"""`sophos-lab grade PATH [--stage X] [--sample] [--lanes N]`: the grader from a shell."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `grade` subcommand's arguments."""
    grade = commands.add_parser(
        "grade", help="grade an agent module: kill it at every point of the scenario, recover, resume, judge",
        description="Run the agent module at PATH (the contract: async run_turn, recover, resume, read; see "
                    "sophos_lab/grading/contract.py) through the grading scenario, SIGKILL it at every kill point, "
                    "recover and resume in a new process, and print the verdicts per point. Exit status 0 when "
                    "the module does what --stage says (without --stage: when every point recovers).")
    grade.add_argument("path", help="the agent module (a .py file); `kit` grades the kit's own runtime")
    grade.add_argument("--stage", choices=["A", "B", "C", "D", "E", "kit"],
                       help="what the module should achieve (the lab's stages; `kit`: everything)")
    grade.add_argument("--sample", action="store_true", help="only the first point of each kind, and the last")
    grade.add_argument("--lanes", type=int, default=2, help="labs grading side by side (default 2)")


def run(args: argparse.Namespace) -> int:
    """Grade, print the table and the verdict; the exit status."""
    import pandas as pd

    from . import KIT_AGENT, grade

    path = KIT_AGENT if args.path == "kit" else Path(args.path)
    stage = args.stage or ("kit" if args.path == "kit" else None)
    result = grade(path, stage, every_point=not args.sample, lanes=max(1, args.lanes), name="grade")
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 80):
        if result.outcomes:
            print(result.table.to_string())
        notes = result.notes()
        if len(notes):
            print("\nwhat was seen where a point did not recover:")
            print(notes.to_string(index=False))
    print(f"\n{result.summary}  ({result.seconds:.0f} s)")
    if stage:
        problems = result.problems()
        print(f"stage {stage}: " + ("as it should be" if not problems else "not as it should be:\n  " + "\n  ".join(problems)))
        return 1 if problems else 0
    return 0 if result.outcomes and all(o.recovers for o in result.outcomes) else 1
