"""The batch page's rate charts in a real Chromium, read the way a person reads them: the tick labels drawn on the
time axis and the value axis, against the series the API keeps for the run; and the page's own tick functions,
called in the page."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, expect

from app.testing import VbatchServer, free_port
from tests.browser_harness import DESKTOP, PHONE, browser, screenshot  # noqa: F401 - browser is a fixture
from tests.helpers import holding, jsonl, request_line, wait_for

WAIT_MS = 30_000
SECONDS_IN = {"s": 1, "min": 60, "h": 3600}
MULTIPLIER = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}
# The two charts, in page order: the axis title each carries and its column of the series.
CHARTS = [("requests/s", 1), ("output tokens/s", 2)]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[VbatchServer]:
    """No keys (loopback only), and a batch can be held mid-run (`hold_after:2`), so that its run lasts seconds."""
    base = tmp_path_factory.mktemp("console-charts")
    env = {"VBATCH_FAILPOINT": "hold_after:2"}
    started = VbatchServer(base / "data", free_port(), [], base / "serve.log", env=env, fake_engine=True)
    started.wait_ready(timeout=120)
    yield started
    started.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811 - the fixture imported above
    context = browser.new_context(viewport=DESKTOP)
    yield context.new_page()
    context.close()


def seconds_of(label: str) -> float:
    """'0', '30 s', '2 min', '1 h' as seconds."""
    if label == "0":
        return 0.0
    number, unit = label.split(" ")
    return float(number) * SECONDS_IN[unit]


def value_of(label: str) -> float:
    """'0.5', '1.5k', '3M' as a number."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kMG]?)", label)
    assert found, f"not a compact number: {label!r}"
    return float(found[1]) * MULTIPLIER[found[2]]


def is_round(step: float) -> bool:
    """1, 2 or 5 times a power of ten."""
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, allowed) for allowed in (1, 2, 5))


def is_round_time(step: float) -> bool:
    """Round in the unit the step is whole in, or the half-minute and half-hour between."""
    unit = 3600 if step >= 3600 else 60 if step >= 60 else 1
    return is_round(step / unit) or step in (30, 1800)


def even_step(ticks: list[float]) -> float:
    """The one step between every two neighbouring ticks, from 0."""
    assert ticks[0] == 0 and len(ticks) >= 2
    step = ticks[1] - ticks[0]
    assert all(math.isclose(b - a, step, rel_tol=1e-6) for a, b in itertools.pairwise(ticks)), ticks
    return step


def assert_covers(ticks: list[float], highest: float, round_step) -> None:
    """Evenly spaced round ticks from 0 that reach `highest`, the last no more than one step past it."""
    step = even_step(ticks)
    assert round_step(step), ticks
    assert ticks[-1] >= highest > ticks[-1] - step or (highest == 0 and ticks[-1] > 0), (ticks, highest)


def drawn(svg: Locator) -> dict:
    return svg.evaluate(
        """svg => ({
          x: [...svg.querySelectorAll('.x-ticks text')].map(t => t.textContent),
          y: [...svg.querySelectorAll('.y-ticks text')].map(t => t.textContent),
          titles: [...svg.querySelectorAll('.axis-title')].map(t => t.textContent),
          label: svg.getAttribute('aria-label'),
        })"""
    )


def progress(client: httpx.Client, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}/progress").json()


