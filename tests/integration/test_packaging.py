"""A wheel of vbatch (what the Docker image installs) starts and migrates with no source tree beside it."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    for name in ("app", "migrations"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source], check=True)
    [wheel] = dist.glob("vbatch-*.whl")
    return wheel


def test_the_wheel_installs_and_migrates_an_empty_database(tmp_path):
    wheel = build_wheel(tmp_path)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel], check=True)
    assert (site / "app" / "migrations" / "env.py").exists()
    assert not (site / "migrations").exists()  # the design card's top-level folder ships inside the package
    console = site / "app" / "console"
    assert (console / "templates" / "batch.html").exists() and (console / "static" / "console.js").exists()
    database = tmp_path / "db" / "vbatch.db"
    script = (
        "import sys, app, app.core.migrate as m; "
        f"assert app.__file__.startswith({str(site)!r}), app.__file__; "
        f"assert str(m.migrations_dir()).startswith({str(site)!r}), m.migrations_dir(); "
        f"m.upgrade_to_head({'sqlite:///' + str(database)!r})"
    )
    # Run away from the source tree, with only the installed wheel to import vbatch from.
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site)}, check=True)
    with sqlite3.connect(database) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        [version] = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    assert {"files", "batches", "deleted_objects"} <= tables
    heads = sorted(p.name.split("_")[0] for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert version == heads[-1]
