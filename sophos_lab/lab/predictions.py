"""A learner's predictions: written down before the experiment, marked after it, summed up at
the end of the lesson.

A lesson asks for its predictions in one cell of plain variables (`prediction_checkpoints =
None`), reveals each with `reveal(prediction, actual)` once it has been observed, and ends with
`score()`: "5 of 7 predicted right". The score counts every prediction the lesson asked (the
`prediction_*` names of the notebook), also those whose reveal has not run yet. No prediction (`None`) is never marked wrong and never stops
a lesson; the score says how many were left out. `Lab.setup` starts a new score, so running a
lesson again counts that pass only.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Revealed:
    prediction: Any
    actual: Any
    right: bool | None
    """None: there was no prediction."""


@dataclass
class Score:
    revealed: list[Revealed] = field(default_factory=list)
    asked: int = 0
    """How many predictions the lesson asked for (its `prediction_*` variables), revealed or not."""

    @property
    def right(self) -> int:
        return sum(1 for r in self.revealed if r.right)

    @property
    def made(self) -> int:
        return sum(1 for r in self.revealed if r.right is not None)

    @property
    def skipped(self) -> int:
        return len(self.revealed) - self.made

    def observed(self) -> list[Any]:
        """What happened, per reveal in order, as plain JSON values (the answers a test injects)."""
        return [_plain(r.actual) for r in self.revealed]

    @property
    def unrevealed(self) -> int:
        return max(self.asked - len(self.revealed), 0)

    def __str__(self) -> str:
        total = max(len(self.revealed), self.asked)
        if not total:
            return "🔮 This lesson asked for no predictions."
        later = (f" {self.unrevealed} not revealed yet: finish the lesson (and its exercises) to see them."
                 if self.unrevealed else "")
        if not self.revealed:
            return f"🔮 Nothing has been revealed yet in this lesson.{later}"
        if not self.made:
            return (f"🔮 You made none of this lesson's {total} predictions. That is allowed, but a guess "
                    "written down first is what shows you what you did not expect: start the lesson "
                    f"over (run its setup cell again) and predict before you look.{later}")
        line = f"🔮 Your predictions: {self.right} of {total} right"
        if self.skipped:
            line += f", {self.skipped} not made"
        return line + "." + later


_score = Score()


def reveal(prediction: Any, actual: Any, *, ordered: bool = True) -> None:
    """Compare a learner's prediction with what happened, and count it for `score()`; never
    fails (None = no prediction).

    As a person would: a list and a tuple with the same items are the same answer, a word's
    case and the spaces around it do not count, and with `ordered=False` (a set of files, of
    processes) neither does the order of a sequence's items."""
    if prediction is None:
        _score.revealed.append(Revealed(prediction, actual, None))
        print(f"observed: {actual!r}  (write your prediction first next time!)")
        return
    right = same_answer(prediction, actual, ordered=ordered)
    _score.revealed.append(Revealed(prediction, actual, right))
    if right:
        print(f"✅ you predicted {prediction!r}, and that is what happened")
    else:
        print(f"❌ you predicted {prediction!r}, but observed {actual!r}")


def score() -> None:
    """Print this lesson's predictions so far: how many were right, wrong, not made and not yet
    revealed (the notebook's `prediction_*` names that no reveal has marked yet).

    It returns nothing, so that a cell ending with `score()` shows the line alone (nbval and
    papermill run cells without IPython's output-hiding `;`); `current_score()` is the value."""
    _score.asked = len(asked_predictions(sys._getframe(1).f_globals))
    print(_score)


def asked_predictions(namespace: Mapping[str, Any]) -> list[str]:
    """The predictions a notebook asked for: its `prediction_*` variables."""
    return [name for name, value in namespace.items() if name.startswith("prediction_") and not callable(value)]


def current_score() -> Score:
    """This lesson's predictions so far, without printing them."""
    return _score


def new_score() -> None:
    """Start counting afresh (a new lab, a new pass at the lesson)."""
    global _score
    _score = Score()


def same_answer(prediction: Any, actual: Any, *, ordered: bool = True) -> bool:
    """Whether `prediction` says what `actual` is, in `reveal`'s sense."""
    return _answer(prediction, ordered) == _answer(actual, ordered)


def _answer(value: Any, ordered: bool) -> Any:
    if isinstance(value, str):
        return value.strip().casefold()
    if isinstance(value, Mapping):
        return {_answer(k, ordered): _answer(v, ordered) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_answer(item, ordered) for item in value]
        return items if ordered else sorted(items, key=repr)
    if isinstance(value, np.generic):
        return value.item()  # a numpy scalar read off a DataFrame
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(item) for item in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return value
