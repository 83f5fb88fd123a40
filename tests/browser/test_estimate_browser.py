"""The submit page shows a file's estimate (`POST /v1/batches/estimate`'s) before the batch is created, in a real
Chromium against `vbatch serve`'s app over the fake engine (whose tokenizer counts words)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from app.testing import VbatchServer, free_port
from tests.browser_harness import DESKTOP, browser  # noqa: F401 - browser is a fixture
from tests.helpers import jsonl, request_line, wait_for

WAIT_MS = 30_000
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def priced_server(tmp_path_factory) -> Iterator[VbatchServer]:
    base = tmp_path_factory.mktemp("console-estimate")
    env = {"VBATCH_GPU_HOUR_PRICE": "2.5"}
    server = VbatchServer(base / "data", free_port(), [], base / "serve.log", env=env, fake_engine=True)
    server.wait_ready(timeout=120)
    yield server
    server.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811 - the fixture imported above
    context = browser.new_context(viewport=DESKTOP)
    yield context.new_page()
    context.close()


def _run_one_batch(client: httpx.Client, content: bytes) -> None:
    uploaded = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}).json()
    body = {"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"}
    batch_id = client.post("/v1/batches", json=body).json()["id"]
    wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed", timeout=60)


def test_the_submit_page_shows_the_estimate_before_the_batch_is_created(priced_server, page):
    content = jsonl([request_line(f"t-{i}") for i in range(5)])
    with httpx.Client(base_url=priced_server.base_url, timeout=30) as client:
        _run_one_batch(client, content)
        batches_before = len(client.get("/v1/batches").json()["data"])
        page.goto(f"{priced_server.base_url}/console/submit")
        page.set_input_files("#file", files=[{"name": "t.jsonl", "mimeType": "application/jsonl", "buffer": content}])
        page.get_by_role("button", name="Upload and check").click()
        expect(page.locator("#estimate")).to_be_visible(timeout=WAIT_MS)
        file_id = page.locator("#input_file_id").input_value()
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        estimate = client.post("/v1/batches/estimate", json=body).json()
        expect(page.locator("#estimate-prompt")).to_have_text(f"{estimate['prompt_tokens']:,}")
        expect(page.locator("#estimate-output")).to_contain_text(f"{estimate['expected_output_tokens']:,} expected")
        expect(page.locator("#estimate-cost")).to_contain_text("$")
        expect(page.locator("#estimate-basis")).to_contain_text("From 1 earlier batch")
        # Shown, and still nothing created: the Create button is next.
        expect(page.get_by_role("button", name="Create batch")).to_be_visible()
        assert len(client.get("/v1/batches").json()["data"]) == batches_before
