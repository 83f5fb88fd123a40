"""Webhook endpoints and one signed delivery, per the Standard Webhooks spec (the `standardwebhooks` package), so
that OpenAI's SDK verifies them unchanged with `client.webhooks.unwrap(body, headers, secret=...)`.

A webhook URL is fetched by the server, so it must not become a way into the server's own network (SSRF): every
address its host resolves to must be public, unless the operator allows private ones. The check runs before each
delivery, and redirects are not followed.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
from standardwebhooks import Webhook

TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    secret: str  # whsec_...

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a webhook URL must be http(s)://host/...: {self.url!r}")
        if not self.secret.startswith("whsec_"):
            raise ValueError("a webhook secret starts with whsec_ (base64 after it), as OpenAI's do")
        Webhook(self.secret)  # refuses a secret that is not base64


class Refused(Exception):
    """The endpoint may not be sent to (a private address without the operator's leave)."""


async def check_destination(url: str, *, allow_private: bool) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=0)
    except OSError as exc:
        raise Refused(f"{host} does not resolve ({exc.strerror or exc})") from None
    for *_, sockaddr in found:
        address = ipaddress.ip_address(sockaddr[0])
        if not allow_private and not address.is_global:
            raise Refused(f"{host} resolves to {address}, not a public address (VBATCH_WEBHOOK_ALLOW_PRIVATE)")


async def send(client: httpx.AsyncClient, endpoint: Endpoint, *, event_id: str, body: str) -> str | None:
    """POST one signed event; None when the receiver took it (2xx), else why not."""
    sent_at = datetime.now(tz=UTC)
    headers = {
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(sent_at.timestamp())),
        "webhook-signature": Webhook(endpoint.secret).sign(event_id, sent_at, body),
    }
    try:
        response = await client.post(endpoint.url, content=body, headers=headers, timeout=TIMEOUT_SECONDS)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    if 200 <= response.status_code < 300:
        return None
    return f"HTTP {response.status_code}"
