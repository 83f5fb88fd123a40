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
