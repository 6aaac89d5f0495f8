"""Checks that read as claims: one line per claim, and a cell that fails when one does not hold.

A lesson's ✅ cell states what the experiment showed, one claim a line:

    check("the run is `interrupted` and resumable", run.status == "interrupted", run.status)

prints `✅ the run is `interrupted` and resumable`, or raises `CheckFailed` (an `AssertionError`,
so nbval and papermill fail the cell) whose message is the claim and what was observed instead.
A claim whose evaluation may itself fail (an empty table, a missing key) is passed as a function:
an error while evaluating it fails the claim with that error, not with a bare traceback.

The claims that hold only for the kit's scripted model (which tool it calls, how many times) are
checked with `scripted_only=True` and `lab.scripted`: with another model they are listed as not
checked, since what a model chooses is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_NOTHING = object()


class CheckFailed(AssertionError):
    """A claim of a lesson's check cell that does not hold."""


def check(claim: str, holds: bool | Callable[[], object], observed: Any = _NOTHING, *,
          scripted_only: bool = False, scripted: bool = True) -> None:
    """Print `✅ claim` when `holds` is true (or returns true), else fail with the claim and `observed`.

    `scripted_only=True` marks a claim about what the scripted model chose; pass `scripted=lab.scripted`
    and, with another model, the claim is printed as not checked instead of evaluated."""
    if scripted_only and not scripted:
        print(f"·  not checked with this model (the scripted model's choice): {claim}")
        return
    if callable(holds):
        try:
            holds = holds()
        except Exception as error:  # noqa: BLE001 - the claim could not even be evaluated: that is its failure
            raise CheckFailed(f"❌ {claim}\n   could not be evaluated: {type(error).__name__}: {error}") from error
    if not holds:
        detail = "" if observed is _NOTHING else f"\n   observed: {_short(observed)}"
        raise CheckFailed(f"❌ {claim}{detail}")
    print(f"✅ {claim}")


def _short(value: Any, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
