"""/metrics in Prometheus text format, parsed with prometheus_client's own parser (fake engine; the real engine's
`vllm:` series are checked end to end in tests/e2e/test_operations.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import FINAL, app_on, create_batch, jsonl, request_line, upload, wait_for, wait_status

pytestmark = pytest.mark.both_backends


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_counters_agree_with_the_batch_and_the_state_is_read_at_scrape_time(client, fake_engine):
    fake_engine.executor.answer_first = 2
    lines = [request_line(f"r{i}") for i in range(4)] + [request_line("bad", max_tokens=-1)]
    running = create_batch(client, upload(client, jsonl(lines))["id"])
    wait_for(lambda: client.get(f"/v1/batches/{running['id']}").json()["request_counts"]["completed"] == 2)
    during = scrape(client)
    assert during[("vbatch_batches", (("status", "in_progress"),))] == 1
    assert during[("vbatch_lines_waiting", ())] == 3
    assert ("vbatch_batch_requests_per_second", (("batch_id", running["id"]),)) in during
    assert ("vbatch_batch_output_tokens_per_second", (("batch_id", running["id"]),)) in during
    assert during[("vbatch_engine_up", ())] == 1

    fake_engine.executor.gate.set()
    done = wait_status(client, running["id"], FINAL)
    invalid = create_batch(client, upload(client, jsonl([request_line("x", model="no-such-model")]))["id"])
    wait_status(client, invalid["id"], FINAL)
    # The publish histogram is observed once the run's files are gone, a moment after the batch reads completed.
    after = wait_for(lambda: (now := scrape(client))[("vbatch_publish_seconds_count", ())] == 1 and now)
    usage = done["usage"]
    assert after[("vbatch_requests_total", (("outcome", "completed"),))] == done["request_counts"]["completed"] == 4
    assert after[("vbatch_requests_total", (("outcome", "failed"),))] == done["request_counts"]["failed"] == 1
    assert after[("vbatch_tokens_total", (("kind", "prompt"),))] == usage["input_tokens"]
    assert after[("vbatch_tokens_total", (("kind", "cached"),))] == usage["input_tokens_details"]["cached_tokens"]
    assert after[("vbatch_tokens_total", (("kind", "output"),))] == usage["output_tokens"]
    assert after[("vbatch_validation_failures_total", (("code", "model_not_found"),))] == 1
    assert after[("vbatch_batches", (("status", "completed"),))] == 1
    assert after[("vbatch_batches", (("status", "failed"),))] == 1
    assert after[("vbatch_lines_waiting", ())] == 0
    assert after[("vbatch_publish_seconds_count", ())] == 1
    assert after[("vbatch_checkpoint_seconds_count", ())] >= 1
    assert after[("vbatch_engine_restarts_total", ())] == 0
    assert after[("fake_engine_requests_total", ())] == 4  # the engine's own series come first, as they are
    assert not any(name.startswith("vbatch_batch_requests_per_second") for name, _ in after)  # none running


def test_metrics_need_a_key_when_keys_are_configured(settings, engine_service):
    settings.api_keys = "sk-alice"
    with app_on(settings, engine_service.factory) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"authorization": "Bearer sk-alice"}).status_code == 200
