"""The docs site builds offline in strict mode (a broken link, a missing page or an unknown anchor fails it), loads
nothing from another site, and the README stays short and points into it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MOST_LINES = 150


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert "WARNING" not in built.stderr, built.stderr[-4000:]
    return folder


def test_the_site_builds_with_every_generated_page(site):
    for page in ("tutorial", "reference/settings", "reference/cli", "reference/metrics", "reference/http-api"):
        assert (site / page / "index.html").is_file(), page
    for page in ("reference/engine-args", "reference/errors", "explanation/security"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "openapi.yaml").read_text().startswith("openapi:")
    assert (site / "monitoring" / "grafana" / "vbatch-dashboard.json").is_file()
    security = (site / "explanation" / "security" / "index.html").read_text()
    assert "Security: who can see what" in security  # the README's section, included as it is


def test_the_site_loads_nothing_from_another_site(site):
    outside = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I)
    found = [
        f"{page.relative_to(site)}: {match.group(0)}"
        for page in site.rglob("*.html")
        for match in outside.finditer(page.read_text(errors="replace"))
    ]
    assert not found, found[:10]


def test_the_readme_is_short_and_points_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MOST_LINES
    assert "## Security: who can see what" in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 20
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
