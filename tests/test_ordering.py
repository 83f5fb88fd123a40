"""Prefix-aware feeding: lines that share a long prefix are sent to the engine together, nothing else added."""

from __future__ import annotations

import asyncio
from collections import Counter

from app.domain.input_index import PREFIX_CHARS, InputIndex
from app.domain.validation import Limits, validate_file
from app.engine.ordering import ordered_lines, plan
from tests.helpers import create_batch, jsonl, read_jsonl, upload, wait_status

INSTRUCTIONS = {name: f"Task {name}: " + "label the row carefully. " * (PREFIX_CHARS // 20) for name in "ABCD"}


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
        if i in (1, 4):
            lines.append(task_line(f"D{i}", "D", "one of two"))
    lines.append(task_line("C0", "C", "only one"))
    return lines


def indexed(path) -> InputIndex:
    limits = Limits(
        endpoint="/v1/chat/completions",
        served_models=frozenset({"fake-model"}),
        max_requests=100,
        max_line_bytes=1 << 20,
    )
    report = validate_file(path, limits)
    assert report.ok, report.errors
    return report.index


def test_plan_groups_shared_prefixes_in_first_appearance_order(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = interleaved()
    path.write_bytes(jsonl(lines))
    groups = plan(indexed(path))
    ids = [[lines[p]["custom_id"] for p in g.positions] for g in groups]
    assert [g.shared_prefix for g in groups] == [True, True, False, True, False]
    assert ids[0] == [f"A{i}" for i in range(6)] and ids[1] == [f"B{i}" for i in range(6)]
    # Two lines are enough to group; lines whose prefix nobody shares keep their relative order between groups.
    assert ids[2] == ["s0", "s1"] and ids[3] == ["D1", "D4"]
    assert ids[4] == [f"s{i}" for i in range(2, 6)] + ["C0"]


def test_ordered_lines_follow_the_plan_and_skip_done(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = interleaved()
    path.write_bytes(jsonl(lines))
    index = indexed(path)
    groups = plan(index)

    async def collect() -> list[str]:
        return [r["custom_id"] async for _, r in ordered_lines(path, index, groups, skip={0})]

    planned = [lines[p]["custom_id"] for g in groups for p in g.positions if p != 0]
    assert asyncio.run(collect()) == planned and "A0" not in planned


def test_service_feeds_lines_in_plan_order_and_nothing_else(client, fake_engine):
    lines = interleaved()
    source = upload(client, jsonl(lines))
    done = wait_status(client, create_batch(client, source["id"])["id"], {"completed"})
    outputs = read_jsonl(client, done["output_file_id"])
    assert Counter(o["custom_id"] for o in outputs) == Counter(x["custom_id"] for x in lines)
    assert fake_engine.executor.calls == len(lines) == done["request_counts"]["completed"]
    sent = [b["messages"][0]["content"] for b in fake_engine.executor.bodies]
    assert [text[:6] for text in sent[:12]] == ["Task A"] * 6 + ["Task B"] * 6
