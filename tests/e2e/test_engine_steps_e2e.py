"""The real engine's steps (vLLM's iteration details, `app.engine.telemetry.steps`) on /metrics and the console's engine
page of the shared `vbatch serve`, once it has run a batch with a live request beside it; and the pacing that came and
went with the live request."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import KEYS, MODEL
from tests.e2e.helpers import chat_line, submit, wait_terminal

AUTH = {"authorization": f"Bearer {KEYS[0]}"}


def step_numbers(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("vbatch_engine_step", "vbatch_batch_pace", "vbatch_batch_prefill")):
                found[sample.name + "/" + sample.labels.get("kind", "")] = sample.value
    return found


def test_the_real_engines_steps_are_counted_split_and_shown(server, openai_client):
    before = step_numbers(server.base_url)
    batch = submit(openai_client, [chat_line(f"st{i}", f"Name a tool, number {i}.", max_tokens=8) for i in range(6)])
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello to the engine."}], max_tokens=4, stream=True
    )
    assert [part for part in stream if part.choices]
    done = wait_terminal(openai_client, batch.id)
    assert done.status == "completed"
    after = step_numbers(server.base_url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vbatch_engine_steps_total/") > 0
    assert grew("vbatch_engine_step_seconds_sum/") > 0
    assert grew("vbatch_engine_step_tokens_total/decode") > 0
    # The batch's prompts, and the live one's: vLLM counts the step's prompt tokens, vbatch says whose they were.
    assert grew("vbatch_engine_step_tokens_total/batch_prefill") > 0
    assert grew("vbatch_engine_step_tokens_total/live_prefill") > 0
    assert after["vbatch_batch_prefill_budget_tokens/"] >= 1

    with httpx.Client(base_url=server.base_url, timeout=30) as console:
        console.post("/console/login", data={"key": KEYS[0]})
        page = " ".join(console.get("/console/engine").text.split())
    assert 'id="step-time"' in page and "ms median" in page
    assert "batch prefill" in page and "live prefill" in page and "decode" in page
