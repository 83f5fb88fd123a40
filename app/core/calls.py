"""The HTTP request being answered, as far as code below the API needs it: its id, which `vbatch api` passes on with
each online request it forwards to a worker (`app.engine.online.forward`), so that the worker logs the same id. The
app's outermost middleware (`app.main.RequestLog`) sets it for each request; a context variable, so each request sees
its own and code outside a request sees None. The caller's key is never passed on: a worker is told the caller's tenant,
signed (`app.core.fleet`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    request_id: str


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
