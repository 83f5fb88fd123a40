"""A worker's beat (`Scheduler.beat`): what API replicas list it by. It goes at once when the engine becomes ready
(`say_now`), not at the next second, and a run of failed beats (the database locked for a moment) is logged once
and does not stop the beats."""

from __future__ import annotations

import asyncio
import logging
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


def test_a_beat_goes_at_once_when_told_the_state_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduling, "POLL_SECONDS", 3600.0)  # without say_now, no second beat in this test
    said: list[str] = []
    heard = asyncio.Event()

    def beat(*, db: object, worker: SimpleNamespace) -> None:
        said.append(worker.value)
        heard.set()

    monkeypatch.setattr(scheduling.workers, "beat", beat)

    async def scenario() -> None:
        scheduler, state = beating()
        task = asyncio.create_task(scheduler.beat(db=None))  # type: ignore[arg-type]
        await asyncio.wait_for(heard.wait(), 10)
        heard.clear()
        state.value = "ok"
        scheduler.say_now()
        await asyncio.wait_for(heard.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
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

    async def scenario() -> None:
        scheduler, _ = beating()
        task = asyncio.create_task(scheduler.beat(db=None))  # type: ignore[arg-type]
        await asyncio.wait_for(landed.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger=scheduling.log.name):
        asyncio.run(scenario())
    assert outcomes == []
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "database is locked" in warnings[0]
