"""Batch, File, list and error JSON checked against OpenAI's official schemas."""

from __future__ import annotations

import jsonschema
import pytest

from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_status
from tests.schemas import validate


def test_file_objects_match_openai_file(client):
    created = upload(client, jsonl([request_line("a")]))
    validate(created, "OpenAIFile")
    validate(client.get("/v1/files").json(), "ListFilesResponse")
    validate(client.delete(f"/v1/files/{created['id']}").json(), "DeleteFileResponse")


def test_batch_objects_match_openai_batch(client):
    source = upload(client, jsonl([request_line("a"), request_line("b", max_tokens=-1)]))
    batch = create_batch(client, source["id"], metadata={"k": "v"})
    validate(batch, "Batch")
    done = wait_status(client, batch["id"], {"completed"})
    validate(done, "Batch")
    validate(client.get("/v1/batches").json(), "ListBatchesResponse")
    for line in read_jsonl(client, done["output_file_id"]) + read_jsonl(client, done["error_file_id"]):
        validate(line, "BatchRequestOutput", document=1)


def test_failed_batch_errors_match(client):
    source = upload(client, b'{"custom_id": "a"}\n')
    validate(wait_status(client, create_batch(client, source["id"])["id"], {"failed"}), "Batch")


def test_error_envelope_matches(client):
    validate(client.get("/v1/files/file-x").json(), "ErrorResponse")
    validate(client.post("/v1/batches", json={}).json(), "ErrorResponse")


def test_the_checker_can_fail():
    with pytest.raises(jsonschema.ValidationError):
        validate({"id": "batch_x", "object": "batch", "status": "sleeping"}, "Batch")
