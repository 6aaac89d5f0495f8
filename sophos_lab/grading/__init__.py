"""Grading a durable agent you wrote: the contract, the kill-point matrix, the verdicts.

    from sophos_lab.grading import grade
    result = grade("agent_c.py", stage="C")
    print(result.summary)      # your agent: 37 of 41 points recover, 3 lost, 0 re-run, 1 payment (2 at 1 point)
    result.table               # point × lost, re-run, extra payment, wrong status, stuck
    result.picture()           # the points along the run's timeline, coloured by verdict

`sophos-lab grade PATH [--stage C]` does the same from a shell. The contract your module meets is
in `contract` (four async functions and the `World` they are handed), the points in `points`,
the verdicts in `grader`, what each stage of the lab should achieve in `stages`; the kit's own
runtime meets the same contract through `kit_agent.py` and is graded as `stage="kit"`.
"""

from __future__ import annotations

from pathlib import Path

KIT_AGENT = Path(__file__).with_name("kit_agent.py")
"""The kit's runtime (`AgentService`) as an agent module: `grade(KIT_AGENT, stage="kit")`."""


def grade(module_path, stage=None, **options):
    """Grade the agent module at `module_path`; see `sophos_lab.grading.grader.grade`."""
    from .grader import grade as _grade

    return _grade(module_path, stage, **options)


__all__ = ["KIT_AGENT", "grade"]
