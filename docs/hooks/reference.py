"""mkdocs hook: at every build the generated pages (`app/reference`), the OpenAPI document the app serves and the
operator's kit (`monitoring/`) join the site's files, so that none of them is kept by hand under docs/."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# Files served for download beside the pages: the Grafana dashboard and the Prometheus rules.
KIT = ROOT / "monitoring"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, text in _generated().items():
        files.append(File.generated(config, path, content=text))
    for path in sorted(KIT.rglob("*")):
        if path.is_file():
            files.append(File.generated(config, f"monitoring/{path.relative_to(KIT)}", abs_src_path=str(path)))
    return files


def _generated() -> dict[str, str]:
    """The reference pages and the OpenAPI document. Writing them imports vLLM (for its engine flags), which logs its
    hardware probes, and runs an app over a fake engine (to read its registry), which logs its start and requests:
    their stderr is kept back, and shown only where it says more than INFO."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    with contextlib.redirect_stderr(io.StringIO()) as said, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from app.openapi import render, served_openapi
            from app.reference.pages import pages

            return {**pages(), "openapi.yaml": render(served_openapi())}
        finally:
            _show_all_but_info(said.getvalue())


def _show_all_but_info(text: str) -> None:
    for line in text.splitlines():
        if " INFO " not in line and not line.startswith("INFO"):
            print(line, file=sys.stderr)
