"""Where a webhook may go: every spelling of a non-public address is refused, and a delivery connects to the address
that was checked, never to what a second lookup of the name says (DNS rebinding).

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_webhook_destinations.py."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from app.core.webhooks import Refused, check_destination

# Hosts that are not global unicast, in the spellings that passed the check before (the first four) and others.
REFUSED = [
    "[::127.0.0.1]",  # IPv4-compatible loopback
    "224.0.0.1",  # multicast
    "[64:ff9b::7f00:1]",  # NAT64 of loopback
    "[2002:7f00:1::]",  # 6to4 of loopback
    "[fec0::1]",  # site-local
    "[ff0e::1]",  # global-scope multicast
    "[64:ff9b::a9fe:a9fe]",  # NAT64 of the cloud metadata address
    "[2002:a9fe:a9fe::]",  # 6to4 of the cloud metadata address
    "[64:ff9b:1::808:808]",  # NAT64's local-use prefix
    "[::ffff:127.0.0.1]",  # IPv4-mapped loopback
    "[::ffff:169.254.169.254]",
    "[2001:0:4136:e378:8000:63bf:3fff:fdd2]",  # Teredo
    "[::8.8.8.8]",  # IPv4-compatible: deprecated, routed nowhere
    "127.0.0.1",
    "[::1]",
    "0.0.0.0",
    "[::]",
    "10.0.0.1",
    "100.64.0.1",
    "169.254.169.254",
    "240.0.0.1",
    "255.255.255.255",
    "[fc00::1]",
    "[fe80::1]",
]
# Public addresses, some spelt as IPv6: these go.
ALLOWED = ["8.8.8.8", "[2606:4700::1111]", "[::ffff:8.8.8.8]", "[64:ff9b::808:808]", "[2002:808:808::1]"]

# A global unicast address the test stands in for: requests to it are answered in-process, nothing is dialled.
PUBLIC = "93.184.215.14"


@pytest.mark.parametrize("host", REFUSED)
def test_a_host_that_is_not_global_unicast_is_refused_in_every_spelling(host):
    with pytest.raises(Refused, match="not a public address"):
        asyncio.run(check_destination(f"http://{host}:8080/hook", allow_private=False))


@pytest.mark.parametrize("host", ALLOWED)
def test_a_public_host_is_sent_to_at_the_address_checked(host):
    checked = asyncio.run(check_destination(f"https://{host}/hook", allow_private=False))
    assert checked == [ipaddress.ip_address(host.strip("[]"))]


def test_the_operator_may_allow_private_addresses():
    checked = asyncio.run(check_destination("http://[::127.0.0.1]:8080/hook", allow_private=True))
    assert checked == [ipaddress.ip_address("::127.0.0.1")]


def _answers(monkeypatch, name: str, answer) -> list[str]:
    """`name` resolves to `answer(lookups so far)` (a list of addresses); every other name as usual."""
    real = socket.getaddrinfo
    given: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if (host.decode() if isinstance(host, bytes) else host) != name:
            return real(host, port, *args, **kwargs)
        addresses = answer(len(given))
        given.extend(addresses)
        return [found for address in addresses for found in real(address, port, *args, **kwargs)]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return given


def test_a_name_with_one_private_answer_among_public_ones_is_refused(monkeypatch):
    _answers(monkeypatch, "hook.test", lambda _: [PUBLIC, "127.0.0.1"])
    with pytest.raises(Refused, match=r"127\.0\.0\.1"):
        asyncio.run(check_destination("http://hook.test/hook", allow_private=False))
