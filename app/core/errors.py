"""What vbatch refuses, in its own terms: the base of every domain error, and the one `app.core.auth` raises for a
missing or wrong key. `app.api.errors` alone turns these into OpenAI's HTTP envelopes, so code that runs on the
engine thread never builds an HTTP answer."""

from __future__ import annotations


class DomainError(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Unauthenticated(DomainError):
    pass
