"""The generated pages, by their path inside the site."""

from __future__ import annotations

from collections.abc import Callable

from app.reference import cli, errors, http, metrics, settings

# Page path inside the site -> what writes it.
PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings.page,
    "reference/cli.md": cli.page,
    "reference/engine-args.md": cli.engine_args_page,
    "reference/metrics.md": metrics.page,
    "reference/http-api.md": http.page,
    "reference/errors.md": errors.page,
}


def pages() -> dict[str, str]:
    return {path: write() for path, write in PAGES.items()}
