"""Fault injection against the real service (CPU vLLM), on the machinery of tests/e2e/test_crash_recovery.py: an engine
core killed mid-run by a poison line and killed while idle, and SIGTERM; an engine death behind two front-end
processes is in tests/e2e/test_engine_death_frontends.py, a module of its own so that the two long tests can run on
two workers. What must hold is what test_crash_recovery.py's docstring says."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.e2e.test_crash_recovery import (
    check_exactly_once,
    create,
    request_lines,
    results,
    wait_done,
)
from tests.helpers import holding, wait_for


def test_engine_death_poison_line_and_sigterm(lineage):
    # A line that kills the engine alone once goes to the error file (the default, twice, costs one more engine
    # start here; the count is tested on the fake engine).
    server = lineage.start(failpoint="poison,hold_after:4", env={"VBATCH_ENGINE_DEATHS_PER_LINE": "1"})
    client = lineage.client()
    # The API answers while the engine loads (it starts on a thread of its own).
    assert "starting" in server.health_seen

    # Mid-run, a line that kills the engine core each time it runs (the failpoint's SIGKILL, as `kill -9` of the core
    # alone): the service restarts the engine, the line ends in the error file, the others succeed, and those that
    # finished before the death are kept as first written. (Behind two front ends: test_engine_death_frontends.py.)
    with holding(lineage.data_dir):  # 4 lines sent, the poisoned one not among them
        poisoned = create(client, request_lines(16, poison=10))
        seen = lineage.wait_partial(poisoned, at_least=2)
        [core] = server.engine_core_pids()
    batch = wait_done(client, poisoned)
    assert batch.status == "completed"
    outputs = check_exactly_once(client, batch, 16, seen)
    assert len(outputs) == 15
    [error] = results(client, batch.error_file_id)
    assert error["custom_id"] == "req-10" and error["error"]["code"] == "engine_crashed"
    assert server.engine_core_pids() not in ([], [core])
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
