"""The engine's prefix cache, kept apart by tenant.

vLLM keys each cached KV block by the tokens up to its end and by the request's `cache_salt`, which the first block's
hash carries: requests of two salts never share a block. Every key shares one engine, so without salts a tenant could
learn whether another's prompt had been seen, block by block, from the `cached_tokens` an answer reports (or from how
soon its first token comes). vbatch therefore gives every request, online or batch line, the salt of its tenant (the
owner id of the key it came with), combined with the caller's own `cache_salt` so that neither replaces the other.
Requests of one tenant still share their prefixes (a batch's lines with each other, a key's online requests with its
batches). Without keys there is one tenant and nothing to keep apart; `VBATCH_SHARED_PREFIX_CACHE` shares the cache
across tenants that trust each other.
"""

from __future__ import annotations

import hashlib

from app.core.auth import ANONYMOUS

# vLLM's rule for a caller's own salt (`validate_cache_salt`): one it refuses is passed on as sent, for its answer.
_MOST_SALT_CHARACTERS = 128
_FORBIDDEN_IN_SALT = frozenset("@/\\\0")


def tenant_salted(body: dict, tenant: str) -> dict:
    """`body` with the salt of `tenant` (an owner id), its own `cache_salt` folded in; unchanged for the one tenant of
    a service without keys, and when its own salt is one the engine refuses."""
    if tenant == ANONYMOUS:
        return body
    own = body.get("cache_salt")
    if own is not None and not _valid_salt(own):
        return body
    return {**body, "cache_salt": _salt(tenant, own)}


def _salt(tenant: str, own: str | None) -> str:
    # A digest, not the two side by side: of a length and alphabet the engine takes, whatever the caller's salt holds.
    text = tenant if own is None else f"{tenant}\0{own}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _valid_salt(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= _MOST_SALT_CHARACTERS
        and not any(character in _FORBIDDEN_IN_SALT for character in value)
    )
