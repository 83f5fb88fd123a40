"""A fleet on one database (issue 41): many `vbatch worker`s and several `vbatch api` replicas on one Postgres
(pgserver) and one S3 store (moto's server), an open-loop population of clients that upload, create and poll, and
what it costs the control plane: database statements and S3 requests per line and per batch, connections, claim
latency, poll latency, fairness between keys, and a worker killed mid-batch.

What runs, and how:
- Postgres: `app.testing.LocalPostgres` (pgserver, PostgreSQL 16, its default `max_connections` 100, read back and
  recorded). With `--pgbouncer`, the workers reach it through Debian's PgBouncer in transaction mode
  (`bench.pgbouncer`), as `VBATCH_DATABASE_POOLER=transaction` says to them.
- S3: `app.testing.LocalS3` (moto's threaded server). Its request log is the S3 count: every request any process
  made, by method.
- API replicas: `--replicas` processes, each `vbatch api`'s app over uvicorn (`app.testing.serve_fake_engine
  --role api`), with the 1,000 keys.
- Workers: `--workers` of them, spread over `--worker-processes` host processes. Each worker is the whole `vbatch
  worker` app (`create_app(..., Role.WORKER)`: its lifespan, its database engine and pool, its engine thread,
  lease holder, scheduler, LISTEN, beats, checkpoints and publishing), run without its HTTP port, which serves
  only online requests and health; its engine is the fake one, a "GPU" that answers up to `--wave` lines per step
  of `--step-seconds`. One more host process holds one worker alone: the one killed mid-batch.
- Clients: one process (asyncio, httpx), open loop: `--pickup` batches created one at a time while the workers are
  free (claim latency), then the rest key after key (each key's batches back to back: the order that shows
  whether claims go round robin over keys), and `--polls` GET /v1/batches/{id} a second in all, spread over the
  batches not yet seen ended.

Counting, from the real code paths: every process the bench starts counts the statements its SQLAlchemy engines
send (`before_cursor_execute`, by kind and table), the pings `pool_pre_ping` sends (a round trip each, outside
SQLAlchemy's events) and its commits; the server's own count of transactions (`pg_stat_database.xact_commit`) is
read beside. Workers log each claim and each batch end with the time (wrapping `leases.claim` and
`batches.end_with_files`, which they call through their modules).

  flock /tmp/vbatch-engine.lock .venv/bin/python -m bench.fleet --out /tmp/fleet --results bench/results/fleet-x.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
FLEET_SECRET = "bench-fleet-secret-0123456789abcdef"
MODEL = "fake-model"


# The run's shape: what the orchestrator hands to every process it starts (as JSON).
@dataclass
class Shape:
    workers: int = 100
    worker_processes: int = 4
    replicas: int = 4
    keys: int = 1000
    batches: int = 10000
    lines: int = 100
    pickup: int = 100  # batches created one at a time, while the workers are free
    pickup_gap: float = 0.25  # seconds between them
    create_rate: float = 50.0  # batches a second at most after that (uploads and creates)
    # The backlog (every key's batches, key after key) is created while the workers are stopped (SIGSTOP), so that
    # every key's batches wait at once when they come back: what shows whether claims go round robin over keys.
    pause: bool = True
    polls: float = 500.0  # polls a second in all
    wave: int = 64  # lines a worker's GPU answers in one step
    step_seconds: float = 2.0  # one step: a line's service time
    lease_seconds: float = 10.0
    checkpoint_seconds: float = 0.5
    worker_batches: int = 2
    pool_size: int = 2  # each worker's VBATCH_DATABASE_POOL_SIZE
    api_pool_size: int = 5  # each replica's
    pgbouncer: bool = False  # the workers reach Postgres through PgBouncer in transaction mode
    bouncer_connections: int = 40  # PgBouncer's connections to Postgres (its default_pool_size)
    kill: bool = True
    extra_env: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Counting, in every process the bench starts.

_TABLE = re.compile(r"\b(?:FROM|UPDATE|INTO|JOIN)\s+\"?(\w+)", re.IGNORECASE)


_SET = re.compile(r"\bSET\s+(\w+)=", re.IGNORECASE)


def statement_kind(sql: str) -> str:
    """`UPDATE batches SET output_bytes_done` (a checkpoint), `SELECT batches by id` (a poll, or a run reading its
    row), `SELECT files`, `SELECT pg_notify`, ...: the verb, the first table it names, and what tells it apart."""
    text = sql.lstrip().lstrip("(")
    verb = text.split(None, 1)[0].upper() if text else "?"
    for function in ("pg_notify", "pg_advisory_xact_lock", "pg_try_advisory", "pg_stat"):
        if function in text:
            return f"{verb} {function}"
    table = _TABLE.search(text)
    kind = f"{verb} {table.group(1)}" if table else verb
    if verb == "UPDATE" and (column := _SET.search(text)):
        kind += f" SET {column.group(1)}"
    elif verb == "SELECT" and table and f"WHERE {table.group(1)}.id = %(pk_1)s" in text:
        kind += " by id"
    elif verb == "SELECT" and "FOR UPDATE" in text:
        kind += " FOR UPDATE"
    return kind


class Counts:
    """What this process sent to the database, written to `path` every second and at exit."""

    def __init__(self, path: Path, role: str) -> None:
        self.path = path
        self.role = role
        self.statements: Counter[str] = Counter()
        self.pings = 0
        self.commits = 0
        self._lock = threading.Lock()

    def install(self) -> None:
        from sqlalchemy import event
        from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
        from sqlalchemy.engine import Engine

        event.listen(Engine, "before_cursor_execute", self._statement)
        event.listen(Engine, "commit", self._commit)
        ping = PGDialect_psycopg.do_ping

        def counted_ping(dialect, dbapi_connection):
            with self._lock:
                self.pings += 1
            return ping(dialect, dbapi_connection)

        PGDialect_psycopg.do_ping = counted_ping  # type: ignore[method-assign]
        threading.Thread(target=self._dump_every_second, daemon=True).start()

    def _statement(self, _conn, _cursor, statement, _parameters, _context, _executemany) -> None:
        kind = statement_kind(statement)
        with self._lock:
            self.statements[kind] += 1

    def _commit(self, _conn) -> None:
        with self._lock:
            self.commits += 1

    def dump(self) -> None:
        with self._lock:
            data = {
                "role": self.role,
                "pid": os.getpid(),
                "at": time.time(),
                "statements": dict(self.statements),
                "pings": self.pings,
                "commits": self.commits,
            }
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        partial.replace(self.path)

    def _dump_every_second(self) -> None:
        while True:
            time.sleep(1.0)
            self.dump()


class EventLog:
    """Claims and batch ends as the workers of this process make them, with the time (ns), appended to a file."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, **record) -> None:
        with self._lock:
            self.file.write(json.dumps(record) + "\n")

    def install(self) -> None:
        from app.domain import batches, leases

        claim, end_with_files = leases.claim, batches.end_with_files

        def logged_claim(**kwargs):
            taken = claim(**kwargs)
            now = time.time_ns()
            for lease in taken:
                self.write(event="claim", at=now, batch=lease.batch_id, token=lease.token, holder=lease.holder)
            return taken

        def logged_end(**kwargs):
            row = end_with_files(**kwargs)
            self.write(event="end", at=time.time_ns(), batch=row.id, status=str(row.status), completed=row.completed)
            return row

        leases.claim = logged_claim
        batches.end_with_files = logged_end


