"""A stop always ends: the engine loop ends on a stop whatever it was doing, and an engine that never finishes its
own shutdown keeps the process from exiting no longer than VBATCH_DRAIN_SECONDS."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from fastapi.testclient import TestClient

from app.domain import batches
from app.domain.leases import LeaseLost
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine, FakeServing
from tests.helpers import app_on, held_batch, wait_for


def test_a_stop_that_comes_with_a_wake_ends_the_engine_loop(settings):
    # A wake (a batch created) and a stop seen by the idle loop at once: on Python 3.11 asyncio.wait_for returned
    # the wake and dropped the stop's cancel, and the loop went on looking for work forever.
    for _ in range(3):
        service = EngineService(FakeEngine())
        with TestClient(create_app(settings, service)) as client:
            wait_for(lambda: client.get("/health").status_code == 200)
            with _frozen(service):
                service.wake()
                service.request_stop()
            client.portal.call(_within, service.stop(), 30)
        # `stop` returns as the thread's last lines run (the loop has ended); the thread itself ends just after.
        assert service._thread is not None
        service._thread.join(10)
        assert not service._thread.is_alive()


@contextmanager
def _frozen(service: EngineService) -> Iterator[None]:
    """The engine loop stands still meanwhile, so that what is asked of it in the block reaches it at once."""
    frozen, thawed = threading.Event(), threading.Event()
    assert service._loop is not None
    service._loop.call_soon_threadsafe(lambda: (frozen.set(), thawed.wait()))
    assert frozen.wait(10)
    try:
        yield
    finally:
        thawed.set()


class EngineThatNeverShutsDown(FakeEngine):
    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[FakeServing]:
        async with super().__call__() as serving:
            yield serving
        await asyncio.Event().wait()


def test_an_engine_that_never_shuts_down_holds_the_exit_only_for_the_drain_deadline(settings):
    settings = settings.model_copy(update={"drain_seconds": 0.5})
    exited = threading.Event()

    def serve() -> None:
        with app_on(settings, EngineThatNeverShutsDown()) as client:
            wait_for(lambda: client.get("/health").status_code == 200)
        exited.set()  # the app's event loop closed: nothing of it waits on the engine thread

    threading.Thread(target=serve, daemon=True).start()
    assert exited.wait(60)


async def _within(stopping, seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await stopping


def test_a_checkpoint_that_loses_its_lease_as_the_service_stops_leaves_no_task_error_unread(
    settings, monkeypatch, caplog
):
    """SIGTERM while the ticker's checkpoint is saving: the stop cancels the ticker, the shielded checkpoint goes on
    and its save finds the lease gone. asyncio logged `Task exception was never retrieved ... LeaseLost`, as the
    shield drops its interest in a task whose caller was cancelled. The stop's cancel comes exactly there: the save
    waits until the run's last checkpoint, after the ticker's cancel, begins."""
    saved = batches.save_checkpoint
    saving, stopping = threading.Event(), threading.Event()
    armed: list[str] = []

    def save_that_loses_its_lease(**fields) -> None:
        if not armed:
            saved(**fields)
            return
        if not saving.is_set():
            saving.set()
            assert stopping.wait(30)
        raise LeaseLost(fields["batch_id"])

    monkeypatch.setattr(batches, "save_checkpoint", save_that_loses_its_lease)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(caplog.handler)
    try:
        with held_batch(settings, lines=4, answered=2) as held:
            storage = held.client.app.state.storage
            checked = storage.check_room

            def check_room(*args, **kwargs):
                if saving.is_set():  # the run's last checkpoint: the ticker's cancel is behind it
                    stopping.set()
                return checked(*args, **kwargs)

            monkeypatch.setattr(storage, "check_room", check_room)
            armed.append(held.batch["id"])
            assert saving.wait(30)
        assert stopping.is_set()
        gc.collect()  # a task's unread error is reported as the task is collected
    finally:
        asyncio_log.removeHandler(caplog.handler)
    unread = [record.getMessage() for record in caplog.records if "never retrieved" in record.getMessage()]
    assert unread == []
