"""One Settings object for the whole service, read from `VBATCH_*` environment variables."""

from __future__ import annotations

import re
import socket
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from app.core.fleet import FleetKey

_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Addresses that bind every interface: no one can reach a service by them.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def window_seconds(window: str) -> int:
    """'24h' -> 86400. Raises ValueError for anything else."""
    match = _WINDOW.match(window)
    if not match:
        raise ValueError(f"not a completion window: {window!r}")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def base_url(host: str, port: int, *, wildcard_name: str | None = None, scheme: str = "http") -> str:
    """`http://host:port` for a server bound there, a wildcard address replaced by a name others reach it by
    (`wildcard_name`, else this machine's host name)."""
    if host in WILDCARD_HOSTS:
        host = wildcard_name or socket.gethostname()
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VBATCH_", extra="ignore")
    # The comment above a field is its description in the docs' settings page (`app/reference/settings.py`
    # reads it from here); it describes every field below it up to a blank line or the next comment.

    # The service's own directory: the SQLite database (`vbatch.db`), stored files (`files/`) unless
    # VBATCH_STORAGE_URL is set, the prepared default model (`models/`), the console's secret. Made 0700.
    data_dir: Path = Path("data")
    # SQLAlchemy URL of the database: unset, the SQLite file `vbatch.db` in the data directory; for Postgres,
    # `postgresql+psycopg://user:password@host/dbname`.
    database_url: str | None = None
    # Connections each process's pool opens to Postgres at most (a thread that finds them all taken waits for one).
    # Beside its pool a `vbatch worker` holds one connection to LISTEN for new work and one for its claim on the
    # database, a `vbatch api` replica one for its claim: a fleet on Postgres directly opens (size + 2) a worker and
    # (size + 1) a replica, which `max_connections` must hold (`docs/explanation/fleet-limits.md`).
    database_pool_size: int = 5
    # `transaction`: VBATCH_DATABASE_URL reaches Postgres through a pooler in transaction mode (PgBouncer's
    # `pool_mode = transaction`), which hands each transaction whichever server connection is free. A process then
    # holds no connection of its own: no prepared statements, no LISTEN (a worker with room looks for new work four
    # times a second instead), and its claim on the database is checked at its start, not held.
    database_pooler: Literal["none", "transaction"] = "none"
    # Where uploads and results are kept: unset, `files/` in the data directory; `s3://bucket/prefix` for an
    # S3-compatible store (credentials, region and endpoint from the usual AWS_* variables), the data directory then
    # holding only scratch (part files as they are written, local copies of inputs being run).
    storage_url: str | None = None
    # LoRA adapters found by name at first use (`app.core.lora_dir`): a local folder or `s3://bucket/prefix` holding
    # one folder per adapter, `<name>/adapter_config.json` and its weights. A line or online request whose `model` is
    # no served name but such a folder's runs on that adapter of the base model (the engine needs `--enable-lora`).
    lora_dir: str | None = None
    # Where the API listens (`--host`, `--port`). An address other than loopback needs API keys, or
    # `--insecure-no-auth`.
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys, comma-separated and/or one a line in a file. With none, vbatch serves loopback only.
    api_keys: str = ""
    api_keys_file: Path | None = None
    # The `completion_window` values a batch may ask for, comma-separated (`30m`, `24h`, `48h`, `7d`, ...).
    # OpenAI accepts only "24h"; a self-hosted box may want longer (or, in tests, shorter) windows.
    completion_windows: str = "24h"
    # Lines (requests) an input file may hold, as at OpenAI.
    max_requests_per_batch: int = 50_000
    # The largest upload of a purpose other than `batch` (413 above it, counted as the body streams in).
    max_upload_bytes: int = 512 * 1000 * 1000
    # The largest `purpose=batch` upload (413 above it, counted as the body streams in), as at OpenAI.
    max_batch_upload_bytes: int = 200 * 1000 * 1000
    # The largest line of an input file (a larger one fails validation, `line_too_large`).
    max_line_bytes: int = 10 * 1024 * 1024
    # Batches a key may have validating, running or finishing at once (0: no limit).
    max_active_batches_per_key: int = 100
    # The largest `n` (choices per request) a batch line may ask for.
    max_choices_per_request: int = 128
    # When a `purpose=batch` upload expires unless it sets `expires_after` (30 days).
    batch_file_ttl_seconds: int = 30 * 86400
    # When output and error files expire unless their batch sets `output_expires_after` (30 days).
    output_file_ttl_seconds: int = 30 * 86400
    # Requests handed to the engine at once; 0 means "derive it from the engine's max_num_seqs".
    max_in_flight: int = 0
    # Online requests' time to first token the batch window keeps under (`app.engine.sharing.window`): while their
    # recent p90 is above it, fewer batch lines are in flight. 500 ms: about where a chat reply stops feeling immediate,
    # and far above what an unhindered GPU engine takes for a chat-sized prompt (tens of ms), so the window gives way
    # only when batch lines really are in the way. 0: the window stays at max_in_flight.
    live_ttft_target_ms: float = 500.0
    # While online requests are about, the batch prompt tokens that may enter each engine step
    # (`app.engine.sharing.pacing`); 0: derived from the target above and the engine's measured step times.
    live_prefill_tokens: int = 0
    # How often a running batch logs its progress (done/total, requests/s, output tokens/s, ETA).
    progress_log_seconds: float = 5.0
    # Estimates (`POST /v1/batches/estimate`, the console's submit page) running at once, of one key and in all, in
    # each process: each tokenizes and hashes a whole file, CPU work that slows every other request while it runs.
    max_estimates_per_key: int = 1
    max_estimates: int = 2
    # The engine's prefix cache is each tenant's own (`app.domain.prefix_cache`): no key's request reuses, or can
    # detect, another key's cached prompt blocks. True shares it across keys that trust each other: prompts that
    # several keys send alike are then prefilled once.
    shared_prefix_cache: bool = False
    # USD per GPU-hour of the engine's devices: with it, an estimate has its cost (`app.domain.estimates`), each
    # batch's progress has its cost (`app.domain.cost`) and /metrics counts cost beside GPU-seconds. Unset:
    # GPU-seconds only.
    gpu_hour_price: float | None = None
    # How often results are fsynced and counts committed with them; a crash re-runs at most this much work.
    checkpoint_seconds: float = 0.5
    # With VBATCH_STORAGE_URL an object store: how often a running batch ships the results it added as a segment
    # object, a request per part file, and its counts move on; the checkpoints between save only its live numbers
    # and renew its lease. A crash re-runs at most this much work.
    segment_seconds: float = 5.0
    # A service holds each batch it runs on a lease it renews every second (`app.domain.leases`); a service that
    # stops renewing (dead, or stalled) loses its batches to another once this has passed.
    lease_seconds: float = 30.0
    # Batches a `vbatch worker` holds at once (the one feeding its engine and the next): the rest wait in the database
    # for whichever worker has room. `vbatch serve`, alone, holds every active batch.
    worker_batches: int = 2
    # A `vbatch worker` cuts a batch of more lines than this into shards of about this many (on shared-prefix group
    # boundaries), which any worker may claim: several workers share one large batch. 0: never. `vbatch serve`,
    # alone with its engine, never does.
    shard_lines: int = 5000
    # Times a line may kill the engine while running alone before it goes to the error file.
    engine_deaths_per_line: int = 2
    # The largest JSON request body (413 `request_too_large` above it): batch creation's are far smaller, and a
    # larger one is refused before it is read whole.
    max_json_body_bytes: int = 256 * 1024
    # Slow clients: headers must be in this long after the connection (or the previous response), and a body must
    # come at this many bytes a second on average after that long (408 otherwise).
    header_timeout_seconds: float = 10.0
    min_body_bytes_per_second: int = 16 * 1024
    # Connections one address may hold at once (0: any number; behind a reverse proxy, which limits instead).
    max_connections_per_client: int = 100
    # Without API keys only requests naming a loopback host (localhost, 127.x, [::1]) or the address served on are
    # answered, so that no web page reaches the service by DNS rebinding; these host names too (comma-separated;
    # `*`: any). When given, the rule holds with keys too.
    allowed_hosts: str = ""
    # Swagger UI (/docs) and ReDoc (/redoc) load their scripts from a public CDN: off unless asked for.
    api_docs: bool = False
    # The console cookie's Secure flag. "auto": when the request came over https, which behind a TLS proxy uvicorn
    # sees only from a proxy it trusts with X-Forwarded-Proto (uvicorn's FORWARDED_ALLOW_IPS, loopback by default);
    # "true" for a proxy it does not trust.
    cookie_secure: Literal["auto", "true", "false"] = "auto"
    # Online requests (`/v1/chat/completions` ...) each key may make a minute, and tokens it may use a minute (the
    # prompt estimated, plus the most it may generate), in each process that answers them; 0: no limit. A key's own
    # `live_rpm=` / `live_tpm=` on its line of the keys file take their place. Batches are not limited by these.
    live_rpm: int = 0
    live_tpm: int = 0
    # Webhooks (OpenAI's batch events, Standard Webhooks signatures): the service's endpoint; keys may have their
    # own in the keys file (`key url secret` on its line).
    webhook_url: str | None = None
    webhook_secret: str | None = None
    # Private, loopback and link-local receivers are refused unless allowed (SSRF).
    webhook_allow_private: bool = False
    # The first retry's delay after a failed delivery; it doubles at each retry, up to an hour, with jitter.
    webhook_retry_base_seconds: float = 5.0
    # How long an event is retried before it is given up (72 hours).
    webhook_give_up_seconds: int = 72 * 3600
    # How often the sender looks for events due.
    webhook_poll_seconds: float = 1.0
    # How long an event a sender claimed is its alone (another process's sender takes it over after that).
    webhook_lease_seconds: float = 60.0
    # SIGTERM: how long the engine may take to stop (runs checkpoint and stop) before the process exits anyway.
    drain_seconds: float = 30.0
    # With several front-end processes (`--api-server-count`): how long they have, once the engine core is up, to be
    # ready before the engine is launched again (`vllm_adapter.LAUNCH_ATTEMPTS` launches at most; a good launch is
    # ready within seconds). The tests set it lower.
    frontend_ready_seconds: float = 120.0
    # Retention: how often expired files are deleted (disk and database), and how long finished webhook events stay.
    retention_sweep_seconds: float = 300.0
    retention_events_seconds: int = 7 * 86400
    # "json": one JSON object a line (`app/core/logs.py`), with each request's `request_id`.
    log_format: Literal["text", "json"] = "text"
    # Below this much free space in the data directory, /health says the service is unavailable and uploads are
    # refused (507): what is left is for the results of running batches.
    min_free_disk_bytes: int = 64 * 1024 * 1024
    # Held in a file while the disk has room, released when it fills, so the database can still end batches and
    # take cancels and deletes (`app/core/disk.py`). 0 keeps none.
    disk_reserve_bytes: int = 32 * 1024 * 1024
    # A batch still active this long after its completion window ended (its run died, hangs, or the engine is
    # down) is ended by the watchdog with the results its last checkpoint holds.
    watchdog_grace_seconds: float = 300.0
    # A synchronous database or object-store call made on a thread that runs an event loop raises instead of
    # stalling that loop (`app/core/blocking.py`): the test suite turns it on, to find such calls.
    guard_blocking: bool = False
    # Where a `vbatch worker` answers online requests, for the API replicas that forward them to it
    # (`http://10.0.0.7:8001`): unset, from the host and port it listens on, a wildcard host replaced by this
    # machine's name. Set it where that name does not reach the worker (a Kubernetes pod: its IP).
    advertise_url: str | None = None
    # A forwarded online request whose worker sends nothing for this long (a streamed answer between two events,
    # or a whole answer that is not streamed) ends with an error: the worker hangs, or is cut off.
    forward_silence_seconds: float = 600.0
    # The secret `vbatch api` replicas and `vbatch worker`s share (`app.core.fleet`; at least 16 bytes, e.g.
    # `openssl rand -hex 32`), or a file holding it: workers prove where they answer with it, replicas sign the caller's
    # tenant on each request they forward with it. Both roles refuse to start without one; `vbatch serve` needs none.
    fleet_secret: SecretStr | None = None
    fleet_secret_file: Path | None = None
    # Where replicas may forward online requests: worker URLs whose host is in one of these networks (CIDR) or is one
    # of these names (comma-separated). Unset: any worker whose proof holds.
    fleet_networks: str = ""
    # Workers served over https (`VBATCH_ADVERTISE_URL=https://...`): the CA bundle a replica checks their
    # certificates with (unset: the system's).
    fleet_ca_file: Path | None = None
    # Serve https with this certificate and key (PEM), in any role: a worker's link to the replicas, or the API itself.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url_parses(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
            raise ValueError(f"VBATCH_ADVERTISE_URL must be a base URL such as http://10.0.0.7:8001, not {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("VBATCH_TLS_CERT_FILE and VBATCH_TLS_KEY_FILE are set together, or neither")
        return self

    @field_validator("completion_windows")
    @classmethod
    def _windows_parse(cls, value: str) -> str:
        for window in value.split(","):
            window_seconds(window.strip())
        return value

    @field_validator("live_rpm", "live_tpm")
    @classmethod
    def _a_limit(cls, value: int) -> int:
        if value < 0:
            raise ValueError("a limit a minute is 0 (none) or more")
        return value

    @field_validator("gpu_hour_price")
    @classmethod
    def _a_price(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError("VBATCH_GPU_HOUR_PRICE is USD per GPU-hour: a number, 0 or more")
        return value

    @cached_property
    def allowed_windows(self) -> dict[str, int]:
        return {w.strip(): window_seconds(w.strip()) for w in self.completion_windows.split(",")}

    def read_api_keys(self) -> list[str]:
        from app.core.auth import read_keys

        return read_keys(inline=self.api_keys, path=self.api_keys_file)

    def upload_limit(self, purpose: str) -> int:
        return self.max_batch_upload_bytes if purpose == "batch" else self.max_upload_bytes

    @property
    def advertised_url(self) -> str:
        """Where this service answers, as workers announce it: `advertise_url`, or the host and port it listens on."""
        return self.advertise_url or base_url(self.host, self.port, scheme=self.scheme)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_file else "http"

    def fleet_key(self) -> FleetKey | None:
        """The key of the fleet's secret (None: none set); ValueError for an unreadable file or a secret too short."""
        from app.core.fleet import FleetKey

        secret = self.fleet_secret.get_secret_value() if self.fleet_secret else None
        return FleetKey.from_settings(secret, self.fleet_secret_file)

    @property
    def database_path(self) -> Path:
        """The default SQLite file (used only while `database_url` is unset)."""
        return self.data_dir / "vbatch.db"

    @property
    def database(self) -> str:
        """The database's URL, set or default."""
        return self.database_url or f"sqlite:///{self.database_path}"

    @property
    def lora_cache_dir(self) -> Path:
        """Where adapters of an `s3://` `lora_dir` are copied at their first use."""
        return self.data_dir / "lora-cache"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