# ---------------------------------------------------------------------------------------------------------------
# The workers' engine: a GPU that answers a wave of lines per step.


def fleet_engine(wave: int, step_seconds: float):
    from app.testing import FakeEngine, FakeExecutor

    class StepExecutor(FakeExecutor):
        """Lines wait for a step; each step answers up to `wave` of them after `step_seconds`."""

        def __init__(self) -> None:
            super().__init__()
            self.bodies = deque(maxlen=0)  # type: ignore[assignment]  # a million lines: keep none
            self.ranks = deque(maxlen=0)  # type: ignore[assignment]
            self.waiting: deque[asyncio.Future] = deque()
            self.stepping: asyncio.Task | None = None

        async def execute(self, endpoint: str, body: dict, rank: int | None = None):
            answered = asyncio.get_running_loop().create_future()
            self.waiting.append(answered)
            if self.stepping is None or self.stepping.done():
                self.stepping = asyncio.create_task(self._steps())
            await answered
            return await super().execute(endpoint, body, rank)

        async def _steps(self) -> None:
            while self.waiting:
                step = [self.waiting.popleft() for _ in range(min(wave, len(self.waiting)))]
                await asyncio.sleep(step_seconds)
                for answered in step:
                    if not answered.done():
                        answered.set_result(None)

    class StepEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.executor = StepExecutor()

        @asynccontextmanager
        async def __call__(self) -> AsyncIterator:
            async with super().__call__() as serving:
                serving.max_num_seqs = wave  # type: ignore[misc]
                serving.engine_config["max_num_seqs"] = wave
                yield serving

    return StepEngine()


# ---------------------------------------------------------------------------------------------------------------
# The processes the orchestrator starts: `python -m bench.fleet <role> ...`.


def serve_api(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    Counts(args.counts, "api").install()
    from app.testing import serve_fake_engine

    serve_fake_engine(["--role", "api", *rest])


def host_workers(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    shape = Shape(**json.loads(args.shape))
    counts = Counts(args.out / "counts" / f"{args.name}.json", "worker")
    counts.install()
    EventLog(args.out / "events" / f"{args.name}.jsonl").install()
    asyncio.run(_host(shape, args))


async def _host(shape: Shape, args: argparse.Namespace) -> None:
    from app.core import logs
    from app.core.config import Settings
    from app.engine.service import EngineService
    from app.main import Role, create_app

    logs.configure("text")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    async with AsyncExitStack() as stack:
        for number in range(args.first, args.first + args.count):
            settings = Settings(
                data_dir=args.out / "workers" / f"w{number:03d}",
                advertise_url=f"http://127.0.0.1:{20000 + number}",  # never called: online requests are not the test
            )
            app = create_app(settings, EngineService(fleet_engine(shape.wave, shape.step_seconds)), Role.WORKER)
            await stack.enter_async_context(app.router.lifespan_context(app))
        (args.out / "ready" / args.name).touch()
        await stopping.wait()


# ---------------------------------------------------------------------------------------------------------------
# The clients.


def input_file(lines: int, tag: str) -> bytes:
    rows = []
    for i in range(lines):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Label item {i} of {tag}: fruit or tool?"}]}
        rows.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))  # fmt: skip
    return ("\n".join(rows) + "\n").encode()


@dataclass
class Made:
    key: int
    number: int  # the key's n-th batch
    batch_id: str
    phase: str
    created: float  # time.time() once the create returned
    ended: float | None = None
    status: str | None = None


def signal_file(out: Path, name: str) -> None:
    (out / "phases" / name).write_text(str(time.time()))


async def wait_for_file(out: Path, name: str) -> None:
    while not (out / "phases" / name).exists():
        await asyncio.sleep(0.1)


