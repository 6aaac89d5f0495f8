"""`check` says pass, fail with the reason, or not done, and never raises: a lesson goes on."""

from sophos_lab.lab.exercises import check_exercise as check, exercise_names


def test_a_right_answer_passes(capsys):
    assert check("sum", lambda: None).outcome == "pass"
    assert capsys.readouterr().out == "✅ sum: right.\n"


def test_a_wrong_answer_fails_with_the_reason(capsys):
    def test():  # as a check cell's `assert answer == 5, "..."` would (pytest rewrites this file's asserts)
        raise AssertionError("2 + 2 is 4, not 5")

    result = check("sum", test)

    assert (result.outcome, result.reason) == ("fail", "2 + 2 is 4, not 5")
    assert capsys.readouterr().out == "❌ sum: not right yet. 2 + 2 is 4, not 5\n"


def test_code_that_raises_is_a_wrong_answer_not_a_stopped_lesson(capsys):
    result = check("query", lambda: {}["missing"])

    assert (result.outcome, result.reason) == ("fail", "KeyError: 'missing'")
    assert "your code raised KeyError" in capsys.readouterr().out


def test_the_stub_says_not_done_yet(capsys):
    def stub():
        raise NotImplementedError

    assert check("query", stub).outcome == "not done"
    assert capsys.readouterr().out.startswith("✏️ query: not done yet.")


def test_an_exercise_cell_is_named_by_its_marker_line():
    source = "# ✏️ EXERCISE resumable_query: the conversations a resume would move on\ndef f():\n    raise NotImplementedError\n"
    assert exercise_names(source) == ["resumable_query"]
    assert exercise_names("# EXERCISE not a marker\n") == []
