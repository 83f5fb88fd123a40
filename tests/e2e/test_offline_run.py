"""`vbatch run`: the offline drop-in for `vllm run-batch` writes the service's line formats."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import MODEL, ROOT, engine_flags
from tests.e2e.helpers import chat_line, to_jsonl
from tests.schemas import validate


def test_vbatch_run_writes_output_and_error_files(tmp_path, model_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(to_jsonl([chat_line("a", "Say yes."), chat_line("b", "Say no."), chat_line("x", "Hi", -1)]))
    output, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    command = [sys.executable, "-m", "app", "run", "-i", str(source), "-o", str(output), "--error-file", str(errors)]
    finished = subprocess.run(command + engine_flags(model_path), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    outputs = [json.loads(line) for line in output.read_text().splitlines()]
    failures = [json.loads(line) for line in errors.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == ["a", "b"]
    assert [f["custom_id"] for f in failures] == ["x"]
    for line in outputs + failures:
        validate(line, "BatchRequestOutput", document=1)
        assert set(line) == {"id", "custom_id", "response", "error"}
    assert all(o["response"]["body"]["model"] == MODEL for o in outputs)
    assert failures[0]["response"]["status_code"] == 400 and failures[0]["error"] is None
    assert "2 succeeded, 1 failed" in finished.stderr


def test_vbatch_run_embeds_with_a_pooling_engine(tmp_path, model_path):
    lines = [
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hello"}},
        {"custom_id": "two", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": ["a", "b"]}},
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(to_jsonl(lines))
    command = [sys.executable, "-m", "app", "run", "-i", str(source), "-o", str(output), "--runner", "pooling"]
    finished = subprocess.run(command + engine_flags(model_path), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    outputs = {o["custom_id"]: o for o in map(json.loads, output.read_text().splitlines())}
    assert set(outputs) == {"one", "two"}
    for custom_id, count in (("one", 1), ("two", 2)):
        body = outputs[custom_id]["response"]["body"]
        assert body["object"] == "list" and len(body["data"]) == count
        vectors = [item["embedding"] for item in body["data"]]
        assert len({len(v) for v in vectors}) == 1 and all(any(x != 0 for x in v) for v in vectors)
        assert body["usage"]["prompt_tokens"] > 0