class Clients:
    """Open loop: creates at their own pace, and a poll every 1/polls s whatever the answers take. A poll or create
    whose connection failed is sent again once (as the openai SDK does), and counted."""

    def __init__(self, shape: Shape, urls: list[str], out: Path) -> None:
        self.shape = shape
        self.urls = urls
        self.out = out
        self.made: list[Made] = []
        self.open: list[Made] = []  # created, not yet seen ended
        self.poll_ms: list[tuple[float, float]] = []  # (when, ms)
        self.create_ms: list[float] = []
        self.errors: Counter[str] = Counter()
        self.resent = 0
        self.late_polls = 0
        self.done = False
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.clients = [httpx.AsyncClient(base_url=url, timeout=60, limits=limits) for url in urls]

    def key(self, number: int) -> str:
        return f"sk-fleet-{number:04d}"

    async def send(self, method: str, path: str, key: int, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key(key)}"}
        for attempt in range(2):
            client = random.choice(self.clients)
            try:
                return await client.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError:
                if attempt:
                    raise
                self.resent += 1
        raise AssertionError("unreachable")

    async def create(self, key: int, number: int, phase: str) -> None:
        started = time.perf_counter()
        try:
            content = input_file(self.shape.lines, f"k{key}b{number}")
            files = {"file": (f"k{key}b{number}.jsonl", content)}
            uploaded = await self.send("POST", "/v1/files", key, files=files, data={"purpose": "batch"})
            uploaded.raise_for_status()
            body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}  # fmt: skip
            created = await self.send("POST", "/v1/batches", key, json=body)
            created.raise_for_status()
        except httpx.HTTPStatusError as exc:
            self.errors[f"create {exc.response.status_code}"] += 1
            return
        except httpx.HTTPError as exc:
            self.errors[f"create {type(exc).__name__}"] += 1
            return
        self.create_ms.append((time.perf_counter() - started) * 1000)
        made = Made(key, number, created.json()["id"], phase, time.time())
        self.made.append(made)
        self.open.append(made)

    async def poll_one(self, made: Made) -> None:
        started = time.perf_counter()
        try:
            answer = await self.send("GET", f"/v1/batches/{made.batch_id}", made.key)
        except httpx.HTTPError as exc:
            self.errors[f"poll {type(exc).__name__}"] += 1
            return
        self.poll_ms.append((time.time(), (time.perf_counter() - started) * 1000))
        if answer.status_code != 200:
            self.errors[f"poll {answer.status_code}"] += 1
            return
        status = answer.json()["status"]
        if status in ("completed", "failed", "cancelled", "expired") and made.ended is None:
            made.ended, made.status = time.time(), status
            with contextlib.suppress(ValueError):
                self.open.remove(made)

    async def polls(self) -> None:
        gap = 1.0 / self.shape.polls
        under_way: set[asyncio.Task] = set()
        next_at = time.perf_counter()
        turn = 0
        while not self.done:
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            pool = self.open or self.made
            if not pool:
                continue
            if len(under_way) >= 2000:
                self.late_polls += 1
                continue
            turn += 1
            task = asyncio.create_task(self.poll_one(pool[turn % len(pool)]))
            under_way.add(task)
            task.add_done_callback(under_way.discard)
        # The polls still out are answered before the clients close (sent on a closed client, they raised).
        await asyncio.gather(*under_way)

    async def until_all_ended(self) -> None:
        while self.open:
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        polling = asyncio.create_task(self.polls())
        shape = self.shape
        for n in range(shape.pickup):
            await self.create(random.randrange(shape.keys), n, "pickup")
            await asyncio.sleep(shape.pickup_gap)
        await self.until_all_ended()
        signal_file(self.out, "backlog-starting")
        if shape.pause:
            await wait_for_file(self.out, "paused")
        await self.backlog()
        signal_file(self.out, "backlog-created")
        await self.until_all_ended()
        self.done = True
        await polling
        for client in self.clients:
            await client.aclose()

    async def backlog(self) -> None:
        """Every key's batches, key after key, at `create_rate` at most (32 creates under way at most)."""
        shape = self.shape
        per_key = max(1, (shape.batches - shape.pickup) // shape.keys)
        gap = 1.0 / shape.create_rate
        creating: set[asyncio.Task] = set()
        for key in range(shape.keys):
            for number in range(per_key):
                task = asyncio.create_task(self.create(key, shape.pickup + number, "backlog"))
                creating.add(task)
                task.add_done_callback(creating.discard)
                await asyncio.sleep(gap)
                while len(creating) >= 32:
                    await asyncio.sleep(gap)
        await asyncio.gather(*creating)

    def record(self) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "made": [asdict(made) for made in self.made],
            "poll_ms": self.poll_ms,
            "create_ms": self.create_ms,
            "errors": dict(self.errors),
            "resent": self.resent,
            "late_polls": self.late_polls,
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
        }


