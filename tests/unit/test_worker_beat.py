"""A worker's beat (`Scheduler.beat`): what API replicas list it by. It goes at once when the engine becomes ready
(`say_now`), not at the next second, and a run of failed beats (the database locked for a moment) is logged once
and does not stop the beats."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from app.engine.scheduling import scheduler as scheduling
from app.engine.scheduling.scheduler import Scheduler


def beating() -> tuple[Scheduler, SimpleNamespace]:
    """A scheduler with nothing but a beat, and the state it says (a stand-in for `WorkerState`)."""
    state = SimpleNamespace(value="starting")
    return Scheduler(
        engine=None,  # type: ignore[arg-type]
        runs=None,  # type: ignore[arg-type]
        holder=None,  # type: ignore[arg-type]
        bridge=None,  # type: ignore[arg-type]
        worker_state=lambda: state,  # type: ignore[arg-type,return-value]
    ), state


async def beats_while(scheduler: Scheduler, scenario: Callable[[], Awaitable[None]]) -> None:
    """`scheduler`'s beats run (as a task, as the service runs them) while `scenario` does."""
    task = asyncio.create_task(scheduler.beat(db=None))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(scenario(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_beat_goes_at_once_when_told_the_state_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduling, "POLL_SECONDS", 3600.0)  # without say_now, no second beat in this test
    said: list[str] = []
    heard = asyncio.Event()

    def beat(*, db: object, worker: SimpleNamespace) -> None:
        said.append(worker.value)
        heard.set()

    monkeypatch.setattr(scheduling.workers, "beat", beat)

    scheduler, state = beating()

    async def first_then_told() -> None:
        await heard.wait()
        heard.clear()
        state.value = "ok"
        scheduler.say_now()
        await heard.wait()

    asyncio.run(beats_while(scheduler, first_then_told))
    assert said == ["starting", "ok"]


def test_failed_beats_are_logged_once_and_the_beats_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduling, "POLL_SECONDS", 0.0)
    outcomes: list[Exception | None] = [OSError("database is locked"), OSError("database is locked"), None]
    landed = asyncio.Event()

    def beat(*, db: object, worker: SimpleNamespace) -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        landed.set()

    monkeypatch.setattr(scheduling.workers, "beat", beat)

    scheduler, _ = beating()
    with caplog.at_level(logging.WARNING, logger=scheduling.log.name):
        asyncio.run(beats_while(scheduler, landed.wait))
    assert outcomes == []
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "database is locked" in warnings[0]
