"""`reveal` marks a prediction as a person would: the same items in a list or a tuple, a word in
another case, the same set of files in another order (where the lesson says order does not
matter) are the answer; anything else is not, and no prediction is never marked wrong."""

import numpy as np
import pytest

from sophos_lab.lab.predictions import current_score, new_score, reveal, score


@pytest.mark.parametrize(("prediction", "actual", "ordered"), [
    (["agent"], ("agent",), True),
    (("agent",), ["agent"], True),
    ("interrupted", "Interrupted ", True),
    (["AGENT_FAILURE"], ("agent_failure",), True),
    (["sophos.db", "sophos.db-wal"], ["sophos.db-wal", "sophos.db"], False),
    (3, np.int64(3), True),
    (True, np.bool_(True), True),
    ({"status": "failed"}, {"status": "FAILED"}, True),
])
def test_the_same_answer_in_another_shape_is_right(capsys, prediction, actual, ordered):
    reveal(prediction, actual, ordered=ordered)

    assert capsys.readouterr().out.startswith("✅")


@pytest.mark.parametrize(("prediction", "actual", "ordered"), [
    (["user", "assistant"], ("assistant", "user"), True),  # the order of messages matters
    (["sophos.db"], ["sophos.db", "sophos.db-wal"], False),
    ("failed", "interrupted", True),
    (2, np.int64(3), True),
    (["agent"], "agent", True),
])
def test_another_answer_is_wrong(capsys, prediction, actual, ordered):
    reveal(prediction, actual, ordered=ordered)

    assert capsys.readouterr().out.startswith("❌")


def test_no_prediction_shows_what_happened_and_asks_for_one(capsys):
    reveal(None, ("agent",))

    assert capsys.readouterr().out == "observed: ('agent',)  (write your prediction first next time!)\n"


def test_the_score_counts_right_wrong_and_missing_predictions(capsys):
    new_score()
    reveal(5, 5)
    reveal(["agent"], ("agent",))
    reveal(2, 3)
    reveal(None, "failed")
    capsys.readouterr()

    score()

    result = current_score()
    assert (result.right, result.made, result.skipped) == (2, 3, 1)
    assert capsys.readouterr().out == "🔮 Your predictions: 2 of 4 right, 1 not made.\n"


def test_a_learner_who_predicted_nothing_is_told_so_and_not_stopped(capsys):
    new_score()
    reveal(None, 5)
    reveal(None, [])
    capsys.readouterr()

    score()

    result = current_score()
    assert (result.right, result.made) == (0, 0)
    out = capsys.readouterr().out
    assert out.startswith("🔮 You made none of this lesson's 2 predictions.") and "start the lesson over" in out, out


def test_a_new_lab_starts_a_new_score(lab_home):
    from sophos_lab import Lab

    reveal(1, 1)
    with Lab.setup("tests-new-score", quiet=True):
        assert current_score().revealed == []


def test_the_score_counts_the_predictions_asked_whose_reveal_has_not_run_yet(capsys) -> None:
    """A lesson whose exercise holds back two reveals says so, instead of scoring 1 of 1."""
    from sophos_lab.lab.predictions import new_score, reveal, score

    new_score()
    lesson = {"reveal": reveal, "score": score}
    exec("prediction_status = 'failed'\nprediction_calls = 2\nprediction_next = None\n"
         "reveal(prediction_status, 'failed')\nscore()", lesson)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "🔮 Your predictions: 1 of 3 right. 2 not revealed yet: finish the lesson (and its exercises) to see them.")
