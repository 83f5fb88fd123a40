"""The console in a real Chromium, against `vbatch serve`'s app over the fake engine in a process of its own:
submit through the page, watch it finish without a reload, download what the API serves, see bad lines by number,
cancel, and keys kept apart. Screenshots at desktop and phone widths come from here (`make screenshots`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from app.testing import VbatchServer, free_port
from tests.browser_harness import DESKTOP, PHONE, browser, screenshot  # noqa: F401 - browser is a fixture
from tests.helpers import holding, jsonl, request_line, wait_for

KEY_A, KEY_B = "sk-browser-a-0123456789", "sk-browser-b-9876543210"
WAIT_MS = 30_000


def start(base: Path, env: dict) -> VbatchServer:
    server = VbatchServer(base / "data", free_port(), [], base / "serve.log", env=env, fake_engine=True)
    server.wait_ready(timeout=120)
    return server


@pytest.fixture(scope="module")
def open_server(tmp_path_factory) -> Iterator[VbatchServer]:
    """No keys (loopback only), and a batch can be held mid-run: `hold_after:2`, inert until a test holds."""
    server = start(tmp_path_factory.mktemp("console-open"), {"VBATCH_FAILPOINT": "hold_after:2"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory) -> Iterator[VbatchServer]:
    server = start(tmp_path_factory.mktemp("console-keyed"), {"VBATCH_API_KEYS": f"{KEY_A},{KEY_B}"})
    yield server
    server.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811 - the fixture imported above
    context = browser.new_context(viewport=DESKTOP, accept_downloads=True)
    yield context.new_page()
    context.close()


def api(server: VbatchServer, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def api_batch(server: VbatchServer, lines: list, key: str | None = None) -> str:
    with api(server, key) as client:
        uploaded = client.post("/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"})
        body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return client.post("/v1/batches", json=body).json()["id"]


def choose_file(page: Page, name: str, content: bytes) -> None:
    page.set_input_files("#file", files=[{"name": name, "mimeType": "application/jsonl", "buffer": content}])


def test_submit_from_the_page_follow_it_to_completed_and_download_the_apis_bytes(open_server, page, tmp_path):
    page.goto(f"{open_server.base_url}/console/submit")
    choose_file(page, "labels.jsonl", jsonl([request_line(f"item-{i}") for i in range(12)]))
    page.select_option("#endpoint", "/v1/chat/completions")
    page.get_by_role("button", name="Upload and check").click()
    expect(page.locator("#report-summary")).to_contain_text("12 requests, all valid", timeout=WAIT_MS)
    page.fill("#metadata", "team=labels\nrun=1")
    page.get_by_role("button", name="Create batch").click()
    page.wait_for_url(re.compile(r".*/console/batches/batch_[^/]+$"))
    batch_id = page.url.rsplit("/", 1)[-1]
    # The panel refreshes itself: the page is never reloaded on the way to completed.
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=WAIT_MS)
    expect(page.locator("#batch-counts")).to_contain_text("12 of 12 done")
    # The run's rate history survives its end: requests/s and output tokens/s, drawn from the kept series.
    expect(page.locator("#chart svg")).to_have_count(2, timeout=WAIT_MS)
    with page.expect_download() as download:
        page.locator("#download-output").click()
    downloaded = Path(download.value.path()).read_bytes()
    with api(open_server) as client:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        assert batch["metadata"] == {"team": "labels", "run": "1"}
        served = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    assert downloaded == served
    assert sorted(json.loads(line)["custom_id"] for line in served.splitlines()) == sorted(
        f"item-{i}" for i in range(12)
    )
    screenshot(page, "batch-desktop", tmp_path)
    page.set_viewport_size(PHONE)
    screenshot(page, "batch-phone", tmp_path)


def test_a_dropped_file_with_bad_lines_shows_them_by_number_before_and_after_creating(open_server, page):
    page.goto(f"{open_server.base_url}/console/submit")
    content = jsonl([request_line("a"), request_line("a"), b"{not json"])
    # A drop as the browser delivers one: a DataTransfer holding the file.
    transfer = page.evaluate_handle(
        """(text) => { const t = new DataTransfer();
            t.items.add(new File([text], "dropped.jsonl", {type: "application/jsonl"})); return t; }""",
        content.decode(),
    )
    page.dispatch_event("#dropzone", "drop", {"dataTransfer": transfer})
    page.get_by_role("button", name="Upload and check").click()
    expect(page.locator("#report-summary")).to_contain_text("dropped.jsonl", timeout=WAIT_MS)
    rows = page.locator("#problems tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("2")
    expect(rows.nth(0)).to_contain_text("duplicate_custom_id")
    expect(rows.nth(1)).to_contain_text("3")
    expect(rows.nth(1)).to_contain_text("invalid_json_line")
    page.get_by_role("button", name="Create batch anyway").click()
    expect(page.locator("#batch-status")).to_have_text("failed", timeout=WAIT_MS)
    validation = page.locator("section", has_text="Validation errors").locator("tbody tr")
    expect(validation).to_have_count(2)
    expect(validation.nth(1)).to_contain_text("invalid_json_line")


def test_cancel_from_the_page_after_confirming(open_server, page):
    with holding(open_server.data_dir):  # two lines run, then the batch waits: it is certain to be running
        batch_id = api_batch(open_server, [request_line(f"c{i}") for i in range(6)])
        page.goto(f"{open_server.base_url}/console/batches/{batch_id}")
        expect(page.locator("#batch-status")).to_have_text("in_progress", timeout=WAIT_MS)
        dialogs: list[str] = []

        def decline_then_accept(dialog) -> None:
            dialogs.append(dialog.message)
            dialog.dismiss() if len(dialogs) == 1 else dialog.accept()

        page.on("dialog", decline_then_accept)
        page.get_by_role("button", name="Cancel batch").click()
        expect(page.locator("#batch-status")).to_have_text("in_progress")  # declined: nothing was sent
        page.get_by_role("button", name="Cancel batch").click()
        expect(page.locator("#batch-status")).to_have_text(re.compile("cancelling|cancelled"), timeout=WAIT_MS)
    expect(page.locator("#batch-status")).to_have_text("cancelled", timeout=WAIT_MS)
    assert len(dialogs) == 2 and batch_id in dialogs[0]
    with api(open_server) as client:
        batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "cancelled" and batch["request_counts"]["total"] == 6


def test_retry_from_the_page_of_a_cancelled_batch_runs_its_unrun_lines(open_server, page):
    with holding(open_server.data_dir), api(open_server) as client:  # two lines run, then the batch waits
        batch_id = api_batch(open_server, [request_line(f"t{i}") for i in range(6)])
        wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] == 2, 60)
        client.post(f"/v1/batches/{batch_id}/cancel")
        wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "cancelled", 60)
    page.goto(f"{open_server.base_url}/console/batches/{batch_id}")
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Retry 4 lines").click()
    page.wait_for_url(re.compile(r".*/console/batches/batch_[^/]+$"))
    retry_id = page.url.rsplit("/", 1)[-1]
    assert retry_id != batch_id
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=WAIT_MS)
    expect(page.locator("#batch-counts")).to_contain_text("4 of 4 done")
    expect(page.locator("#retry-of")).to_have_text(batch_id)
    expect(page.locator("#retry")).to_have_count(0)  # every line of the retry succeeded
    with api(open_server) as client:
        retried = client.get(f"/v1/batches/{retry_id}").json()
        original = client.get(f"/v1/batches/{batch_id}").json()
        unrun = client.get(f"/v1/files/{original['error_file_id']}/content").text.splitlines()
        done = client.get(f"/v1/files/{retried['output_file_id']}/content").text.splitlines()
    assert retried["metadata"] == {"retry_of": batch_id}
    assert sorted(json.loads(line)["custom_id"] for line in done) == sorted(
        json.loads(line)["custom_id"] for line in unrun
    )


def test_the_batches_page_shows_new_batches_live_and_filters_by_status(open_server, page, tmp_path):
    page.goto(f"{open_server.base_url}/console/batches")
    batch_id = api_batch(open_server, [request_line("live-1"), request_line("live-2")])
    row = page.locator(f'tr[data-batch="{batch_id}"]')
    expect(row).to_be_visible(timeout=WAIT_MS)  # appeared without a reload
    expect(row).to_have_attribute("data-status", "completed", timeout=WAIT_MS)
    expect(row.locator(".counts")).to_have_text("2/2")
    page.select_option("#status", "cancelled")
    page.wait_for_url(re.compile(r".*status=cancelled.*"))
    statuses = page.locator("tr[data-batch]").evaluate_all("rows => rows.map(r => r.dataset.status)")
    assert set(statuses) <= {"cancelled"} and batch_id not in page.content()
    page.goto(f"{open_server.base_url}/console/batches")
    screenshot(page, "batches-desktop", tmp_path)
    page.set_viewport_size(PHONE)
    screenshot(page, "batches-phone", tmp_path)
    # At phone width the table keeps what matters and scrolls instead of overflowing the page.
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]


def test_files_and_engine_pages(open_server, page):
    api_batch(open_server, [request_line("f1")])
    page.goto(f"{open_server.base_url}/console/files")
    expect(page.locator("tr[data-file]").first).to_be_visible()
    page.goto(f"{open_server.base_url}/console/engine")
    expect(page.locator("#models")).to_have_text("fake-model")
    expect(page.locator("#engine-config")).to_contain_text("max_num_seqs")
    expect(page.locator("#health")).to_have_text("ok")
    expect(page.locator("#online-rates")).to_contain_text("Online requests")


def log_in(page: Page, server: VbatchServer, key: str) -> None:
    page.goto(f"{server.base_url}/console/batches")
    page.wait_for_url(re.compile(r".*/console/login.*"))
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(re.compile(r".*/console/batches$"))


def test_two_keys_see_only_their_own_batches_and_a_forged_form_is_refused(keyed_server, browser):  # noqa: F811
    mine, theirs = (
        api_batch(keyed_server, [request_line("a")], KEY_A),
        api_batch(keyed_server, [request_line("b")], KEY_B),
    )
    pages = {}
    for key in (KEY_A, KEY_B):
        context = browser.new_context(viewport=DESKTOP)
        pages[key] = context.new_page()
        log_in(pages[key], keyed_server, key)
    a, b = pages[KEY_A], pages[KEY_B]
    expect(a.locator(f'tr[data-batch="{mine}"]')).to_be_visible()
    expect(a.locator(f'tr[data-batch="{theirs}"]')).to_have_count(0)
    expect(b.locator(f'tr[data-batch="{theirs}"]')).to_be_visible()
    expect(b.locator(f'tr[data-batch="{mine}"]')).to_have_count(0)
    assert a.goto(f"{keyed_server.base_url}/console/batches/{theirs}").status == 404
    # The key is nowhere the page can reach: not in a URL, not in storage, and the cookie is httpOnly.
    [cookie] = a.context.cookies()
    assert cookie["httpOnly"] and KEY_A not in cookie["value"] and cookie["sameSite"] == "Strict"
    assert KEY_A not in a.url and a.evaluate("localStorage.length + sessionStorage.length") == 0
    assert a.evaluate("document.cookie") == ""
    # A form posted without the session's CSRF token, with the session cookie attached, is refused.
    forged = a.request.post(f"{keyed_server.base_url}/console/batches/{mine}/cancel", form={"reason": "forged"})
    assert forged.status == 403
    with api(keyed_server, KEY_A) as client:
        assert client.get(f"/v1/batches/{mine}").json()["status"] != "cancelling"
    for page in pages.values():
        page.context.close()


@pytest.fixture(scope="module")
def priced_server(tmp_path_factory) -> Iterator[VbatchServer]:
    """A GPU-hour price, and a fake engine slow enough that a batch's engine time shows."""
    env = {"VBATCH_GPU_HOUR_PRICE": "3.6", "VBATCH_FAKE_SECONDS_PER_ANSWER": "0.2"}
    server = start(tmp_path_factory.mktemp("console-priced"), env)
    yield server
    server.stop()


def test_a_finished_batch_shows_its_gpu_time_and_cost_on_its_page_and_in_the_list(priced_server, page):
    batch_id = api_batch(priced_server, [request_line(f"p{i}") for i in range(4)])
    page.goto(f"{priced_server.base_url}/console/batches/{batch_id}")
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=WAIT_MS)
    expect(page.locator("#batch-gpu-seconds")).to_contain_text(re.compile(r"[0-9.,]+ GPU-s"))
    expect(page.locator("#batch-cost")).to_contain_text(re.compile(r"\$0\.\d+ at \$3\.60/GPU-hour"))
    with api(priced_server) as client:
        progress = client.get(f"/v1/batches/{batch_id}/progress").json()
    assert progress["gpu_seconds"] > 0 and progress["cost_usd"] > 0
    page.goto(f"{priced_server.base_url}/console/batches")
    expect(page.get_by_role("columnheader", name="GPU time, cost")).to_be_visible()
    row = page.locator(f'tr[data-batch="{batch_id}"] td.cost')
    expect(row).to_contain_text("GPU-s")
    expect(row).to_contain_text("$0.")
