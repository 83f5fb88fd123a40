"""Prints the OpenAPI document the app serves, as YAML: `make openapi` writes it to openapi.yaml. It builds the whole
app (`app.main`) to ask it, so it sits with the wiring, above the routes it documents."""

from __future__ import annotations

import sys

import yaml

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app


def served_openapi() -> dict:
    return create_app(Settings(), EngineService(None)).openapi()


def render(document: dict) -> str:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


if __name__ == "__main__":
    sys.stdout.write(render(served_openapi()))
