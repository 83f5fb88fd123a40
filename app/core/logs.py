"""vbatch's logs: text for a terminal, or one JSON object a line (`VBATCH_LOG_FORMAT=json`) for a log pipeline.

vbatch's own loggers keep a handler of their own: vLLM and uvicorn both reconfigure logging while the engine and
server start, and on the CUDA build (0.26) vbatch's lines vanished. In JSON, everything else (uvicorn, vLLM,
Python's warnings) goes through the root logger's JSON handler too, so every line of the log parses. Records
carry ids, counts, sizes and times; never a key or a prompt.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_chosen: LogFormat = "text"


def configure(log_format: LogFormat | None = None) -> None:
    global _chosen
    _chosen = log_format or _chosen
    if _chosen == "json":
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's lines through the root's JSON handler
    root = logging.getLogger()
    if _chosen == "json" or not root.handlers:
        _own_handler(root)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    vbatch = logging.getLogger("vbatch")
    _own_handler(vbatch)
    vbatch.setLevel(logging.INFO)
    vbatch.propagate = False


def _own_handler(logger: logging.Logger) -> None:
    """Exactly one handler of ours on `logger`, in the chosen format (others' handlers on the root stay)."""
    for handler in list(logger.handlers):
        if getattr(handler, "vbatch", False):
            logger.removeHandler(handler)
    if _chosen == "json":
        for handler in list(logger.handlers):  # a second, text, handler would break "every line parses"
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.vbatch = True  # type: ignore[attr-defined]
    handler.setFormatter(_formatter())
    logger.addHandler(handler)


def _formatter() -> logging.Formatter:
    if _chosen == "json":
        return JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    return logging.Formatter(FORMAT)


def ensure_enabled() -> None:
    """Undo what others' logging setup did to vbatch's loggers (called once the engine is up)."""
    if logging.root.manager.disable >= logging.INFO:
        logging.disable(logging.NOTSET)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "vbatch" or name.startswith("vbatch.")) and isinstance(logger, logging.Logger):
            logger.disabled = False
    configure()
