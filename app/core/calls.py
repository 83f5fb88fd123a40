"""The HTTP request being answered, as far as code below the API needs it: its id, and the caller's credentials,
which `vbatch api` passes on with each online request it forwards to a worker (`app.engine.forward`), so that the
worker checks the same key and logs the same id. The app's outermost middleware (`app.main.RequestLog`) sets it
for each request; a context variable, so each request sees its own and code outside a request sees None."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    request_id: str
    authorization: str | None  # the caller's `Authorization` header as sent: never logged

    def headers(self) -> dict[str, str]:
        """The headers a request made on the caller's behalf carries."""
        own = {"x-request-id": self.request_id}
        return own if self.authorization is None else {**own, "authorization": self.authorization}


_current: ContextVar[Call | None] = ContextVar("vbatch_call", default=None)


def current() -> Call | None:
    return _current.get()


@contextmanager
def answering(call: Call) -> Iterator[None]:
    token = _current.set(call)
    try:
        yield
    finally:
        _current.reset(token)
