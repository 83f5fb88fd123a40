"""JSON logs from a real server process (fake engine): every line parses, the client's request id is there, and
no key or prompt is."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from app.testing import VbatchServer, free_port
from tests.helpers import jsonl, request_line, wait_for

KEY = "sk-log-test-key-7f3a"
PROMPT_MARKER = "PROMPT-MARKER-91c2"


def test_json_logs_parse_carry_the_request_id_and_hold_no_key_or_prompt(tmp_path: Path):
    env = {"VBATCH_LOG_FORMAT": "json", "VBATCH_API_KEYS": KEY, "VBATCH_DISK_RESERVE_BYTES": "0"}
    server = VbatchServer(tmp_path / "data", free_port(), [], tmp_path / "serve.log", env=env, fake_engine=True)
    try:
        server.wait_ready(60)
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:
            content = jsonl([request_line(f"r{i}", user=PROMPT_MARKER) for i in range(3)])
            uploaded = http.post(
                "/v1/files",
                files={"file": ("in.jsonl", content)},
                data={"purpose": "batch"},
                headers={"x-request-id": "client-req-42"},
            )
            assert uploaded.headers["x-request-id"] == "client-req-42"
            body = {
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            batch = http.post("/v1/batches", json=body).json()
            wait_for(lambda: http.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed")
            assert http.get("/v1/files", headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"] != (
                "bad id with spaces"
            )
            assert http.get("/v1/files", headers={"authorization": "Bearer sk-wrong-key-4b1d"}).status_code == 401
    finally:
        server.stop()
    text = (tmp_path / "serve.log").read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    [upload_record] = [r for r in records if r.get("request_id") == "client-req-42"]
    assert upload_record["path"] == "/v1/files" and upload_record["status"] == 200
    assert any(r.get("batch_id") == batch["id"] and r.get("event") == "batch.completed" for r in records)
    assert any(r.get("status") == 401 for r in records)
    assert KEY not in text and "sk-wrong-key-4b1d" not in text and PROMPT_MARKER not in text
