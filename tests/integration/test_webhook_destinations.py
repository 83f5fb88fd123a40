"""Where a webhook may go: every spelling of a non-public address is refused, and a delivery connects to the address
that was checked, never to what a second lookup of the name says (DNS rebinding).

Through the app, a socket or a process here; the logic alone is in tests/unit/test_webhook_destinations.py."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from starlette.applications import Starlette
from starlette.routing import Route

from app.core.webhooks import Endpoint, send
from app.testing import free_port
from tests.helpers import FINAL, app_on, create_batch, jsonl, request_line, serving, upload, wait_for, wait_status
from tests.integration.test_webhooks import SECRET, Receiver, outbox, receiving, with_webhook
from tests.unit.test_webhook_destinations import PUBLIC, _answers


@pytest.fixture
def loopback_receiver() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


@pytest.fixture
def public_receiver(monkeypatch) -> list[httpx.Request]:
    """Requests to PUBLIC are answered here (204) and kept; every other request goes out as usual."""
    reached: list[httpx.Request] = []
    handle = httpx.AsyncHTTPTransport.handle_async_request

    async def answering_public(transport: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        if request.url.host == PUBLIC:
            reached.append(request)
            return httpx.Response(204)
        return await handle(transport, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", answering_public)
    return reached


def test_a_name_that_rebinds_to_loopback_after_the_check_is_sent_to_the_checked_address_only(
    settings, fake_engine, loopback_receiver, public_receiver, monkeypatch
):
    port = int(loopback_receiver.url.split(":")[2].split("/")[0])
    # A rebinding DNS server: public for the first lookup, loopback (where a receiver listens) from then on.
    lookups = _answers(monkeypatch, "hook.test", lambda count: [PUBLIC] if count == 0 else ["127.0.0.1"])
    hook = f"http://hook.test:{port}/hook"
    with app_on(with_webhook(settings, hook, allow_private=False), fake_engine) as client:
        batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
        wait_status(client, batch["id"], FINAL)
        wait_for(lambda: [row["delivered_at"] for row in outbox(settings)] != [None])
    assert loopback_receiver.received == []
    [request] = public_receiver
    assert (request.url.host, request.url.port, request.url.path) == (PUBLIC, port, "/hook")
    assert request.headers["host"] == f"hook.test:{port}"
    assert lookups == [PUBLIC]  # one lookup, the one that was checked


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def test_https_to_the_checked_address_uses_the_urls_name_for_sni_the_certificate_and_host(tmp_path):
    cert_file, key_file = _certificate(tmp_path, "hook.test")
    recorder = Receiver()
    app = Starlette(routes=[Route("/hook", recorder.hook, methods=["POST"])])
    loopback = [ipaddress.ip_address("127.0.0.1")]

    async def deliver(url: str) -> str | None:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=cert_file)) as client:
            return await send(client, Endpoint(url, SECRET), addresses=loopback, event_id="evt_1", body="{}")

    with serving(app, free_port(), ssl_certfile=str(cert_file), ssl_keyfile=str(key_file)) as port:
        assert asyncio.run(deliver(f"https://hook.test:{port}/hook")) is None
        refused = asyncio.run(deliver(f"https://other.test:{port}/hook"))  # same address, a name the cert lacks
    assert refused is not None and "certificate" in refused.lower()
    [(_, headers)] = recorder.received
    assert headers["host"] == f"hook.test:{port}"
