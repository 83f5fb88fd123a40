"""`POST /v1/batches/{id}/retry` and `vbatch merge`, on the real app with SQLite and files (the cancel-midway case on
Postgres with an S3 store too) over the fake engine: exactly the lines that may succeed on a second try run again,
byte for byte; the others are listed; merging the chain gives every custom_id once, in the input's order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app import cli
from app.core.config import Settings
from app.domain import retry as retry_module
from app.domain.results import ResultHead, error_outcome, line_for, result_head
from app.domain.retry import failure_of
from tests.helpers import FINAL, app_on, create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

CSRF = re.compile(r'<meta name="csrf-token" content="([^"]*)">')


def retry(client: TestClient, batch_id: str, **body) -> dict:
    response = client.post(f"/v1/batches/{batch_id}/retry", json=body or None)
    assert response.status_code == 200, response.text
    return response.json()


def refusal(client: TestClient, batch_id: str, status: int, **body) -> dict:
    response = client.post(f"/v1/batches/{batch_id}/retry", json=body or None)
    assert response.status_code == status, response.text
    return response.json()["error"]


def file_lines(client: TestClient, file_id: str) -> list[bytes]:
    return client.get(f"/v1/files/{file_id}/content").content.splitlines()


def cancelled_midway(client: TestClient, fake_engine, *, lines: int, answered: int, **create) -> tuple[bytes, dict]:
    """A batch of r0, r1, ... cancelled after the engine answered its first `answered` lines; the engine then
    answers everything."""
    content = jsonl([request_line(f"r{i}") for i in range(lines)])
    fake_engine.executor.answer_first = answered
    batch = create_batch(client, upload(client, content)["id"], **create)
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == answered)
    client.post(f"/v1/batches/{batch['id']}/cancel")
    done = wait_status(client, batch["id"], {"cancelled"})
    fake_engine.executor.answer_first = None
    return content, done


def merged(out: Path, *argv: str) -> list[dict]:
    cli.merge([*argv, "-o", str(out)])
    return [json.loads(line) for line in out.read_bytes().splitlines()]


def with_service_env(monkeypatch, settings: Settings) -> None:
    """`vbatch merge BATCH` finds the service's database and store as the service does: in its environment."""
    for name, value in (("VBATCH_DATABASE_URL", settings.database_url), ("VBATCH_STORAGE_URL", settings.storage_url)):
        if value is not None:
            monkeypatch.setenv(name, value)


@pytest.mark.both_backends
def test_a_batch_cancelled_midway_is_retried_with_exactly_its_unrun_lines(
    client, fake_engine, settings, tmp_path, monkeypatch
):
    content, cancelled = cancelled_midway(client, fake_engine, lines=10, answered=3, metadata={"job": "nightly"})
    answer = retry(client, cancelled["id"])
    new = answer["batch"]
    assert answer["object"] == "batch.retry" and answer["retried"] == 7
    assert answer["not_retried_count"] == 0 and answer["not_retried"] == []
    assert new["metadata"] == {"job": "nightly", "retry_of": cancelled["id"]}
    assert (new["endpoint"], new["completion_window"]) == (cancelled["endpoint"], cancelled["completion_window"])
    unrun = {e["custom_id"] for e in read_jsonl(client, cancelled["error_file_id"])}
    original = content.splitlines()
    # The unrun lines, byte for byte and in input order: which ones they are is the engine's doing, not the test's.
    assert file_lines(client, new["input_file_id"]) == [
        line for line in original if json.loads(line)["custom_id"] in unrun
    ]
    done = wait_status(client, new["id"], {"completed"})
    assert done["request_counts"] == {"total": 7, "completed": 7, "failed": 0}

    with_service_env(monkeypatch, settings)
    by_id = merged(tmp_path / "merged.jsonl", new["id"], "--data-dir", str(settings.data_dir))
    assert [line["custom_id"] for line in by_id] == [f"r{i}" for i in range(10)]
    assert all(line["response"]["status_code"] == 200 for line in by_id)
    retried_ids = {o["custom_id"] for o in read_jsonl(client, done["output_file_id"])}
    assert retried_ids == unrun


