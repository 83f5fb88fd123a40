"""VBATCH_FRONTEND_READY_SECONDS reaches the launch of front-end processes: how long they have to be ready before the
engine is launched again (a guard against a launch that stalls; the tests set it low)."""

from __future__ import annotations

import argparse

from app.core.config import Settings
from app.engine.inference import frontends
from app.engine.inference.vllm_adapter import live_frontends
from app.launch import engine_factory_from


def _launch_arguments(setting: str | None, monkeypatch) -> tuple:
    if setting is None:
        monkeypatch.delenv("VBATCH_FRONTEND_READY_SECONDS", raising=False)
    else:
        monkeypatch.setenv("VBATCH_FRONTEND_READY_SECONDS", setting)
    settings = Settings()
    factory = engine_factory_from(
        argparse.Namespace(api_server_count=2), frontend_ready_seconds=settings.frontend_ready_seconds
    )
    assert factory.func is live_frontends  # type: ignore[attr-defined]
    return factory.args  # type: ignore[attr-defined]


def test_front_ends_are_given_the_seconds_the_setting_names(monkeypatch):
    assert _launch_arguments("7.5", monkeypatch)[-1] == 7.5


def test_unset_front_ends_are_given_the_default(monkeypatch):
    assert _launch_arguments(None, monkeypatch)[-1] == frontends.READY_TIMEOUT_SECONDS == 120.0
