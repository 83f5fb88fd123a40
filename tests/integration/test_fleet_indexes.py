"""The queries a fleet runs most are served by indexes (issue 41): Postgres's EXPLAIN of the statements the real code
sends (captured as it sends them, planned as the server plans them once prepared), on a database with a fleet's
history in it: thousands of ended batches and files over hundreds of keys, a queue of waiting batches and those the
workers hold. A poll reads its batch by its key, a page of a key's batches or files is read from the key's own index
in order (no sort), a claim walks the waiting batches in turn order, and a new batch's turn, a look for work and a
renewal touch only the rows they name."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event, insert, text

from app.core.db import make_engine, session_scope
from app.core.migrate import upgrade_to_head
from app.domain import batches, files, leases, turns
from app.domain.models import BatchRow, FileRow

KEYS = 400
PER_KEY = 10  # ended batches and files a key has
WAITING = 300  # batches in the queue
HELD = 200  # batches the workers run


@pytest.fixture(scope="module")
def db(postgres):
    url = postgres.new_database()
    upgrade_to_head(url)
    engine = make_engine(url)
    now = time.time_ns()
    ended = [_batch(n, f"key{n % KEYS}", "completed", now) for n in range(KEYS * PER_KEY)]
    first = KEYS * PER_KEY
    queue = [_batch(n, f"key{n % KEYS}", "in_progress", now, turn=n // KEYS) for n in range(first, first + WAITING)]
    last = first + WAITING
    held = [_batch(n, f"key{n % KEYS}", "in_progress", now, holder=f"w{n % 99}") for n in range(last, last + HELD)]
    with engine.begin() as connection:
        connection.execute(insert(BatchRow), [*ended, *queue, *held])
        connection.execute(insert(FileRow), [_file(n, f"key{n % KEYS}", now) for n in range(KEYS * PER_KEY)])
        connection.execute(text("ANALYZE"))
    yield engine
    engine.dispose()


def _batch(n: int, owner: str, status: str, now: int, *, turn: int = 0, holder: str | None = None) -> dict:
    return {
        "id": f"batch_{n:06d}", "created_ns": now + n, "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "completion_window": "24h", "status": status, "owner": owner, "created_at": now // 10**9, "turn": turn,
        "lease_holder": holder, "lease_expires_ns": now + 10**12 if holder else None, "lease_token": 1 if holder else 0,
    }  # fmt: skip


def _file(n: int, owner: str, now: int) -> dict:
    return {"id": f"file-{n:06d}", "created_ns": now + n, "created_at": now // 10**9, "bytes": 1,
            "filename": "in.jsonl", "purpose": "batch", "owner": owner}  # fmt: skip


@contextmanager
def captured(db) -> Iterator[list[tuple[str, dict]]]:
    """The statements `db` sends meanwhile, with their parameters."""
    seen: list[tuple[str, dict]] = []

    def before(_conn, _cursor, statement, parameters, _context, _executemany) -> None:
        seen.append((statement, parameters))

    event.listen(db, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(db, "before_cursor_execute", before)


def plan_of(db, statement: str, parameters: dict | list) -> list[dict]:
    """Every node of the statement's two plans: the one for these parameters, and the generic one the server keeps
    for it once prepared (psycopg prepares a statement at its sixth run), which may not rely on their values."""
    numbers: dict[str, int] = {}
    generic = re.sub(r"%\((\w+)\)s", lambda name: f"${numbers.setdefault(name[1], len(numbers) + 1)}", statement)
    first = parameters[0] if isinstance(parameters, list) else parameters  # the ORM's updates: one row's
    with db.connect() as connection:
        found = [
            connection.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", first).scalar(),
            connection.exec_driver_sql(f"EXPLAIN (GENERIC_PLAN, FORMAT JSON) {generic}").scalar(),
        ]
    nodes, todo = [], [(json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"] for plan in found]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.get("Plans", []))
    return nodes


def plans(db, call) -> list[list[dict]]:
    """The plans of the statements on batches and files that `call` sends."""
    with captured(db) as statements:
        call()
    wanted = [(sql, params) for sql, params in statements if " batches" in sql or " files" in sql]
    assert wanted, "nothing was sent"
    return [plan_of(db, sql, params) for sql, params in wanted]


def indexes(nodes: list[dict]) -> set[str]:
    return {node["Index Name"] for node in nodes if "Index Name" in node}


def no_scan_of_a_whole_table(nodes: list[dict]) -> bool:
    return not [node for node in nodes if node["Node Type"] == "Seq Scan"]


def test_a_poll_reads_its_batch_by_its_key(db):
    [nodes] = plans(db, lambda: batches.get(db=db, batch_id="batch_000123", owner="key123"))
    assert no_scan_of_a_whole_table(nodes) and indexes(nodes) == {"batches_pkey"}


def test_a_page_of_a_keys_batches_or_files_is_read_in_order_from_its_own_index(db):
    for nodes in plans(db, lambda: batches.list_batches(db=db, owner="key7", limit=3, after="batch_002007")):
        assert no_scan_of_a_whole_table(nodes)
        assert not [node for node in nodes if node["Node Type"] == "Sort"]
    assert "ix_batches_owner_created" in indexes(nodes)  # the page itself: the last statement
    listing = plans(db, lambda: files.list_files(db=db, owner="key7", purpose=None, limit=3, order="desc", after=None))
    [nodes] = listing
    assert no_scan_of_a_whole_table(nodes) and not [node for node in nodes if node["Node Type"] == "Sort"]
    assert indexes(nodes) == {"ix_files_owner_created"}


def test_a_claim_walks_the_waiting_batches_in_turn_order(db):
    for nodes in plans(db, lambda: leases.claim(db=db, holder="new-worker", seconds=30, limit=2)):
        assert no_scan_of_a_whole_table(nodes)
    [select, *_] = plans(db, lambda: leases.claim(db=db, holder="new-worker", seconds=30, limit=2))
    assert "ix_batches_claim_order" in indexes(select)


def test_a_new_batchs_turn_and_a_workers_look_and_renewal_touch_only_their_rows(db):
    def turn() -> None:
        with session_scope(db) as session:
            turns.next_turn(session, "key5")

    [nodes] = plans(db, turn)
    assert no_scan_of_a_whole_table(nodes) and indexes(nodes) <= {"ix_batches_claim_order", "ix_batches_owner_turn"}
    mine = [f"batch_{n:06d}" for n in range(KEYS * PER_KEY + WAITING, KEYS * PER_KEY + WAITING + 2)]
    [nodes] = plans(db, lambda: batches.active_among(db=db, batch_ids=mine))
    assert no_scan_of_a_whole_table(nodes) and indexes(nodes) == {"batches_pkey"}
    held = [leases.Lease(batch_id, "worker0", 1) for batch_id in mine]
    [nodes] = plans(db, lambda: leases.renew(db=db, leases=held, seconds=30))
    assert no_scan_of_a_whole_table(nodes) and indexes(nodes) == {"batches_pkey"}
