"""A service that runs batches as API replicas see it: besides its engine's state, its beat (`app.domain.workers`)
says where it answers online requests and how many it has in flight, what `vbatch api` forwards them by
(`app.engine.forward`)."""

from __future__ import annotations

import dataclasses

from sqlalchemy.engine import Engine

from app.core.config import Settings
from app.core.storage import Storage
from app.domain.online import OnlineAnswer
from app.domain.workers import WorkerState
from app.engine.forward import Finishing
from app.engine.metrics import Metrics
from app.engine.service import EngineService
from app.engine.serving import EngineFactory


class AdvertisedService(EngineService):
    """`EngineService`, its online requests counted from the call until the answer, or the stream's end or close."""

    def __init__(self, factory: EngineFactory | None) -> None:
        super().__init__(factory)
        self.url: str | None = None
        self.online_in_flight = 0

    def advertise(self, url: str) -> None:
        """Where it answers, when that is known only once its server is bound (a Ray replica's free port); else
        `start` takes it from the settings (`VBATCH_ADVERTISE_URL`, or the host and port)."""
        self.url = url

    async def start(
        self,
        *,
        db: Engine,
        storage: Storage,
        settings: Settings,
        metrics: Metrics | None = None,
        hold_at_most: int | None = None,
    ) -> None:
        self.url = self.url or settings.advertised_url
        await super().start(db=db, storage=storage, settings=settings, metrics=metrics, hold_at_most=hold_at_most)

    def worker_state(self) -> WorkerState:
        return dataclasses.replace(super().worker_state(), url=self.url, online_in_flight=self.online_in_flight)

    async def respond(self, endpoint: str, body: dict) -> OnlineAnswer:
        # On the API's loop only: the engine thread's beat reads the number, which is one assignment at a time.
        self.online_in_flight += 1
        try:
            answer = await super().respond(endpoint, body)
        except BaseException:
            self._answered()
            raise
        if answer.events is None:
            self._answered()
            return answer

        async def ended() -> None:
            self._answered()

        return dataclasses.replace(answer, events=Finishing(answer.events, ended))

    def _answered(self) -> None:
        self.online_in_flight -= 1
