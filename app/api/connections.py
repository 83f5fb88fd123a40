"""Slow and greedy clients, at the connection: uvicorn has no limit on how long a client may take to send its
headers, nor on how many connections one address holds, so 200 connections at one byte a second were held for a
minute and, at the descriptor limit, every other client was refused.

Two limits on uvicorn's own HTTP protocol: a request's headers must be in within `header_timeout` of the
connection (or of the previous response), and one address holds at most `max_per_client` connections (0: any
number; behind a reverse proxy every client has the proxy's address, so the proxy limits instead). A body that
comes too slowly is the request guard's (`app.api.guard`): it needs the request.

A request uvicorn cannot parse (a malformed request line or header, bytes that are not ASCII in the URL, a URL or
headers past the parser's limits) gets the error envelope here, where uvicorn would answer a plain-text 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections import Counter
from http import HTTPStatus
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from app.api.errors import APIError
from app.core.ids import new_id

log = logging.getLogger("vbatch.api")
# httptools parses a URL's parts into 16-bit lengths: a longer URL is refused whole.
HTTPTOOLS_MAX_URL_BYTES = 0xFFFF
H11_DEFAULT_MAX_HEAD_BYTES = 16 * 1024  # h11's max_incomplete_event_size, unless uvicorn is told otherwise


def guarded_protocol(*, header_timeout: float, max_per_client: int, parser: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's own HTTP protocol (`parser`: "auto" is httptools where installed, else h11) with both limits."""
    base: Any = import_from_string(HTTP_PROTOCOLS[parser])
    per_address = _OpenPerAddress(max_per_client)

    class GuardedProtocol(base):
        _host: str | None = None
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._host = self.client[0] if self.client else None
            if self._host is not None and not per_address.admit(self._host):
                log.warning("refused a connection: its address holds %d already", max_per_client)
                transport.close()
                return
            self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._host is not None:
                per_address.release(self._host)
                self._host = None
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._wait_for_headers()

        def _wait_for_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late, self.cycle)

        def send_400_response(self, msg: str) -> None:
            """uvicorn calls this while handling the parse error (either parser's), which says what went wrong."""
            error = _unparsable(_too_long(self, sys.exc_info()[1]))
            self.transport.write(_raw_response(error, self.server_state.default_headers))
            self.transport.close()

        def _headers_late(self, cycle_before: Any) -> None:
            """No request has begun since `cycle_before` ended (or since the connection, if None)."""
            idle = cycle_before is None or cycle_before.response_complete
            if idle and self.cycle is cycle_before and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


class _OpenPerAddress:
    """Connections open by each client address: one more is admitted while its address holds no more than
    `max_per_client` (0: any number). A refused connection counts until it is lost, as an admitted one does."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.open: Counter[str] = Counter()

    def admit(self, host: str) -> bool:
        self.open[host] += 1
        return not (self.max_per_client and self.open[host] > self.max_per_client)

    def release(self, host: str) -> None:
        self.open[host] -= 1
        if self.open[host] <= 0:
            del self.open[host]


def _too_long(protocol: Any, exc: BaseException | None) -> int | None:
    """414 or 431 when the request `protocol` was parsing failed for its size, else None."""
    conn = getattr(protocol, "conn", None)
    if conn is None:  # httptools
        return 414 if len(getattr(protocol, "url", b"")) > HTTPTOOLS_MAX_URL_BYTES else None
    # h11: a request line and headers that outgrew its buffer; the URL did if the request line alone does.
    if getattr(exc, "error_status_hint", None) != 431:
        return None
    limit = protocol.config.h11_max_incomplete_event_size or H11_DEFAULT_MAX_HEAD_BYTES
    return 414 if len(conn.trailing_data[0].partition(b"\n")[0]) > limit else 431


def _unparsable(too_long: int | None) -> APIError:
    if too_long == 414:
        return APIError(414, "The request URL is too long.", code="url_too_long")
    if too_long == 431:
        return APIError(431, "The request's headers are too large.", code="headers_too_large")
    return APIError(400, "The request is not valid HTTP/1.1.", code="invalid_http_request")


def _raw_response(error: APIError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status_code} {HTTPStatus(error.status_code).phrase}".encode()]
    head += [name + b": " + value for name, value in default_headers]
    head += [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        b"x-request-id: " + new_id("req_").encode(),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body
