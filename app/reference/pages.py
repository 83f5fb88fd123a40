"""The generated pages, by their path inside the site."""

from __future__ import annotations

from collections.abc import Callable

from app.reference.cli import engine_args_page
from app.reference.cli import page as commands_page
from app.reference.errors import page as errors_page
from app.reference.http import page as http_page
from app.reference.metrics import page as metrics_page
from app.reference.settings import page as settings_page

# Page path inside the site -> what writes it.
PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page,
    "reference/cli.md": commands_page,
    "reference/engine-args.md": engine_args_page,
    "reference/metrics.md": metrics_page,
    "reference/http-api.md": http_page,
    "reference/errors.md": errors_page,
}


def pages() -> dict[str, str]:
    return {path: write() for path, write in PAGES.items()}
