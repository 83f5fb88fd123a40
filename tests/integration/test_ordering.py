"""Prefix-aware feeding: lines that share a long prefix are sent to the engine together, nothing else added."""

from __future__ import annotations

import asyncio
from collections import Counter

from app.domain.input_index import PREFIX_CHARS, InputIndex
from app.domain.validation import Limits, validate_file
from app.engine.batch.ordering import ordered_lines, pin_to_ranks, plan
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, upload, wait_status

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
        return [r["custom_id"] async for _, r, _ in ordered_lines(path, index, groups, skip={0})]

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


def test_each_shared_prefix_group_is_pinned_to_one_rank_largest_first(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(interleaved()))
    groups = plan(indexed(path))
    pin_to_ranks(groups, 1)
    assert [g.rank for g in groups] == [None] * 5  # one rank: the engine places every line
    pin_to_ranks(groups, 2)
    # A (6 lines) and B (6) on ranks of their own; D (2) on the rank with fewer lines; lines without one unpinned.
    assert [(g.shared_prefix, len(g.positions), g.rank) for g in groups] == [
        (True, 6, 0), (True, 6, 1), (False, 2, None), (True, 2, 0), (False, 5, None),
    ]  # fmt: skip


def test_the_service_sends_a_groups_lines_to_its_rank(settings):
    from app.testing import FakeEngine

    engine = FakeEngine(data_parallel_size=2)
    lines = interleaved()
    with app_on(settings, engine) as client:
        done = wait_status(client, create_batch(client, upload(client, jsonl(lines))["id"])["id"], {"completed"})
    assert done["request_counts"]["completed"] == len(lines)
    rank_of = {
        b["messages"][0]["content"]: r for b, r in zip(engine.executor.bodies, engine.executor.ranks, strict=True)
    }
    ranks_by_task: dict[str, set] = {}
    for line in lines:
        content = line["body"]["messages"][0]["content"]
        task = line["custom_id"][0] if line["custom_id"][0] in "ABCD" else "none"
        ranks_by_task.setdefault(task, set()).add(rank_of[content])
    assert ranks_by_task == {"A": {0}, "B": {1}, "D": {0}, "C": {None}, "none": {None}}
