"""What a fleet asks of its S3 store, counted in the store's own request log (moto's server, issue 41): an upload no
larger than a part is one PUT, not a multipart upload's three, a batch's run files go at its end in one bulk delete,
with one listing for the parts its process never shipped nor downloaded, and a running batch ships a segment each
`segment_seconds`, not at each checkpoint."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import obstore
import pytest

from app.core.object_storage import UPLOAD_PART_BYTES, ObjectStorage
from app.domain.results import run_files
from app.testing import LocalS3
from tests.helpers import create_batch, jsonl, request_line, upload, wait_for, wait_status

REQUEST = re.compile(r'"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/[\d.]+" \d+')


@pytest.fixture
def storage(s3: LocalS3, tmp_path: Path) -> ObjectStorage:
    return ObjectStorage(s3.new_url(), tmp_path / "scratch")


@contextmanager
def requests_to_paths(s3: LocalS3) -> Iterator[list[tuple[str, str]]]:
    """The requests the store answers meanwhile: (method, path)."""
    log = Path(s3.log.name)
    start = log.stat().st_size
    seen: list[tuple[str, str]] = []
    yield seen
    with log.open("rb") as lines:
        lines.seek(start)
        seen.extend(REQUEST.findall(lines.read().decode(errors="replace")))


@contextmanager
def requests_to(s3: LocalS3) -> Iterator[Counter[str]]:
    """The requests the store answers meanwhile, by method and the query that names what they do."""
    counted: Counter[str] = Counter()
    with requests_to_paths(s3) as seen:
        yield counted
    for method, path in seen:
        query = path.partition("?")[2].split("=")[0]
        counted[f"{method} ?{query}" if query else method] += 1


async def chunks(total: int, size: int = 65536) -> AsyncIterator[bytes]:
    for start in range(0, total, size):
        yield bytes([start // size % 251]) * min(size, total - start)


def test_an_upload_no_larger_than_a_part_is_one_request(s3, storage):
    with requests_to(s3) as counted:
        assert asyncio.run(storage.save_stream("file-small", chunks(200_000), max_bytes=10**9)) == 200_000
    assert counted == Counter({"PUT": 1})
    large = UPLOAD_PART_BYTES + 300_000  # still a multipart upload, whole
    assert asyncio.run(storage.save_stream("file-large", chunks(large), max_bytes=10**9)) == large
    stored = asyncio.run(storage.read_bytes("file-large"))
    assert len(stored) == large and stored[-1:] == bytes([(large - 1) // 65536 % 251])


def test_a_batch_s_run_files_go_in_one_bulk_delete(s3, storage):
    batch_id = "batch_fleet"
    names = run_files(batch_id, last_token=2)  # the parts of tokens 0, 1 and 2, its index and its input
    earlier_output = names[2]  # token 1's output part, shipped by another process that died
    for name, data in ((f"{batch_id}.index", b"i"), (f"{batch_id}.input", b"in")):
        asyncio.run(storage.save_bytes(name, data))
    obstore.put(storage.store, f"{earlier_output}/{0:016d}-{4:016d}", b"ab\ncd")
    # Other batches' objects, named just before and after this one's: the listing passes them by.
    others = ["batch_fleea.index", f"batch_fleet2.output.part/{0:016d}-{4:016d}", "batch_fleez.input"]
    for name in others:
        obstore.put(storage.store, name, b"theirs")

    async def run() -> None:
        own = [storage.path(name) for name in names[4:6]]  # token 2's: this process's run
        ship = await storage.begin_parts(names[2:4], [0, 0], own)
        for path in own:
            path.write_bytes(b"x\n")
        await ship((2, b"x\n"), (2, b"x\n"))
        with requests_to(s3) as counted:
            await storage.delete_all(names)
        # Tokens 0 and 1's parts were never seen here: one listing under the batch's id finds them (token 1's
        # segment). Token 2's segments are known. One delete for all.
        assert counted == Counter({"GET ?list-type": 1, "POST ?delete": 1})

    asyncio.run(run())
    assert sorted(meta["path"] for batch in obstore.list(storage.store) for meta in batch) == others


@pytest.mark.parametrize("backend", ["postgres_s3"], indirect=True)
def test_a_batch_ships_a_segment_each_segment_seconds_not_at_each_checkpoint(s3, client, fake_engine, backend):
    # Each answer takes its own while (on a thread), so results come in all the time, not in waves.
    fake_engine.executor.before_answer = lambda body: time.sleep(0.02 + 0.1 * (hash(str(body)) % 7) / 7)
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(160)]))
    with requests_to_paths(s3) as paths:
        started = time.monotonic()
        batch = create_batch(client, source["id"])
        done = wait_status(client, batch["id"], {"completed"}, timeout=60)
        seconds = time.monotonic() - started
    assert done["request_counts"]["completed"] == 160
    segments = [path for method, path in paths if method == "PUT" and ".output.part/" in path]
    checkpoints = seconds / 0.05  # the tests' checkpoint_seconds
    assert checkpoints > 20  # long enough that every checkpoint shipping would show
    assert len(segments) <= seconds / 5.0 + 2  # the default segment_seconds


@pytest.mark.parametrize("backend", ["postgres_s3"], indirect=True)
def test_a_100_line_batch_costs_its_worker_seven_requests(s3, client, backend):
    """What `docs/explanation/fleet-limits.md` counts a batch at (the upload's PUT aside): the input's copy to the
    batch's own name (a PUT) and its one GET, the index's PUT, one segment, the output file, one listing of the parts
    an earlier lease might have left, and one bulk delete of its run files, which comes just after the batch ends."""
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(100)]))
    log = Path(s3.log.name)
    start = log.stat().st_size
    with requests_to(s3) as counted:
        batch = create_batch(client, source["id"])
        assert wait_status(client, batch["id"], {"completed"}, timeout=60)["request_counts"]["completed"] == 100
        wait_for(lambda: b"POST /" in log.read_bytes()[start:] and b"?delete" in log.read_bytes()[start:])
    assert counted == Counter({"PUT": 4, "GET": 1, "GET ?list-type": 1, "POST ?delete": 1}), counted
