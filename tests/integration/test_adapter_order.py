"""Adapter-aware order (issue 30): the plan runs a file's lines adapter by adapter (the base model's a group of its
own), shared-prefix groups kept inside each; the feed lets lines of at most `--max-loras` adapters into the engine
at once, never holding a place while a line waits, so the batch window cannot deadlock with it; a file with no
more adapters than that keeps the plain path; shards keep an adapter's lines whole where they can. The real engine
runs a file over more adapters than its slots in tests/e2e/test_lora.py.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_adapter_order.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from itertools import groupby

from app.domain.input_index import PREFIX_CHARS
from app.testing import FAKE_MODEL, FakeEngine
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, upload, wait_status

BASE = FAKE_MODEL
INSTRUCTIONS = {task: f"Task {task}: " + "label the row carefully. " * (PREFIX_CHARS // 20) for task in "PQ"}


def line(custom_id: str, model: str | None, task: str | None = None) -> dict:
    """A chat line on `model` (None: it names none, the base model); `task`: a long shared instruction first."""
    content = f"{INSTRUCTIONS[task]}\nRow: {custom_id}" if task else f"Short question {custom_id}"
    body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": 5}
    if model is not None:
        body["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def shuffled_adapters(count: int, per_adapter: int, seed: int = 30) -> tuple[list[str], list[dict]]:
    names = [f"lora{i:02}" for i in range(count)]
    lines = [line(f"{name}-{i}", name) for name in names for i in range(per_adapter)]
    random.Random(seed).shuffle(lines)
    return names, lines


# The plan.


# Which batches are gated.


# The feed.


class Watching:
    """An engine that records the adapters in flight at every moment; each answer takes a few turns of the loop,
    so lines overlap as they do in an engine."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.most_adapters = 0
        self.entered: list[str] = []
        self.turns = random.Random(7)

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        model = body.get("model", BASE)
        self.entered.append(model)
        self.in_flight[model] += 1
        self.most_adapters = max(self.most_adapters, len(self.in_flight.keys() - {BASE}))
        try:
            for _ in range(self.turns.randrange(1, 6)):
                await asyncio.sleep(0)  # other lines' turns: the engine working, not a wait for a condition
            return 200, {"model": model, "choices": []}
        finally:
            self.in_flight[model] -= 1
            if not self.in_flight[model]:
                del self.in_flight[model]


def test_the_service_feeds_forty_adapters_at_most_max_loras_at_once_and_completes(settings):
    names, lines = shuffled_adapters(40, 2)  # the window's 8 places would hold lines of 5 adapters at once
    engine = FakeEngine(adapters=names, max_loras=4)
    watching = Watching()
    answer = engine.executor.execute

    async def watched(endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        await watching.execute(endpoint, body, rank)
        return await answer(endpoint, body, rank)

    engine.executor.execute = watched  # type: ignore[method-assign]
    with app_on(settings, engine) as client:
        done = wait_status(client, create_batch(client, upload(client, jsonl(lines))["id"])["id"], {"completed"})
        outputs = read_jsonl(client, done["output_file_id"])
    assert done["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
    assert 1 < watching.most_adapters <= 4
    assert Counter(o["custom_id"] for o in outputs) == Counter(x["custom_id"] for x in lines)
    assert all(o["response"]["body"]["model"] == o["custom_id"].split("-")[0] for o in outputs)
    assert len([model for model, _ in groupby(watching.entered)]) == 40


class Held:
    """An engine whose requests wait until the test answers them, or until every one is answered at once."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, asyncio.Future]] = []
        self.answer_all = False
        self.entered = asyncio.Event()

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        request = asyncio.get_running_loop().create_future()
        self.requests.append((body["model"], request))
        self.entered.set()
        if self.answer_all:
            request.set_result(None)
        await request
        return 200, {"model": body["model"], "choices": []}

    def waiting(self) -> list[asyncio.Future]:
        return [request for _, request in self.requests if not request.done()]


async def until(condition, engine: Held) -> None:
    """Each time a request enters the engine, look again (a line takes its place and enters in one turn)."""
    while not condition():
        engine.entered.clear()
        await asyncio.wait_for(engine.entered.wait(), timeout=10)


# Shards.
