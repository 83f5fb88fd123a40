"""Fault injection against the real service (CPU vLLM), on the machinery of tests/e2e/test_crash_recovery.py: a killed
engine core (mid-run and idle), a poison line, SIGTERM, and an engine death behind two front-end processes. What
must hold is what test_crash_recovery.py's docstring says."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.e2e.test_crash_recovery import (
    Lineage,
    check_exactly_once,
    create,
    request_lines,
    results,
    wait_done,
)
from tests.helpers import holding, wait_for


@pytest.fixture
def lineage(tmp_path, model_path) -> Iterator[Lineage]:
    running = Lineage(tmp_path, model_path)
    yield running
    running.stop()


def kill_the_engine_core_mid_run(lineage: Lineage, client: OpenAI) -> None:
    """`kill -9` of the engine core while a 16-line batch runs (the server holds at 4 lines sent): the service
    starts a new one and the batch completes, each line once, those seen before the kill as first written."""
    assert lineage.server is not None
    with holding(lineage.data_dir):
        killed = create(client, request_lines(16))
        seen = lineage.wait_partial(killed, at_least=2)
        [core] = lineage.server.engine_core_pids()
        os.kill(core, signal.SIGKILL)
    batch = wait_done(client, killed)
    assert batch.status == "completed"
    check_exactly_once(client, batch, 16, seen)
    assert lineage.server.engine_core_pids() != [core]


def test_engine_death_poison_line_and_sigterm(lineage):
    server = lineage.start(failpoint="poison,hold_after:4")
    client = lineage.client()
    # The API answers while the engine loads (it starts on a thread of its own).
    assert "starting" in server.health_seen

    # The engine core alone is killed mid-run: the service restarts it and the batch completes.
    kill_the_engine_core_mid_run(lineage, client)

    # A line that kills the engine each time it runs ends in the error file; the others succeed.
    poisoned = create(client, request_lines(8, poison=3))
    batch = wait_done(client, poisoned)
    assert batch.status == "completed"
    outputs = check_exactly_once(client, batch, 8, [])
    assert len(outputs) == 7
    [error] = results(client, batch.error_file_id)
    assert error["custom_id"] == "req-3" and error["error"]["code"] == "engine_crashed"
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"

    # The engine core killed while nothing runs: no request notices, so the loop's own check must restart it.
    [idle_core] = server.engine_core_pids()
    os.kill(idle_core, signal.SIGKILL)

    health_seen = set()

    def restarted() -> bool:
        status = httpx.get(f"{server.base_url}/health", timeout=2).json()["status"]
        health_seen.add(status)
        return status == "ok" and server.engine_core_pids() not in ([], [idle_core])

    wait_for(restarted, timeout=300)
    assert "restarting" in health_seen  # answered within 2 s throughout the restart
    assert wait_done(client, create(client, request_lines(2))).request_counts.completed == 2

    # SIGTERM mid-run: the service checkpoints and exits within seconds; the next start finishes the batch
    # without re-running what had finished.
    with holding(lineage.data_dir):
        stopped = create(client, request_lines(16))
        lineage.wait_partial(stopped, at_least=2)
        asked = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once its shutdown (ours included) is complete.
        assert server.wait_exit(timeout=30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in (lineage.base / "serve-1.log").read_text(errors="replace")
        exit_seconds = time.monotonic() - asked
        [part] = (lineage.data_dir / "files").glob(f"{stopped}.*.output.part")  # named by its run's lease token
        finished_at_stop = [json.loads(line) for line in part.read_bytes().splitlines()]
        assert 2 <= len(finished_at_stop) < 16

    lineage.start()
    client = lineage.client()
    batch = wait_done(client, stopped)
    assert batch.status == "completed"
    check_exactly_once(client, batch, 16, finished_at_stop)
    print(f"SIGTERM to exit: {exit_seconds:.1f} s")


def test_behind_two_front_end_processes_an_engine_death_and_a_cancel(lineage):
    """The same engine behind two front-end processes (`--api-server-count 2`): an engine core killed mid-run is
    restarted with its front ends and the batch completes, each line once; a cancel ends the next batch."""
    lineage.flags += ["--api-server-count", "2"]
    server = lineage.start(failpoint="hold_after:4")
    client = lineage.client()
    assert len(server.frontend_pids()) == 2
    kill_the_engine_core_mid_run(lineage, client)
    assert len(server.frontend_pids()) == 2

    with holding(lineage.data_dir):
        cancelled = create(client, request_lines(16))
        lineage.wait_partial(cancelled, at_least=2)
        client.batches.cancel(cancelled)
        batch = wait_done(client, cancelled)
    assert batch.status == "cancelled"
    finished = results(client, batch.output_file_id)
    unfinished = results(client, batch.error_file_id)
    assert Counter(r["custom_id"] for r in finished + unfinished) == Counter(f"req-{i}" for i in range(16))
    assert 2 <= len(finished) < 16
