"""vbatch's own log lines (progress, lifecycle). They keep a handler of their own: vLLM and uvicorn both
reconfigure logging while the engine and server start, and on the CUDA build (0.26) vbatch's lines vanished."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure() -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    root = logging.getLogger("vbatch")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def ensure_enabled() -> None:
    """Undo what others' logging setup did to vbatch's loggers (called once the engine is up)."""
    if logging.root.manager.disable >= logging.INFO:
        logging.disable(logging.NOTSET)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "vbatch" or name.startswith("vbatch.")) and isinstance(logger, logging.Logger):
            logger.disabled = False
    configure()
