"""Exercises: a cell the learner writes, and a check that says pass or fail with the reason.

An exercise cell starts with a marker line naming it, `# ✏️ EXERCISE <name>: what to write`, and
holds a stub that raises `NotImplementedError`. The check cell after it calls `check_exercise(name, test)`:
`test` uses the learner's code and raises `AssertionError` (its message: what is wrong) when the
answer is not right; any other exception from the learner's code is a wrong answer too. A learner who has not written it yet is told so and goes on: a check never
stops a lesson.

The reference solutions live outside `notebooks/` (`solutions/<lesson>/<name>.py`, with a known
wrong answer beside each, `<name>.wrong.py`); the tests put them into the exercise cell and run
the lesson, to prove each check passes a right answer and fails a wrong one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

MARKER = re.compile(r"(?m)^# ✏️ EXERCISE (?P<name>[a-z0-9_]+):")


@dataclass
class Checked:
    name: str
    outcome: str
    """"pass", "fail" or "not done"."""
    reason: str = ""


def check_exercise(name: str, test: Callable[[], object]) -> Checked:
    """Run the exercise's `test` and print the verdict: ✅ pass, ❌ the reason, or ✏️ not done yet."""
    try:
        test()
    except NotImplementedError:
        result = Checked(name, "not done")
        print(f"✏️ {name}: not done yet. Write your answer in the ✏️ cell above, run it, then run this check again.")
    except AssertionError as error:
        result = Checked(name, "fail", str(error))
        print(f"❌ {name}: not right yet. {error}")
    except Exception as error:  # the learner's code broke: that is an answer too, and never stops the lesson
        result = Checked(name, "fail", f"{type(error).__name__}: {error}")
        print(f"❌ {name}: your code raised {type(error).__name__}: {error}")
    else:
        result = Checked(name, "pass")
        print(f"✅ {name}: right.")
    return result


def exercise_names(source: str) -> list[str]:
    return [match["name"] for match in MARKER.finditer(source)]
