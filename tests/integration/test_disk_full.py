"""A full disk: on a real, small tmpfs the test mounts, filled by someone else while a batch runs."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.testing import FakeEngine
from tests.helpers import FINAL, app_on, create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"this machine refuses to mount a small tmpfs (needs CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path) -> Path:
    """Write until the file system says ENOSPC, as a runaway log would."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(b"x" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        try:  # the last pages, a small write at a time
            while True:
                out.write(b"x" * 512)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def health_problems(client: TestClient) -> list[str]:
    return client.get("/health").json()["problems"]


@pytest.fixture
def disk_settings(small_disk: Path) -> Settings:
    return Settings(
        data_dir=small_disk / "data",
        checkpoint_seconds=0.05,
        disk_reserve_bytes=1 << 20,
        min_free_disk_bytes=512 * 1024,
    )


@dataclass
class FullDisk:
    running: dict  # writing results when the disk filled: failed, with the 3 it had
    queued: dict  # its turn came with the disk full: waiting for room
    filler: Path


def fill_behind_a_running_batch(client: TestClient, disk: Path, runner_log: pytest.LogCaptureFixture) -> FullDisk:
    """Two batches on an engine that answers 3 lines and holds the rest, the disk filled while the first runs."""
    assert client.get("/health").status_code == 200
    running = create_batch(client, upload(client, jsonl([request_line(f"r{i}") for i in range(60)]))["id"])
    queued = create_batch(client, upload(client, jsonl([request_line(f"q{i}") for i in range(5)]))["id"])
    wait_for(lambda: client.get(f"/v1/batches/{running['id']}").json()["request_counts"]["completed"] == 3)
    # Validated (which writes) before the disk fills, as the running one is.
    wait_for(lambda: client.get(f"/v1/batches/{queued['id']}").json()["status"] == "in_progress")

    filler = fill(disk)
    wait_for(lambda: any("reserve" in problem for problem in health_problems(client)))
    assert client.get("/health").status_code == 503

    # The batch writing results fails with what it has; the one queued behind it, whose turn then comes, waits for
    # room instead of failing with nothing.
    failed = wait_status(client, running["id"], FINAL)
    assert failed["status"] == "failed"
    assert [e["code"] for e in failed["errors"]["data"]] == ["insufficient_storage"]
    counts = failed["request_counts"]
    assert counts["total"] == 60 and counts["completed"] >= 3 and counts["failed"] == 0
    wait_for(lambda: f"batch {queued['id']}: its turn came with the disk full; it waits for room" in runner_log.text)
    assert client.get(f"/v1/batches/{queued['id']}").json()["status"] == "in_progress"
    return FullDisk(running=failed, queued=queued, filler=filler)


def test_a_full_disk_ends_the_batch_with_its_results_and_the_api_still_cancels_deletes_and_recovers(
    small_disk, disk_settings, runner_log
):
    engine = FakeEngine()
    engine.executor.answer_first = 3
    with app_on(disk_settings, engine) as client:
        spare = upload(client, jsonl([request_line("spare")]))
        full = fill_behind_a_running_batch(client, small_disk, runner_log)
        failed, queued, filler = full.running, full.queued, full.filler
        counts = failed["request_counts"]

        # Everything the API does to what is stored still works, and says why when it cannot.
        cancel = client.post(f"/v1/batches/{queued['id']}/cancel")
        assert cancel.status_code == 200, cancel.text
        assert wait_status(client, queued["id"], FINAL)["status"] == "cancelled"
        assert client.delete(f"/v1/files/{spare['id']}").json()["deleted"] is True
        refused = client.post(
            "/v1/files", files={"file": ("x.jsonl", jsonl([request_line("x")]))}, data={"purpose": "batch"}
        )
        assert refused.status_code == 507
        assert refused.json()["error"]["code"] == "insufficient_storage"

        engine.executor.gate.set()  # the failed batch's other 57 answers come now, with nowhere to go
        outputs = read_jsonl(client, failed["output_file_id"])
        assert len(outputs) == counts["completed"]
        assert len({o["custom_id"] for o in outputs}) == len(outputs)
        assert client.get("/v1/files").status_code == 200

        filler.unlink()
        wait_for(lambda: client.get("/health").status_code == 200)
        again = create_batch(client, upload(client, jsonl([request_line(f"a{i}") for i in range(60)]))["id"])
        done = wait_status(client, again["id"], FINAL)
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 60
    # Nothing of the failed batch's own (parts, index, input link) is left to keep the disk full.
    assert not [p for p in (disk_settings.files_dir).iterdir() if p.name.startswith(failed["id"])]


def test_a_batch_waiting_for_room_at_a_stop_runs_at_the_next_start(small_disk, disk_settings, runner_log):
    engine = FakeEngine()
    engine.executor.answer_first = 3
    with app_on(disk_settings, engine) as client:
        full = fill_behind_a_running_batch(client, small_disk, runner_log)
    # Stopped while it waited: left in progress, not failed by its stop's checkpoint on the full disk.
    full.filler.unlink()
    with app_on(disk_settings) as client:
        done = wait_status(client, full.queued["id"], FINAL)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
