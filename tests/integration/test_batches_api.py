"""The batch lifecycle through the HTTP API, on the real loop and SQLite with the fake executor."""

from __future__ import annotations

import pytest

from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

pytestmark = pytest.mark.both_backends

BATCH_KEYS = {
    "id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "usage",
    "metadata",
}  # fmt: skip


def test_batch_completes_with_output_and_error_files(client):
    lines = [request_line(f"r{i}") for i in range(6)] + [request_line("bad", max_tokens=-1)]
    source = upload(client, jsonl(lines))
    created = create_batch(client, source["id"], metadata={"job": "nightly"})
    assert set(created) == BATCH_KEYS
    assert created["object"] == "batch" and created["id"].startswith("batch_")
    assert created["status"] == "validating"
    assert created["expires_at"] == created["created_at"] + 86400
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert created["metadata"] == {"job": "nightly"}

    done = wait_status(client, created["id"], {"completed"})
    assert done["request_counts"] == {"total": 7, "completed": 6, "failed": 1}
    assert done["created_at"] <= done["in_progress_at"] <= done["finalizing_at"] <= done["completed_at"]
    assert done["model"] == "fake-model"
    assert done["usage"] == {
        "input_tokens": 30,
        "input_tokens_details": {"cached_tokens": 12},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 36,
    }
    outputs = read_jsonl(client, done["output_file_id"])
    errors = read_jsonl(client, done["error_file_id"])
    assert sorted(o["custom_id"] for o in outputs) == [f"r{i}" for i in range(6)]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in outputs)
    assert all(o["id"].startswith("batch_req_") for o in outputs)
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"] is None
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"

    output_file = client.get(f"/v1/files/{done['output_file_id']}").json()
    assert output_file["purpose"] == "batch_output"
    assert output_file["filename"] == f"{done['id']}_output.jsonl"


def test_a_finished_batch_logs_where_its_time_went(client, runner_log):
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(4)]))
    batch_id = wait_status(client, create_batch(client, source["id"])["id"], {"completed"})["id"]

    def timeline() -> dict | None:
        found = [r for r in runner_log.records if getattr(r, "batch_id", None) == batch_id and hasattr(r, "timeline")]
        return found[0].timeline if found else None

    stages = wait_for(timeline)  # a structured record, written just after the batch's final commit
    assert stages == client.get(f"/v1/batches/{batch_id}/progress").json()["timeline"]
    assert set(stages) == {"created", "planned", "all_sent", "first_result", "last_result", "published"}
    assert (
        stages["created"]
        <= 0
        <= stages["planned"]
        <= stages["first_result"]
        <= stages["last_result"]
        <= stages["published"]
    )
    assert stages["all_sent"] <= stages["published"]


def test_only_errors_means_no_output_file(client):
    source = upload(client, jsonl([request_line("bad", max_tokens=-1)]))
    done = wait_status(client, create_batch(client, source["id"])["id"], {"completed"})
    assert done["output_file_id"] is None and done["error_file_id"] is not None


def test_validation_failure_lists_lines(client):
    content = jsonl([request_line("a"), b"{not json", request_line("a"), request_line("b", url="/v1/embeddings")])
    source = upload(client, content)
    failed = wait_status(client, create_batch(client, source["id"])["id"], {"failed"})
    assert failed["failed_at"] is not None
    assert failed["output_file_id"] is None and failed["error_file_id"] is None
    assert failed["errors"]["object"] == "list"
    assert [(e["code"], e["line"]) for e in failed["errors"]["data"]] == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("mismatched_url", 4),
    ]


def test_cancel_keeps_finished_and_marks_the_rest(client, fake_engine):
    executor = fake_engine.executor
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(20)]))
    executor.answer_first = 3
    batch = create_batch(client, source["id"])
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 3)
    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert cancelling.status_code == 200
    assert cancelling.json()["status"] == "cancelling" and cancelling.json()["cancelling_at"] is not None
    again = client.post(f"/v1/batches/{batch['id']}/cancel", headers={"content-type": "application/json"})
    assert again.status_code == 200 and again.json()["status"] == "cancelling"
    done = wait_status(client, batch["id"], {"cancelled"})
    assert done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 20, "completed": 3, "failed": 17}
    outputs = read_jsonl(client, done["output_file_id"])
    errors = read_jsonl(client, done["error_file_id"])
    assert sorted(o["custom_id"] for o in outputs + errors) == sorted(f"r{i}" for i in range(20))
    assert {o["custom_id"] for o in outputs} == {"r0", "r1", "r2"}
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert all(e["response"] is None for e in errors)
    finished = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert finished.status_code == 400
    assert finished.json()["error"]["code"] == "batch_not_cancellable"