def run_held_batch(server: VbatchServer, page: Page) -> list[list[float]]:
    """A batch held after two lines until its series has three points, followed on its page from the start; the
    whole run's series once it has completed."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with holding(server.data_dir):
            uploaded = client.post(
                "/v1/files",
                files={"file": ("in.jsonl", jsonl([request_line(f"r{i}") for i in range(8)]))},
                data={"purpose": "batch"},
            )
            body = {
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            batch_id = client.post("/v1/batches", json=body).json()["id"]
            page.goto(f"{server.base_url}/console/batches/{batch_id}")
            expect(page.locator("#chart svg")).to_have_count(2, timeout=WAIT_MS)  # drawn while it runs
            wait_for(lambda: len(progress(client, batch_id)["series"]) >= 3, 60)
        ended = wait_for(lambda: (p := progress(client, batch_id))["status"] == "completed" and p, 60)
    expect(page.locator("#batch-status")).to_have_text("completed", timeout=WAIT_MS)  # the page followed it
    return ended["series"]


def test_the_charts_read_time_into_the_run_and_round_values_and_redraw_as_it_runs(server, page, tmp_path):
    series = run_held_batch(server, page)
    end = max(point[0] for point in series)
    first = page.locator("#chart svg").first
    # Redrawn as it ran: the last drawing is of the whole run, seconds longer than the first one.
    wait_for(lambda: abs(float(re.search(r"over ([\d.]+) s", drawn(first)["label"])[1]) - end) < 0.06, 30)
    for index, (title, column) in enumerate(CHARTS):
        axes = drawn(page.locator("#chart svg").nth(index))
        highest = max(point[column] for point in series)
        assert axes["titles"] == [title, "time into the run"]
        times = [seconds_of(label) for label in axes["x"]]
        assert 3 <= len(times) <= 6 and times == sorted(set(times))
        assert_covers(times, end, is_round_time)
        values = [value_of(label) for label in axes["y"]]
        assert 3 <= len(values) <= 5
        assert_covers(values, highest, is_round)
        # The aria-label tells what the picture shows.
        spoken = re.fullmatch(rf"{re.escape(title)}: last ([\d.]+), highest ([\d.]+), over ([\d.]+) s", axes["label"])
        assert spoken and float(spoken[1]) == series[-1][column] and float(spoken[2]) == highest
    screenshot(page, "batch-chart-desktop", tmp_path)


def test_at_phone_width_the_charts_are_redrawn_to_fit_with_labels_apart(server, page, tmp_path):
    run_held_batch(server, page)
    page.set_viewport_size(PHONE)
    # Redrawn at the new width rather than shrunk: the picture's own width is the width it is shown at.
    page.wait_for_function(
        """() => [...document.querySelectorAll('#chart svg')].every(svg =>
             Math.abs(svg.viewBox.baseVal.width - svg.getBoundingClientRect().width) < 1)""",
        timeout=WAIT_MS,
    )
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    gaps = page.locator("#chart svg").evaluate_all(
        """svgs => svgs.flatMap(svg => {
             const boxes = [...svg.querySelectorAll('.x-ticks text')].map(t => t.getBBox());
             return boxes.slice(1).map((box, i) => box.x - (boxes[i].x + boxes[i].width));
           })"""
    )
    assert gaps and min(gaps) > 0, gaps  # no two time labels overlap
    screenshot(page, "batch-chart-phone", tmp_path)


# Maxima across the scales a chart meets: a trickle of requests to billions of tokens, a second to days.
MAXIMA = [0.004, 0.3, 0.9, 1, 3.7, 12.5, 61, 99, 150, 151, 1234, 3601, 20000, 99999, 1.2e6, 7.7e9]


def test_the_pages_tick_functions_step_by_1_2_5_and_label_compactly(server, page):
    page.goto(f"{server.base_url}/console/batches")  # console.js is on every console page
    results = page.evaluate(
        """maxima => maxima.map(max => ({
             max, values: valueTicks(max), valueLabels: valueTicks(max).map(compact),
             times: timeTicks(max), timeLabels: timeLabels(timeTicks(max)),
           }))""",
        MAXIMA,
    )
    for result in results:
        highest, values, times = result["max"], result["values"], result["times"]
        assert 3 <= len(values) <= 5 and 3 <= len(times) <= 6, result
        assert_covers(values, highest, is_round)
        assert_covers(times, highest, is_round_time)
        # Each label says its tick's value, short enough for a phone.
        assert [value_of(label) for label in result["valueLabels"]] == pytest.approx(values)
        assert all(len(label) <= 5 for label in result["valueLabels"]), result["valueLabels"]
        assert [seconds_of(label) for label in result["timeLabels"]] == pytest.approx(times)
    assert page.evaluate("[compact(1200), compact(3.4e6), compact(0.5), compact(0)]") == ["1.2k", "3.4M", "0.5", "0"]
    no_tokens = page.evaluate("valueTicks(0)")  # a run that made no tokens still gets an axis
    assert len(no_tokens) >= 3 and no_tokens[-1] > 0 and is_round(even_step(no_tokens))
