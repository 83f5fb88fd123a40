"""The batch's in-flight window (`app.engine.sharing.window`): it shrinks while online requests miss their
time-to-first-token target, holds its floor, grows back when they stop, and shrinking cancels no line in flight. The
rule is driven by hand on a clock the test moves; the batch runs on the fake engine.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_batch_window.py."""

from __future__ import annotations

import asyncio
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from app.core import clock
from app.engine.service import EngineService
from app.engine.sharing.window import QUIET_SECONDS, InFlightWindow, WindowSize
from app.testing import FakeEngine, FakeExecutor
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def online(window: InFlightWindow, moved: Clock, *, first_token: float, then: float = 0.25) -> None:
    """An online request arrives, has its first token `first_token` seconds later, and the clock moves on."""
    window.online_arrived()
    moved.now += first_token
    window.online_first_token(first_token)
    moved.now += then


class OneByOne(FakeExecutor):
    """Answers a line only when the test lets one go; counts the lines in the engine at once."""

    def __init__(self) -> None:
        super().__init__()
        self.finish = asyncio.Semaphore(0)
        self.in_engine = 0
        self.peak_since_mark = 0
        self.entered_since_mark = 0
        self.aborted = 0

    def mark(self) -> None:
        self.peak_since_mark = self.entered_since_mark = 0

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        self.in_engine += 1
        self.entered_since_mark += 1
        self.peak_since_mark = max(self.peak_since_mark, self.in_engine)
        try:
            await self.finish.acquire()
            return await super().execute(endpoint, body, rank)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.in_engine -= 1


def test_an_online_request_withdraws_the_youngest_batch_lines_beyond_a_wave_at_once_and_each_line_ends_once(
    settings, monkeypatch
):
    moved = Clock()
    monkeypatch.setattr(clock, "monotonic", moved)
    engine = FakeEngine()
    executor = engine.executor = OneByOne()
    with app_on(settings, engine) as client:
        service: EngineService = client.app.state.engine
        batch = create_batch(client, upload(client, jsonl([request_line(f"r{i}") for i in range(20)]))["id"])
        wait_for(lambda: executor.in_engine == 8)  # two waves of the fake engine's 4
        window = service._ctx.window  # type: ignore[union-attr]
        on_engine_loop = service._loop.call_soon_threadsafe  # type: ignore[union-attr]

        def one_online_request_misses_the_target() -> None:
            window.online_arrived()
            window.online_first_token(2.0)
            executor.mark()

        on_engine_loop(one_online_request_misses_the_target)
        # 8 batch lines and 1 online request for a wave of 4 seats: the 5 youngest lines are withdrawn at once, their
        # requests aborted; the window is under its ceiling (4 less twice the 1 in flight), then the miss halves it.
        wait_for(lambda: executor.in_engine == 3 and executor.aborted == 5)
        assert window.withdrawn == 5 and executor.generated == 0
        wait_for(lambda: service.batch_window == WindowSize(1, 8))
        for answered in range(1, 3):
            on_engine_loop(executor.finish.release)
            wait_for(lambda answered=answered: executor.generated == answered and executor.in_engine == 3 - answered)
        assert executor.entered_since_mark == 0  # two finished, none started: the window is full at 1
        on_engine_loop(executor.finish.release)
        wait_for(lambda: executor.generated == 3 and executor.entered_since_mark == 1)
        assert executor.in_engine == 1

        def online_traffic_stops() -> None:
            window.online_done()
            moved.now += QUIET_SECONDS

        on_engine_loop(online_traffic_stops)
        wait_for(lambda: service.batch_window == WindowSize(8, 8))
        wait_for(lambda: executor.in_engine == 8)  # the batch fills every place again
        assert executor.peak_since_mark == 8
        for _ in range(17):
            on_engine_loop(executor.finish.release)
        done = wait_status(client, batch["id"], {"completed"})
        assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        answered_ids = Counter(line["custom_id"] for line in read_jsonl(client, done["output_file_id"]))
        assert answered_ids == Counter(f"r{i}" for i in range(20))  # the withdrawn lines too, once each
        assert executor.aborted == 5 and window.withdrawn == 5


def test_the_window_and_the_preemptions_are_on_metrics(client, engine_service, fake_engine):
    def scraped() -> dict[str, float]:
        text = client.get("/metrics").text
        return {sample.name: sample.value for f in text_string_to_metric_families(text) for sample in f.samples}

    now = wait_for(lambda: (seen := scraped()).get("vbatch_batch_window") is not None and seen)
    assert now["vbatch_batch_window"] == now["vbatch_batch_window_max"] == 8
    assert now["vbatch_batch_preemptions_total"] == 0
    assert now["vbatch_batch_lines_withdrawn_total"] == 0
    assert engine_service.batch_window == WindowSize(8, 8)  # what the console's engine page reads
    fake_engine.executor.preemptions = 3
    assert scraped()["vbatch_batch_preemptions_total"] == 3
