"""Fair limits between users: how many runs one user may have, and the order workers claim them.

On the stores themselves (a real SQLite file, a real PostgreSQL database), with users added as
`sophos-lab user add` adds them and requests acting for them as the HTTP server's do.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest

from sophos_lab.runtime import users
from sophos_lab.runtime.errors import TOO_MANY_RUNS, SophosError
from sophos_lab.runtime.service import open_store
from sophos_lab.runtime.store import utc_now

LIMITS = {"SOPHOS_LAB_USER_MAX_RUNNING": "2", "SOPHOS_LAB_USER_MAX_QUEUED": "3"}


@contextlib.contextmanager
def acting_as(user: users.User | None):
    token = users.acting_user.set(None if user is None else user.id)
    try:
        yield
    finally:
        users.acting_user.reset(token)


@pytest.fixture
def store(lab, database):
    store = open_store(lab.settings(**database, **LIMITS))
    yield store
    store.close()


@pytest.fixture
def queue_store(lab, request, postgres, migrated_template):
    """A store on a fresh PostgreSQL database, where runs can be queued for workers."""
    from sophos_lab.lab import postgres_server

    url = postgres_server.new_database(postgres.url, request.node.name[:30], template=migrated_template)
    store = open_store(lab.settings(DATABASE_URL=url, **LIMITS))
    yield store
    store.close()
    postgres_server.drop_database(postgres.url, url)


def add(store, name: str) -> users.User:
    return users.add_user(store, name, utc_now())[0]


def start(store, user: users.User | None, queued: bool = False) -> str:
    """A run of `user` on a new conversation of theirs; its conversation id."""
    conversation, run = str(uuid.uuid4()), str(uuid.uuid4())
    message = [{"id": str(uuid.uuid4()), "role": "user", "content": "hello"}]
    with acting_as(user):
        if queued:
            store.queue_run(run, conversation, message, "hello", None, None, False)
        else:
            store.start_run(run, conversation, message, "hello")
    return conversation


@pytest.mark.both_backends
def test_a_user_at_their_running_limit_is_refused_with_too_many_runs_and_nothing_is_stored(store):
    ada, bea = add(store, "ada"), add(store, "bea")
    start(store, ada), start(store, ada)
    before = len(store.list_runs())

    with pytest.raises(SophosError) as refused:
        start(store, ada)

    assert refused.value.code == TOO_MANY_RUNS
    assert "SOPHOS_LAB_USER_MAX_RUNNING=2" in refused.value.message and "Nothing was stored" in refused.value.message
    assert len(store.list_runs()) == before
    start(store, bea)  # another user is not held up by ada's limit
    start(store, None), start(store, None), start(store, None)  # nor the single-user mode, which has none


def test_a_user_at_their_queued_limit_is_refused_and_workers_claim_in_turns_across_users(queue_store):
    store = queue_store
    ada, bea = add(store, "ada"), add(store, "bea")
    adas = [start(store, ada, queued=True) for _ in range(3)]
    with pytest.raises(SophosError) as refused:
        start(store, ada, queued=True)
    beas = start(store, bea, queued=True)  # queued after all of ada's

    claimed = []
    while (run := store.claim_run()) is not None:
        claimed.append(run.conversation_id)

    assert refused.value.code == TOO_MANY_RUNS and "SOPHOS_LAB_USER_MAX_QUEUED=3" in refused.value.message
    # bea's first run is claimed second, not fourth; ada's third waits: two of hers run already
    assert claimed == [adas[0], beas, adas[1]]
    position = {conversation: i + 1 for i, conversation in enumerate(claimed)}
    print(f"\nclaim order: bea's run (queued 4th) claimed {position[beas]}nd; in queue order it would be 4th")