def test_a_retry_of_a_retry_and_a_second_retry_and_merging_by_files(client, fake_engine, tmp_path):
    content, cancelled = cancelled_midway(client, fake_engine, lines=6, answered=2)
    fake_engine.executor.answer_first = fake_engine.executor.calls + 2  # the retry is cancelled midway too
    first = retry(client, cancelled["id"])["batch"]
    wait_for(lambda: client.get(f"/v1/batches/{first['id']}").json()["request_counts"]["completed"] == 2)
    client.post(f"/v1/batches/{first['id']}/cancel")
    first = wait_status(client, first["id"], {"cancelled"})
    fake_engine.executor.answer_first = None
    # Not idempotent: a second retry of the same batch is another batch of the same lines.
    again = retry(client, cancelled["id"])["batch"]
    assert file_lines(client, again["input_file_id"]) == file_lines(client, first["input_file_id"])
    second = retry(client, first["id"])["batch"]
    assert second["metadata"] == {"retry_of": first["id"]} and len(file_lines(client, second["input_file_id"])) == 2
    second = wait_status(client, second["id"], {"completed"})
    wait_status(client, again["id"], {"completed"})
    # Results of the chain as files, oldest batch first (`again` is left out: it is no part of this chain's files).
    paths = []
    for batch in (cancelled, first, second):
        for kind in ("output_file_id", "error_file_id"):
            if batch[kind]:
                paths.append(tmp_path / batch[kind])
                paths[-1].write_bytes(client.get(f"/v1/files/{batch[kind]}/content").content)
    (tmp_path / "in.jsonl").write_bytes(content)
    lines = merged(tmp_path / "by-files.jsonl", "--input", str(tmp_path / "in.jsonl"), *map(str, paths))
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in lines)
    finals = {o["custom_id"]: o for b in (cancelled, first, second) for o in read_jsonl(client, b["output_file_id"])}
    assert lines == [finals[f"r{i}"] for i in range(6)]  # each success copied from the batch that had it


def test_lines_answered_400_are_listed_and_those_answered_500_retried(client, fake_engine, tmp_path):
    lines = [
        request_line("ok-1"),
        request_line("bad", max_tokens=-1),
        request_line("boom", server_error=True),
        request_line("ok-2"),
    ]
    content = jsonl(lines)
    done = wait_status(client, create_batch(client, upload(client, content)["id"])["id"], {"completed"})
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    answer = retry(client, done["id"])
    assert answer["retried"] == 1 and answer["not_retried_count"] == 1
    assert answer["not_retried"] == [
        {"custom_id": "bad", "line": 2, "status_code": 400, "reason": "invalid_value: max_tokens must be positive"}
    ]
    assert file_lines(client, answer["batch"]["input_file_id"]) == [content.splitlines()[2]]
    again = wait_status(client, answer["batch"]["id"], {"completed"})  # the fake's 500 is the same every time
    (tmp_path / "in.jsonl").write_bytes(content)
    files = []
    for batch in (done, again):
        for kind in ("output_file_id", "error_file_id"):
            if batch[kind]:
                files.append(tmp_path / batch[kind])
                files[-1].write_bytes(client.get(f"/v1/files/{batch[kind]}/content").content)
    merged_lines = merged(tmp_path / "m.jsonl", "--input", str(tmp_path / "in.jsonl"), *map(str, files))
    assert [(line["custom_id"], line["response"]["status_code"]) for line in merged_lines] == [
        ("ok-1", 200),
        ("bad", 400),
        ("boom", 500),
        ("ok-2", 200),
    ]
    # The last error of the chain: the retry's line, not the first batch's.
    assert merged_lines[2] == read_jsonl(client, again["error_file_id"])[0]


def test_merge_gives_lines_without_a_result_an_error_and_refuses_another_jobs_results(client, fake_engine, tmp_path):
    content, cancelled = cancelled_midway(client, fake_engine, lines=5, answered=2)
    (tmp_path / "in.jsonl").write_bytes(content)
    output = tmp_path / "out.jsonl"
    output.write_bytes(client.get(f"/v1/files/{cancelled['output_file_id']}/content").content)
    lines = merged(tmp_path / "m.jsonl", "--input", str(tmp_path / "in.jsonl"), str(output))
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(5)]
    codes = [line["error"]["code"] if line["error"] else None for line in lines]
    assert codes.count(None) == 2 and codes.count("no_result") == 3
    (tmp_path / "other.jsonl").write_bytes(jsonl([request_line("x")]))
    with pytest.raises(SystemExit) as refused:
        merged(tmp_path / "refused.jsonl", "--input", str(tmp_path / "other.jsonl"), str(output))
    assert refused.value.code == 2 and not (tmp_path / "refused.jsonl").exists()


def test_merge_never_writes_over_a_file_it_reads_nor_merges_an_input_no_batch_ran(
    client, fake_engine, tmp_path, monkeypatch, settings, capsys
):
    content, cancelled = cancelled_midway(client, fake_engine, lines=3, answered=1)
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(content)
    results.write_bytes(client.get(f"/v1/files/{cancelled['output_file_id']}/content").content)
    for output in (source, results, tmp_path / "." / "in.jsonl"):
        with pytest.raises(SystemExit) as refused:
            merged(output, "--input", str(source), str(results))
        assert refused.value.code == 2 and "a file the merge reads" in capsys.readouterr().err
    assert source.read_bytes() == content  # the requests are still there

    twice = tmp_path / "twice.jsonl"
    twice.write_bytes(content + jsonl([request_line("r0")]))
    with pytest.raises(SystemExit):
        merged(tmp_path / "m.jsonl", "--input", str(twice), str(results))
    assert "repeats the custom_id 'r0' of line 1" in capsys.readouterr().err

    never_ran = create_batch(client, upload(client, jsonl([request_line("a"), request_line("a")]))["id"])
    assert wait_status(client, never_ran["id"], {"failed"})["status"] == "failed"
    with_service_env(monkeypatch, settings)
    with pytest.raises(SystemExit):
        merged(tmp_path / "m.jsonl", never_ran["id"], "--data-dir", str(settings.data_dir))
    assert "failed before it ran a line" in capsys.readouterr().err
    assert not (tmp_path / "m.jsonl").exists()


def test_what_cannot_be_retried_gets_a_clear_error(client, fake_engine):
    fake_engine.executor.answer_first = 0
    running = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    wait_status(client, running["id"], {"in_progress"})
    assert refusal(client, running["id"], 409)["code"] == "batch_not_ended"
    client.post(f"/v1/batches/{running['id']}/cancel")
    wait_status(client, running["id"], {"cancelled"})
    fake_engine.executor.answer_first = None
    assert refusal(client, "batch_nope", 404)["message"] == "No such Batch object: batch_nope"

    invalid = create_batch(client, upload(client, jsonl([request_line("a"), request_line("a")]))["id"])
    wait_status(client, invalid["id"], {"failed"})
    assert refusal(client, invalid["id"], 400)["code"] == "batch_never_ran"

    good = wait_status(client, create_batch(client, upload(client, jsonl([request_line("a")]))["id"])["id"], FINAL)
    error = refusal(client, good["id"], 400)
    assert error["code"] == "nothing_to_retry" and "Every line" in error["message"]

    bad = create_batch(client, upload(client, jsonl([request_line("b", max_tokens=-1)]))["id"])
    error = refusal(client, wait_status(client, bad["id"], FINAL)["id"], 400)
    assert error["code"] == "nothing_to_retry" and "line 1: 400 invalid_value" in error["message"]

    assert client.delete(f"/v1/files/{running['input_file_id']}").status_code == 200
    assert refusal(client, running["id"], 400)["code"] == "input_file_not_found"


def test_full_metadata_is_refused_unless_the_body_replaces_it(client, fake_engine):
    full = {f"k{i}": "v" for i in range(16)}
    _, cancelled = cancelled_midway(client, fake_engine, lines=3, answered=1, metadata=full)
    error = refusal(client, cancelled["id"], 400)
    assert error["code"] == "metadata_full" and error["param"] == "metadata"
    assert "has 16 pairs, so `retry_of` would make 17" in error["message"]
    assert client.get("/v1/batches").json()["data"][0]["id"] == cancelled["id"]  # nothing was created
    answer = retry(client, cancelled["id"], metadata={"job": "retry"})
    assert answer["batch"]["metadata"] == {"job": "retry", "retry_of": cancelled["id"]}
    sent = refusal(client, cancelled["id"], 400, metadata={f"k{i}": "v" for i in range(16)})
    assert sent["code"] == "metadata_full"
    assert sent["message"].startswith("'metadata' has 16 pairs, and the retry adds `retry_of`: 17 in all")


