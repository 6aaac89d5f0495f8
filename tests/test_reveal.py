"""`reveal` marks a prediction as a person would: the same items in a list or a tuple, a word in
another case, the same set of files in another order (where the lesson says order does not
matter) are the answer; anything else is not, and no prediction is never marked wrong."""

import numpy as np
import pytest

from sophos_lab.lab.harness import reveal


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
