"""Every `vllm:` series the Grafana dashboard and the alert rules name is one the real engine exports, on the
/metrics of the real `vbatch serve` the end-to-end tests share, once it has run a batch and a live request (vLLM
shows its histograms' samples only after a request)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import KEYS, MODEL
from tests.e2e.helpers import chat_line, submit, wait_terminal
from tests.integration.test_monitoring_kit import alert_rules, dashboard_exprs, named


def test_every_vllm_series_the_kit_names_is_exported_by_the_real_engine(server, openai_client):
    batch = submit(openai_client, [chat_line(f"k{i}", "Name a fruit.", max_tokens=4) for i in range(2)])
    assert wait_terminal(openai_client, batch.id).status == "completed"
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert [part for part in stream if part.choices]
    text = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {KEYS[0]}"}).text
    exported = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    wanted = {
        name for name in named(dashboard_exprs() + [rule["expr"] for rule in alert_rules()]) if name.startswith("vllm:")
    }
    assert len(wanted) >= 5
    assert wanted <= exported, sorted(wanted - exported)
