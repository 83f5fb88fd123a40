"""The webhook sender: claims due events from the outbox, sends each signed, records what came of it.

It runs on the API's event loop, never on the engine's, and keeps its schedule in the outbox rows, not in a
retrying coroutine, so a restart (or a crash) loses no event: an event is sent until a receiver answers 2xx, at
least once (the `webhook-id` header lets receivers drop repeats), with exponential backoff, for up to
`VBATCH_WEBHOOK_GIVE_UP_SECONDS` (72 hours).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import httpx
from sqlalchemy.engine import Engine

from app.core.auth import key_file_entries, owner_of
from app.core.config import Settings
from app.core.webhooks import Endpoint, Refused, check_destination, send
from app.domain import events
from app.domain.models import WebhookEvent
from app.engine.telemetry.metrics import Metrics

log = logging.getLogger("vbatch.webhooks")

MAX_BACKOFF_SECONDS = 3600.0
CLAIM_LIMIT = 32


@dataclass(frozen=True)
class Endpoints:
    """Where each key's events go: its own endpoint (from the keys file) or the service's."""

    default: Endpoint | None = None
    by_owner: dict[str, Endpoint] = field(default_factory=dict)

    def for_owner(self, owner: str) -> Endpoint | None:
        return self.by_owner.get(owner, self.default)

    @property
    def any(self) -> bool:
        return self.default is not None or bool(self.by_owner)


def endpoints_from(settings: Settings) -> Endpoints:
    """`VBATCH_WEBHOOK_URL` + `VBATCH_WEBHOOK_SECRET`, and `key url secret` lines of the keys file (checked as it is
    read, `app.core.auth.key_file_entries`); ValueError for a half-given service endpoint or a malformed line."""
    if (settings.webhook_url is None) != (settings.webhook_secret is None):
        raise ValueError("set both VBATCH_WEBHOOK_URL and VBATCH_WEBHOOK_SECRET, or neither")
    default = None
    if settings.webhook_url is not None and settings.webhook_secret is not None:
        default = Endpoint(settings.webhook_url, settings.webhook_secret)
    by_owner = {}
    for line in key_file_entries(settings.api_keys_file):
        if line.webhook is not None:
            by_owner[owner_of(line.fields[0])] = line.webhook
    return Endpoints(default=default, by_owner=by_owner)


def backoff(attempts: int, base: float) -> float:
    """Seconds before try `attempts + 1`: doubling from `base`, at most an hour, with jitter so that a receiver
    back from an outage is not hit by every event at once."""
    return min(MAX_BACKOFF_SECONDS, base * 2 ** (attempts - 1)) * random.uniform(0.8, 1.2)


class Outbox:
    def __init__(self, *, db: Engine, endpoints: Endpoints, settings: Settings, metrics: Metrics) -> None:
        self.metrics = metrics
        self.db = db
        self.endpoints = endpoints
        self.settings = settings

    async def run(self) -> None:
        # No connection is kept for another delivery: a send connects to an address, and one kept from a delivery to
        # another name at that address was checked (TLS) for that name, not this one.
        async with httpx.AsyncClient(
            follow_redirects=False, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:
            while True:
                try:
                    due = await asyncio.to_thread(
                        events.claim_due,
                        db=self.db,
                        now=time.time(),
                        lease=self.settings.webhook_lease_seconds,
                        limit=CLAIM_LIMIT,
                    )
                    await asyncio.gather(*(self._deliver(client, event) for event in due))
                except Exception:
                    log.exception("the webhook sender failed; it tries again")
                    due = []
                if len(due) < CLAIM_LIMIT:
                    await asyncio.sleep(self.settings.webhook_poll_seconds)

    async def _deliver(self, client: httpx.AsyncClient, event: WebhookEvent) -> None:
        endpoint = self.endpoints.for_owner(event.owner)
        error: str | None
        retry = True
        if endpoint is None:
            error, retry = "no webhook endpoint for this key", False
        else:
            try:
                addresses = await check_destination(endpoint.url, allow_private=self.settings.webhook_allow_private)
                error = await send(client, endpoint, addresses=addresses, event_id=event.id, body=events.payload(event))
            except Refused as exc:
                error, retry = f"refused: {exc}", False
                log.error("webhook %s for batch %s not sent: %s", event.id, event.batch_id, exc)
        now = time.time()
        attempts = event.attempts + 1
        retry_at = None
        if error is not None and retry and now - event.created_at < self.settings.webhook_give_up_seconds:
            retry_at = now + backoff(attempts, self.settings.webhook_retry_base_seconds)
        outcome = "delivered" if error is None else "failed" if retry_at is not None else "given_up"
        self.metrics.webhook_deliveries.labels(outcome).inc()
        if error is not None and endpoint is not None:
            log.warning("webhook %s (%s, try %d) failed: %s", event.id, event.type, attempts, error)
        await asyncio.to_thread(
            events.record_attempt,
            db=self.db,
            event_id=event.id,
            now=int(now),
            delivered=error is None,
            error=error,
            retry_at=retry_at,
        )
