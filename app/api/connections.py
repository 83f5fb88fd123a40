"""Slow and greedy clients, at the connection: uvicorn has no limit on how long a client may take to send its
headers, nor on how many connections one address holds, so 200 connections at one byte a second were held for a
minute and, at the descriptor limit, every other client was refused.

Two limits on uvicorn's own HTTP protocol: a request's headers must be in within `header_timeout` of the
connection (or of the previous response), and one address holds at most `max_per_client` connections (0: any
number; behind a reverse proxy every client has the proxy's address, so the proxy limits instead). A body that
comes too slowly is the request guard's (`app.api.guard`): it needs the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger("vbatch.api")


def guarded_protocol(*, header_timeout: float, max_per_client: int) -> type[asyncio.Protocol]:
    """uvicorn's own HTTP protocol (httptools where installed, else h11) with both limits."""
    base: Any = import_from_string(HTTP_PROTOCOLS["auto"])
    open_by_host: Counter[str] = Counter()

    class GuardedProtocol(base):
        _host: str | None = None
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._host = self.client[0] if self.client else None
            if self._host is not None:
                open_by_host[self._host] += 1
                if max_per_client and open_by_host[self._host] > max_per_client:
                    log.warning("refused a connection: its address holds %d already", max_per_client)
                    transport.close()
                    return
            self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._host is not None:
                open_by_host[self._host] -= 1
                if open_by_host[self._host] <= 0:
                    del open_by_host[self._host]
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

        def _headers_late(self, cycle_before: Any) -> None:
            """No request has begun since `cycle_before` ended (or since the connection, if None)."""
            idle = cycle_before is None or cycle_before.response_complete
            if idle and self.cycle is cycle_before and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol
