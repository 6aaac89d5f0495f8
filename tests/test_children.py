"""The children's small interface where it meets a refusal: the refused command says so at once."""

import uuid

import pytest

from sophos_lab.lab.children import ChildFailed
from sophos_lab.lab.harness import Lab


@pytest.fixture(scope="module")
def lab(lab_home):
    with Lab.setup("tests-children", quiet=True) as lab:
        yield lab


@pytest.mark.parametrize("kind", ["worker", "server"])
def test_the_conversation_of_a_refused_chat_raises_with_the_code(lab, kind):
    with getattr(lab, kind)() as child:
        child.chat("hello", str(uuid.uuid4()))  # no such conversation

        with pytest.raises(ChildFailed, match="NOT_FOUND"):
            child.conversation()
        assert child.wait_final()["event"] == "rejected"
