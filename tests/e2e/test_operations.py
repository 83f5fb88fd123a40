"""Operations against the real engine: /metrics scraped while a real CPU batch runs."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import KEYS
from tests.e2e.helpers import chat_line, submit, wait_terminal, wait_until
from tests.helpers import holding

VBATCH_SERIES = {
    "vbatch_requests",
    "vbatch_tokens",
    "vbatch_validation_failures",
    "vbatch_checkpoint_seconds",
    "vbatch_publish_seconds",
    "vbatch_webhook_deliveries",
    "vbatch_batches",
    "vbatch_lines_waiting",
    "vbatch_batch_requests_per_second",
    "vbatch_batch_output_tokens_per_second",
    "vbatch_engine_restarts",
    "vbatch_engine_up",
}


def scrape(server) -> tuple[set[str], dict[tuple[str, tuple], float]]:
    response = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert response.status_code == 200
    families = list(text_string_to_metric_families(response.text))
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    return {family.name for family in families}, values


def test_metrics_while_a_real_batch_runs(openai_client, server):
    _, before = scrape(server)
    lines = [chat_line(f"m{i}", f"Name a fruit, number {i}.", max_tokens=8) for i in range(12)]
    with holding(server.data_dir):  # 4 lines run, then the batch waits: it is certain to be running at the scrape
        batch = submit(openai_client, lines)
        wait_until(openai_client, batch.id, lambda b: b.request_counts.completed >= 1)
        names, during = scrape(server)
    assert names >= VBATCH_SERIES, VBATCH_SERIES - names
    assert {"vllm:generation_tokens", "vllm:prompt_tokens", "vllm:num_requests_running"} <= names
    assert ("vbatch_batch_requests_per_second", (("batch_id", batch.id),)) in during
    assert during[("vbatch_engine_up", ())] == 1

    done = wait_terminal(openai_client, batch.id)
    assert done.status == "completed"
    _, after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("vbatch_requests_total", outcome="completed") == done.request_counts.completed == 12
    assert delta("vbatch_requests_total", outcome="failed") == done.request_counts.failed == 0
    assert delta("vbatch_tokens_total", kind="prompt") == done.usage.input_tokens
    assert delta("vbatch_tokens_total", kind="output") == done.usage.output_tokens
    generated = sum(after[key] - before.get(key, 0.0) for key in after if key[0] == "vllm:generation_tokens_total")
    assert generated >= done.usage.output_tokens  # the engine's own count, over every engine and model label
