"""Every batch ends: whatever happens to its input file object, and however late a cancel comes."""

from __future__ import annotations

from collections import Counter

import pytest

from app.domain import batches
from app.domain.schemas import CreateBatchRequest
from app.testing import FakeEngine
from tests.helpers import (
    FINAL,
    app_on,
    create_batch,
    held_batch,
    jsonl,
    read_jsonl,
    request_line,
    stopped_mid_batch,
    storage_of,
    stored_names,
    upload,
    wait_status,
)

pytestmark = pytest.mark.both_backends


def test_input_deleted_while_running_leaves_the_batch_its_input_across_a_restart(settings):
    with held_batch(settings, lines=10, answered=2) as held:
        assert held.client.delete(f"/v1/files/{held.source['id']}").status_code == 200
    source, batch = held.source, held.batch
    assert source["id"] not in stored_names(settings)
    with app_on(settings) as client:
        done = wait_status(client, batch["id"], FINAL)
        outputs = read_jsonl(client, done["output_file_id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 10
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(10))
    # Nothing of the batch's own stays behind once it has ended: only its output file is on disk.
    assert stored_names(settings) == [done["output_file_id"]]


def test_input_deleted_before_validation_fails_the_batch(client, engine_service, fake_engine):
    source = upload(client, jsonl([request_line("a")]))
    row = batches.create(
        db=client.app.state.db,
        request=CreateBatchRequest(
            input_file_id=source["id"], endpoint="/v1/chat/completions", completion_window="24h"
        ),
        windows={"24h": 86400},
        owner="",
        max_active=0,
    )
    client.delete(f"/v1/files/{source['id']}")
    engine_service.wake()
    failed = wait_status(client, row.id, {"failed"})
    assert failed["errors"]["data"][0]["code"] == "file_not_found"
    assert fake_engine.executor.calls == 0


def test_a_cancel_after_the_last_line_ends_the_batch_cancelled(client, settings, fake_engine):
    settings.checkpoint_seconds = 60  # no tick notices the cancel first: the run ends with every line done
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(3)]))
    batch = create_batch(client, source["id"])
    db = client.app.state.db

    def cancel_on_the_last(body: dict) -> None:
        if body["messages"][0]["content"] == "hi r2":
            batches.request_cancel(db=db, batch_id=batch["id"], owner="")

    fake_engine.executor.before_answer = cancel_on_the_last
    done = wait_status(client, batch["id"], FINAL)
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(read_jsonl(client, done["output_file_id"])) == 3


def test_a_batch_from_before_the_index_is_indexed_again_and_finishes(settings):
    batch = stopped_mid_batch(settings, lines=6, answered=2).batch
    # As a batch started by a vbatch that kept neither an index nor its own name for the input left it.
    for suffix in (".index", ".input"):
        storage_of(settings).remove_any(f"{batch['id']}{suffix}")
    resumed = FakeEngine()
    with app_on(settings, resumed) as client:
        done = wait_status(client, batch["id"], FINAL)
        outputs = read_jsonl(client, done["output_file_id"])
    assert done["status"] == "completed" and resumed.executor.calls == 4
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(6))


def test_a_batch_begun_before_vbatch_kept_its_input_ends_failed_when_its_input_is_gone(settings):
    batch = stopped_mid_batch(settings, lines=6, answered=2).batch
    # As a vbatch that kept neither an index nor its own name for the input left it, its input deleted since.
    for name in (f"{batch['id']}.index", f"{batch['id']}.input", batch["input_file_id"]):
        storage_of(settings).remove_any(name)
    resumed = FakeEngine()
    with app_on(settings, resumed) as client:
        failed = wait_status(client, batch["id"], FINAL)
    assert failed["status"] == "failed" and resumed.executor.calls == 0
    assert [error["code"] for error in failed["errors"]["data"]] == ["file_not_found"]


def test_a_cancel_during_validation_ends_the_batch_cancelled_whatever_validation_found(
    client, fake_engine, monkeypatch
):
    from app.engine.batch import intake

    db = client.app.state.db
    validate = intake.validate_file

    def cancelled_meanwhile(path, limits):
        report = validate(path, limits)
        batch_id = path.name.removesuffix(".input")
        batches.request_cancel(db=db, batch_id=batch_id, owner="")
        return report

    monkeypatch.setattr(intake, "validate_file", cancelled_meanwhile)
    good = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    bad = create_batch(client, upload(client, jsonl([request_line("b", model="no-such-model")]))["id"])
    for batch in (good, bad):
        ended = wait_status(client, batch["id"], FINAL)
        assert ended["status"] == "cancelled" and ended["request_counts"]["total"] == 0
    assert fake_engine.executor.calls == 0
    assert sorted(client.app.state.storage.names()) == sorted(f["id"] for f in client.get("/v1/files").json()["data"])
