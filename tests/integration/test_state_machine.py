from __future__ import annotations

import threading

import pytest

from app.core.db import make_engine
from app.core.migrate import upgrade_to_head
from app.domain import batches
from app.domain.errors import NotCancellable, NotFound, TooManyActive
from app.domain.lifecycle import TERMINAL, TRANSITIONS, BatchStatus, InvalidTransition
from app.domain.models import FileRow
from app.domain.schemas import CreateBatchRequest

pytestmark = pytest.mark.both_backends


@pytest.fixture
def db(settings):
    upgrade_to_head(settings.database)
    engine = make_engine(settings.database)
    with batches.write_scope(engine) as session:
        session.add(FileRow(id="file-1", created_ns=1, created_at=1, bytes=1, filename="f", purpose="batch"))
        session.commit()
    return engine


def new_batch(db, *, owner: str = "", max_active: int = 0) -> str:
    request = CreateBatchRequest(input_file_id="file-1", endpoint="/v1/chat/completions", completion_window="24h")
    return batches.create(db=db, request=request, windows={"24h": 86400}, owner=owner, max_active=max_active).id


def test_terminal_states_have_no_way_out():
    assert all(TRANSITIONS[state] == frozenset() for state in TERMINAL)


def test_happy_path_stamps_each_time_once(db):
    batch_id = new_batch(db)
    for status in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.COMPLETED):
        row = batches.transition(db=db, batch_id=batch_id, to=status)
        assert row.status == status and getattr(row, f"{status}_at") is not None
    assert batches.get(db=db, batch_id=batch_id, owner="").in_progress_at is not None


def test_no_moving_backwards(db):
    batch_id = new_batch(db)
    batches.transition(db=db, batch_id=batch_id, to=BatchStatus.IN_PROGRESS)
    with pytest.raises(InvalidTransition):
        batches.transition(db=db, batch_id=batch_id, to=BatchStatus.VALIDATING)
    batches.transition(db=db, batch_id=batch_id, to=BatchStatus.FINALIZING)
    batches.transition(db=db, batch_id=batch_id, to=BatchStatus.COMPLETED)
    for status in TRANSITIONS:
        with pytest.raises(InvalidTransition):
            batches.transition(db=db, batch_id=batch_id, to=status)


def test_cancel_is_idempotent_and_refused_when_finished(db):
    batch_id = new_batch(db)
    first = batches.request_cancel(db=db, batch_id=batch_id, owner="")
    second = batches.request_cancel(db=db, batch_id=batch_id, owner="")
    assert first.status == second.status == "cancelling" and first.cancelling_at == second.cancelling_at
    batches.transition(db=db, batch_id=batch_id, to=BatchStatus.CANCELLED)
    with pytest.raises(NotCancellable):
        batches.request_cancel(db=db, batch_id=batch_id, owner="")


def test_active_is_in_creation_order(db):
    ids = [new_batch(db) for _ in range(3)]
    batches.transition(db=db, batch_id=ids[1], to=BatchStatus.FAILED)
    assert [row.id for row in batches.active(db=db)] == [ids[0], ids[2]]


def test_active_batches_per_key_are_capped_until_one_ends(db):
    ids = [new_batch(db, max_active=2) for _ in range(2)]
    with pytest.raises(TooManyActive) as refused:
        new_batch(db, max_active=2)
    assert refused.value.code == "too_many_active_batches"
    batches.transition(db=db, batch_id=ids[0], to=BatchStatus.FAILED)
    assert new_batch(db, max_active=2) not in ids


def test_another_owner_cannot_use_or_see_the_file_or_batch(db):
    batch_id = new_batch(db)
    for call in (
        lambda: new_batch(db, owner="someone-else"),
        lambda: batches.get(db=db, batch_id=batch_id, owner="someone-else"),
        lambda: batches.request_cancel(db=db, batch_id=batch_id, owner="someone-else"),
    ):
        with pytest.raises(NotFound):
            call()
    assert batches.get(db=db, batch_id=batch_id, owner="").status == "validating"


def test_concurrent_creates_take_the_last_place_once(db):
    # Each from its own input file: nothing but the quota's own lock stands between them.
    with batches.write_scope(db) as session:
        for i in range(8):
            session.add(FileRow(id=f"file-r{i}", created_ns=i, created_at=1, bytes=1, filename="f", purpose="batch"))
        session.commit()
    outcomes: list[str] = []

    def create(i: int) -> None:
        request = CreateBatchRequest(
            input_file_id=f"file-r{i}", endpoint="/v1/chat/completions", completion_window="24h"
        )
        try:
            batches.create(db=db, request=request, windows={"24h": 86400}, owner="", max_active=1)
            outcomes.append("created")
        except TooManyActive:
            outcomes.append("refused")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] + ["refused"] * 7
