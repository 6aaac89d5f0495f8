"""A ✅ check cell states claims: each prints one line, and one that does not hold fails the cell."""

import pytest

from sophos_lab import check
from sophos_lab.lab.checks import CheckFailed


def test_a_claim_that_holds_prints_one_line(capsys) -> None:
    check("the run is `interrupted` and resumable", "interrupted" == "interrupted", "interrupted")
    assert capsys.readouterr().out == "✅ the run is `interrupted` and resumable\n"


def test_a_claim_that_does_not_hold_fails_with_the_claim_and_what_was_observed(capsys) -> None:
    with pytest.raises(AssertionError) as failed:
        check("the run is `completed`", "failed" == "completed", "failed")
    assert str(failed.value) == "❌ the run is `completed`\n   observed: 'failed'"
    assert capsys.readouterr().out == ""


def test_a_claim_that_cannot_be_evaluated_fails_as_that_claim() -> None:
    with pytest.raises(CheckFailed, match=r"❌ the first tool message is an error\n   could not be evaluated: IndexError"):
        check("the first tool message is an error", lambda: [][0] == "error")


def test_a_claim_about_the_scripted_model_s_choice_is_not_checked_with_another_model(capsys) -> None:
    check("the model called the tool twice", False, 1, scripted_only=True, scripted=False)
    assert capsys.readouterr().out.startswith("·  not checked with this model")
    with pytest.raises(CheckFailed):
        check("the model called the tool twice", False, 1, scripted_only=True, scripted=True)
