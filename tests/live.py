"""The app (fake engine) behind a real uvicorn socket, for what TestClient cannot show: when bytes arrive."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine
from tests.helpers import wait_for


@contextmanager
def live_app(settings: Settings) -> Iterator[tuple[str, int]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings, EngineService(FakeEngine())), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20)
        yield listener.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        listener.close()