def test_another_keys_batch_is_not_found(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", api_keys="sk-retry-a-0123456789,sk-retry-b-0123456789")
    with app_on(settings) as client:
        client.headers["Authorization"] = "Bearer sk-retry-a-0123456789"
        done = wait_status(client, create_batch(client, upload(client, jsonl([request_line("a")]))["id"])["id"], FINAL)
        other = TestClient(client.app, headers={"Authorization": "Bearer sk-retry-b-0123456789"})
        assert refusal(other, done["id"], 404)["code"] is None


def test_the_consoles_retry_needs_its_token_and_shows_only_where_lines_can_run_again(client, fake_engine):
    _, cancelled = cancelled_midway(client, fake_engine, lines=4, answered=1)
    page = client.get(f"/console/batches/{cancelled['id']}")
    assert "Retry 3 lines" in page.text
    token = CSRF.search(page.text)
    assert token is not None
    form = f"/console/batches/{cancelled['id']}/retry"
    assert client.post(form, follow_redirects=False).status_code == 403
    assert len(client.get("/v1/batches").json()["data"]) == 1
    created = client.post(form, data={"csrf_token": token.group(1)}, follow_redirects=False)
    assert created.status_code == 303
    new_id = created.headers["location"].rsplit("/", 1)[-1]
    new = wait_status(client, new_id, {"completed"})
    assert new["metadata"] == {"retry_of": cancelled["id"]}
    again = client.get(f"/console/batches/{new_id}").text
    assert 'id="retry"' not in again and f'href="/console/batches/{cancelled["id"]}"' in again


def _error_line(status: int | None, code: str = "x") -> dict:
    if status is None:
        return {"id": "batch_req_1", "custom_id": "c", "response": None, "error": {"code": code, "message": "m"}}
    body = {"error": {"message": "m", "type": "T", "param": None, "code": status}}
    return {"id": "batch_req_1", "custom_id": "c", "response": {"status_code": status, "body": body}, "error": None}


@pytest.mark.parametrize(
    ("line", "retryable"),
    [
        (_error_line(None, "batch_expired"), True),
        (_error_line(None, "batch_cancelled"), True),
        (_error_line(None, "engine_crashed"), True),
        (_error_line(500), True),
        (_error_line(503), True),
        (_error_line(429), True),
        (_error_line(400), False),
        (_error_line(404), False),
        (_error_line(413), False),
    ],
)
def test_which_failures_a_second_try_may_change(line, retryable):
    assert failure_of(line).retryable is retryable


def test_a_result_line_is_read_in_any_layout_and_one_that_is_not_is_refused():
    written = line_for(error_outcome("c\u00e9", "batch_expired", "late"))
    assert result_head(written.rstrip(b"\n")) == ResultHead("c\u00e9", None)
    reordered = {"response": {"body": {}, "status_code": 200}, "custom_id": "d", "id": "x", "error": None}
    assert result_head(json.dumps(reordered, indent=1).encode()).succeeded
    with pytest.raises(ValueError):
        result_head(b'{"custom_id": 3}')


def test_merge_answers_a_line_nested_past_the_parsers_stack_in_one_line(tmp_path, capsys):
    """200,000 levels: Python's parser gives up with a RecursionError (a traceback, exit 1); merge reads the input's
    line as no request, as any line that is not one, and refuses the result file's in one line with exit 2."""
    deep = "[" * 200_000 + "]" * 200_000
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([request_line("a")]) + f'{{"custom_id": "b", "body": {deep}}}\n'.encode())
    results.write_bytes(line_for(error_outcome("a", "batch_expired", "late")))
    lines = merged(tmp_path / "m.jsonl", "--input", str(source), str(results))
    assert [line["custom_id"] for line in lines] == ["a"]
    capsys.readouterr()
    results.write_bytes(f'{{"id": {deep}, "custom_id": "a"}}\n'.encode())
    with pytest.raises(SystemExit) as refused:
        merged(tmp_path / "m2.jsonl", "--input", str(source), str(results))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err == f"vbatch merge: {results} line 1 is not a batch result line.\n"
    assert not (tmp_path / "m2.jsonl").exists()


def test_a_retry_whose_input_is_deleted_as_it_reads_gets_the_gone_inputs_400(client, fake_engine, monkeypatch):
    """The race an outside probe hit 3 times in 30: the input deleted after the plan read it and before the new
    input was copied out of it (a 500, FileNotFoundError). The delete comes exactly there."""
    _, cancelled = cancelled_midway(client, fake_engine, lines=4, answered=1)
    planned = retry_module.plan

    def plan_then_delete(sources):
        chosen = planned(sources)
        assert client.delete(f"/v1/files/{cancelled['input_file_id']}").status_code == 200
        return chosen

    monkeypatch.setattr(retry_module, "plan", plan_then_delete)
    error = refusal(client, cancelled["id"], 400)
    assert (error["code"], error["param"]) == ("input_file_not_found", "batch_id")
    assert [b["id"] for b in client.get("/v1/batches").json()["data"]] == [cancelled["id"]]  # nothing was created
    assert [f["filename"] for f in client.get("/v1/files").json()["data"] if "retry" in f["filename"]] == []
