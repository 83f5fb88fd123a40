"""Prefix-aware feeding: shared-prefix lines go together, each group behind a one-token warm-up."""

from __future__ import annotations

import asyncio
from collections import Counter

from app.engine.ordering import PREFIX_CHARS, ordered_lines, plan, warm_up_body
from tests.helpers import create_batch, jsonl, read_jsonl, upload, wait_status

INSTRUCTIONS = {name: f"Task {name}: " + "label the row carefully. " * (PREFIX_CHARS // 20) for name in "ABC"}


def task_line(custom_id: str, task: str | None, row: str) -> dict:
    content = f"{INSTRUCTIONS[task]}\nRow: {row}" if task else f"Short question {row}"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 5}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def interleaved() -> list[dict]:
    lines = []
    for i in range(6):
        for task in "AB":
            lines.append(task_line(f"{task}{i}", task, str(i)))
        lines.append(task_line(f"s{i}", None, str(i)))
    lines.append(task_line("C0", "C", "only one"))
    return lines


def test_plan_groups_shared_prefixes_in_first_appearance_order(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = interleaved()
    path.write_bytes(jsonl(lines))
    groups = plan(path)
    ids = [[lines[n - 1]["custom_id"] for n in g.numbers] for g in groups]
    assert [g.shared_prefix for g in groups] == [True, True, False]
    assert ids[0] == [f"A{i}" for i in range(6)] and ids[1] == [f"B{i}" for i in range(6)]
    # Lines without a shared prefix (and a group too small to warm) keep their relative order.
    assert ids[2] == [f"s{i}" for i in range(6)] + ["C0"]


def test_ordered_lines_warms_each_group_once_and_skips_done(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = interleaved()
    path.write_bytes(jsonl(lines))
    warmed: list[str] = []

    async def warm(number: int, body: dict) -> None:
        warmed.append(body["messages"][0]["content"][:6])

    async def collect() -> list[str]:
        return [r["custom_id"] async for _, r in ordered_lines(path, plan(path), skip={1}, warm=warm)]

    fed = asyncio.run(collect())
    assert warmed == ["Task A", "Task B"]
    assert "A0" not in fed and Counter(fed) == Counter(x["custom_id"] for x in lines[1:])


def test_warm_up_is_one_token():
    body = {"model": "m", "messages": [], "max_completion_tokens": 300, "n": 4}
    assert warm_up_body(body) == {"model": "m", "messages": [], "max_tokens": 1}
    assert warm_up_body({"model": "m", "input": "x", "max_output_tokens": 9})["max_output_tokens"] == 1


def test_service_feeds_groups_behind_warm_ups_and_writes_no_warm_up_line(client, fake_engine):
    source = upload(client, jsonl(interleaved()))
    done = wait_status(client, create_batch(client, source["id"])["id"], {"completed"})
    outputs = read_jsonl(client, done["output_file_id"])
    assert Counter(o["custom_id"] for o in outputs) == Counter(x["custom_id"] for x in interleaved())
    assert fake_engine.executor.calls == len(interleaved()) + 2
    assert done["request_counts"]["completed"] == len(interleaved())
    first = fake_engine.executor.bodies[0]
    assert first["max_tokens"] == 1 and first["messages"][0]["content"].startswith("Task A")
