"""What each stage of the lab should achieve, point by point: the grader's expectations.

A stage adds one idea of the course to the agent, and so fixes some points and not others.
`expected(stage, point)` is the set of verdicts a right solution of that stage gets at a point:

- **A · the bare agent** (no saver): every point loses its turn (and the messages before it),
  and there are no statuses to be right.
- **B · checkpoints** (a saver, durability `sync`, a resume by `astream(None)`): nothing is lost
  and nothing answered runs again, but no runs table records that a run was cut short (a wrong
  status at every point); the payment, between its commit and its checkpoint, is made again.
- **C · runs and recovery** (a runs table, recovery on the next open): the statuses are right
  everywhere; a kill after the run's row and before the turn's first checkpoint loses the
  message; the payment is made again.
- **D · the accepted message is durable** (stored with its run, entered again by the resume):
  nothing is lost; the payment is made again.
- **E · a replay-safe effect** (the payment stores the runtime's key with its effect): every
  point recovers, with one payment.
- **kit**: the kit's own runtime (`kit_agent.py`, an adapter over `AgentService`): as E.

`problems(result)` compares a graded result with its stage's expectations, in words.
"""

from __future__ import annotations

from .points import Point

STAGES = ("A", "B", "C", "D", "E")
TITLES = {"A": "the bare agent", "B": "checkpoints", "C": "runs and recovery",
          "D": "the accepted message is durable", "E": "a replay-safe effect", "kit": "the kit's runtime"}
VERDICTS = ("lost", "re-run", "extra payment", "wrong status", "stuck")


def expected(stage: str, point: Point) -> set[str]:
    """The verdicts a right solution of `stage` gets at `point`."""
    paid_again = {"extra payment"} if point.trigger == "payment" else set()
    if stage == "A":
        return {"lost", "wrong status"}
    if stage == "B":
        return {"wrong status"} | paid_again
    if stage == "C":
        return ({"lost"} if point.before_input else set()) | paid_again
    if stage == "D":
        return paid_again
    if stage in ("E", "kit"):
        return set()
    raise ValueError(f"no stage {stage!r} (the stages are {', '.join(STAGES)} and 'kit')")


def problems(result) -> list[str]:
    """Where `result` (a `Graded`) differs from what its stage should achieve; [] when it does."""
    reference = result.reference
    if reference.error:
        return [reference.error]
    found = []
    for outcome in result.outcomes:
        want, got = expected(result.stage, outcome.point), set(outcome.verdicts)
        if want != got:
            missing = ", ".join(v for v in VERDICTS if v in want - got)
            extra = ", ".join(v for v in VERDICTS if v in got - want)
            said = "; ".join(filter(None, [extra and f"found {extra}", missing and f"expected {missing}"]))
            notes = f" ({'; '.join(outcome.notes)})" if outcome.notes else ""
            found.append(f"at `{outcome.point.name}` (turn {outcome.point.turn}): {said}{notes}")
    return found
