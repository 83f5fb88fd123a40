"""Retry on the real CPU engine through the official SDK: a batch cancelled midway is retried in one call
(`client.post`, a vbatch extension), the retry completes exactly the lines the cancel left, and `vbatch merge` joins
both into one file with every custom_id once, in the input's order, each a real answer."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from tests.e2e.conftest import ROOT
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal, wait_until
from tests.helpers import holding


def test_a_cancelled_batch_is_retried_and_merged_with_its_retry(openai_client, server, tmp_path):
    lines = [chat_line(f"q{i}", f"What is {i} plus {i}?", max_tokens=8) for i in range(12)]
    with holding(server.data_dir):  # at most 4 lines run: the cancel is certain to land mid-run
        batch = submit(openai_client, lines, metadata={"job": "retry-e2e"})
        wait_until(openai_client, batch.id, lambda b: b.request_counts.completed >= 1)
        openai_client.batches.cancel(batch.id)
        cancelled = wait_terminal(openai_client, batch.id, timeout=120)
    assert cancelled.status == "cancelled"
    unrun = [line["custom_id"] for line in lines_of(openai_client, cancelled.error_file_id)]
    assert unrun

    answer = openai_client.post(f"/batches/{batch.id}/retry", cast_to=httpx.Response).json()
    assert answer["retried"] == len(unrun) and answer["not_retried_count"] == 0
    retry = openai_client.batches.retrieve(answer["batch"]["id"])
    assert retry.metadata == {"job": "retry-e2e", "retry_of": batch.id}
    sent = [json.loads(line) for line in openai_client.files.content(retry.input_file_id).text.splitlines()]
    assert [line["custom_id"] for line in sent] == sorted(unrun, key=lambda custom_id: int(custom_id[1:]))
    done = wait_terminal(openai_client, retry.id, timeout=300)
    assert done.status == "completed" and done.request_counts.completed == len(unrun)

    merged_path = tmp_path / "merged.jsonl"
    command = [sys.executable, "-m", "app", "merge", batch.id, "--data-dir", str(server.data_dir)]
    subprocess.run([*command, "-o", str(merged_path)], cwd=ROOT, check=True, timeout=120)
    merged = [json.loads(line) for line in merged_path.read_text().splitlines()]
    assert [line["custom_id"] for line in merged] == [f"q{i}" for i in range(12)]
    assert all(line["response"]["status_code"] == 200 for line in merged)
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in merged)