def test_expiry_keeps_results_and_writes_expired_lines(client, fake_engine):
    fake_engine.executor.answer_first = 2
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(10)]))
    batch = create_batch(client, source["id"], completion_window="2s")
    done = wait_status(client, batch["id"], {"expired"}, timeout=10)
    assert done["expired_at"] is not None and done["expired_at"] >= batch["expires_at"]
    assert done["request_counts"] == {"total": 10, "completed": 2, "failed": 8}
    assert len(read_jsonl(client, done["output_file_id"])) == 2
    errors = read_jsonl(client, done["error_file_id"])
    assert len(errors) == 8
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert errors[0]["error"]["message"] == "This request could not be executed before the completion window expired."


def test_batches_run_in_creation_order_and_list_pages(client):
    ids = []
    for n in range(3):
        source = upload(client, jsonl([request_line(f"b{n}-{i}") for i in range(3)]))
        ids.append(create_batch(client, source["id"])["id"])
    finished = [wait_status(client, batch_id, {"completed"}) for batch_id in ids]
    assert [b["in_progress_at"] for b in finished] == sorted(b["in_progress_at"] for b in finished)
    listing = client.get("/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in listing["data"]] == ids[::-1][:2] and listing["has_more"] is True
    rest = client.get("/v1/batches", params={"limit": 2, "after": listing["data"][-1]["id"]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False


def test_create_rejections(client):
    source = upload(client, jsonl([request_line("a")]))
    cases = [
        ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id", 400),
        ({"input_file_id": source["id"], "endpoint": "/v1/images", "completion_window": "24h"}, "endpoint", 400),
        ({"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"},
         "completion_window", 400),
        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
         "input_file_id", 404),
        ({"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
        ({"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {"k" * 65: "v"}}, "metadata", 400),
        ({"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {"k": "v" * 513}}, "metadata", 400),
        ({"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {"k": 5}}, "metadata.k", 400),
    ]  # fmt: skip
    for body, param, status in cases:
        response = client.post("/v1/batches", json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param
    missing = client.post("/v1/batches", json={"endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert missing.json()["error"]["code"] == "missing_required_parameter"
    assert client.get("/v1/batches").json()["data"] == []


def test_batch_needs_a_batch_purpose_file(client):
    other = upload(client, jsonl([request_line("a")]), purpose="user_data")
    response = client.post(
        "/v1/batches",
        json={"input_file_id": other["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_file_id"


def test_unknown_batch_is_404(client):
    for method, path in (("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel")):
        response = getattr(client, method)(path)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "No such Batch object: batch_x"


def test_malformed_json_body_is_400(client):
    response = client.post("/v1/batches", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_every_response_has_request_id(client):
    assert client.get("/v1/batches").headers["x-request-id"].startswith("req_")
    assert client.get("/nope").headers["x-request-id"].startswith("req_")
    assert client.get("/nope").json()["error"]["type"] == "invalid_request_error"


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok", "model": "fake-model", "problems": []}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["object"] == "model"


def test_poison_line_goes_to_the_error_file_and_the_rest_succeed(client, fake_engine):
    lines = [request_line(f"r{i}") for i in range(4)] + [request_line("poison", seed=1)]
    source = upload(client, jsonl(lines))
    batch = create_batch(client, source["id"])
    done = wait_status(client, batch["id"], {"completed"})
    assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    assert sorted(o["custom_id"] for o in read_jsonl(client, done["output_file_id"])) == [f"r{i}" for i in range(4)]
    [error] = read_jsonl(client, done["error_file_id"])
    assert error["custom_id"] == "poison" and error["error"]["code"] == "engine_crashed"
    # One death with all five in flight, then two with the poison alone (engine_deaths_per_line = 2).
    assert fake_engine.starts == 4
    assert client.get("/health").json()["status"] == "ok"


def test_engine_that_cannot_restart_keeps_results_and_the_api_up(client, fake_engine):
    fake_engine.fail_restarts = True
    lines = [request_line(f"r{i}") for i in range(4)] + [request_line("poison", seed=1)]
    source = upload(client, jsonl(lines))
    batch = create_batch(client, source["id"])
    wait_for(lambda: client.get("/health").status_code == 503)
    assert client.get("/health").json()["status"] == "down"
    current = client.get(f"/v1/batches/{batch['id']}").json()
    assert current["status"] == "in_progress"
    assert client.get("/v1/files").status_code == 200


def test_an_engine_that_dies_while_idle_is_restarted_and_health_says_so(client, fake_engine, engine_service):
    wait_for(lambda: client.get("/health").json()["status"] == "ok")  # the engine starts on its own thread
    assert fake_engine.starts == 1
    fake_engine.serving.alive = False
    wait_for(lambda: fake_engine.starts == 2 and client.get("/health").json()["status"] == "ok")
    assert engine_service.engine.deaths == 1
    done = wait_status(
        client, create_batch(client, upload(client, jsonl([request_line("a")]))["id"])["id"], {"completed"}
    )
    assert done["request_counts"]["completed"] == 1
