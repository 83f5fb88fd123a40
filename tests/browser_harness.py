"""Debian's Chromium driven by Playwright (`executable_path`, never `playwright install`), kept off the network.

`make setup` installs the `chromium` package where it is missing. A module that needs a browser imports the
`browser` fixture from here; it lives for one module (Playwright's sync API runs its own event loop, which other
tests' loops should not meet).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
# Where screenshots go: docs/console with `make screenshots`, else the test's own temporary folder.
SCREENSHOT_DIR = os.environ.get("VBATCH_SCREENSHOT_DIR")


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "Chromium is missing: `make setup` installs Debian's chromium package"
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def screenshot(page: Page, name: str, fallback: Path) -> Path:
    folder = Path(SCREENSHOT_DIR) if SCREENSHOT_DIR else fallback
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
