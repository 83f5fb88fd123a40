"""The models a service will serve are answered from the moment its API answers, before the engine has loaded
(issue 30, "Models known at start"); the engine's own list takes their place once it serves."""

from __future__ import annotations

import argparse
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi.testclient import TestClient

from app.engine.service import EngineService
from app.launch import announced_models
from app.main import create_app
from app.testing import FAKE_MODEL, FakeEngine, FakeServing
from tests.helpers import wait_for


class HeldStart:
    """An engine factory whose engine has not loaded until the test lets it."""

    def __init__(self) -> None:
        self.loaded = threading.Event()
        self.engine = FakeEngine()

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[FakeServing]:
        await anyio.to_thread.run_sync(self.loaded.wait)
        async with self.engine() as serving:
            yield serving


def test_the_announced_models_are_listed_while_the_engine_loads_then_the_engines_own(settings):
    start = HeldStart()
    service = EngineService(start, models=["my-model"])
    with TestClient(create_app(settings, service)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["my-model"]
        assert client.get("/v1/models/my-model").json()["id"] == "my-model"
        assert client.get("/v1/models/other").status_code == 404
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        assert health.json()["model"] == "my-model"
        start.loaded.set()
        wait_for(lambda: client.get("/health").status_code == 200)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [FAKE_MODEL]


def test_the_announced_models_are_the_served_names_else_the_model_as_given():
    assert announced_models(argparse.Namespace(model="Qwen/Qwen3-8B", served_model_name=None)) == ["Qwen/Qwen3-8B"]
    named = argparse.Namespace(model="/models/qwen", served_model_name=["qwen", "qwen-latest"])
    assert announced_models(named) == ["qwen", "qwen-latest"]
