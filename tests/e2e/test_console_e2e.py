"""The console over the real CPU engine: a batch submitted from the page completes in Chromium and its answers
download as the API serves them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from playwright.sync_api import expect

from tests.browser_harness import DESKTOP, browser, screenshot  # noqa: F401 - browser is a fixture
from tests.e2e.conftest import KEYS
from tests.e2e.helpers import chat_line, to_jsonl

LINES = 16


def test_a_batch_submitted_from_the_page_completes_and_its_answers_download(server, openai_client, browser, tmp_path):  # noqa: F811
    context = browser.new_context(viewport=DESKTOP, accept_downloads=True)
    page = context.new_page()
    page.goto(f"{server.base_url}/console/submit")
    page.get_by_label("API key").fill(KEYS[0])
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(re.compile(r".*/console/submit$"))
    questions = [chat_line(f"q{i}", f"Name a colour and a number above {i}.", max_tokens=16) for i in range(LINES)]
    page.set_input_files(
        "#file", files=[{"name": "q.jsonl", "mimeType": "application/jsonl", "buffer": to_jsonl(questions)}]
    )
    page.get_by_role("button", name="Upload and check").click()
    expect(page.locator("#report-summary")).to_contain_text(f"{LINES} requests, all valid", timeout=60_000)
    page.get_by_role("button", name="Create batch").click()
    page.wait_for_url(re.compile(r".*/console/batches/batch_[^/]+$"))
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=600_000)
    expect(page.locator("#chart svg")).to_have_count(2, timeout=60_000)
    with page.expect_download() as download:
        page.locator("#download-output").click()
    downloaded = Path(download.value.path()).read_bytes()
    batch = openai_client.batches.retrieve(page.url.rsplit("/", 1)[-1])
    assert downloaded == openai_client.files.content(batch.output_file_id).content
    answers = [json.loads(line) for line in downloaded.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == sorted(f"q{i}" for i in range(LINES))
    assert all(a["response"]["body"]["choices"][0]["message"]["content"] for a in answers)
    screenshot(page, "batch-real-engine-desktop", tmp_path)
    context.close()
