"""Webhook endpoints and one signed delivery, per the Standard Webhooks spec (the `standardwebhooks` package), so
that OpenAI's SDK verifies them unchanged with `client.webhooks.unwrap(body, headers, secret=...)`.

A webhook URL is fetched by the server, so it must not become a way into the server's own network (SSRF): every
address its host resolves to must be global unicast, in whatever spelling (an IPv6 address standing for an IPv4 one
is judged by the IPv4 one), unless the operator allows private ones. The host is resolved once per delivery, and the
delivery connects to the very addresses that were checked (a second lookup could answer otherwise: DNS rebinding),
with the URL's own name in the Host header and for TLS (SNI and the certificate check). Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
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


Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# The well-known NAT64 prefix: on an IPv6-only network a DNS64 resolver answers this for an IPv4-only host, and the
# translator delivers to the IPv4 address in its last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def refusal(address: Address) -> str | None:
    """Why `address` is no place to send to, or None for a global unicast address. An IPv6 address that only
    spells an IPv4 one (IPv4-mapped, NAT64) is judged as that one; a tunnel's (6to4, Teredo) by itself and by each
    IPv4 address it delivers through."""
    if isinstance(address, ipaddress.IPv6Address):
        spelled = _spelled(address)
        if spelled is not None:
            return refusal(spelled)
        for inner in _tunnelled(address):
            if (why := _not_global(inner)) is not None:
                return f"a tunnel to {inner}, {why}"
    return _not_global(address)


def _spelled(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _tunnelled(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    if address.sixtofour is not None:
        return (address.sixtofour,)
    return address.teredo or ()


def _not_global(address: Address) -> str | None:
    """`is_global` alone passes multicast and site-local addresses, and (as Python versions differ) some reserved
    ones such as IPv4-compatible IPv6."""
    kinds = (
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("site-local", getattr(address, "is_site_local", False)),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("not global", not address.is_global),
    )
    return next((kind for kind, applies in kinds if applies), None)


async def check_destination(url: str, *, allow_private: bool) -> list[Address]:
    """The addresses of the URL's host, looked up once: the delivery connects to these and to no others. Refused
    if the host does not resolve, or (unless `allow_private`) if any address is not global unicast: a name is as
    safe as the worst of its answers."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Refused(f"{host} does not resolve ({exc.strerror or exc})") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(sockaddr[0]) for *_, sockaddr in found))
    for address in [] if allow_private else addresses:
        if (why := refusal(address)) is not None:
            raise Refused(f"{host} resolves to {address} ({why}), not a public address (VBATCH_WEBHOOK_ALLOW_PRIVATE)")
    return addresses


async def send(
    client: httpx.AsyncClient, endpoint: Endpoint, *, addresses: Sequence[Address], event_id: str, body: str
) -> str | None:
    """POST one signed event to the first of `addresses` (those `check_destination` checked) that takes a
    connection; None when the receiver took it (2xx), else why not."""
    sent_at = datetime.now(tz=UTC)
    url = httpx.URL(endpoint.url)
    headers = {
        "host": url.netloc.decode("ascii"),
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(sent_at.timestamp())),
        "webhook-signature": Webhook(endpoint.secret).sign(event_id, sent_at, body),
    }
    error = "no address to send to"
    for address in addresses:
        try:
            response = await client.post(
                url.copy_with(host=str(address)),
                content=body,
                headers=headers,
                timeout=TIMEOUT_SECONDS,
                extensions={"sni_hostname": url.raw_host.decode("ascii")},
            )
        except httpx.ConnectError as exc:  # nothing was sent: the host's next address may take it
            error = f"{type(exc).__name__}: {exc}"[:500]
            continue
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:500]
        return None if 200 <= response.status_code < 300 else f"HTTP {response.status_code}"
    return error
