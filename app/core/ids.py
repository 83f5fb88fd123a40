"""OpenAI-shaped identifiers."""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    """`file-…`, `batch_…`, `batch_req_…`, `req_…`: prefix plus 24 random hex digits."""
    return f"{prefix}{secrets.token_hex(12)}"