def run_clients(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True)
    parser.add_argument("--urls", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    clients = Clients(Shape(**json.loads(args.shape)), args.urls.split(","), args.out)
    try:
        asyncio.run(clients.run())
    finally:
        (args.out / "clients.json").write_text(json.dumps(clients.record()))


# ---------------------------------------------------------------------------------------------------------------
# The orchestrator.


class Fleet:
    def __init__(self, shape: Shape, out: Path) -> None:
        self.shape = shape
        self.out = out
        self.processes: dict[str, subprocess.Popen] = {}
        self.samples: list[dict] = []
        self.snapshots: dict[str, dict] = {}  # the counts as they stood at each phase
        self.kill: dict = {}
        self.phases: dict[str, float] = {}
        self.sampling = True
        self._s3_offset = 0
        self._s3_seen: Counter[str] = Counter()
        self._s3_lock = threading.Lock()

    def env(self, database_url: str, storage_env: dict, storage_url: str, pool_size: int) -> dict:
        keys = ",".join(f"sk-fleet-{n:04d}" for n in range(self.shape.keys))
        return {
            **os.environ,
            **storage_env,
            "VBATCH_DATABASE_URL": database_url,
            "VBATCH_DATABASE_POOL_SIZE": str(pool_size),
            "VBATCH_STORAGE_URL": storage_url,
            "VBATCH_FLEET_SECRET": FLEET_SECRET,
            "VBATCH_API_KEYS": keys,
            "VBATCH_MAX_CONNECTIONS_PER_CLIENT": "0",  # every client comes from 127.0.0.1
            "VBATCH_MAX_ACTIVE_BATCHES_PER_KEY": "0",
            "VBATCH_LEASE_SECONDS": str(self.shape.lease_seconds),
            "VBATCH_CHECKPOINT_SECONDS": str(self.shape.checkpoint_seconds),
            "VBATCH_WORKER_BATCHES": str(self.shape.worker_batches),
            "VBATCH_DISK_RESERVE_BYTES": "0",
            "VBATCH_MIN_FREE_DISK_BYTES": "0",
            **self.shape.extra_env,
        }

    def start(self, name: str, command: list[str], env: dict) -> subprocess.Popen:
        log = (self.out / "logs" / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.fleet", *command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes[name] = process
        return process

    def start_apis(self, env: dict) -> list[str]:
        from app.testing import free_port

        urls = []
        for n in range(self.shape.replicas):
            port = free_port()
            data = self.out / "apis" / f"api{n}"
            command = ["serve-api", "--counts", str(self.out / "counts" / f"api{n}.json"), "--data-dir", str(data),
                       "--port", str(port)]  # fmt: skip
            self.start(f"api{n}", command, env)
            urls.append(f"http://127.0.0.1:{port}")
        return urls

    def start_workers(self, env: dict) -> list[str]:
        shape = self.shape
        names = []
        hosts = max(1, shape.worker_processes)
        alone = 1 if shape.kill else 0
        spread = shape.workers - alone
        first = 0
        for n in range(hosts):
            count = spread // hosts + (1 if n < spread % hosts else 0)
            names.append(self.host(f"host{n}", first, count, env))
            first += count
        if alone:
            names.append(self.host("victim", first, 1, env))
        return names

    def host(self, name: str, first: int, count: int, env: dict) -> str:
        command = ["host-workers", "--shape", json.dumps(asdict(self.shape)), "--first", str(first), "--count",
                   str(count), "--out", str(self.out), "--name", name]  # fmt: skip
        self.start(name, command, env)
        return name

    def hosts(self) -> list[subprocess.Popen]:
        return [process for name, process in self.processes.items() if name.startswith(("host", "victim"))]

    def wait_ready(self, hosts: list[str], urls: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}: see {self.out / 'logs' / name}.log")
            ready = all((self.out / "ready" / name).exists() for name in hosts)
            if ready and all(_healthy(url) for url in urls):
                return
            time.sleep(1.0)
        raise RuntimeError(f"the fleet was not ready in {timeout} s")

    def direct(self, client: subprocess.Popen, db_url: str) -> None:
        """Stops the workers while the backlog is created (SIGSTOP), then lets them go and kills the victim
        mid-batch."""
        phases = self.out / "phases"
        while not (phases / "backlog-starting").exists() and client.poll() is None:
            time.sleep(0.1)
        self.mark("backlog-starting")
        if self.shape.pause:
            for host in self.hosts():
                host.send_signal(signal.SIGSTOP)
            signal_file(self.out, "paused")
        while not (phases / "backlog-created").exists() and client.poll() is None:
            time.sleep(0.1)
        time.sleep(1.5)  # every process's counts written since the last create: the window starts clean
        self.mark("backlog-created")
        if self.shape.pause:
            for host in self.hosts():
                if host.poll() is None:
                    host.send_signal(signal.SIGCONT)
        self.mark("resumed")
        if self.shape.kill:
            self.kill_mid_batch(db_url, client)

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.time()
        self.snapshots[phase] = {"counts": read_counts(self.out), "s3": dict(self.s3_seen())}

    def s3_seen(self) -> Counter[str]:
        """The store's requests so far (its log read on from where the last look stopped), a copy."""
        with self._s3_lock, (self.out / "moto.log").open("rb") as log:
            log.seek(self._s3_offset)
            data = log.read()
            complete = data.rfind(b"\n") + 1
            self._s3_offset += complete
            self._s3_seen.update(s3_requests(data[:complete].decode(errors="replace")))
            return Counter(self._s3_seen)

    def sample(self, db_url: str, pids: dict[str, list[int]]) -> None:
        """Every half second: connections the server has open, its transactions, lines done, batches waiting for a
        worker, statements and S3 requests so far, and each part's CPU seconds."""
        import psycopg

        plain = db_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(plain, autocommit=True) as conn:
            while self.sampling:
                row = conn.execute(SAMPLE).fetchone()
                assert row is not None
                counts = read_counts(self.out)
                self.samples.append({
                    "at": time.time(), "connections": row[0], "xacts": row[1], "lines": row[2], "waiting": row[3],
                    "ended": row[4], "statements": sum(sum(c["statements"].values()) + c["pings"] for c in counts),
                    "s3": sum((seen := self.s3_seen()).values()), "s3_kinds": dict(seen),
                    "cpu": {part: _cpu_seconds(ids) for part, ids in list(pids.items())},
                })  # fmt: skip
                time.sleep(0.5)

    def kill_mid_batch(self, db_url: str, client: subprocess.Popen) -> None:
        """Once the victim worker holds a batch it has answered some lines of, SIGKILL its process. Given up when
        the clients end first (batches of one step's lines are never part done), so the run's end is not held."""
        from app.core.db import make_engine

        victim = self.processes["victim"]
        db = make_engine(db_url)
        try:
            while victim.poll() is None and client.poll() is None:
                held = _held_by(db, victim.pid)
                if [row for row in held if 0 < row.completed < row.total]:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    self.kill = {"at": time.time_ns(), "batches": [row.id for row in held],
                                 "tokens": {row.id: row.lease_token for row in held},
                                 "completed_at_kill": {row.id: row.completed for row in held}}  # fmt: skip
                    return
                time.sleep(0.05)
        finally:
            db.dispose()


SAMPLE = """
SELECT
  (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
  (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()),
  (SELECT coalesce(sum(completed + failed), 0) FROM batches WHERE parent_id IS NULL),
  (SELECT count(*) FROM batches WHERE status IN ('validating', 'in_progress') AND lease_holder IS NULL),
  (SELECT count(*) FROM batches WHERE status IN ('completed', 'failed', 'cancelled', 'expired'))
"""


def read_counts(out: Path) -> list[dict]:
    found = []
    for path in sorted((out / "counts").glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            found.append(json.loads(path.read_text()))
    return found


def _held_by(db, pid: int) -> list:
    from sqlmodel import col, select

    from app.core.db import session_scope
    from app.domain.models import BatchRow

    with session_scope(db) as session:
        statement = select(BatchRow).where(
            col(BatchRow.lease_holder).like(f"%/{pid}/%"), col(BatchRow.lease_expires_ns).is_not(None)
        )
        return list(session.exec(statement).all())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _cpu_seconds(pids: list[int]) -> float:
    """Each process's CPU seconds with its children's, those still running and those it has reaped (Postgres's
    backends come and go)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child_times = child.cpu_times()
                    total += child_times.user + child_times.system
    return total


# ---------------------------------------------------------------------------------------------------------------
# The results.


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))], 1)


def spread(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
        "max": percentile(values, 1.0),
    }


def jain(values: list[float]) -> float | None:
    if not values or not any(values):
        return None
    return round(sum(values) ** 2 / (len(values) * sum(v * v for v in values)), 4)


def read_events(out: Path) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    claims: dict[str, list[dict]] = {}
    ends: dict[str, dict] = {}
    for path in sorted((out / "events").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line a killed process cut short
                record = json.loads(line)
                if record["event"] == "claim":
                    claims.setdefault(record["batch"], []).append(record)
                else:
                    ends[record["batch"]] = record
    return claims, ends


PROBLEM = re.compile(r"(too many clients|remaining connection slots|Traceback|ERROR|WARNING|CRITICAL)")


def log_problems(out: Path) -> dict:
    """Lines of the processes' logs that say something went wrong, by the problem's words (the 8 commonest)."""
    found: Counter[str] = Counter()
    for path in sorted((out / "logs").glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if PROBLEM.search(line):
                words = re.sub(r"batch_\w+|file-\w+|\d+", "#", line.split(": ", 1)[-1])[:140]
                found[f"{path.stem.rstrip('0123456789')}: {words}"] += 1
    return dict(found.most_common(8)) | {"lines": sum(found.values())}


def started_workers(out: Path) -> int:
    """Workers whose engine came up (each logs it once) before the fleet stopped."""
    return sum(path.read_text(errors="replace").count("engine ready") for path in (out / "logs").glob("*.log"))


_REQUEST = re.compile(r'"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/[\d.]+" (\d+)')


def s3_requests(text: str) -> Counter[str]:
    """moto's request log: each request by method and the query that says what it is (a list, a bulk delete, a
    multipart upload's steps)."""
    found: Counter[str] = Counter()
    for method, path, status in _REQUEST.findall(text):
        query = path.partition("?")[2]
        kind = method
        for marker in ("uploads", "uploadId", "list-type", "delete"):
            if marker in query:
                kind = f"{method} ?{marker}"
                break
        found[kind if status.startswith("2") else f"{kind} {status}"] += 1
    return found


def summarise(fleet: Fleet, rows: list, clients: dict) -> dict:
    shape = fleet.shape
    claims, ends = read_events(fleet.out)
    made = {record["batch_id"]: record for record in clients["made"]}
    created_ns = {row["id"]: row["created_ns"] for row in rows}
    first_claim = {batch: min(c["at"] for c in taken) for batch, taken in claims.items()}
    pickup = [(first_claim[b] - created_ns[b]) / 1e6 for b, m in made.items()
              if m["phase"] == "pickup" and b in first_claim and b in created_ns]  # fmt: skip
    lines = sum(row["completed"] + row["failed"] for row in rows if row["parent_id"] is None)
    return {
        "batches": {
            "created": len(made),
            "statuses": dict(Counter(r["status"] for r in rows)),
            "lines_done": lines,
            "lines_expected": len(made) * shape.lines,
        },
        "errors": clients["errors"],
        "resent_after_a_transport_error": clients["resent"],
        "log_problems": log_problems(fleet.out),
        "late_polls": clients["late_polls"],
        "poll_ms": spread([ms for _, ms in clients["poll_ms"]]),
        "poll_ms_backlog": spread([ms for at, ms in clients["poll_ms"] if at >= fleet.phases.get("resumed", 0)]),
        "create_ms": spread(clients["create_ms"]),
        "pickup_ms": spread(pickup),
        "fairness": fairness(rows, made, ends, claims),
        "takeover": takeover(fleet.kill, claims, rows, shape),
        "pickup_phase": pickup_window(fleet),
        "creation": creation_window(fleet, sum(1 for m in made.values() if m["phase"] == "backlog")),
        "backlog": with_polls(backlog_window(fleet), clients["poll_ms"]),
        "whole_run": costs(fleet.samples[0] if fleet.samples else {}, fleet.samples[-1] if fleet.samples else {}),
        "connections": connections(fleet.samples),
        "cpu": cpu_shares(fleet.samples, clients["cpu_seconds"]),
    }


def fairness(rows: list, made: dict, ends: dict, claims: dict) -> dict:
    """Over the backlog's keys (every key's batches waiting at once). The claims' order: a claim's round is how many
    of its key's batches were claimed before it, and a claim is out of round when some claim before it was of a
    later round (0 in a perfect round robin; a key's batches are created at once, so which of them goes first is
    not the test). And each key's lines done at the moment half the lines were (Jain's index: 1.0 is every key
    alike), beside the same index for a perfect round robin over the same batches, which is below 1.0 when keys
    have few batches each (0.9 at three apiece), and at the end of the first round (1.0 in a perfect one)."""
    backlog = {b: m for b, m in made.items() if m["phase"] == "backlog" and b in ends}
    if not backlog:
        return {}
    size = {row["id"]: row["completed"] + row["failed"] for row in rows}
    keys = sorted({m["key"] for m in backlog.values()})
    order = sorted(backlog, key=lambda b: ends[b]["at"])
    claimed = sorted((min(c["at"] for c in claims[b]), backlog[b]["key"]) for b in backlog if b in claims)
    rounds: Counter[int] = Counter()
    ranks = []
    for _, key in claimed:
        ranks.append(rounds[key])
        rounds[key] += 1
    ideal = _round_robin({key: [size.get(b, 0) for b in order if backlog[b]["key"] == key] for key in keys})
    first_round = len(keys)
    return {
        "keys": len(keys),
        "claims_out_of_round": _inversions(ranks),
        "distinct_keys_in_first_round_of_claims": len({key for _, key in claimed[:first_round]}),
        "jain_at_half": _jain_at([size.get(b, 0) for b in order], [backlog[b]["key"] for b in order], keys, 0.5),
        "jain_at_half_perfect_round_robin": _jain_at([n for n, _ in ideal], [k for _, k in ideal], keys, 0.5),
        "jain_after_first_round": _jain_of_first(order[:first_round], backlog, size, keys),
    }


def _round_robin(sizes: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(lines, key) of every batch as a perfect round robin over keys would end them."""
    ended = []
    for turn in range(max((len(v) for v in sizes.values()), default=0)):
        ended += [(lines[turn], key) for key, lines in sizes.items() if turn < len(lines)]
    return ended


def _jain_at(lines: list[int], keys_of: list[int], keys: list[int], share: float) -> float | None:
    """Jain's index over `keys` of their lines done when `share` of all lines were, batches ended in this order."""
    target = sum(lines) * share
    done: Counter[int] = Counter()
    counted = 0
    for number, key in zip(lines, keys_of, strict=True):
        if counted >= target:
            break
        done[key] += number
        counted += number
    return jain([float(done.get(key, 0)) for key in keys])


def _jain_of_first(ended: list[str], backlog: dict, size: dict, keys: list[int]) -> float | None:
    """Jain's index over `keys` of their lines in these batches (the first as many to end as there are keys: in a
    perfect round robin, one of each key's)."""
    done: Counter[int] = Counter()
    for batch in ended:
        done[backlog[batch]["key"]] += size.get(batch, 0)
    return jain([float(done.get(key, 0)) for key in keys])


def _inversions(ranks: list[int]) -> int:
    """Claims of a round after some claim of a later round: 0 in a perfect round robin."""
    out_of_round = 0
    highest = -1
    for rank in ranks:
        if rank < highest:
            out_of_round += 1
        highest = max(highest, rank)
    return out_of_round


def takeover(kill: dict, claims: dict, rows: list, shape: Shape) -> dict:
    if not kill:
        return {}
    by_id = {row["id"]: row for row in rows}
    taken = {}
    for batch in kill["batches"]:
        later = [c for c in claims.get(batch, []) if c["token"] > kill["tokens"][batch]]
        taken[batch] = round((min(c["at"] for c in later) - kill["at"]) / 1e9, 2) if later else None
    return {
        "lease_seconds": shape.lease_seconds,
        "taken_over_after_s": taken,
        "ended": {b: (by_id[b]["status"], by_id[b]["completed"], by_id[b]["total"]) for b in kill["batches"]},
        "answers_checked": kill.get("answers_checked"),
    }


def backlog_window(fleet: Fleet) -> dict:
    """From the workers' return until no batch waits for one (every worker busy): throughput, and the statements
    and S3 requests per line and per batch, by kind."""
    resumed = fleet.phases.get("resumed")
    if resumed is None:
        return {}
    after = [s for s in fleet.samples if s["at"] >= resumed]
    busy = next((i for i, s in enumerate(after) if s["at"] > resumed + 3 and s["waiting"] == 0), len(after) - 1)
    if busy < 2:
        return {}
    first, last = after[0], after[busy]
    found = costs(first, last)
    found["statements_by_kind"] = kinds(
        fleet.snapshots.get("resumed", {}), {"counts": read_counts_at(fleet, last["at"])}
    )
    found["s3_by_kind"] = dict((Counter(last["s3_kinds"]) - Counter(first["s3_kinds"])).most_common())
    return found


def pickup_window(fleet: Fleet) -> dict:
    """From the start to the backlog: workers mostly idle, a batch now and then. What an idle worker costs the
    database a second (its looks for work, beats and renewals), the batches' own statements included."""
    before, after = fleet.snapshots.get("start"), fleet.snapshots.get("backlog-starting")
    if not before or not after:
        return {}
    seconds = fleet.phases["backlog-starting"] - fleet.phases["start"]
    by_kind = kinds(before, after).get("worker", {})
    per_worker_second = {kind: round(n / seconds / fleet.shape.workers, 3) for kind, n in by_kind.items()}
    return {"seconds": round(seconds, 1), "worker_statements_per_worker_second": per_worker_second}


def creation_window(fleet: Fleet, created: int) -> dict:
    """While the backlog was created (the workers stopped): what a create costs the API replicas, polls aside."""
    before, after = fleet.snapshots.get("backlog-starting"), fleet.snapshots.get("backlog-created")
    if not before or not after or not created:
        return {}
    by_kind = kinds(before, after).get("api", {})
    statements = sum(number for kind, number in by_kind.items() if kind != "SELECT batches by id")
    s3 = Counter(after["s3"]) - Counter(before["s3"])
    return {
        "batches_created": created,
        "statements_per_batch": round(statements / created, 2),
        "statements_by_kind": {
            kind: round(n / created, 2) for kind, n in by_kind.items() if kind != "SELECT batches by id"
        },
        "s3_per_batch": round(sum(s3.values()) / created, 2),
        "s3_by_kind": {kind: round(n / created, 2) for kind, n in s3.items()},
    }


def with_polls(window: dict, polls: list) -> dict:
    """The window's polls, and the statements each cost its replica."""
    if not window:
        return window
    answered = sum(1 for at, _ in polls if window["from"] <= at <= window["until"])
    reads = window["statements_by_kind"].get("api", {}).get("SELECT batches by id", 0)
    return window | {"polls": answered, "statements_per_poll": round(reads / answered, 3) if answered else None}


def read_counts_at(fleet: Fleet, at: float) -> list[dict]:
    return fleet.snapshots.get(f"at:{at}", {}).get("counts", [])


def costs(first: dict, last: dict) -> dict:
    if not first or not last or last["at"] <= first["at"]:
        return {}
    seconds = last["at"] - first["at"]
    lines = last["lines"] - first["lines"]
    ended = last["ended"] - first["ended"]
    statements = last["statements"] - first["statements"]
    s3 = last["s3"] - first["s3"]
    return {
        "from": first["at"],
        "until": last["at"],
        "seconds": round(seconds, 1),
        "lines_per_s": round(lines / seconds, 1),
        "batches_per_s": round(ended / seconds, 2),
        "statements_per_s": round(statements / seconds, 1),
        "server_transactions_per_s": round((last["xacts"] - first["xacts"]) / seconds, 1),
        "statements_per_line": round(statements / lines, 4) if lines else None,
        "statements_per_batch": round(statements / ended, 1) if ended else None,
        "s3_per_line": round(s3 / lines, 4) if lines else None,
        "s3_per_batch": round(s3 / ended, 2) if ended else None,
    }


def kinds(before: dict, after: dict) -> dict:
    """Statements by role and kind between two snapshots of the counts (and pings)."""
    found: dict[str, Counter[str]] = {}
    for sign, snapshot in ((-1, before), (1, after)):
        for counts in snapshot.get("counts", []):
            role = found.setdefault(counts["role"], Counter())
            for kind, number in counts["statements"].items():
                role[kind] += sign * number
            role["(ping)"] += sign * counts["pings"]
    return {role: {k: v for k, v in counter.most_common() if v} for role, counter in found.items()}


def connections(samples: list[dict]) -> dict:
    seen = [s["connections"] for s in samples]
    return {"max": max(seen, default=None), "median": statistics.median(seen) if seen else None}


def cpu_shares(samples: list[dict], client_seconds: float) -> dict:
    """Each part's share of one core over the run (2.0 is both cores), from its CPU seconds."""
    if len(samples) < 2:
        return {}
    first, last = samples[0], samples[-1]
    seconds = last["at"] - first["at"]
    shares = {part: round((last["cpu"][part] - first["cpu"].get(part, 0.0)) / seconds, 2)
              for part in last["cpu"] if part != "clients"}  # fmt: skip
    return shares | {"clients": round(client_seconds / seconds, 2)}


# ---------------------------------------------------------------------------------------------------------------


def all_rows(db_url: str) -> list[dict]:
    from sqlmodel import select

    from app.core.db import make_engine, session_scope
    from app.domain.models import BatchRow

    db = make_engine(db_url)
    try:
        with session_scope(db) as session:
            return [row.model_dump(warnings=False) for row in session.exec(select(BatchRow)).all()]
    finally:
        db.dispose()


def check_answers(urls: list[str], rows: list[dict], batch_ids: list[str], made: dict) -> dict:
    """Every line of these batches answered exactly once in its output file."""
    by_id = {row["id"]: row for row in rows}
    checked = {}
    for batch in batch_ids:
        file_id = by_id[batch]["output_file_id"]
        if file_id is None:
            checked[batch] = "no output file"
            continue
        key = made[batch]["key"]
        content = httpx.get(f"{urls[0]}/v1/files/{file_id}/content", timeout=30,
                            headers={"Authorization": f"Bearer sk-fleet-{key:04d}"}).content  # fmt: skip
        ids = [json.loads(line)["custom_id"] for line in content.splitlines()]
        checked[batch] = {"lines": len(ids), "distinct": len(set(ids)), "total": by_id[batch]["total"]}
    return checked


def run(shape: Shape, out: Path) -> dict:
    from app.core.migrate import upgrade_to_head
    from app.testing import LocalPostgres, LocalS3

    for folder in ("logs", "counts", "events", "ready", "apis", "workers", "phases"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    postgres = LocalPostgres(out / "pg")
    s3 = LocalS3(out / "moto.log")
    bouncer = None
    fleet = Fleet(shape, out)
    try:
        db_url = postgres.new_database()
        upgrade_to_head(db_url)
        max_connections = int(postgres.server.psql("SHOW max_connections;").split()[2])
        worker_url = db_url
        if shape.pgbouncer:
            from app.testing import LocalPgBouncer

            bouncer = LocalPgBouncer(out / "pgbouncer", postgres, server_connections=shape.bouncer_connections)
            worker_url = bouncer.url(db_url)
        storage_url = s3.new_url()
        urls = fleet.start_apis(fleet.env(db_url, s3.environ, storage_url, shape.api_pool_size))
        worker_env = fleet.env(worker_url, s3.environ, storage_url, shape.pool_size)
        if shape.pgbouncer:
            worker_env["VBATCH_DATABASE_POOLER"] = "transaction"
        hosts = fleet.start_workers(worker_env)
        started = time.monotonic()
        try:
            fleet.wait_ready(hosts, urls, timeout=600)
        except RuntimeError as exc:
            return {"failed_at_start": str(exc), "log_problems": log_problems(out),
                    "workers_started": started_workers(out), "setup": {"max_connections": max_connections}}  # fmt: skip
        ready_s = time.monotonic() - started
        for path in (out / "counts").glob("*.json"):  # the start's statements (migrations, sweeps) are not the run's
            path.rename(path.with_suffix(".start"))
        fleet.s3_seen()  # the start's requests: counted from here
        fleet._s3_seen.clear()
        results = drive(fleet, shape, urls, db_url, postgres, s3, bouncer)
        results["setup"] = {"max_connections": max_connections, "ready_s": round(ready_s, 1)}
        return results
    finally:
        fleet.sampling = False
        for process in fleet.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for process in fleet.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        if bouncer is not None:
            bouncer.stop()
        s3.stop()
        postgres.stop()


def drive(fleet: Fleet, shape: Shape, urls: list[str], db_url: str, postgres, s3, bouncer) -> dict:
    parts = {
        "postgres": [postgres.server.get_pid()],
        "moto": [s3.process.pid],
        "api": [p.pid for name, p in fleet.processes.items() if name.startswith("api")],
        "workers": [p.pid for p in fleet.hosts()],
        **({"pgbouncer": [bouncer.process.pid]} if bouncer else {}),
    }
    fleet.mark("start")
    sampler = threading.Thread(target=fleet.sample, args=(db_url, parts), daemon=True)
    sampler.start()
    client = fleet.start("clients", ["clients", "--shape", json.dumps(asdict(shape)), "--urls", ",".join(urls),
                                     "--out", str(fleet.out)], dict(os.environ))  # fmt: skip
    director = threading.Thread(target=fleet.direct, args=(client, db_url), daemon=True)
    director.start()
    watch_backlog(fleet, client)
    client.wait()
    director.join(timeout=60)
    fleet.sampling = False
    sampler.join()
    rows = all_rows(db_url)
    clients = json.loads((fleet.out / "clients.json").read_text())
    if fleet.kill:
        made = {m["batch_id"]: m for m in clients["made"]}
        fleet.kill["answers_checked"] = check_answers(urls, rows, fleet.kill["batches"], made)
    return summarise(fleet, rows, clients)


def watch_backlog(fleet: Fleet, client: subprocess.Popen) -> None:
    """Once the workers are back, snapshot the counts at each sample until no batch waits: the backlog window's
    end is the first sample with none waiting (`backlog_window`)."""
    while "resumed" not in fleet.phases and client.poll() is None:
        time.sleep(0.1)
    while client.poll() is None:
        if fleet.samples:
            last = fleet.samples[-1]
            key = f"at:{last['at']}"
            if key not in fleet.snapshots:
                fleet.snapshots[key] = {"counts": read_counts(fleet.out)}
            if last["at"] > fleet.phases.get("resumed", 0) + 3 and last["waiting"] == 0:
                return
        time.sleep(0.25)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ROLES:
        ROLES[sys.argv[1]](sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--label", default="")
    for name, default in asdict(Shape()).items():
        if isinstance(default, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, int | float):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every vbatch process")
    args = parser.parse_args()
    values = {name: getattr(args, name) for name in asdict(Shape()) if name != "extra_env"}
    shape = Shape(**values, extra_env=dict(item.split("=", 1) for item in args.env))
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "app"], capture_output=True, text=True, cwd=ROOT)
    started = time.time()
    results = run(shape, args.out)
    results["meta"] = {
        "label": args.label,
        "command": " ".join(["python", "-m", "bench.fleet", *sys.argv[1:]]),
        "commit": commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else ""),
        "machine": f"{platform.node()}, {len(os.sched_getaffinity(0))} cores, "
        f"{psutil.virtual_memory().total // 2**30} GiB",
        "seconds": round(time.time() - started, 1),
        "shape": asdict(shape),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


def refair(argv: list[str]) -> None:
    """`python -m bench.fleet refair --out DIR --results FILE`: the fairness of a finished run measured again from
    the claims and ends its workers logged in DIR (its database is gone: a batch's lines are those its end
    logged), written into FILE with the commit that measured it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args(argv)
    claims, ends = read_events(args.out)
    rows = [{"id": batch, "completed": end["completed"], "failed": 0} for batch, end in ends.items()]
    made = {m["batch_id"]: m for m in json.loads((args.out / "clients.json").read_text())["made"]}
    results = json.loads(args.results.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["fairness"] = fairness(rows, made, ends, claims) | {"measured_again_at": commit.stdout.strip()}
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["fairness"], indent=1))


ROLES = {"serve-api": serve_api, "host-workers": host_workers, "clients": run_clients, "refair": refair}

if __name__ == "__main__":
    main()
