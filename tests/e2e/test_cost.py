"""Cost after running on the real CPU engine (issue 31): a batch's progress, read through the openai SDK, has the
engine time its requests used and its cost at the shared server's VBATCH_GPU_HOUR_PRICE, and the batch object
itself stays OpenAI's."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import GPU_HOUR_PRICE, KEYS, MODEL
from tests.e2e.helpers import chat_line, submit, wait_terminal


def test_a_completed_batch_has_its_gpu_seconds_and_cost_on_its_progress(openai_client: OpenAI, server):
    lines = [chat_line(f"c{i}", f"Name a colour, {i}.", max_tokens=12) for i in range(6)]
    batch = wait_terminal(openai_client, submit(openai_client, lines).id)
    assert batch.status == "completed" and batch.request_counts.completed == 6

    progress = openai_client.get(f"/batches/{batch.id}/progress", cast_to=httpx.Response).json()
    used = progress["gpu_seconds"]
    assert used > 0
    assert progress["gpu_hour_price"] == GPU_HOUR_PRICE
    assert progress["cost_usd"] == pytest.approx(used / 3600 * GPU_HOUR_PRICE, abs=2e-6)
    per_input = progress["cost_usd"] * 1e6 / batch.usage.input_tokens
    assert progress["cost_per_million_input_tokens"] == pytest.approx(per_input, rel=1e-2, abs=1e-5)
    assert progress["cost_per_million_output_tokens"] > progress["cost_per_million_input_tokens"]  # fewer outputs
    # The batch object keeps OpenAI's shape: cost lives only in the extension.
    raw = openai_client.get(f"/batches/{batch.id}", cast_to=httpx.Response).json()
    assert not [key for key in raw if "gpu" in key or "cost" in key]

    scraped = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    samples = {
        (sample.name, sample.labels.get("model")): sample.value
        for family in text_string_to_metric_families(scraped.text)
        for sample in family.samples
    }
    assert samples[("vbatch_batch_gpu_seconds_total", MODEL)] >= used - 1e-3
    assert samples[("vbatch_batch_cost_usd_total", MODEL)] > 0
