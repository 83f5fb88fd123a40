"""Fault injection against the real service (CPU vLLM), on the machinery of tests/e2e/test_crash_recovery.py: a killed
engine core (mid-run and idle), a poison line and SIGTERM; an engine death behind two front-end processes is in
tests/e2e/test_engine_death_frontends.py, a module of its own so that the two long tests can run on two workers.
What must hold is what test_crash_recovery.py's docstring says."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
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
    # A line that kills the engine alone once goes to the error file (the default, twice, costs one more engine
    # start here; the count is tested on the fake engine).
    server = lineage.start(failpoint="poison,hold_after:4", env={"VBATCH_ENGINE_DEATHS_PER_LINE": "1"})
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
