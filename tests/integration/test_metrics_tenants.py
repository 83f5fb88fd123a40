"""/metrics with several keys: the service-wide series count everyone's work, but a series about one batch (its
`batch_id` label) is there only for the batch's own key, as the batch itself is (another key's is a 404)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.testing import FakeEngine
from tests.helpers import app_on, create_batch, jsonl, request_line, upload, wait_for
from tests.integration.test_metrics import scrape

KEYS = ("sk-tenant-a", "sk-tenant-b")


def _as(client: TestClient, key: str) -> TestClient:
    client.headers["authorization"] = f"Bearer {key}"
    return client


def _running_with_two_done(client: TestClient, key: str) -> str:
    """A batch of `key`'s with two of its three lines answered; the executor holds the third."""
    batch = create_batch(_as(client, key), upload(client, jsonl([request_line(f"{key}-{i}") for i in range(3)]))["id"])
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 2)
    return batch["id"]


def _batch_series(metrics: dict) -> set[str]:
    return {dict(labels)["batch_id"] for _, labels in metrics if "batch_id" in dict(labels)}


def test_a_key_sees_the_series_of_its_own_running_batches_and_no_other_keys(settings, fake_engine: FakeEngine):
    settings.api_keys = ",".join(KEYS)
    executor = fake_engine.executor
    with app_on(settings, fake_engine) as client:
        executor.answer_first = 2
        a_batch = _running_with_two_done(client, KEYS[0])
        wait_for(lambda: executor.calls == 3)  # the third line of a's is held
        executor.answer_first = 5
        b_batch = _running_with_two_done(client, KEYS[1])
        try:
            assert _as(client, KEYS[1]).get(f"/v1/batches/{a_batch}").status_code == 404
            seen = {key: scrape(_as(client, key)) for key in KEYS}
        finally:
            executor.gate.set()
    assert _batch_series(seen[KEYS[0]]) == {a_batch}
    assert _batch_series(seen[KEYS[1]]) == {b_batch}
    for key in KEYS:
        assert ("vbatch_batch_requests_per_second", (("batch_id", b_batch if key == KEYS[1] else a_batch),)) in seen[
            key
        ]
        assert seen[key][("vbatch_batches", (("status", "in_progress"),))] == 2  # service-wide: everyone's
        assert seen[key][("vbatch_lines_waiting", ())] == 2
