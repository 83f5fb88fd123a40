"""Adapter-aware order (issue 30): the plan runs a file's lines adapter by adapter (the base model's a group of its
own), shared-prefix groups kept inside each; the feed lets lines of at most `--max-loras` adapters into the engine
at once, never holding a place while a line waits, so the batch window cannot deadlock with it; a file with no
more adapters than that keeps the plain path; shards keep an adapter's lines whole where they can. The real engine
runs a file over more adapters than its slots in tests/e2e/test_lora.py.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_adapter_order.py."""

from __future__ import annotations

from collections import Counter
from itertools import groupby

from app.testing import FakeEngine
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, upload, wait_status
from tests.unit.test_adapter_order import Watching, shuffled_adapters


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


# Shards.
